"""Issue 20's checkpoint defects, one regression test each (numbers as in the issue), at world size 1."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slipstream.engine.checkpoint import writer
from slipstream.engine.checkpoint.cli import main as checkpoint_cli
from slipstream.engine.checkpoint.format import write_safetensors
from slipstream.engine.checkpoint.reader import CheckpointError, _looks_pickled, complete_checkpoints, resolve
from tests.unit.ckpt_helpers import engine, rewrite_json, rewrite_tensor, same, snapshot, train

ROOT = Path(__file__).resolve().parents[2]


def _cli_lines(err: str) -> list[str]:
    """The CLI's own lines on stderr (engine log lines of the test's set-up aside)."""
    return [line for line in err.splitlines() if not line.startswith("[slipstream rank")]


def _saved(tmp_path: Path, tag: str = "good", **extra: object) -> tuple[object, Path]:
    eng = engine(**extra)
    train(eng)
    return eng, Path(eng.save_checkpoint(tmp_path, tag=tag))


def test_1_a_safetensors_file_whose_header_length_starts_with_0x80_is_not_a_pickle(tmp_path: Path) -> None:
    for pad in range(64):
        path = tmp_path / "t.safetensors"
        write_safetensors(path, {"w": torch.ones(3)}, {"pad": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] & 0xFF == 0x80
    assert not _looks_pickled(path)
    torch.save({"x": 1}, tmp_path / "p.pt")
    assert _looks_pickled(tmp_path / "p.pt")


def test_2_a_crash_between_the_renames_of_a_resave_keeps_latest_loadable_and_is_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, _ = _saved(tmp_path, tag="last")
    train(eng)
    expected = snapshot(eng)
    monkeypatch.setattr(writer, "_exchange", lambda a, b: False)  # a file system without renameat2
    real = os.replace

    def crash_after_first(src: object, dst: object) -> None:
        real(src, dst)
        if ".trash-" in str(dst):
            raise SystemExit("killed between the two renames")

    monkeypatch.setattr(writer.os, "replace", crash_after_first)
    with pytest.raises(SystemExit):
        eng.save_checkpoint(tmp_path, tag="last")
    monkeypatch.setattr(writer.os, "replace", real)
    assert not (tmp_path / "last").exists()
    found = resolve(tmp_path, None)
    assert found is not None and found.name.startswith(".tmp-last")  # the committed new copy stands in
    fresh = engine(seed=9)
    fresh.load_checkpoint(tmp_path)
    assert same(snapshot(fresh), expected)
    eng.save_checkpoint(tmp_path, tag="other")  # the next save puts "last" back and cleans up
    assert (tmp_path / "last" / "manifest.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_3_a_failed_async_save_at_the_end_of_a_run_exits_non_zero(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from slipstream.engine.checkpoint import writer
        from tests.unit.ckpt_helpers import engine, train
        eng = engine(checkpoint={{"async": True}})
        train(eng)
        def broken(tmp, payload, checksum=True):
            raise OSError(28, "No space left on device", str(tmp / "rank00000.safetensors"))
        writer.write_rank = broken
        eng.save_checkpoint({str(tmp_path)!r})
        print("script returned")
    """)
    env = {**os.environ, "SLIPSTREAM_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert "script returned" in done.stdout
    assert done.returncode != 0, done.stderr[-2000:]
    assert "background checkpoint save failed" in done.stderr and "rank00000.safetensors" in done.stderr


def test_4_a_failed_load_leaves_the_engine_untouched(tmp_path: Path) -> None:
    _saved(tmp_path)
    target = engine(seed=3)
    train(target, 1, seed=5)

    class Refuses:
        def state_dict(self) -> dict:
            return {"n": 1}

        def load_state_dict(self, state: dict) -> None:
            raise ValueError("refused")

    target.register_checkpoint_state("picky", Refuses())
    before = snapshot(target)
    saved_dir = tmp_path / "good"
    rewrite_json(saved_dir, "rank00000.json", lambda m: {**m, "stateful": {**m["stateful"], "picky": {"n": 2}}})
    with pytest.raises(CheckpointError, match="picky.load_state_dict"):
        target.load_checkpoint(tmp_path, tag="good")
    assert same(snapshot(target), before)
    # a different number of parameter groups: refused before anything is applied
    groups = engine(seed=4, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    groups.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1e-3})
    before = snapshot(groups)
    with pytest.raises(CheckpointError, match="parameter group"):
        groups.load_checkpoint(tmp_path, tag="good")
    assert same(snapshot(groups), before)


@pytest.mark.parametrize("saved_as", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer_states", [True, False])
def test_5_an_fp32_or_bf16_checkpoint_loads_into_an_fp16_engine(
    tmp_path: Path, saved_as: str, optimizer_states: bool
) -> None:
    extra = {"bf16": {"enabled": True}} if saved_as == "bf16" else {}
    _, path = _saved(tmp_path, **extra)
    fp16 = engine(seed=2, fp16={"enabled": True, "initial_scale_power": 8})
    scale = fp16.loss_scale()
    got, _ = fp16.load_checkpoint(tmp_path, tag="good", load_optimizer_states=optimizer_states)
    assert got == str(path) and fp16.loss_scale() == scale and fp16.global_steps == 2
    train(fp16, 1)


@pytest.mark.parametrize("stage", [0, 2])
def test_6_a_zero_element_parameter_saves_loads_and_exports(tmp_path: Path, stage: int) -> None:
    eng, path = _saved(tmp_path, stage=stage, empty=True)
    fresh = engine(seed=7, stage=stage, empty=True)
    fresh.load_checkpoint(tmp_path, tag="good")
    assert torch.equal(fresh.module.a.weight, eng.module.a.weight) and fresh.module.nothing.shape == (0, 3)
    out = tmp_path / "export" / "model.safetensors"
    assert checkpoint_cli(argparse.Namespace(checkpoint_command="export", dir=str(path), out=str(out), tag=None)) == 0
    from safetensors.torch import load_file

    assert load_file(out)["nothing"].shape == (0, 3)


def test_7_client_state_keys_with_slashes_never_collide(tmp_path: Path) -> None:
    eng = engine()
    train(eng)
    client = {
        "a/b": torch.ones(2),
        "a": {"b": torch.zeros(2)},
        1: torch.full((1,), 3.0),
        "1": torch.full((1,), 4.0),
        "%2F": torch.ones(1) * 5,
    }
    eng.save_checkpoint(tmp_path, tag="t", client_state=client)
    _, back = engine(seed=1).load_checkpoint(tmp_path, tag="t")
    assert same(back, client)


def test_8_a_sibling_with_a_wrong_typed_manifest_field_is_only_itself_incomplete(tmp_path: Path) -> None:
    eng = engine(checkpoint={"keep_last_n": 1})
    train(eng)
    eng.save_checkpoint(tmp_path, tag="older")
    rewrite_json(tmp_path / "older", "manifest.json", lambda m: {**m, "global_steps": "2"})
    train(eng)
    eng.save_checkpoint(tmp_path, tag="newer")  # retention runs over the bad sibling without raising
    assert [p.name for p, _ in complete_checkpoints(tmp_path)] == ["newer"]
    (tmp_path / "latest").unlink()
    with pytest.warns(UserWarning, match="newest complete"):
        assert resolve(tmp_path, None) == tmp_path / "newer"
    assert (
        checkpoint_cli(argparse.Namespace(checkpoint_command="inspect", dir=str(tmp_path), tag=None, verify=False)) == 0
    )


def test_9_overlapping_slices_and_wrong_tensor_sizes_are_refused_by_load_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(tmp_path, tag="overlap", stage=0)
    _saved(tmp_path, tag="small", stage=0)

    def overlap(meta: dict) -> dict:
        entry = next(e for e in meta["slices"] if e["name"] == "a.weight")
        extra = {"name": "a.weight", "shape": entry["shape"], "start": 4, "numel": 4, "key": "p/a.weight/4"}
        entry["numel"] = 20
        meta["slices"].append(extra)
        return meta

    rewrite_json(tmp_path / "overlap", "rank00000.json", overlap)
    key = next(
        e["key"]
        for e in json.loads((tmp_path / "small" / "rank00000.json").read_text())["slices"]
        if e["name"] == "a.weight"
    )
    rewrite_tensor(tmp_path / "small", 0, key, torch.ones(1))
    for tag, message in (("overlap", "saved slices overlap at element 4"), ("small", "has shape \\[1\\]")):
        fresh = engine(seed=5, stage=0)
        before = snapshot(fresh)
        with pytest.raises(CheckpointError, match=message):
            fresh.load_checkpoint(tmp_path, tag=tag)
        assert same(snapshot(fresh), before)
        assert (
            checkpoint_cli(argparse.Namespace(checkpoint_command="inspect", dir=str(tmp_path), tag=tag, verify=True))
            == 1
        )
        err = _cli_lines(capsys.readouterr().err)
        assert len(err) == 1 and tag in err[0]


def test_10_tags_and_latest_cannot_leave_the_save_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _saved(outside)
    inside = tmp_path / "run"
    eng, _ = _saved(inside)
    for tag in ("../outside/good", str(outside / "good"), "a/../../outside/good"):
        with pytest.raises(ValueError, match="leaves the checkpoint directory"):
            eng.load_checkpoint(inside, tag=tag)
        assert (
            checkpoint_cli(argparse.Namespace(checkpoint_command="inspect", dir=str(inside), tag=tag, verify=False))
            == 1
        )
    (inside / "latest").write_text("../outside/good")
    with pytest.warns(UserWarning, match="path separator"):
        path, _ = eng.load_checkpoint(inside)
    assert path == str(inside / "good")


def test_14_export_never_overwrites_the_checkpoint_and_refuses_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = _saved(tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    for out in (path / "rank00000.safetensors", path / "new.safetensors", tmp_path / "latest", tmp_path):
        code = checkpoint_cli(
            argparse.Namespace(checkpoint_command="export", dir=str(tmp_path), out=str(out), tag=None)
        )
        err = capsys.readouterr().err
        assert code == 1 and len(_cli_lines(err)) == 1 and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert not list(tmp_path.rglob("*.part"))
