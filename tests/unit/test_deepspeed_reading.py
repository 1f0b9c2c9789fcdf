"""Reading DeepSpeed checkpoints safely: the allow-listed unpickler, and where each rank's elements lie."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.engine.checkpoint.formats.deepspeed.partitions import zero3_shares, zero12_shares, zero12_total
from slipstream.engine.checkpoint.formats.deepspeed.source import describe, locate
from slipstream.engine.checkpoint.formats.deepspeed.unpickle import DeepSpeedRecord, load_pickle
from slipstream.engine.checkpoint.validate import CheckpointError


class _Payload:
    """Pickles as a call of ``os.system`` (what a booby-trapped checkpoint holds)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _deepspeed_dir(root: Path, state: dict[str, object]) -> Path:
    tag = root / "global_step3"
    tag.mkdir(parents=True)
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step3")
    return tag


def test_a_pickled_callable_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    tag = _deepspeed_dir(
        tmp_path / "ckpt", {"module": {"w": torch.ones(2)}, "global_steps": 3, "trap": _Payload(marker)}
    )
    assert locate(tmp_path / "ckpt", None) == tag
    with pytest.raises(CheckpointError) as err:
        describe(tag)
    assert "names the global posix.system" in str(err.value) or "names the global os.system" in str(err.value)
    assert "not unpickled" in str(err.value)
    assert not marker.exists()


def test_a_deepspeed_class_is_read_as_data(tmp_path: Path) -> None:
    """DeepSpeed's loss scaler is rebuilt as an inert record of its attributes, under its own class name."""

    class LossScaler:  # the shape DeepSpeed pickles: module.qualname + attribute dict
        pass

    LossScaler.__module__ = "deepspeed.runtime.fp16.loss_scaler"
    LossScaler.__qualname__ = "LossScaler"
    scaler = LossScaler()
    scaler.cur_scale = 1024.0
    file = tmp_path / "x.pt"
    import sys
    import types

    fake = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")
    fake.LossScaler = LossScaler  # type: ignore[attr-defined]
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["deepspeed.runtime.fp16.loss_scaler"] = fake
    try:
        torch.save({"loss_scaler": scaler, "t": torch.arange(3)}, file)
    finally:
        for name in ("deepspeed.runtime.fp16.loss_scaler", "deepspeed.runtime.fp16", "deepspeed.runtime", "deepspeed"):
            sys.modules.pop(name, None)
    loaded = load_pickle(file)
    assert isinstance(loaded["loss_scaler"], DeepSpeedRecord)
    assert loaded["loss_scaler"].ds_class == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert vars(loaded["loss_scaler"]) == {"cur_scale": 1024.0}
    assert torch.equal(loaded["t"], torch.arange(3))


def test_not_a_pickle_is_one_line(tmp_path: Path) -> None:
    file = tmp_path / "mp_rank_00_model_states.pt"
    file.write_bytes(b"PK\x03\x04 this is no zip")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_pickle(file)


def test_parallel_deepspeed_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    tag = _deepspeed_dir(tmp_path, {"module": {"w": torch.ones(2)}})
    torch.save({"module": {}}, tag / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="mp_rank_01_model_states.pt.*tensor parallelism.*ds_to_universal"):
        describe(tag)


@pytest.mark.parametrize("tag", ["step3", "zero"])  # "zero": not taken for a universal checkpoint's zero/ folder
def test_our_own_checkpoints_are_not_taken_for_deepspeed(tmp_path: Path, tag: str) -> None:
    (tmp_path / tag).mkdir()
    (tmp_path / tag / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_text(tag)
    assert locate(tmp_path, None) is None
    assert locate(tmp_path, tag) is None


_shapes = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=6)


def _covers_exactly(shapes: dict[str, tuple[int, ...]], shares_per_rank: list[list]) -> None:
    seen: dict[str, list[tuple[int, int]]] = {}
    for shares in shares_per_rank:
        for s in shares:
            seen.setdefault(s.name, []).append((s.start, s.numel))
    for name, shape in shapes.items():
        at = 0
        for start, numel in sorted(seen[name]):
            assert start == at
            at += numel
        assert at == math.prod(shape)


@settings(max_examples=60, deadline=None)
@given(_shapes, st.integers(1, 5), st.data())
def test_zero12_partitions_tile_every_parameter(dims: list[list[int]], world: int, data: st.DataObject) -> None:
    shapes = {f"p{i}": tuple(d) for i, d in enumerate(dims)}
    paddings = data.draw(st.lists(st.integers(0, 3), min_size=len(shapes), max_size=len(shapes)))
    total = zero12_total(shapes, paddings)
    partition = math.ceil(total / world) + data.draw(st.integers(0, 2))  # DeepSpeed may pad to a larger multiple
    flat = torch.arange(partition * world, dtype=torch.float32)
    per_rank = []
    for rank in range(world):
        held = max(0, min(partition, total - rank * partition))
        shares = zero12_shares(shapes, paddings, rank, partition, held)
        for s in shares:  # each share reads the parameter's own elements from the rank's partition
            values = flat[rank * partition + s.offset : rank * partition + s.offset + s.numel]
            assert values.numel() == s.numel
        per_rank.append(shares)
    _covers_exactly(shapes, per_rank)


@settings(max_examples=60, deadline=None)
@given(_shapes, st.integers(1, 5))
def test_zero3_partitions_tile_every_parameter(dims: list[list[int]], world: int) -> None:
    shapes = {f"p{i}": tuple(d) for i, d in enumerate(dims)}
    lengths = set()
    per_rank = []
    for rank in range(world):
        shares, length = zero3_shares(shapes, rank, world)
        lengths.add(length)
        per_rank.append(shares)
    assert lengths == {
        sum(math.ceil(math.prod(s) / world) for s in shapes.values())
    }  # equal flat groups, as DeepSpeed's
    _covers_exactly(shapes, per_rank)


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"


@pytest.mark.skipif(not (FIXTURES / "gpt2_s3_fp32").is_dir(), reason="no DeepSpeed fixtures")
@pytest.mark.parametrize("case", ["gpt2_s2_fp32", "gpt2_s3_fp32"])
def test_there_and_back_keeps_every_tensor(case: str, tmp_path: Path) -> None:
    """DeepSpeed's files -> ours -> DeepSpeed's universal layout -> ours again: every weight, moment and step equal.

    The export is read with plain ``torch.load(weights_only=True)`` (no allow-list needed), and read
    back through the universal-checkpoint reader.
    """
    from slipstream.engine.checkpoint.formats.deepspeed.convert import convert
    from slipstream.engine.checkpoint.formats.deepspeed.export import export_deepspeed
    from slipstream.engine.checkpoint.reader import CheckpointReader
    from slipstream.utils.pieces import ParamSlice

    first = convert(FIXTURES / case / "global_step3", tmp_path / "ours", "converted")
    back = export_deepspeed(tmp_path / "ours", tmp_path / "deepspeed")
    assert (tmp_path / "deepspeed" / "latest_universal").read_text() == back.name == "global_step3"
    for file in back.rglob("*.pt"):
        torch.load(file, weights_only=True)  # plain data only
    assert locate(tmp_path / "deepspeed", None) == back
    second = convert(back, tmp_path / "again", "converted")
    a, b = CheckpointReader(first), CheckpointReader(second)
    assert a.manifest["parameters"] == b.manifest["parameters"]
    assert a.manifest["state_dict_keys"] == b.manifest["state_dict_keys"]
    for name, info in a.manifest["parameters"].items():
        whole = ParamSlice(name, tuple(info["shape"]), 0, math.prod(info["shape"]))
        assert torch.equal(a.read_param(whole), b.read_param(whole))
        sa, sb = a.read_optimizer_state(whole), b.read_optimizer_state(whole)
        assert sa is not None and sb is not None and set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key][1], sb[key][1])
        assert float(sa["step"][1][0]) == float(sb["step"][1][0]) == 3.0
    ca, cb = a.common(), b.common()
    for key in ("counters", "lr_scheduler", "client_state"):
        assert a.decode(0, ca[key]) == b.decode(0, cb[key]), key


@pytest.mark.skipif(not (FIXTURES / "gpt2_s3_bf16").is_dir(), reason="no DeepSpeed fixtures")
def test_the_command_line_inspects_and_converts_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.cli import main

    assert main(["checkpoint", "inspect", str(FIXTURES / "gpt2_s3_bf16")]) == 0
    shown = capsys.readouterr().out
    assert "DeepSpeed 0.19.8 (ZeRO stage 3, 2 data-parallel rank(s)), bf16" in shown
    assert "step 3, 12 samples" in shown and "client_state    epoch, note" in shown and "1 tied aliases" in shown
    assert main(["checkpoint", "convert", str(FIXTURES / "gpt2_s3_bf16"), str(tmp_path / "ours")]) == 0
    assert (tmp_path / "ours" / "latest").read_text() == "global_step3"
    assert main(["checkpoint", "inspect", str(tmp_path / "ours"), "--verify"]) == 0
    assert "ZeRO stage 3, bf16" in capsys.readouterr().out
    assert main(["checkpoint", "convert", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    assert main(["checkpoint", "inspect", str(tmp_path / "back")]) == 0
    assert "(universal), bf16" in capsys.readouterr().out
    inside = FIXTURES / "gpt2_s3_bf16" / "global_step3" / "x"
    assert main(["checkpoint", "convert", str(FIXTURES / "gpt2_s3_bf16"), str(inside)]) == 1
    assert "lies inside the DeepSpeed checkpoint" in capsys.readouterr().err
    assert not inside.exists()
