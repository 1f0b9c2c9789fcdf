"""Checkpoint slices of an offloaded partition, in the format every stage writes (zero/slices.py).

[Note: offloaded slices] An offloaded stage keeps its fp32 masters and Adam moments flat, in
partition coordinates, in CPU memory or in NVMe swap files, and its step counts per parameter.
Each layout piece becomes one :class:`OffloadSlice` whose ``value`` is the piece's master (a
writable view in CPU memory, a copy read from the swap files on NVMe) and whose optimizer state
is ``exp_avg``/``exp_avg_sq`` of the piece's length plus ``step`` as a 0-dim CPU tensor, as
``torch.optim.Adam`` keeps it. So a checkpoint saved with offload loads without it, and the
reverse. A parameter that never stepped has no state, as with torch's optimizers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.zero.offload.partition import PartitionOffload
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.pieces import ParamSlice

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class OffloadSlice(OwnedSlice):
    """An :class:`OwnedSlice` that also knows its piece's start in the partition."""

    offset: int = 0


def offload_slices(offload: PartitionOffload, pieces: list[tuple[ParamSlice, int]]) -> list[OwnedSlice]:
    """One slice per ``(slice, partition offset)``; frozen pieces (no optimizer segment) get no optimizer key."""
    owned: list[OwnedSlice] = []
    for piece, offset in pieces:
        value = offload.piece("master", offset, piece.numel)
        optimized = offload.segment_at(offset) is not None
        # On NVMe the optimizer's parameters are meta placeholders: the CPU copy stands for the piece.
        owned.append(OffloadSlice(piece, value, value if optimized else None, offset=offset))
    return owned


def slice_state(offload: PartitionOffload, owned: OwnedSlice) -> dict[str, Any] | None:
    """One piece's Adam state, as torch's Adam keys it (None: frozen, replicated or never stepped)."""
    if not isinstance(owned, OffloadSlice):
        return None  # stages 1/2's replicated frozen parameters
    segment = offload.segment_at(owned.offset)
    if segment is None or offload.step_count(segment.param) == 0:
        return None
    state: dict[str, Any] = {"step": torch.tensor(float(offload.step_count(segment.param)))}
    for name in MOMENTS:
        state[name] = offload.piece(name, owned.offset, owned.slice.numel)
    return state


def load_slice_state(offload: PartitionOffload, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
    """Install one piece's Adam state (None: never stepped, zero moments)."""
    segment = offload.segment_at(owned.offset) if isinstance(owned, OffloadSlice) else None
    if segment is None:
        return
    numel = owned.slice.numel
    for name in MOMENTS:
        values = state[name] if state is not None else torch.zeros(numel)
        if values.numel() != numel:
            raise ValueError(
                f"optimizer state {name!r} of {owned.slice.name}: {values.numel()} elements, the piece has {numel}"
            )
        offload.write(name, owned.offset, values)
    step = 0 if state is None else state.get("step", 0)
    offload.set_step_count(segment.param, int(step.item() if torch.is_tensor(step) else step))


def load_masters(
    offload: PartitionOffload, owned: list[OwnedSlice], read: Callable[[ParamSlice], torch.Tensor]
) -> None:
    """Fill every slice with ``read(slice)``; offloaded masters on NVMe go back to the swap files in one pass."""
    swapped = [o for o in owned if isinstance(o, OffloadSlice) and not offload.in_memory()]
    with torch.no_grad():
        for o in owned:
            if not (isinstance(o, OffloadSlice) and not offload.in_memory()):
                o.value.copy_(read(o.slice).reshape(-1))
        if swapped:
            full = offload.masters(0, offload.numel)  # padding keeps its values
            for o in swapped:
                full[o.offset : o.offset + o.slice.numel].copy_(read(o.slice).reshape(-1))
            offload.write("master", 0, full)
