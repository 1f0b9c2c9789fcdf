"""Activations measured on fake tensors ([Note: activations measured on fake tensors], slipstream/estimator_measure.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.engine.monitor.memory import LiveTensorMeter
from slipstream.estimator import STAGES, Stage3Layout, estimate
from slipstream.estimator_measure import MeasureError, measure_activations, stage3_gathered_params
from tests.reference import tiny_gpt2, tiny_llama

SEQ, BATCH = 24, 3


def _real_peak(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The reference: the same training call on real tensors, gradients dropped as they arrive, only the loss kept."""
    model = model.to(dtype)
    handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with LiveTensorMeter() as meter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    for handle in handles:
        handle.remove()
    return meter.peak["cpu"]


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fake_tensors_measure_what_the_real_step_holds_to_the_byte(build, precision: str) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    measured = measure_activations(build(seed=0), SEQ, BATCH, precision)
    assert measured == _real_peak(build(seed=0), dtype) > 0


def test_the_measurement_sees_more_than_the_formula_where_the_code_keeps_more() -> None:
    """GPT-2's tanh GELU keeps four intermediates of the MLP's width that the textbook layer does not."""
    model = tiny_gpt2(seed=0, n_layer=4, n_embd=128)  # 32 positions, a 256-token vocabulary
    measured = measure_activations(model, 32, 8, "fp32")
    formula = estimate(model, 1, seq_len=32, micro_batch=8, precision="fp32").stage(0).activations
    assert measured > 1.3 * formula, (measured, formula)


def test_a_model_that_reads_a_value_back_is_refused_with_its_name() -> None:
    class ReadsBack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            hidden = self.linear(torch.ones(input_ids.shape[0], 8))
            k = int(hidden.abs().argmax())  # a data-dependent read: fake tensors hold no values
            return hidden.flatten()[k]

    with pytest.raises(MeasureError, match="ReadsBack cannot run on fake tensors"):
        measure_activations(ReadsBack(), 4, 2, "fp32")


def test_a_model_without_a_scalar_loss_is_refused() -> None:
    with pytest.raises(MeasureError, match="with no scalar loss to run the backward from"):
        measure_activations(torch.nn.Linear(4, 4), 4, 2, "fp32", make_inputs=lambda b, s: {"input": torch.ones(b, 4)})


def test_measured_activations_and_gathered_units_enter_every_stage() -> None:
    model = tiny_gpt2(seed=0, n_layer=3, n_embd=64)
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
    outside = sum(p.numel() for p in model.parameters()) - sum(blocks)
    gathered = stage3_gathered_params(model)
    assert gathered == outside + 3 * max(blocks), "the root, two blocks gathered and one block's packed gradients"
    plain = estimate(model, 4, seq_len=SEQ, micro_batch=BATCH, precision="fp32")
    found = estimate(
        model,
        4,
        seq_len=SEQ,
        micro_batch=BATCH,
        precision="fp32",
        activations=12345,
        layout=Stage3Layout(gathered=gathered),
    )
    assert [found.stage(s).activations for s in STAGES] == [12345.0] * 4 and found.measured
    assert "measured on fake tensors" in found.table() and "measured" not in plain.table()
    for s in (0, 1, 2):
        assert found.stage(s).model_states == plain.stage(s).model_states
    assert found.stage(3).params == plain.stage(3).params + 4 * gathered


def test_the_command_measures_a_transformers_config(tmp_path: Path) -> None:
    config = tiny_llama(seed=0).config.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "slipstream.cli", "estimate", "--model-config", str(path), "--seq-len", "32"]
    measured = subprocess.run([*command, "--measure"], capture_output=True, text=True, timeout=120)
    assert measured.returncode == 0, measured.stderr
    assert "measured on fake tensors" in measured.stdout and "holding" in measured.stdout
    refused = subprocess.run([*command, "--measure", "--tiled-mlp", "8"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--measure runs the plain model once; it does not combine with --tiled-mlp" in refused.stderr
