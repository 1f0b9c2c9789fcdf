"""The whole sequence's per-token outputs (logits, and any other) under sequence sharding, gathered when read.

[Note: logits on read] Each rank of a sequence group computes the outputs of its own tokens only.
A loss written on ``out.logits`` (z-loss, distillation, a custom token weighting), or on another
per-token output (TRL's fused head returns ``log_probs``, ``label_mask``, ``entropy`` and sums them
itself; a base model returns ``last_hidden_state``), expects the whole sequence's, in order, at the
caller's length. So every tensor field of the engine's output that is per token ([b, n, ...] with
this rank's n) answers ``out.<field>`` (and ``out["<field>"]``, ``out.to_tuple()``) with the
group's values gathered: one all-gather, put back in global token order (zig-zag chunks too), the
engine's fill cut off. It is gathered only when read: the loss path never pays for the ``b·s·V``
tensor sequence sharding exists to avoid. Reading it is a collective over the sequence group, so
every rank of the group must read it (as every rank runs the same training code); a rank that does
not leaves the others waiting until ``comms_timeout_seconds`` names the gather.

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

_WITH_WHOLE_SEQUENCE: dict[tuple[type, tuple[str, ...]], type] = {}


def gather_in_order(local: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor, tag: str) -> torch.Tensor:
    """[b, u·n, ...] in global token order (the engine's fill included) from every rank's [b, n, ...]; ``order``:
    the global position of every gathered token (rank after rank, each in its local order)."""
    size = dist.get_world_size(group)
    wire = local.to(torch.uint8) if local.dtype == torch.bool else local  # gloo gathers no bool
    flat = torch.empty(size * local.numel(), dtype=wire.dtype, device=local.device)
    comm.all_gather_into_tensor(flat, wire.contiguous().view(-1), group=group, tag=tag).wait()
    pieces = flat.view(size, *local.shape).to(local.dtype)  # [u, b, n, ...]
    gathered = torch.cat(pieces.unbind(0), dim=1)  # [b, u·n, ...], rank after rank
    whole = torch.empty_like(gathered)
    whole[:, order] = gathered
    return whole


def group_positions(
    group: dist.ProcessGroup, positions: Callable[[int, int], torch.Tensor], padded: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's tokens' global positions, rank after rank; this rank's) for a sequence of ``padded`` tokens."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.cat([positions(r, padded) for r in range(size)]).to(device), positions(rank, padded).to(device)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor, mine: torch.Tensor, length: int
    ) -> torch.Tensor:  # type: ignore[override]
        """``mine``: this rank's tokens' global positions; ``length``: the caller's (before the engine's fill)."""
        whole = gather_in_order(local, group, order, "sequence-parallel outputs all-gather")
        ctx.group_size, ctx.mine, ctx.padded = dist.get_world_size(group), mine, whole.shape[1]
        return whole[:, :length]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if grad.shape[1] < ctx.padded:  # the fill's logits: read by nobody
            grad = torch.nn.functional.pad(grad, [0, 0] * (grad.dim() - 2) + [0, ctx.padded - grad.shape[1]])
        return grad[:, ctx.mine] * ctx.group_size, None, None, None, None


def gather_sequence(
    local: torch.Tensor, group: dist.ProcessGroup, positions: Callable[[int, int], torch.Tensor], length: int
) -> torch.Tensor:
    """The whole sequence's values [b, length, ...] from this rank's [b, n, ...]; ``positions(rank, padded)``: a
    rank's tokens' global positions in its local order (the sharder's layout)."""
    order, mine = group_positions(group, positions, local.shape[1] * dist.get_world_size(group), local.device)
    return _GatherSequence.apply(local, group, order, mine, length)


def with_whole_sequence(output: Any, local_length: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``output`` (a transformers ModelOutput) answering each per-token tensor field ([b, ``local_length``, ...])
    with ``gather(local)``, computed on its first read and kept; other outputs are returned unchanged."""
    if not hasattr(output, "to_tuple") or not hasattr(output, "keys"):
        return output
    names = tuple(
        k
        for k in output.keys()
        if k != "loss"
        and isinstance(getattr(output, k, None), torch.Tensor)
        and getattr(output, k).dim() >= 2
        and getattr(output, k).shape[1] == local_length
    )
    if not names:
        return output
    cls = type(output)
    whole_cls = _WITH_WHOLE_SEQUENCE.get((cls, names))
    if whole_cls is None:
        fields = {name: property(_reader(name), _writer(name)) for name in names}
        whole_cls = type(
            cls.__name__,
            (cls,),
            {**fields, "__getitem__": _getitem, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
        _WITH_WHOLE_SEQUENCE[(cls, names)] = whole_cls
    output.__class__ = whole_cls
    output.__dict__["_slipstream_gather"] = gather
    output.__dict__["_slipstream_whole"] = {}
    return output


def _reader(name: str) -> Callable[[Any], Any]:
    def read(self: Any) -> Any:
        state = self.__dict__
        whole = state["_slipstream_whole"]
        if name not in whole:
            local = state.get(name)
            whole[name] = state["_slipstream_gather"](local) if isinstance(local, torch.Tensor) else local
        return whole[name]

    return read


def _writer(name: str) -> Callable[[Any, Any], None]:
    def write(self: Any, value: Any) -> None:  # the user's own value: nothing to gather
        self.__dict__[name] = value
        self.__dict__.setdefault("_slipstream_whole", {})[name] = value

    return write


def _getitem(self: Any, key: Any) -> Any:
    if isinstance(key, str) and isinstance(type(self).__dict__.get(key), property):
        return getattr(self, key)
    return super(type(self), self).__getitem__(key)
