"""The Megatron f/g pairs as autograd functions over the tensor-parallel group.

[Note: the four pairs] A column-parallel layer needs its input whole on every rank and a
row-parallel layer leaves a partial sum, so each sub-block (attention, MLP) is bracketed by a pair:

* tensor parallel: ``copy`` (forward identity, backward all-reduce) before the column layers and
  ``reduce`` (forward all-reduce, backward identity) after the row layer;
* sequence parallel: ``gather`` (forward all-gather on the sequence, backward reduce-scatter) and
  ``reduce_scatter`` (forward reduce-scatter on the sequence, backward all-gather): the same bytes,
  but the norm and dropout regions between the pairs hold only ``s / t`` of the sequence;
* ``split``/``gather_keep`` at the edges of the sequence-parallel region (first block in, last
  block out) and ``gather_last`` for vocabulary-sharded logits (backward: keep this rank's chunk);
* ``gather``/``keep_chunk`` around a replicated attention inside the region (sequence.py's
  [Note: replicated attention]): whole sequences in, this rank's chunk out, partial gradients.

[Note: a length that does not divide] The region holds ``ceil(s / t)`` tokens per rank: ``split`` and
``reduce_scatter`` extend a whole sequence of ``s`` tokens with zero rows to a multiple of ``t``
before cutting it, and every gather back to the whole sequence (``gather`` at a sub-block's entry,
``gather_keep`` at the region's end, given the region's ``length``) cuts those rows off again. So
attention, MLPs and the head only ever see the caller's ``s`` tokens; the zero rows pass through
norms and residual adds on their own (each row is its own) and no output reads them, so their
gradient is zero and the replicated parameters' gradients are one process's.

[Note: flattened tokens] Some blocks flatten their tokens before the MLP (OPT: ``[b, s, h]`` to
``[b·s, h]``). Inside the region that is ``[b·s/t, h]``, whose first dimension mixes the batch and
this rank's part of the sequence. A 2-D activation reaching a gather or a reduce-scatter is viewed
as ``[rows, s/t, h]`` with the region's batch rows (recorded at its entry), exchanged on the
sequence, and flattened back, so the ranks' tokens interleave as the unflattened ones do.

Every collective goes through ``slipstream.comm`` so the comms log counts it (tests pin the
bytes per block). On CUDA these run on the backend's stream and the next matmul waits only on the
collective it consumes; nothing here synchronizes the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from slipstream.utils.eager_island import declare, island


def _owned(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a tensor of its own, not a view: a custom Function's output that is a view cannot be modified in
    place by the model (Falcon adds its attention output to its MLP output with ``+=``)."""
    if x._base is None:
        return x
    return x.contiguous() if not x.is_contiguous() else x.clone()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, tag: str) -> torch.Tensor:
    out = x.contiguous().clone()
    all_reduce(out, group=group, tag=tag).wait()
    return out


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str) -> torch.Tensor:
    """Concatenate the ranks' pieces along ``dim`` (rank order)."""
    size = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out.view(-1), front.view(-1), group=group, tag=tag).wait()
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str) -> torch.Tensor:
    """Sum over ranks and keep this rank's chunk along ``dim``."""
    size = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous().clone()  # scratch: the collective may overwrite it
    if front.shape[0] % size:
        raise ValueError(
            f"tensor parallel: dimension {dim} of size {front.shape[0]} does not divide by the tp size {size}"
        )
    out = torch.empty((front.shape[0] // size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out.view(-1), front.view(-1), group=group, tag=tag).wait()
    return out.movedim(0, dim)


def _fit(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``x`` cut or extended with zeros along ``dim`` to ``length`` (see [Note: a length that does not divide])."""
    have = x.shape[dim]
    if have == length:
        return x
    if have > length:
        return x.narrow(dim, 0, length)
    shape = list(x.shape)
    shape[dim] = length - have
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _divisible(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    return _fit(x, dim, -(-x.shape[dim] // size) * size)


def _chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"tensor parallel: dimension {dim} of size {x.shape[dim]} does not divide by the tp size {size}"
        )
    return x.chunk(size, dim)[rank].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, "tp copy (backward)"), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group, "tp reduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str, length: int | None
    ) -> torch.Tensor:
        whole = _gather(x, dim, group, tag)
        ctx.dim, ctx.group, ctx.tag, ctx.padded = dim, group, tag, whole.shape[dim]
        return _owned(whole if length is None else _fit(whole, dim, length))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return (
            _reduce_scatter(_fit(grad, ctx.dim, ctx.padded), ctx.dim, ctx.group, f"{ctx.tag} (backward)"),
            None,
            None,
            None,
            None,
        )


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tag, ctx.length = dim, group, tag, x.shape[dim]
        return _owned(_reduce_scatter(_divisible(x, dim, group), dim, group, tag))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _fit(_gather(grad, ctx.dim, ctx.group, f"{ctx.tag} (backward)"), ctx.dim, ctx.length), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.length = dim, group, x.shape[dim]
        return _owned(_chunk(_divisible(x, dim, group), dim, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _fit(_gather(grad, ctx.dim, ctx.group, "sp split (backward)"), ctx.dim, ctx.length), None, None


class _GatherKeep(torch.autograd.Function):
    """Forward all-gather; backward keeps this rank's chunk (the gradient is already whole on every rank)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str, length: int | None
    ) -> torch.Tensor:
        whole = _gather(x, dim, group, tag)
        ctx.dim, ctx.group, ctx.padded = dim, group, whole.shape[dim]
        return _owned(whole if length is None else _fit(whole, dim, length))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _chunk(_fit(grad, ctx.dim, ctx.padded), ctx.dim, ctx.group), None, None, None, None


class _KeepChunk(_Split):
    """Forward: ``split``'s (this rank's chunk of a whole sequence every rank computed alike); backward: that chunk's
    gradient in its place and zeros elsewhere, so what computed the whole sequence holds a partial gradient on each
    rank (summed by a ``gather``'s reduce-scatter before it, and by the replicated parameters' sum over tp)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size, rank, local = dist.get_world_size(ctx.group), dist.get_rank(ctx.group), grad.shape[ctx.dim]
        shape = list(grad.shape)
        shape[ctx.dim] = local * size
        whole = grad.new_zeros(shape)
        whole.narrow(ctx.dim, rank * local, local).copy_(grad)
        return _fit(whole, ctx.dim, ctx.length), None, None


def keep_chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return island(_KeepChunk, (x,), (dim, group))


def on_tokens(x: torch.Tensor, rows: int | None, exchange: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``exchange`` on batch-first tokens, a flattened ``[rows·s, h]`` activation viewed as ``[rows, s, h]`` for it
    ([Note: flattened tokens])."""
    if x.dim() != 2 or not rows:
        return exchange(x)
    y = exchange(x.reshape(rows, -1, x.shape[-1]))
    return y.reshape(-1, y.shape[-1])


# Each pair is one eager island inside a compiled block (utils/eager_island.py); these give its output's shape.
def _same_meta(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(x)


def _resized(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = length
    return x.new_empty(shape)


def _gather_meta(x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str, length: int | None) -> torch.Tensor:
    return _resized(x, dim, length if length is not None else x.shape[dim] * dist.get_world_size(group))


def _chunk_meta(x: torch.Tensor, dim: int, group: dist.ProcessGroup, *_: Any) -> torch.Tensor:
    return _resized(x, dim, -(-x.shape[dim] // dist.get_world_size(group)))


for _fn, _meta in (
    (_Copy, _same_meta),
    (_Reduce, _same_meta),
    (_GatherSeq, _gather_meta),
    (_ReduceScatterSeq, _chunk_meta),
    (_Split, _chunk_meta),
    (_GatherKeep, _gather_meta),
    (_KeepChunk, _chunk_meta),
):
    declare(_fn, _meta)


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return island(_Copy, (x,), (group,))


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return island(_Reduce, (x,), (group,))


def gather_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str = "sp gather", length: int | None = None
) -> torch.Tensor:
    """``length``: the region's whole sequence (the rows past it are the region's extension, cut off)."""
    return island(_GatherSeq, (x,), (dim, group, tag, length))


def reduce_scatter_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str = "sp reduce-scatter"
) -> torch.Tensor:
    return island(_ReduceScatterSeq, (x,), (dim, group, tag))


def split_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return island(_Split, (x,), (dim, group))


def gather_keep(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, tag: str, length: int | None = None
) -> torch.Tensor:
    return island(_GatherKeep, (x,), (dim, group, tag, length))
