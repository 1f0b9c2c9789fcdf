"""Issue 14's checkpoint layout: pieces are (name, global shape, box, flat range); any layout loads into any other.

A synthetic 6×8 weight is saved by 4 simulated writer ranks as 2 column boxes × 2 flat ranges
(what tensor parallelism 2 × ZeRO 2 would save), through the real capture, writer and commit.
It loads into a 1-rank whole-tensor layout and back, and into row boxes.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine.checkpoint import writer
from slipstream.engine.checkpoint.capture import capture
from slipstream.engine.checkpoint.reader import CheckpointReader
from slipstream.engine.checkpoint.restore import restore
from slipstream.engine.checkpoint.rng import RngState
from slipstream.engine.checkpoint.target import CheckpointTarget, Counters, TrainState
from slipstream.engine.checkpoint.tiling import LayoutError, check_tiling
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.pieces import ParamSlice

SHAPE = (6, 8)
W = torch.arange(48, dtype=torch.float32).reshape(SHAPE) / 7


class Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SHAPE))


class Shards:
    """A strategy stand-in holding given (box, range) pieces of ``w``, with an Adam-like moment per piece."""

    def __init__(self, pieces: list[ParamSlice], source: torch.Tensor | None) -> None:
        self.owned = []
        for s in pieces:
            region = (source if source is not None else torch.zeros(SHAPE))[
                tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
            ]
            value = region.reshape(-1)[s.start : s.start + s.numel].clone()
            self.owned.append(OwnedSlice(s, value, value))
        self.moments = {id(o): o.value * 2 for o in self.owned}

    def sharded_state(self) -> list[OwnedSlice]:
        return self.owned

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any]:
        return {"exp_avg": self.moments[id(owned)], "step": torch.tensor(3.0)}

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        assert state is not None
        self.moments[id(owned)] = state["exp_avg"]

    def load_sharded_state(self, read: Any) -> None:
        for o in self.owned:
            o.value.copy_(read(o.slice))


def _target(shards: Shards, world: int) -> CheckpointTarget:
    counters = {"state": TrainState(global_steps=3, micro_steps=3)}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return CheckpointTarget(
        module=Module(),
        shards=shards,
        optimizer=optimizer,
        scheduler=None,
        loss_scaler=_NoScale(),
        counters=Counters(lambda: counters["state"], lambda s: counters.update(state=s)),
        rng=RngState(lambda: None, lambda t: None),
        extra={},
        config={},
        zero_stage=2,
        precision="fp32",
        world_size=world,
    )


class _NoScale:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _column_boxes() -> list[list[ParamSlice]]:
    """4 ranks: tp rank t holds columns [4t, 4t+4), split in two flat ranges over 2 dp ranks."""
    ranks = []
    for t in range(2):
        box = ((0, 4 * t), (6, 4))
        for d in range(2):
            ranks.append([ParamSlice("w", SHAPE, 12 * d, 12, box)])
    return ranks


def _whole() -> list[list[ParamSlice]]:
    return [[ParamSlice("w", SHAPE, 0, 48)]]


def _row_boxes() -> list[list[ParamSlice]]:
    return [[ParamSlice("w", SHAPE, 0, 24, ((3 * r, 0), (3, 8)))] for r in range(2)]


def _save(directory: Path, layout: list[list[ParamSlice]], source: torch.Tensor) -> Path:
    world = len(layout)
    payloads = [capture(_target(Shards(pieces, source), world), rank, "t", None) for rank, pieces in enumerate(layout)]
    lock = writer.prepare(directory, "t")
    tmp = writer.temp_dir(directory, "t")
    for p in payloads:
        writer.write_rank(tmp, p)
    assert payloads[0].manifest is not None
    writer.commit(directory, "t", tmp, world, payloads[0].manifest, True, 10.0)
    lock.release()
    return directory / "t"


def _load(path: Path, layout: list[list[ParamSlice]]) -> list[Shards]:
    loaded = []
    for rank, pieces in enumerate(layout):
        shards = Shards(pieces, None)
        restore(
            _target(shards, len(layout)),
            CheckpointReader(path),
            rank,
            strict=True,
            optimizer=True,
            scheduler=True,
            module_only=False,
        )
        loaded.append(shards)
    return loaded


def _expected(s: ParamSlice, source: torch.Tensor) -> torch.Tensor:
    return source[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))].reshape(-1)[s.start : s.start + s.numel]


def test_two_boxes_by_two_flat_ranges_load_into_one_whole_tensor_and_back(tmp_path: Path) -> None:
    boxed = _save(tmp_path / "boxed", _column_boxes(), W)
    [whole] = _load(boxed, _whole())
    assert torch.equal(whole.owned[0].value.view(SHAPE), W)
    assert torch.equal(whole.moments[id(whole.owned[0])].view(SHAPE), W * 2)  # optimizer state re-sliced the same way
    back = _save(tmp_path / "whole", _whole(), whole.owned[0].value.view(SHAPE))
    for layout in (_column_boxes(), _row_boxes()):
        for shards in _load(back, layout):
            for o in shards.owned:
                assert torch.equal(o.value, _expected(o.slice, W))
                assert torch.equal(shards.moments[id(o)], _expected(o.slice, W) * 2)
    for shards in _load(boxed, _row_boxes()):  # boxes into other boxes
        assert all(torch.equal(o.value, _expected(o.slice, W)) for o in shards.owned)


def test_inspect_names_the_boxes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.engine.checkpoint.cli import main

    boxed = _save(tmp_path / "boxed", _column_boxes(), W)
    assert main(argparse.Namespace(checkpoint_command="inspect", dir=str(boxed), tag=None, verify=True)) == 0
    assert "4 saved pieces, 4 in boxes" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([(((0, 0), (6, 4)), 0, 24), (((0, 3), (6, 5)), 0, 30)], "overlap"),
        ([(((0, 0), (6, 4)), 0, 24)], "hold 24 of its 48"),
        ([(((0, 0), (6, 8)), 0, 20), (((0, 0), (6, 8)), 24, 24)], "gap"),
        ([(((0, 0), (6, 9)), 0, 54)], "outside"),
    ],
)
def test_pieces_that_do_not_tile_their_tensor_exactly_are_refused(pieces: list, message: str) -> None:
    entries = [
        {"name": "w", "shape": list(SHAPE), "start": s, "numel": n, "box": {"offsets": list(b[0]), "sizes": list(b[1])}}
        for b, s, n in pieces
    ]
    with pytest.raises(LayoutError, match=message):
        check_tiling("w", SHAPE, entries)
    assert math.prod(SHAPE) == 48


def test_export_assembles_the_boxes_into_the_whole_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from slipstream.engine.checkpoint.formats.hf.export import export_fp32

    boxed = _save(tmp_path / "boxed", _column_boxes(), W)
    export_fp32(boxed, tmp_path / "out" / "w.safetensors")
    assert torch.equal(load_file(tmp_path / "out" / "w.safetensors")["w"], W)


def test_a_snapshot_without_tensor_checksums_loads_and_a_checkpoint_missing_one_is_refused(tmp_path: Path) -> None:
    import json

    from slipstream.engine.checkpoint.reader import is_complete
    from slipstream.engine.checkpoint.validate import METADATA_CRC_ONLY

    source = W
    layout = _row_boxes()
    payloads = [capture(_target(Shards(pieces, source), 2), rank, "t", None) for rank, pieces in enumerate(layout)]
    lock, tmp = writer.prepare(tmp_path, "t"), writer.temp_dir(tmp_path, "t")
    for p in payloads:
        writer.write_rank(tmp, p, checksum=False)  # as an in-memory snapshot writes
    writer.commit(tmp_path, "t", tmp, 2, payloads[0].manifest, True, 10.0)
    lock.release()
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["checksum"] == METADATA_CRC_ONLY and "crc32" not in manifest["files"]["rank00000.safetensors"]
    assert "crc32" in manifest["files"]["rank00000.json"]
    for shards in _load(tmp_path / "t", layout):
        assert all(
            torch.equal(o.value, _expected(o.slice, W))
            and torch.equal(shards.moments[id(o)], _expected(o.slice, W) * 2)
            for o in shards.owned
        )
    # An ordinary checkpoint whose manifest lost a tensor file's CRC is damaged, not a snapshot.
    full = _save(tmp_path / "disk", layout, source)
    manifest = json.loads((full / "manifest.json").read_text())
    del manifest["files"]["rank00000.safetensors"]["crc32"]
    (full / "manifest.json").write_text(json.dumps(manifest))
    assert is_complete(full) is None
