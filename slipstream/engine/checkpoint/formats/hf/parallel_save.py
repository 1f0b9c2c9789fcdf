"""The sharded Hugging Face save, collective: every rank writes the files of its share from what it holds.

[Note: writing in parallel] No rank gathers the model. Every rank sends every other rank the
*metadata* of what it holds (the strategy's checkpoint slices: name, global shape, box, flat range;
its persistent buffers), one small ``all_gather_object``, and all derive the same plan: the parameters
in model order cut into world-size contiguous shares balanced by bytes (rank r writes share r), a
buffer with the first rank that holds it, each share cut into files at ``max_shard_size``. Then the
ranks go in rounds: in round k every rank gets the k-th parameter of its share, so all ranks write at
the same time. A parameter's writer takes it from its own whole copy when it has one (ZeRO 0,
replicated pieces); otherwise each rank holding pieces of it sends them, cast to the output dtype,
point to point, and the writer assembles the parameter, streams it into its open file and drops it.
So a rank holds its parameter of the round plus the pieces it sends others in that round (about one
more parameter under ZeRO), never its share and never the model; :class:`HeldBytes` counts it. A
failed write (full disk) does not stop the rounds, so the other ranks never hang: every rank raises
the same error at the end.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import all_gather_objects, broadcast_object, p2p
from slipstream.engine.checkpoint.formats.hf import files
from slipstream.engine.checkpoint.formats.hf.files import Spec, finish_directory, parse_size, plan_files, split_shares
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.pieces import ParamSlice, assemble

CHANNEL = 1 << 24  # p2p channels (backend tags) of a save: CHANNEL + the parameter's place in the plan


class HeldBytes:
    """Bytes of the tensors a save made and still holds (each counted until the object is freed), and their peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._release, n)
        return t

    def _release(self, n: int) -> None:
        self.now -= n


# --------------------------------------------------------------------------- online: every rank writes its share


@dataclasses.dataclass
class ShardReport:
    """What one rank did in a sharded save."""

    files: list[str]  # the files this rank wrote
    weight_map: dict[str, str]  # every key -> its file (all ranks)
    total_bytes: int  # all files together
    peak_bytes: int  # the most bytes this rank held at once in tensors made for the save (HeldBytes)
    sent_bytes: int
    received_bytes: int


@dataclasses.dataclass(frozen=True)
class _Held:
    """A slice of a parameter as one rank holds it for the save."""

    rank: int
    piece: ParamSlice
    duplicate: bool  # another rank holds the same elements and sends them


def write_sharded(
    save_dir: Path,
    filename: str,
    owned: list[OwnedSlice],
    names: list[str],
    frozen: set[str],
    buffers: dict[str, torch.Tensor],
    dtype: torch.dtype,
    exclude_frozen: bool,
    max_shard_size: int | str | None,
) -> ShardReport:
    """Write the model as Hugging Face shards, each rank its own; see [Note: writing in parallel]. Collective.

    ``owned``: this rank's checkpoint slices (``strategy.sharded_state()``); ``names``: its parameter
    names in model order; ``buffers``: its persistent buffers.
    """
    if not filename.endswith(".safetensors"):
        raise ValueError(f"a sharded save writes safetensors: name a '.safetensors' file, got {filename!r}")
    max_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    pieces, values = [], []
    for o in owned:
        value = o.value.detach().reshape(-1)
        for lo, hi, s in o.slice.split():  # a packed piece (tensor parallel) is one box per part
            pieces.append((s.entry(), o.duplicate))
            values.append(value[lo:hi])
    mine = {
        "names": names,
        "frozen": sorted(frozen),
        "pieces": pieces,
        "buffers": [(n, list(b.shape), str(b.dtype).removeprefix("torch.")) for n, b in buffers.items()],
    }
    gathered = all_gather_objects(mine)
    walk = _Walk(gathered, rank, world, values, dtype, frozen_out=exclude_frozen)
    shares: list[list[Spec]] = [[] for _ in range(world)]
    for name in walk.order:
        shares[walk.owner[name]].append(Spec(name, walk.shape[name], dtype))
    for holder, spec in walk.buffers.values():
        shares[holder].append(spec)
    plan = plan_files(shares, filename, max_bytes)
    save_dir, error = Path(save_dir), None
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        for name, specs in plan.of_rank(rank):
            files.write_file(save_dir / name, specs, lambda key: walk.take(key, buffers))
    except OSError as err:  # the rounds go on: the other ranks wait for this rank's pieces
        error = f"rank {rank}: {err}"
    walk.finish()
    errors = [e for e in all_gather_objects(error) if e is not None]
    if not errors and rank == 0:
        try:
            missing = [name for _, name, _ in plan.files if not (save_dir / name).is_file()]
            if missing:
                where = save_dir / missing[0]
                raise OSError(
                    f"{where} is missing: every rank writes into save_dir, which must be one directory all ranks see"
                )
            finish_directory(save_dir, plan, sum(math.prod(walk.shape[n]) for n in walk.order))
        except OSError as err:
            errors = [f"rank 0: {err}"]
    errors = _broadcast(errors, world)
    if errors:
        raise OSError(f"save to {save_dir}: " + "; ".join(errors))
    return ShardReport(
        [name for name, _ in plan.of_rank(rank)],
        plan.weight_map,
        plan.total_size,
        walk.held.peak,
        walk.sent,
        walk.received,
    )


def _broadcast(obj: Any, world: int) -> Any:
    return obj if world == 1 else broadcast_object(obj, src=0, tag="sharded save plan")


class _Walk:
    """The plan, the same on every rank, run in rounds; :meth:`take` runs them up to this rank's next parameter."""

    def __init__(
        self,
        gathered: list[dict[str, Any]],
        rank: int,
        world: int,
        values: list[torch.Tensor],
        dtype: torch.dtype,
        frozen_out: bool,
    ) -> None:
        self.rank, self.dtype, self.held = rank, dtype, HeldBytes()
        self.sent = self.received = 0
        self.device = _comm_device()
        self.shape: dict[str, tuple[int, ...]] = {}
        self.pieces: dict[str, list[_Held]] = {}
        self.local: dict[str, list[tuple[_Held, torch.Tensor]]] = {}
        frozen: set[str] = set()
        order: dict[str, None] = {}  # names in model order: the ranks in order (pipeline stages), each its own order
        for r, found in enumerate(gathered):
            frozen.update(found["frozen"])
            order.update(dict.fromkeys(found["names"]))
            for i, (entry, duplicate) in enumerate(found["pieces"]):
                held = _Held(r, ParamSlice.from_entry(entry), duplicate)
                name = held.piece.name
                self.shape.setdefault(name, held.piece.shape)
                self.pieces.setdefault(name, []).append(held)
                if r == rank:
                    self.local.setdefault(name, []).append((held, values[i]))
        missing = [n for n in order if n not in self.pieces]
        if missing:
            raise RuntimeError(f"sharded save: no rank holds a slice of parameter {missing[0]!r}")
        self.order = [n for n in order if not (frozen_out and n in frozen)]
        sizes = [math.prod(self.shape[n]) * dtype.itemsize for n in self.order]
        self.owner = dict(zip(self.order, split_shares(sizes, world)))
        self.buffers: dict[str, tuple[int, Spec]] = {}
        for r, found in enumerate(gathered):
            for name, shape, kind in found["buffers"]:
                self.buffers.setdefault(name, (r, Spec(name, tuple(shape), getattr(torch, kind))))
        self.place = {name: i for i, name in enumerate(self.order)}
        self.shares: list[list[str]] = [[] for _ in range(world)]
        for name in self.order:
            self.shares[self.owner[name]].append(name)
        self.mine = {name: k for k, name in enumerate(self.shares[rank])}
        self.rounds, self.done = max(map(len, self.shares), default=0), 0

    def take(self, key: str, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tensor to write for ``key``: a buffer this rank holds, or its next parameter (running rounds up to it)."""
        if key not in self.mine:
            return self.held.hold(buffers[key].detach().cpu().contiguous())
        k, found = self.mine[key], None
        if k < self.done:
            raise RuntimeError(f"sharded save: {key!r} asked for after its round (files out of plan order)")
        while self.done <= k:
            found = self._round(self.done)
            self.done += 1
        assert found is not None
        return found

    def finish(self) -> None:
        """Run the remaining rounds: other ranks still need this rank's pieces (a failed file just drops its own)."""
        while self.done < self.rounds:
            self._round(self.done)
            self.done += 1

    def _round(self, k: int) -> torch.Tensor | None:
        """Round ``k``: every rank gets the ``k``-th parameter of its share, so all write at once. Returns this rank's.

        All transfers of the round are posted, then waited for. Each rank posts them in plan order, so
        two ranks post theirs to each other in the same order (NCCL runs a pair's transfers in order).
        """
        hold = self.held.hold
        works, outgoing, own = [], [], None
        for name in (share[k] for share in self.shares if k < len(share)):  # plan order: the shares are contiguous
            owner, shape, channel = self.owner[name], self.shape[name], CHANNEL + self.place[name]
            if any(p.rank == owner and p.piece.complete for p in self.pieces[name]):  # the writer holds it whole
                if self.rank == owner:
                    own = (shape, [next((held.piece, v) for held, v in self.local[name] if held.piece.complete)])
                continue
            saved = [p for p in self.pieces[name] if not p.duplicate]
            senders = sorted({p.rank for p in saved} - {owner})
            if self.rank == owner:
                parts = [(held.piece, v) for held, v in self.local.get(name, []) if not held.duplicate]
                for source in senders:
                    theirs = [p.piece for p in saved if p.rank == source]
                    buffer = hold(torch.empty(sum(p.numel for p in theirs), dtype=self.dtype, device=self.device))
                    works.append(p2p.recv(buffer, source, channel, tag=f"{name} for the sharded save"))
                    self.received += buffer.numel() * buffer.element_size()
                    at = 0
                    for piece in theirs:
                        parts.append((piece, buffer[at : at + piece.numel]))
                        at += piece.numel
                own = (shape, parts)
            elif self.rank in senders:
                sources = [v for held, v in self.local[name] if not held.duplicate]
                cast = [v.to(self.device, self.dtype) for v in sources]
                outgoing.append(cast[0].contiguous() if len(cast) == 1 else torch.cat(cast))  # kept until sent
                if outgoing[-1] is not sources[0]:  # a new tensor; the live slice itself costs nothing more
                    hold(outgoing[-1])
                del sources, cast
                works.append(p2p.send(outgoing[-1], owner, channel, tag=f"{name} for the sharded save"))
                self.sent += outgoing[-1].numel() * outgoing[-1].element_size()
        for work in works:
            work.wait()
        del works, outgoing  # sent (a backend's work holds its tensor): freed before this rank's parameter is assembled
        return None if own is None else self._assemble(*own)

    def _assemble(self, shape: tuple[int, ...], parts: Iterable[tuple[ParamSlice, torch.Tensor]]) -> torch.Tensor:
        """The whole parameter from pieces that tile it, on the CPU, in the output dtype, counted as held."""
        return assemble(shape, parts, self.dtype, self.held.hold)


def _comm_device() -> torch.device:
    """Where point-to-point tensors live: the accelerator under NCCL, else the CPU."""
    if dist.is_initialized() and str(dist.get_backend()) == "nccl":
        from slipstream.accelerator import get_accelerator

        return get_accelerator().device()
    return torch.device("cpu")


# --------------------------------------------------------------------------- offline: from a checkpoint's files
