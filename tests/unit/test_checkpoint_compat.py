"""Checkpoints written by older code still load: the format-1 fixture of tests/data (main 5c4955e)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.data.make_v1_checkpoint import MORE_STEPS, SAVED_STEPS, TAG, TARGET, batches, build_model, config, train
from tests.harness import run_distributed


def _resume_body(directory: str, stage: int) -> dict:
    import slipstream

    engine = slipstream.initialize(build_model(seed=5), config(1, stage))
    path, client = engine.load_checkpoint(directory)
    assert path is not None and path.endswith(TAG)
    assert client == {"note": "format v1 fixture", "step": SAVED_STEPS}
    assert (
        engine.global_steps == SAVED_STEPS and engine.micro_steps == SAVED_STEPS * engine.gradient_accumulation_steps()
    )
    losses = train(engine, batches(SAVED_STEPS + MORE_STEPS)[SAVED_STEPS:])
    final = engine.consolidated_state_dict()
    engine.close()
    return {"losses": losses, "final": {k: v.reshape(-1).tolist() for k, v in final.items()}}


def test_a_format_1_checkpoint_from_main_loads_at_another_world_size_and_continues(tmp_path: Path) -> None:
    expected = json.loads((TARGET.parent / "ckpt_v1_expected.json").read_text())
    copy = tmp_path / "v1"
    shutil.copytree(TARGET, copy)  # loading must not need to write, but never risk the fixture
    got = run_distributed(1, _resume_body, str(copy), 1)[0]
    torch.testing.assert_close(got["losses"], expected["losses_after_resume"], rtol=1e-5, atol=1e-6)
    for name, values in expected["final_weights"].items():
        torch.testing.assert_close(torch.tensor(got["final"][name]), torch.tensor(values), rtol=1e-5, atol=1e-6)
