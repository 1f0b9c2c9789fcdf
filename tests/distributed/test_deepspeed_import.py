"""DeepSpeed 0.19.8 checkpoints resume in slipstream exactly as DeepSpeed resumes them, at any world size and stage.

The inputs are checked in under tests/fixtures/deepspeed/: each case is a checkpoint DeepSpeed wrote
at world 2 after 3 steps, with DeepSpeed's own resume recorded (the next 3 losses, and the fp32
masters and Adam moments right after ``load_checkpoint``). ``make_checkpoints.py`` there rebuilds
them with DeepSpeed installed; these tests need only slipstream.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file()) if FIXTURES.is_dir() else []


def _reference(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "reference.json").read_text())


def _resume(
    case_dir: str, stage: int, world: int, precision: str, offload: bool, model: str, out: str, tp: int = 1
) -> dict[str, Any]:
    """Rank body: build the recipe's model and optimizer under slipstream, load DeepSpeed's checkpoint, train 3 steps.

    ``tp`` > 1: tensor parallel over that many ranks; ranks of one data-parallel coordinate see the same rows.
    """
    import torch.distributed as dist

    import slipstream
    from tests.fixtures.deepspeed import recipe

    config = recipe.ds_config(stage, precision, offload=offload, world=world // tp)
    config.pop("zero_force_ds_cpu_optimizer", None)
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    engine = slipstream.initialize(recipe.build_model(model), config, optimizer=recipe.make_optimizer)
    path, client_state = engine.load_checkpoint(case_dir)
    after = {"global_steps": engine.global_steps, "lr": engine.get_lr()[0], "client_state": client_state, "path": path}
    engine.save_checkpoint(out, tag="after_load")  # what was loaded, read back offline by the test
    rank, losses = dist.get_rank() // tp, []
    for step in range(4, 7):
        loss = recipe.loss_fn(engine, recipe.batch(step, rank, world // tp))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.close()
    return {"losses": losses, **after}


def _loaded_state(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    from slipstream.engine.checkpoint.reader import CheckpointReader
    from slipstream.utils.pieces import ParamSlice

    reader = CheckpointReader(out / "after_load")
    found: dict[str, dict[str, torch.Tensor]] = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, info in reader.manifest["parameters"].items():
        shape = tuple(info["shape"])
        whole = ParamSlice(name, shape, 0, math.prod(shape))
        found["fp32"][name] = reader.read_param(whole).view(shape)
        state = reader.read_optimizer_state(whole) or {}
        for key in ("exp_avg", "exp_avg_sq"):
            found[key][name] = state[key][1].view(shape)
    return found


def _check(case: str, stage: int, world: int, tmp_path: Path, tp: int = 1) -> None:
    from safetensors.torch import load_file

    ref = _reference(case)
    out = tmp_path / f"{case}-w{world}-s{stage}-tp{tp}"
    model = ref["model"]
    results = run_distributed(
        world,
        _resume,
        str(FIXTURES / ref["checkpoint_dir"]),
        stage,
        world,
        ref["precision"],
        ref["offload_optimizer"],
        model,
        str(out),
        tp,
    )
    got = results[0]
    assert got["path"] is not None, f"nothing loaded from {ref['checkpoint_dir']}"
    # fp32: DeepSpeed's next three losses to 1e-6; bf16 computes in bf16, where summation order shows at ~1e-3.
    tolerance = 1e-6 if ref["precision"] == "fp32" else 2e-2
    for mine, theirs in zip(got["losses"], ref["resume_losses"], strict=True):
        assert mine == pytest.approx(theirs, rel=tolerance), (got["losses"], ref["resume_losses"])
    assert got["global_steps"] == ref["after_load"]["global_steps"]
    assert got["lr"] == pytest.approx(ref["after_load"]["lr"], rel=1e-9)
    assert got["client_state"] == ref["client_state_saved"]
    expected = load_file(str(FIXTURES / case / "reference.safetensors"))
    loaded = _loaded_state(out)
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        names = {k.split("/", 1)[1] for k in expected if k.startswith(f"{kind}/")}
        assert names == set(loaded[kind]), (kind, names ^ set(loaded[kind]))
        for name in names:  # the state right after the load is DeepSpeed's, bit for bit
            assert torch.equal(loaded[kind][name], expected[f"{kind}/{name}"].float()), (kind, name)


@pytest.mark.skipif(not CASES, reason="no DeepSpeed fixtures (tests/fixtures/deepspeed/make_checkpoints.py makes them)")
@pytest.mark.parametrize("case", CASES)
def test_resumes_as_deepspeed_at_the_same_world_and_stage(case: str, tmp_path: Path) -> None:
    ref = _reference(case)
    _check(case, ref["stage"], ref["resume_world"], tmp_path)


_RESHARD = [  # (case, our stage, our world, tp): another world size, stage and mesh
    ("gpt2_s1_fp32", 3, 4, 1),
    ("gpt2_s2_fp32", 0, 1, 1),
    ("gpt2_s3_fp32", 1, 4, 1),
    ("gpt2_s3_fp32", 2, 1, 1),
    ("llama_s3_fp32", 1, 1, 1),
    ("gpt2_s2_fp32", 1, 2, 2),
    ("gpt2_s3_bf16", 3, 4, 2),
]


@pytest.mark.parametrize(("case", "stage", "world", "tp"), [c for c in _RESHARD if c[0] in CASES])
def test_resumes_at_another_world_size_stage_and_mesh(
    case: str, stage: int, world: int, tp: int, tmp_path: Path
) -> None:
    """DeepSpeed's world-2 checkpoint at world 1 or 4, another ZeRO stage, or tensor parallel: DeepSpeed's own losses."""
    _check(case, stage, world, tmp_path, tp)


class _Trap:
    """Pickles as a call of ``os.system`` (a booby-trapped checkpoint)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def _refused_body(root: str, marker: str) -> dict[str, Any]:
    """Rank body: load a DeepSpeed checkpoint holding a pickled callable; every rank must raise slipstream's error."""
    import torch.distributed as dist

    import slipstream
    from slipstream.engine.checkpoint.validate import CheckpointError

    if dist.get_rank() == 0:
        tag = Path(root) / "global_step3"
        tag.mkdir(parents=True)
        torch.save(
            {"module": {"weight": torch.ones(2, 2)}, "global_steps": 3, "trap": _Trap(marker)},
            tag / "mp_rank_00_model_states.pt",
        )
        (Path(root) / "latest").write_text("global_step3")
    dist.barrier()
    engine = slipstream.initialize(
        torch.nn.Linear(2, 2),
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(root)
    except CheckpointError as err:
        caught = {"kind": type(err).__name__, "message": str(err)}
    untouched = (
        all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items()) and engine.global_steps == 0
    )
    engine.close()
    return {**caught, "untouched": untouched}


def test_a_refused_deepspeed_checkpoint_raises_checkpoint_error_on_every_rank(tmp_path: Path) -> None:
    """Only the converting rank reads the file; the other must raise the same class (was a bare RuntimeError)."""
    marker = tmp_path / "ran"
    results = run_distributed(2, _refused_body, str(tmp_path / "ds"), str(marker))
    for rank, got in enumerate(results):
        assert got["kind"] == "CheckpointError", (rank, got)
        assert "os.system" in got["message"] or "posix.system" in got["message"], (rank, got["message"])
        assert got["untouched"], rank
    assert "failed on rank(s) [0]" in results[1]["message"], results[1]["message"]
    assert not marker.exists()
