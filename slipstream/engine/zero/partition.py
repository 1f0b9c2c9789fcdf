"""``PartitionSpec``: this rank's partition described once, for whoever keeps its master weights.

[Note: partition coordinates] A rank owns chunk r of every bucket (stages 1/2) or unit (stage
3); concatenated, the chunks form its partition, ``numel`` elements long. Every optimized piece
of a parameter has an offset in it, and the gradients and parameters of the partition are a
few tensors addressed in the same coordinates (``offload/chunks.py``). The master weights
(``masters.py``) and the offloaded optimizer receive this value and nothing else of the
strategy, so neither reaches back into a strategy's attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from slipstream.engine.zero.offload.chunks import Chunks


@dataclasses.dataclass(frozen=True)
class OptimizedPiece:
    """Elements ``[offset, offset + numel)`` of the partition belong to trainable parameter ``param``."""

    offset: int
    numel: int
    param: int  # index in the strategy's list of trainable parameters (step count, used flag)


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    numel: int  # elements in this rank's partition, padding included
    pieces: tuple[OptimizedPiece, ...]  # the trainable pieces, in partition order
    num_params: int  # trainable parameters of the strategy (used flags and step counts are per parameter)
    boundaries: tuple[int, ...]  # bucket or unit starts: NVMe sub-groups prefer to cut there
    dtype: torch.dtype  # the model's dtype (parameters and reduced gradients)
    device: torch.device
    rank: int  # this rank's position in the sharding group (names swap directories)
    job_id: str  # shared by the ranks of the group when anything swaps to NVMe, else ""
    initial: Chunks  # the partition's starting values
    grads: Callable[[], Chunks]  # where the reduced gradients are (asked at the first step)
    params: Chunks | None  # where updated parameters are written in place (None: through ``publish``)
    publish: Callable[[int, int, torch.Tensor], None] | None = (
        None  # (sub-group, start, values) when ``params`` is None
    )
