"""The distributed training data loader behind ``engine.training_dataloader``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DistributedDataLoader:
    """Each rank reads its own micro-batches; every new pass reshuffles (``set_epoch``) the same way on all ranks."""

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)
