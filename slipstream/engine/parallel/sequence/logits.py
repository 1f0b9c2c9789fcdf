"""The whole sequence's logits under sequence sharding, gathered when the user reads them.

[Note: logits on read] Each rank of a sequence group computes the logits of its own tokens only.
A loss written on ``out.logits`` (z-loss, distillation, a custom token weighting) expects the
whole sequence's, in order, at the caller's length. So the engine's output answers
``out.logits`` (and ``out["logits"]``, ``out.to_tuple()``) with the group's logits gathered: one
all-gather, put back in global token order (zig-zag chunks too), the engine's fill cut off. It is
gathered only when read: the loss path never pays for the ``b·s·V`` tensor sequence sharding exists
to avoid. Reading it is a collective over the sequence group, so every rank of the group must read
it (as every rank runs the same training code); a rank that does not leaves the others waiting
until ``comms_timeout_seconds`` names the gather.

Gradient: every rank computes the same loss from the same gathered logits. The backward of the
gather keeps this rank's tokens' gradient and multiplies it by the group size ``u``: the engine
averages gradients over the group's ranks (as for the sequence loss, inputs.py's note), and the mean
over ``u`` ranks of ``u ×`` (each rank's share) is the whole sequence's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm

_WITH_WHOLE_LOGITS: dict[type, type] = {}


class _GatherLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor, mine: torch.Tensor, length: int) -> torch.Tensor:  # type: ignore[override]
        """``order``: the global position of every gathered token (rank after rank, each in its local order);
        ``mine``: this rank's tokens' global positions; ``length``: the caller's (before the engine's fill)."""
        size = dist.get_world_size(group)
        flat = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(flat, local.contiguous().view(-1), group=group, tag="sequence-parallel logits all-gather").wait()
        pieces = flat.view(size, *local.shape)  # [u, b, n, V]
        gathered = torch.cat(pieces.unbind(0), dim=1)  # [b, u·n, V], rank after rank
        whole = torch.empty_like(gathered)
        whole[:, order] = gathered
        ctx.group_size, ctx.mine, ctx.padded = size, mine, whole.shape[1]
        return whole[:, :length]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if grad.shape[1] < ctx.padded:  # the fill's logits: read by nobody
            grad = torch.nn.functional.pad(grad, [0, 0] * (grad.dim() - 2) + [0, ctx.padded - grad.shape[1]])
        return grad[:, ctx.mine] * ctx.group_size, None, None, None, None


def gather_logits(local: torch.Tensor, group: dist.ProcessGroup, positions: Callable[[int, int], torch.Tensor], length: int) -> torch.Tensor:
    """The whole sequence's logits [b, length, ...] from this rank's [b, n, ...]; ``positions(rank, padded)``: a
    rank's tokens' global positions in its local order (the sharder's layout)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = local.shape[1] * size
    order = torch.cat([positions(r, padded) for r in range(size)]).to(local.device)
    return _GatherLogits.apply(local, group, order, positions(rank, padded).to(local.device), length)


def with_whole_logits(output: Any, gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``output`` (a transformers ModelOutput) answering ``.logits`` with ``gather(local logits)``, computed on first
    read and kept; other outputs are returned unchanged."""
    local = getattr(output, "logits", None)
    if not isinstance(local, torch.Tensor) or not hasattr(output, "to_tuple"):
        return output
    cls = type(output)
    whole_cls = _WITH_WHOLE_LOGITS.get(cls)
    if whole_cls is None:
        whole_cls = type(cls.__name__, (cls,), {
            "logits": property(_read_logits, _write_logits),
            "__getitem__": _getitem,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        })  # fmt: skip
        _WITH_WHOLE_LOGITS[cls] = whole_cls
    output.__class__ = whole_cls
    output.__dict__["_slipstream_gather"] = gather
    return output


def _read_logits(self: Any) -> Any:
    state = self.__dict__
    if "_slipstream_whole_logits" not in state:
        local = state.get("logits")
        state["_slipstream_whole_logits"] = state["_slipstream_gather"](local) if isinstance(local, torch.Tensor) else local
    return state["_slipstream_whole_logits"]


def _write_logits(self: Any, value: Any) -> None:
    self.__dict__["logits"] = value
    self.__dict__.pop("_slipstream_whole_logits", None)
    self.__dict__["_slipstream_gather"] = lambda t: t  # the user's own logits: nothing to gather


def _getitem(self: Any, key: Any) -> Any:
    if key == "logits":
        return self.logits
    return super(type(self), self).__getitem__(key)
