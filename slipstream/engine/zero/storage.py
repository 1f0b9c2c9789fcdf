"""Tensors over storage ZeRO-3 manages by hand: aliases, empty ("hollow") tensors, shard slices."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def contiguous_strides(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def alias(
    storage: torch.UntypedStorage,
    offset: int,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    stride: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A tensor over ``storage`` that is not an autograd view: it has its own version counter.

    Writing through it does not bump the version of other tensors on the same storage (ZeRO-3's
    parameters, which autograd may have saved), and its own version tells whether it was written.
    """
    stride = contiguous_strides(shape) if stride is None else stride
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def hollow(shapes: list[torch.Size], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Tensors of these shapes whose (shared) storage holds zero bytes; ZeRO-3 gives them real storage.

    ``set_`` needs a large enough storage when the view is made, so one is allocated for the
    largest shape and emptied afterwards: one allocation, not one per parameter (glibc keeps freed
    chunks mapped, so a per-parameter allocation would leave the heap as large as the model).
    """
    largest = max((math.prod(shape) for shape in shapes), default=0)
    base = torch.empty(largest, dtype=dtype, device=device)
    views = [alias(base.untyped_storage(), 0, shape, dtype) for shape in shapes]
    base.untyped_storage().resize_(0)
    return views


def copy_pieces(value: torch.Tensor, shard: torch.Tensor, pieces: Iterable[Any]) -> None:
    """Copy the parts of one parameter's ``value`` that this rank owns (layout pieces) into ``shard``."""
    flat = value.reshape(-1)
    for piece in pieces:
        shard[piece.shard_offset : piece.shard_offset + piece.numel].copy_(
            flat[piece.param_offset : piece.param_offset + piece.numel]
        )
