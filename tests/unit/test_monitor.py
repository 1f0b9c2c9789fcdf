"""Monitoring: the writers record exactly the logged losses; FLOPs match the formula; MFU is printed."""

from __future__ import annotations

import csv
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.engine.monitor.flops import analytic_flops, flop_counter_mode, matmul_parameters
from slipstream.estimator import training_flops_per_token
from tests.reference import global_batches, gpt2_loss, tiny_gpt2, tiny_llama

GAS, STEPS = 2, 5


def _config(**extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }


def _train(config: dict, model: torch.nn.Module | None = None) -> tuple[slipstream.Engine, list[float]]:
    engine = slipstream.initialize(model or tiny_gpt2(), config)
    losses = []
    for tokens in global_batches(STEPS, 2 * GAS):
        window = []
        for micro in range(GAS):
            loss = gpt2_loss(engine, tokens[2 * micro : 2 * micro + 2])
            engine.backward(loss)
            engine.step()
            window.append(float(loss.detach()))
        losses.append(sum(window) / GAS)  # the step's loss: the mean over its micro-batches
    engine.close()
    return engine, losses


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines() -> list[str]:
    handler = _Lines()
    logging.getLogger("slipstream").addHandler(handler)
    yield handler.lines
    logging.getLogger("slipstream").removeHandler(handler)


def test_tensorboard_and_csv_hold_the_logged_losses(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(
        tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
    )
    _, losses = _train(config)
    samples = [2 * GAS * (step + 1) for step in range(STEPS)]  # x axis: samples trained (as DeepSpeed)

    with open(tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == samples
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)  # float32 losses printed exactly

    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()
    scalars = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in scalars] == samples
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)  # TensorBoard stores float32
    assert {
        "Train/Samples/lr",
        "Train/Samples/grad_norm",
        "Train/Samples/tokens_per_second",
        "Train/Samples/tflops_per_device",
    } <= set(events.Tags()["scalars"])


def test_progress_line_reports_throughput_mfu_timers_and_comms(log_lines: list[str]) -> None:
    # One process runs the plain step, with no collective to report; the stage's own all-reduce (over a group of
    # one) has a comms entry to show.
    config = _config(
        steps_per_print=2,
        wall_clock_breakdown=True,
        flops_profiler={"peak_tflops": 0.5, "recompute_fwd_factor": 1.0},
        zero_optimization={"partition_single_rank": True},
    )
    engine, losses = _train(config)
    lines = [line for line in log_lines if line.startswith("step ")]
    assert len(lines) == STEPS // 2
    first = lines[0]
    for part in (
        "loss ",
        "lr ",
        "grad norm ",
        "tokens/s",
        "samples/s",
        "TFLOP/s/device",
        "MFU ",
        "peak mem ",
        "HFU ",
        "time/step forward ",
        " backward ",
        " reduce ",
        " step ",
        "comms all_reduce",
    ):
        assert part in first, (part, first)
    assert f"loss {losses[1]:.4f}" in first
    last = engine.monitor.last
    assert last["mfu"] == pytest.approx(last["tflops_per_device"] / 0.5)
    assert last["hfu"] == pytest.approx(last["mfu"] * 4 / 3)  # full recomputation: 4 forward-equivalents, not 3
    assert last["tokens_per_second"] == pytest.approx(2 * GAS * 16 / (last["step_time_ms"] / 1e3))
    assert {"time_forward_ms", "time_backward_ms", "time_reduce_ms", "time_step_ms"} <= last.keys()


def test_flops_profiler_prints_a_measured_profile(log_lines: list[str], tmp_path: Path) -> None:
    output = tmp_path / "profile.txt"
    _train(
        _config(
            flops_profiler={
                "enabled": True,
                "profile_step": 2,
                "module_depth": 4,
                "top_modules": 2,
                "output_file": str(output),
            }
        )
    )
    text = output.read_text()
    assert "flops profile, step 2" in text and "counted/formula 1.0" in text
    assert (
        "depth 4, top 2: GPT2LMHeadModel.transformer.h.1 " in text
        or "depth 4, top 2: GPT2LMHeadModel.transformer.h.0 " in text
    )


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_flop_count_per_token_matches_6n_plus_attention(build) -> None:
    layers, hidden, seq = 3, 64, 32
    model = build(n_layer=layers)
    config = model.config
    vocab = config.vocab_size
    # Weight matrices by hand: GPT-2 attention 4h² + MLP 8h² per layer, tied head V·h;
    # the Llama test model: attention 4h², gated MLP 3·h·2h, untied head V·h.
    per_layer = 12 * hidden**2 if build is tiny_gpt2 else 4 * hidden**2 + 3 * hidden * 2 * hidden
    n = layers * per_layer + vocab * hidden
    assert matmul_parameters(model) == n
    formula = training_flops_per_token(n, layers, hidden, seq)
    assert analytic_flops(model).per_token(seq) == formula
    tokens = torch.randint(0, vocab, (4, seq))
    with flop_counter_mode() as counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
    counted = counter.get_total_flops() / tokens.numel()
    assert abs(counted - formula) <= 0.05 * formula, (counted, formula)


class _NoConfig(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.head(self.embed(input_ids))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_models_without_a_config_are_measured_once() -> None:
    engine, _ = _train(_config(), _NoConfig())
    assert engine.monitor.analytic is None
    # Forward: a 32×256 matmul per token (2 FLOPs per multiply-add); training is 3× the forward.
    assert engine.monitor.measured_flops_per_token == 3 * 2 * 32 * 256


def test_wandb_needs_its_package_and_runs_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: None if name == "wandb" else types.SimpleNamespace()
    )
    with pytest.raises(slipstream.ConfigError, match="wandb.enabled: the wandb package is not installed"):
        slipstream.initialize(tiny_gpt2(), _config(wandb={"enabled": True}))
    monkeypatch.undo()

    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class _Run:
        def log(self, values: dict, step: int) -> None:
            calls["log"].append((values, step))

        def finish(self) -> None:
            calls["finish"].append(True)

    def init(**kwargs: object) -> _Run:
        calls["init"].append(kwargs)
        return _Run()

    fake = types.ModuleType("wandb")
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: types.SimpleNamespace())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _, losses = _train(_config(wandb={"enabled": True, "project": "p", "team": "t"}))
    assert (
        calls["init"][0]["mode"] == "offline"
        and calls["init"][0]["project"] == "p"
        and calls["init"][0]["entity"] == "t"
    )
    assert [values["Train/Samples/train_loss"] for values, _ in calls["log"]] == pytest.approx(losses, rel=1e-6)
    assert calls["finish"] == [True]
