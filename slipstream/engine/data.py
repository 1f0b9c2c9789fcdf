"""The distributed training data loader behind ``engine.training_dataloader``."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class _ResumableSampler(DistributedSampler):
    """A :class:`DistributedSampler` that can start a pass after its first ``skip`` indices."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(self.num_samples - self.skip, 0)


class DistributedDataLoader:
    """Each data-parallel rank reads its own micro-batches; every new pass reshuffles (``set_epoch``) the same way on all ranks.

    ``rank`` and ``world_size`` are the mesh's dp coordinate and dp size (``initialize`` passes
    them): ranks that differ only in pp, cp, sp or tp share a dp coordinate and so read the same
    micro-batches, as tensor, sequence and pipeline parallelism need. "world" below means dp.

    [Note: resumable position] The position is kept as (epoch, samples of that epoch consumed by
    all ranks together). The shuffled order of an epoch depends only on the seed, the epoch and
    the dataset, and rank r reads every world-th index of it, so after ``samples`` global samples
    each rank of *any* world size skips ``samples / world`` of its own indices and no sample is
    repeated or skipped (exactly, whenever ``samples`` divides by the new world size).
    """

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
        self.sampler = _ResumableSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            generator=self.generator,
        )
        self.micro_batch_size, self.world_size, self.seed, self.shuffle = micro_batch_size, world_size, seed, shuffle
        self.epoch = 0
        self._position: tuple[int, int] | None = None  # (epoch, this rank's samples consumed) of the pass in progress
        self._pass_generator_state = self.generator.get_state()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        self._pass_generator_state = self.generator.get_state()  # workers' seeds are drawn from it per pass
        self._position = (self.epoch - 1, self.sampler.skip)
        return self._count(iter(self.loader))

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        try:
            for batch in batches:
                self.sampler.skip = 0  # read (lazily) by the first batch of this pass
                epoch, consumed = self._position  # type: ignore[misc]
                self._position = (epoch, min(consumed + self.micro_batch_size, self.sampler.num_samples))
                yield batch
        finally:
            self.sampler.skip = 0

    # ------------------------------------------------------------------ checkpoint hook
    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: the epoch and the samples all ranks consumed in it."""
        if self._position is None:
            epoch, consumed = self.epoch, self.sampler.skip
        else:
            epoch, consumed = self._position
            remaining = self.sampler.num_samples - consumed
            if remaining <= 0 or (self.loader.drop_last and remaining < self.micro_batch_size):  # pass done: next epoch
                epoch, consumed = epoch + 1, 0
        return {
            "epoch": epoch,
            "samples": consumed * self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": len(self.sampler.dataset),  # type: ignore[arg-type]
            "generator": self._pass_generator_state if self._position is not None else self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue the saved epoch after the samples already consumed."""
        if int(state["dataset_len"]) != len(self.sampler.dataset):  # type: ignore[arg-type]
            warnings.warn(
                f"training data: the checkpoint's dataset had {state['dataset_len']} samples, this one has "
                f"{len(self.sampler.dataset)}; the loader position may not match",  # type: ignore[arg-type]
                stacklevel=2,
            )
        samples = int(state["samples"])
        if samples % self.world_size:
            warnings.warn(
                f"training data: {samples} samples of epoch {state['epoch']} were consumed, not a multiple of the world "
                f"size {self.world_size}; resuming after {samples // self.world_size * self.world_size}",
                stacklevel=2,
            )
        self.epoch = int(state["epoch"])
        self.sampler.skip = samples // self.world_size
        self._position = None
        self.generator.set_state(state["generator"])
