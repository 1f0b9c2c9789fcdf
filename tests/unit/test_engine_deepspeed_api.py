"""DeepSpeed's engine calls that training hosts make (issue 15): backward scaling, forced boundaries,
skipped steps, engines without an optimizer, frozen parameters in saves, 16-bit model files."""

from __future__ import annotations

import json

import pytest
import torch

import slipstream
from slipstream.engine.checkpoint.reader import CheckpointError


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def _config(gas: int = 1, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }


def _inputs(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(2, 4, generator=generator) for _ in range(n)]


def _weights(engine: slipstream.Engine) -> dict[str, torch.Tensor]:
    state = engine.consolidated_state_dict()
    assert state is not None
    return state


def test_scale_wrt_gas_false_equals_backward_of_the_loss_times_gas() -> None:
    """The Trainer divides by the accumulation steps itself: backward(loss, scale_wrt_gas=False) == backward(loss * gas)."""
    results = []
    for unscaled in (True, False):
        engine = slipstream.initialize(_Model(), _config(gas=2))
        for x in _inputs(4):
            loss = engine(x)
            engine.backward(loss, scale_wrt_gas=False) if unscaled else engine.backward(loss * 2)
            engine.step()
        assert engine.global_steps == 2
        results.append(_weights(engine))
        engine.close()
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_forced_boundary_steps_and_a_forced_non_boundary_does_not(stage: int) -> None:
    engine = slipstream.initialize(_Model(), _config(gas=4, zero_optimization={"stage": stage}))
    before = _weights(engine)
    x1, x2, x3 = _inputs(3)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(x1))
    engine.step()
    assert (engine.global_steps, engine.was_step_applied()) == (0, False)
    engine.set_gradient_accumulation_boundary(True)  # e.g. the epoch's last batch, after 2 of 4 micro-batches
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(engine(x2))
    engine.step()
    assert (engine.global_steps, engine.micro_steps, engine.was_step_applied()) == (1, 2, True)
    assert engine.micro_steps_in_window() == 0  # a save here is at a boundary, whatever micro_steps % gas says
    after = _weights(engine)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    engine.set_gradient_accumulation_boundary(None)  # back to counting: micro-step 3 of 4 is no boundary
    assert not engine.is_gradient_accumulation_boundary()
    engine.backward(engine(x3))
    engine.step()
    assert engine.global_steps == 1 and engine.micro_steps_in_window() == 1
    engine.destroy()


def test_was_step_applied_is_false_on_an_fp16_overflow_step() -> None:
    engine = slipstream.initialize(_Model(), _config(fp16={"enabled": True, "initial_scale_power": 4}))
    x1, x2 = _inputs(2)
    loss = engine(x1.half())
    engine.backward(loss * float("inf"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    engine.backward(engine(x2.half()))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 2
    engine.close()


def test_an_engine_without_an_optimizer_runs_forward_and_names_the_missing_optimizer() -> None:
    engine = slipstream.initialize(_Model(), _config(scheduler={"type": "WarmupLR"}), inference=True)
    loss = engine(_inputs(1)[0])
    assert torch.isfinite(loss)
    assert not engine.has_optimizer() and not engine.optimizer.state and engine.lr_scheduler is None
    # slipstream's own error class (catchable as slipstream.UsageError / SlipstreamError), still a RuntimeError
    with pytest.raises(
        slipstream.UsageError, match=r"engine.backward: this engine has no optimizer .*\"optimizer\" section"
    ):
        engine.backward(loss)
    with pytest.raises(slipstream.UsageError, match="engine.step: this engine has no optimizer"):
        engine.step()
    with pytest.raises(slipstream.UsageError, match="optimizer.step: this engine has no optimizer"):
        engine.optimizer.step()
    assert issubclass(slipstream.UsageError, RuntimeError) and issubclass(
        slipstream.UsageError, slipstream.SlipstreamError
    )
    engine.close()


def test_every_error_slipstream_raises_on_purpose_is_one_family() -> None:
    """Config, usage, checkpoint, collective, launch and op-build errors all derive from slipstream.SlipstreamError,
    and each still from the builtin callers caught before."""
    from slipstream.comm import CollectiveError, LaunchEnvError
    from slipstream.engine.checkpoint.validate import CheckpointError
    from slipstream.launcher.hostfile import HostfileError
    from slipstream.ops.builder import OpBuildError

    for error, builtin in [
        (slipstream.ConfigError, ValueError),
        (CheckpointError, ValueError),
        (HostfileError, ValueError),
        (CollectiveError, RuntimeError),
        (LaunchEnvError, RuntimeError),
        (OpBuildError, RuntimeError),
        (slipstream.UsageError, RuntimeError),
    ]:
        assert issubclass(error, slipstream.SlipstreamError) and issubclass(error, builtin), error


def test_exclude_frozen_parameters_omits_frozen_tensors(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    model = _Model()
    model.a.requires_grad_(False)
    engine = slipstream.initialize(model, _config(bf16={"enabled": True}))
    engine.backward(engine(_inputs(1)[0].bfloat16()))
    engine.step()
    full = engine.consolidated_state_dict()
    trainable = engine.consolidated_state_dict(exclude_frozen_parameters=True)
    assert set(full) == {"a.weight", "a.bias", "b.weight", "b.bias"} and set(trainable) == {"b.weight", "b.bias"}
    assert engine.consolidated_state_dict(dtype=torch.bfloat16)["b.weight"].dtype == torch.bfloat16
    path = engine.save_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
    manifest = json.loads(next(p for p in (tmp_path / "ckpt").rglob("*.json") if "manifest" in p.name).read_text())
    assert set(manifest["parameters"]) == {"b.weight", "b.bias"}, path
    saved_bytes = b"".join(p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert b"a.weight" not in saved_bytes and b"b.weight" in saved_bytes
    trained = _weights(engine)
    engine.close()
    # Loading it back: strict names the missing frozen tensors and the fix; non-strict keeps the model's own.
    fresh = _Model()
    fresh.a.requires_grad_(False)
    with torch.no_grad():
        fresh.a.weight.fill_(0.5)
    other = slipstream.initialize(fresh, _config(bf16={"enabled": True}))
    before = _weights(other)
    with pytest.raises(CheckpointError, match="missing from the checkpoint: a.weight.*load_module_strict=False"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(before[k], v) for k, v in _weights(other).items())  # a refused load changes nothing
    other.load_checkpoint(tmp_path / "ckpt", load_module_strict=False)
    loaded = _weights(other)
    torch.testing.assert_close(loaded["b.weight"], trained["b.weight"], rtol=0, atol=0)
    torch.testing.assert_close(loaded["a.weight"], before["a.weight"], rtol=0, atol=0)
    assert other.global_steps == 1
    other.close()


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
def test_save_16bit_model_writes_the_training_dtype_loadable_without_unpickling(tmp_path, filename: str) -> None:  # noqa: ANN001
    engine = slipstream.initialize(_Model(), _config(bf16={"enabled": True}, zero_optimization={"stage": 1}))
    assert engine.save_16bit_model(tmp_path, filename)
    if filename.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(str(tmp_path / filename))
    else:
        state = torch.load(tmp_path / filename, weights_only=True)
    assert set(state) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    torch.testing.assert_close(state["a.weight"], _Model().a.weight.detach().bfloat16())
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    engine.close()


def test_zero_init_accepts_deepspeeds_argument_names() -> None:
    config = {**_config(), "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with slipstream.zero.Init(config_dict_or_path=config, remote_device="cpu", dtype=torch.float32, pin_memory=False):
        model = _Model()
    engine = slipstream.initialize(model, config)
    reference = _Model()
    torch.testing.assert_close(_weights(engine)["a.weight"], reference.a.weight.detach())
    engine.close()
    with pytest.raises(ValueError, match="pass the config once"):
        slipstream.zero.Init(config=config, config_dict_or_path=config)
