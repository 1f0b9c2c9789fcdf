"""Point-to-point transfers between pipeline stages, logged and timed like the collectives.

A send is logged as ``p2p`` with its bytes (so a boundary's traffic is the sum of what both sides
send); a receive as ``p2p_recv``; the small shape headers that precede activations as
``p2p_meta``, so activation bytes can be checked exactly against their formula.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm.collectives import Work, _launch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
HEADER = 8  # dtype code, number of dimensions, up to six sizes


def send(
    tensor: torch.Tensor, to: int, channel: int, group: dist.ProcessGroup | None = None, tag: str = "", op: str = "p2p"
) -> Work:
    """Asynchronous send to global rank ``to``; keep ``tensor`` unchanged until the work completes.

    [Note: channels] Messages between two ranks are matched by ``channel`` (the backend's tag),
    not by order: a V-shaped schedule sends activations and gradients the same way between the
    same two ranks, in an order the receiver does not share.
    """
    return _launch(
        op,
        tensor,
        tag,
        group,
        lambda: dist.isend(tensor, to, group=group, tag=channel),
        route=f"{dist.get_rank()}->{to}",
    )


def recv(
    tensor: torch.Tensor,
    source: int,
    channel: int,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    op: str = "p2p_recv",
) -> Work:
    """Asynchronous receive into ``tensor`` from global rank ``source`` on ``channel``."""
    return _launch(
        op,
        tensor,
        tag,
        group,
        lambda: dist.irecv(tensor, source, group=group, tag=channel),
        route=f"{source}->{dist.get_rank()}",
    )


PARTS = 2  # tensors one pipeline transfer may carry: the hidden state and what a carry hands on (router logits)


def channel(stage: int, kind: int, micro: int, part: int = 0) -> int:
    """A distinct channel per (receiving stage, part of the handoff, kind of message, micro-batch); kinds: 0 shape,
    1 activation, 2 gradient; part 0 is the hidden state."""
    if not 0 <= part < PARTS:
        raise ValueError(f"pipeline: a transfer carries at most {PARTS} tensors (part {part})")
    return ((stage * PARTS + part) * 3 + kind) * 100_000 + micro


def header(tensor: torch.Tensor) -> torch.Tensor:
    """Shape and dtype of ``tensor`` as a small int64 tensor the receiver can allocate from."""
    if tensor.dim() > HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"pipeline: cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)} between stages")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64)


def empty_from(head: torch.Tensor, device: torch.device) -> torch.Tensor:
    values = head.tolist()
    return torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=device)
