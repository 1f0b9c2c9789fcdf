"""A piece of a global tensor: the one value type every layer uses to say which elements a rank holds.

[Note: a piece of a global tensor]
Tensor, pipeline and expert parallelism cut a parameter into *boxes* (offsets and sizes along each
dimension of the global tensor); ZeRO then flattens what a rank holds and cuts it into flat ranges.
So a rank's share of a parameter is a :class:`ParamSlice`: elements ``[start, start + numel)`` of
one box of the global tensor, flattened row-major (ZeRO alone: the box is the whole tensor).

Everything that moves or stores shares goes through this type and the functions beside it:

* the native checkpoint's manifest and the consolidated and Hugging Face saves send a slice as its
  ``entry()`` dict (the wire form) and read it back with ``from_entry``;
* ``assemble`` builds a whole parameter from slices that tile it (checkpoint load, the gathered
  weights, the sharded HF save), ``cut`` takes a slice out of a whole one;
* DCP stores rectangular chunks: ``flat_boxes`` turns a flat range into the boxes that hold it,
  ``covering_rows`` the whole rows around it;
* the placement of a parameter (``utils/placement.py``) and the twin check's reference (``box_index``)
  speak in the same ``Box``.

DTensor's ``Shard``/``Replicate`` placements cannot say "a flat range of a box": ZeRO's flat shards
cut across rows, so this type is ours; a DTensor-sharded tensor is one box per rank here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) within the global tensor


def whole_box(shape: tuple[int, ...]) -> Box:
    return (0,) * len(shape), tuple(shape)


def is_whole(box: Box, shape: tuple[int, ...]) -> bool:
    return all(o == 0 for o in box[0]) and tuple(box[1]) == tuple(shape)


def box_index(box: Box) -> tuple[slice, ...]:
    """The index of ``box`` in the global tensor: ``full[box_index(box)]`` is the box's region."""
    return tuple(slice(o, o + s) for o, s in zip(*box))


def flat_boxes(sizes: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements ``[start, end)`` of a row-major tensor of ``sizes`` as boxes, in order (each one contiguous)."""
    if start >= end:
        return []
    if not sizes:
        return [((), ())]
    inner = math.prod(sizes[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def row(r: int, lo: int, hi: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    boxes = row(r0, c0, inner) if c0 else []
    first = r0 + 1 if c0 else r0
    if r1 > first:
        boxes.append(((first, *[0] * (len(sizes) - 1)), (r1 - first, *sizes[1:])))
    return boxes + (row(r1, 0, c1) if c1 else [])


@dataclasses.dataclass(frozen=True)
class ParamSlice:
    """Elements ``[start, start + numel)`` of the flattened ``box`` of the parameter ``name`` of global shape ``shape``.

    ``box`` is ``(offsets, sizes)`` within the global tensor; ``None`` means the whole tensor.
    ``parts``: a packed piece (utils/placement.py, [Note: packed pieces]) is several boxes laid end
    to end, given as ``(flat start in the piece, box)``; then ``start`` counts in the piece and
    :meth:`split` gives the one-box slices a checkpoint stores.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    box: Box | None = None
    parts: tuple[tuple[int, Box], ...] | None = None

    def split(self) -> list[tuple[int, int, ParamSlice]]:
        """``(lo, hi, one-box slice)``: elements ``[lo, hi)`` of this slice are that slice (itself when one box)."""
        if self.parts is None:
            return [(0, self.numel, self)]
        found = []
        end = self.start + self.numel
        for begin, box in self.parts:
            lo, hi = max(self.start, begin), min(end, begin + math.prod(box[1]))
            if lo < hi:
                found.append(
                    (lo - self.start, hi - self.start, ParamSlice(self.name, self.shape, lo - begin, hi - lo, box))
                )
        return found

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.box[0] if self.box is not None else (0,) * len(self.shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.box[1] if self.box is not None else tuple(self.shape)

    @property
    def region(self) -> Box:
        """The box, whole tensor included (one-box slices only)."""
        return self.offsets, self.sizes

    @property
    def whole(self) -> bool:
        """True when the box is the whole tensor (every ZeRO-only slice)."""
        if self.parts is not None:
            return False
        return self.box is None or is_whole(self.box, self.shape)

    @property
    def complete(self) -> bool:
        """The whole tensor, every element: nothing to assemble."""
        return self.whole and self.start == 0 and self.numel == math.prod(self.shape)

    def entry(self) -> dict[str, Any]:
        """The wire and manifest form of a one-box slice: name, shape, start, numel, and the box unless whole."""
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "start": self.start, "numel": self.numel}
        if not self.whole:
            out["box"] = {"offsets": list(self.offsets), "sizes": list(self.sizes)}
        return out

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> ParamSlice:
        """The slice an ``entry()`` dict (or a checkpoint manifest's slice entry) describes."""
        box = entry.get("box")
        shape = tuple(entry["shape"])
        region = None if box is None else (tuple(box["offsets"]), tuple(box["sizes"]))
        return cls(entry["name"], shape, int(entry["start"]), int(entry["numel"]), region)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This slice's elements of the whole tensor ``full``, as a new 1-D tensor."""
        return full[box_index(self.region)].reshape(-1)[self.start : self.start + self.numel].clone()

    def covering_rows(self) -> tuple[Box, int]:
        """The box of whole rows (of this slice's box) that holds its flat range, and where the range starts in it."""
        offsets, sizes = self.offsets, self.sizes
        if not sizes:
            return ((), ()), 0
        inner = max(1, math.prod(sizes[1:]))
        r0, r1 = self.start // inner, -(-(self.start + self.numel) // inner)
        return ((offsets[0] + r0, *offsets[1:]), (r1 - r0, *sizes[1:])), self.start - r0 * inner


Data = torch.Tensor | Callable[[], torch.Tensor]  # a slice's values, or how to read them when needed


def assemble(
    shape: tuple[int, ...],
    parts: Iterable[tuple[ParamSlice, Data]],
    dtype: torch.dtype,
    new: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> torch.Tensor:
    """The whole parameter of ``shape`` (CPU, ``dtype``) from one-box slices that tile it.

    Slices of one box are written into a flat buffer of the box (the output itself when the box is
    the whole tensor), then the box into its region: one box's buffer at a time. ``new`` is handed
    every tensor this allocates (a save counts what it holds with it).
    """
    full = new(torch.empty(shape, dtype=dtype))
    by_box: dict[Box, list[tuple[ParamSlice, Data]]] = {}
    for piece, data in parts:
        by_box.setdefault(piece.region, []).append((piece, data))
    for box, members in by_box.items():
        whole = is_whole(box, shape)
        flat = full.view(-1) if whole else new(torch.empty(math.prod(box[1]), dtype=dtype))
        for piece, data in members:
            if piece.numel:
                values = data() if callable(data) else data
                flat[piece.start : piece.start + piece.numel].copy_(values.reshape(-1).to("cpu", dtype))
        if not whole:
            full[box_index(box)] = flat.view(box[1])
        del flat
    return full
