"""Issue 14: the manifest records the mesh and ``checkpoint inspect`` prints it; no ``.lock-<tag>`` file outlives its save.

Single process (the mesh is then 1 on every axis); tests/distributed/test_checkpoint_mesh_record.py
saves at tp 2. The boxes' wording is checked on the synthetic tp 2 × ZeRO layout of
test_checkpoint_layout.py, saved with a mesh record of each kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import json
import os
from pathlib import Path

import pytest

from slipstream.engine.checkpoint import format as ckpt_format
from slipstream.engine.checkpoint import writer
from slipstream.engine.checkpoint.capture import capture
from slipstream.engine.checkpoint.cli import main as checkpoint_cli
from slipstream.engine.checkpoint.reader import CheckpointError, CheckpointReader, complete_checkpoints
from tests.unit.ckpt_helpers import eng, engine, rewrite_json, train  # noqa: F401 - eng is a fixture
from tests.unit.test_checkpoint_layout import Shards, W, _column_boxes, _target

ONE_PROCESS = {"pp": 1, "dp": 1, "cp": 1, "sp": 1, "tp": 1, "ep": 1}
V1 = Path(__file__).resolve().parents[1] / "data" / "ckpt_v1_zero2_world2"


def inspect(directory: Path, capsys: pytest.CaptureFixture[str], tag: str | None = None) -> str:
    capsys.readouterr()
    assert (
        checkpoint_cli(argparse.Namespace(checkpoint_command="inspect", dir=str(directory), tag=tag, verify=True)) == 0
    )
    return capsys.readouterr().out


def locks(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(writer.LOCK_PREFIX))


def test_the_manifest_records_the_mesh_and_inspect_prints_it(
    eng: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(eng.save_checkpoint(tmp_path, tag="m"))
    assert json.loads((path / "manifest.json").read_text())["mesh"] == ONE_PROCESS
    out = inspect(tmp_path, capsys)
    assert "mesh            pp 1 × dp 1 × cp 1 × sp 1 × tp 1, ep 1\n" in out
    assert "all whole-tensor boxes (ZeRO flat ranges)" in out


def test_a_checkpoint_without_the_record_still_loads_and_inspects(
    eng: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(eng.save_checkpoint(tmp_path, tag="old"))
    rewrite_json(path, "manifest.json", lambda m: {k: v for k, v in m.items() if k != "mesh"})
    assert "mesh            not recorded\n" in inspect(tmp_path, capsys)
    assert engine(seed=3).load_checkpoint(tmp_path, tag="old")[0] == str(path)
    assert "mesh            not recorded\n" in inspect(V1, capsys)  # written by the code of format version 1


def test_a_damaged_mesh_record_is_one_line_naming_the_field(eng: object, tmp_path: Path) -> None:
    path = Path(eng.save_checkpoint(tmp_path, tag="bad"))
    rewrite_json(path, "manifest.json", lambda m: {**m, "mesh": {"tp": "2"}})
    with pytest.raises(
        CheckpointError, match=r"manifest.json field mesh is \{'tp': '2'\}, expected an object of axis sizes"
    ):
        CheckpointReader(path)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_leaves_no_lock_file(tmp_path: Path, async_save: bool) -> None:
    e = engine(checkpoint={"async": async_save})
    train(e, steps=1)
    e.save_checkpoint(tmp_path, tag="a")
    e.save_checkpoint(tmp_path, tag="a")  # the same tag again
    e.save_checkpoint(tmp_path, tag="b")
    e.close()
    assert locks(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest"]


def test_a_failed_save_leaves_no_lock_file(eng: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError):
        eng.save_checkpoint(tmp_path, tag="c", client_state={"bad": object()})  # refused before the lock

    def full(t: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    monkeypatch.setattr(ckpt_format, "_byte_blocks", full)
    with pytest.raises(OSError, match="No space left"):
        eng.save_checkpoint(tmp_path, tag="c")  # fails while holding the lock
    assert locks(tmp_path) == []


def test_locks_left_by_killed_processes_are_not_checkpoints_and_the_next_save_removes_them(
    eng: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eng.save_checkpoint(tmp_path, tag="x")
    for tag in ("x", "y", "global_step9"):  # what a save killed while holding its lock leaves: the file, unlocked
        (tmp_path / f"{writer.LOCK_PREFIX}{tag}").touch()
    assert [p.name for p, _ in complete_checkpoints(tmp_path)] == ["x"]
    listing = inspect(tmp_path, capsys)
    assert writer.LOCK_PREFIX not in listing and "global_step9" not in listing
    held = writer.TagLock(tmp_path, "busy")  # another job's save in progress: its lock stays
    try:
        eng.save_checkpoint(tmp_path, tag="x")
        assert locks(tmp_path) == [f"{writer.LOCK_PREFIX}busy"]
    finally:
        held.release()
    assert locks(tmp_path) == []


def test_a_lock_file_removed_while_being_taken_is_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another job releases (unlinks) the file between our open and our flock: we must not hold the orphaned inode."""
    path = tmp_path / f"{writer.LOCK_PREFIX}t"
    real = fcntl.flock
    calls = []

    def flock(fd: int, op: int) -> None:
        calls.append(fd)
        if len(calls) == 1:  # the holder's release: unlink, then a third job creates the file afresh
            os.unlink(path)
            path.touch()
        real(fd, op)

    monkeypatch.setattr(writer.fcntl, "flock", flock)
    lock = writer.TagLock(tmp_path, "t")
    monkeypatch.undo()
    assert len(calls) == 2  # the first, orphaned inode was dropped
    with pytest.raises(CheckpointError, match="another job is saving tag 't'"):
        writer.TagLock(tmp_path, "t")  # the file on disk is the one held
    lock.release()
    assert not path.exists()
    writer.TagLock(tmp_path, "t").release()


def _save_boxes(directory: Path, mesh: dict[str, int]) -> Path:
    """The 4-rank tp 2 × dp 2 column-box layout, its manifest carrying ``mesh``."""
    layout = _column_boxes()
    targets = [dataclasses.replace(_target(Shards(pieces, W), len(layout)), mesh=mesh) for pieces in layout]
    payloads = [capture(t, rank, "t", None) for rank, t in enumerate(targets)]
    lock = writer.prepare(directory, "t")
    for p in payloads:
        writer.write_rank(writer.temp_dir(directory, "t"), p)
    assert payloads[0].manifest is not None
    writer.commit(directory, "t", writer.temp_dir(directory, "t"), len(layout), payloads[0].manifest, True, 10.0)
    lock.release()
    assert locks(directory) == []
    return directory / "t"


@pytest.mark.parametrize(
    ("mesh", "shown", "boxes"),
    [
        (
            {"pp": 1, "dp": 2, "cp": 1, "sp": 1, "tp": 2, "ep": 1},
            "pp 1 × dp 2 × cp 1 × sp 1 × tp 2, ep 1",
            "tensor-parallel blocks, tp 2",
        ),
        (
            {"pp": 1, "dp": 4, "cp": 1, "sp": 1, "tp": 1, "ep": 2},
            "pp 1 × dp 4 × cp 1 × sp 1 × tp 1, ep 2",
            "expert-parallel slices, ep 2",
        ),
        (
            {"pp": 1, "dp": 2, "cp": 1, "sp": 1, "tp": 2, "ep": 2},
            "pp 1 × dp 2 × cp 1 × sp 1 × tp 2, ep 2",
            "tensor-parallel blocks (tp 2) and expert-parallel slices (ep 2)",
        ),
        ({}, "not recorded", "tensor-parallel blocks or expert-parallel slices"),
    ],
    ids=["tp2", "ep2", "tp2-ep2", "not-recorded"],
)
def test_inspect_says_what_the_boxes_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mesh: dict[str, int], shown: str, boxes: str
) -> None:
    path = _save_boxes(tmp_path / "ckpt", mesh)
    assert ("mesh" in json.loads((path / "manifest.json").read_text())) == bool(mesh)
    out = inspect(path, capsys)
    assert f"mesh            {shown}\n" in out
    assert f"4 saved pieces, 4 in boxes ({boxes})\n" in out
    assert "cut" not in out
