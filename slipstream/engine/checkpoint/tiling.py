"""A checkpoint's saved slices: exact-coverage checks, their tensor keys, and assembling from files.

[Note: the layout] A saved piece is (parameter name, global shape, box, flat range inside the
box): ``box`` = per-dimension offsets and sizes within the global tensor (absent: the whole
tensor), then elements ``[start, start + numel)`` of the box flattened row-major. ZeRO alone
saves whole-tensor boxes cut into flat ranges; tensor parallelism adds real boxes. The boxes of
a parameter must tile it and each box's ranges must tile the box: no overlap, no gap. A load
asks for any (box, range) and gets it assembled from whatever pieces hold it, one parameter at a
time, so memory is bounded by the largest parameter. The slice type and the box arithmetic are
``utils/pieces.py``'s ([Note: a piece of a global tensor]); this module adds what the files need.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.checkpoint.format import key_part
from slipstream.errors import SlipstreamError
from slipstream.utils.pieces import Box, ParamSlice, is_whole, whole_box
from slipstream.utils.pieces import assemble as assemble_slices


class LayoutError(SlipstreamError, ValueError):
    """Pieces that do not tile their parameter exactly (overlap, gap, out of bounds)."""


def entry_box(entry: dict[str, Any], shape: tuple[int, ...]) -> Box:
    box = entry.get("box")
    if box is None:
        return whole_box(shape)
    return tuple(box["offsets"]), tuple(box["sizes"])


def check_tiling(name: str, shape: tuple[int, ...], entries: list[dict[str, Any]]) -> None:
    """The boxes of ``entries`` tile ``shape`` and each box's flat ranges tile the box, exactly."""
    boxes: dict[Box, list[tuple[int, int]]] = {}
    for e in entries:
        box = entry_box(e, shape)
        offsets, sizes = box
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise LayoutError(
                f"parameter {name!r}: a box has {len(offsets)} offsets and {len(sizes)} sizes for a {len(shape)}-d tensor"
            )
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise LayoutError(
                f"parameter {name!r}: box offsets {list(offsets)} sizes {list(sizes)} lie outside its shape {list(shape)}"
            )
        volume = math.prod(sizes)
        if e["start"] < 0 or e["numel"] < 0 or e["start"] + e["numel"] > volume:
            raise LayoutError(
                f"parameter {name!r}: elements {e['start']}..{e['start'] + e['numel']} lie outside their box of {volume}"
            )
        boxes.setdefault(box, []).append((e["start"], e["numel"]))
    total = 0
    for box, ranges in boxes.items():
        volume = math.prod(box[1])
        total += volume
        at = 0
        for start, numel in sorted(r for r in ranges if r[1] > 0):
            if start != at:
                what = "overlap" if start < at else "gap"
                raise LayoutError(
                    f"parameter {name!r}: saved slices {what} at element {min(start, at)} of box {list(box[0])}"
                )
            at = start + numel
        if at != volume:
            raise LayoutError(
                f"parameter {name!r}: elements {at}..{volume} of box {list(box[0])} are not saved (a gap)"
            )
    numel = math.prod(shape)
    real = [b for b in boxes if math.prod(b[1]) > 0]
    for i, a in enumerate(real):
        for b in real[i + 1 :]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1])):
                raise LayoutError(f"parameter {name!r}: boxes at offsets {list(a[0])} and {list(b[0])} overlap")
    if total != numel:
        raise LayoutError(f"parameter {name!r}: its boxes hold {total} of its {numel} elements")


def piece_key(prefix: str, name: str, box: Box, shape: tuple[int, ...], start: int, version: int) -> str:
    """The tensor key of a piece: one per (parameter, box, start), so a rewritten key is detected on load.

    Format 1 wrote ``p/<name>/<start>`` with the name unescaped; format 2 escapes the name and
    adds ``@offsets:sizes`` for a box that is not the whole tensor.
    """
    if version < 2:
        return f"{prefix}/{name}/{start}"
    tail = "" if is_whole(box, shape) else "@" + ",".join(map(str, box[0])) + ":" + ",".join(map(str, box[1]))
    return f"{prefix}/{key_part(name)}{tail}/{start}"


def check_keys(entry: dict[str, Any], version: int) -> str | None:
    """Why the tensor keys of a saved slice entry are not the ones its name, box and start give, or None."""
    shape = tuple(entry["shape"])
    box = entry_box(entry, shape)
    expected = piece_key("p", entry["name"], box, shape, entry["start"], version)
    if entry["key"] != expected:
        return f"key {entry['key']!r} (expected {expected!r})"
    state_prefix = piece_key("o", entry["name"], box, shape, entry["start"], version)
    for state, record in entry.get("optimizer", {}).items():
        for kind in ("slice", "tensor"):
            if kind in record:
                want = f"{state_prefix}/{state if version < 2 else key_part(state)}"
                if record[kind] != want:
                    return f"optimizer key {record[kind]!r} (expected {want!r})"
    return None


def assemble(
    shape: tuple[int, ...], pieces: list[tuple[dict[str, Any], Callable[[int, int], torch.Tensor]]], dtype: torch.dtype
) -> torch.Tensor:
    """The whole parameter of ``shape`` from its saved slices; ``read(lo, hi)`` gives elements ``[lo, hi)`` of one."""
    return assemble_slices(
        shape,
        ((ParamSlice.from_entry(entry), lambda read=read, n=entry["numel"]: read(0, n)) for entry, read in pieces),
        dtype,
    )
