"""The Engine's user contract, single process: outputs, counters, optimizers, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import slipstream


class _Model(torch.nn.Module):
    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)
        self.output = output

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - returns several kinds on purpose
        loss = self.b(torch.relu(self.a(x))).pow(2).mean()
        if self.output == "tuple":
            return loss, x
        if self.output == "dict":
            return {"loss": loss, "x": x}
        if self.output == "modeloutput":
            from transformers.modeling_outputs import CausalLMOutput

            return CausalLMOutput(loss=loss)
        return loss


def _config(**extra: object) -> dict:
    return {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 0,
        **extra,
    }


@pytest.mark.parametrize("output", ["tensor", "tuple", "dict", "modeloutput"])
def test_forward_returns_the_model_output_unchanged(output: str) -> None:
    engine = slipstream.initialize(_Model(output), _config())
    out = engine(torch.randn(2, 4))
    loss = {
        "tensor": lambda o: o,
        "tuple": lambda o: o[0],
        "dict": lambda o: o["loss"],
        "modeloutput": lambda o: o.loss,
    }[output](out)
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    engine.close()


def test_counters_and_boundaries_with_accumulation() -> None:
    engine = slipstream.initialize(_Model(), _config(gradient_accumulation_steps=2, train_batch_size=4))
    boundaries = []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    assert boundaries == [False, True, False, True]
    assert (engine.global_steps, engine.micro_steps) == (2, 4)
    assert (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    ) == (4, 2, 2)
    assert engine.get_global_grad_norm() > 0
    engine.close()


def test_misuse_is_explained() -> None:
    engine = slipstream.initialize(_Model(), _config())
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine.step()
    with pytest.raises(TypeError, match="expected the scalar loss tensor"):
        engine.backward(torch.ones(3, requires_grad=True))
    engine.backward(engine(torch.randn(2, 4)))
    with pytest.raises(RuntimeError, match="called twice at an accumulation boundary"):
        engine.backward(engine(torch.randn(2, 4)))
    engine.close()


def _reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, clip: float) -> None:
    model(x).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


def test_param_groups_with_their_own_lr_match_torch() -> None:
    model, ref = _Model(), _Model()
    groups = [{"params": model.a.parameters(), "lr": 1e-1}, {"params": model.b.parameters()}]
    engine = slipstream.initialize(model, _config(gradient_clipping=0.5), model_parameters=groups)
    ref_opt = torch.optim.AdamW(
        [{"params": ref.a.parameters(), "lr": 1e-1}, {"params": ref.b.parameters(), "lr": 1e-2}], weight_decay=0.0
    )
    for step in range(5):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x))
        engine.step()
        _reference_step(ref, ref_opt, x, 0.5)
    assert engine.get_lr() == [1e-1, 1e-2]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    engine.close()


@pytest.mark.parametrize("kind", ["instance", "callable"])
def test_user_optimizer_drives_bf16_master_weights(kind: str) -> None:
    model = _Model()
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if kind == "instance"
        else (lambda params: torch.optim.SGD(params, lr=0.1))
    )
    engine = slipstream.initialize(
        model, {"train_batch_size": 2, "bf16": {"enabled": True}, "gradient_clipping": 0.0}, optimizer=optimizer
    )
    assert model.a.weight.dtype == torch.bfloat16
    masters = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in masters) and len(masters) == 4
    before = model.a.weight.detach().float().clone()
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)))
    engine.step()
    assert not torch.equal(before, model.a.weight.float()), "the bf16 weights must receive the fp32 update"
    state = engine.consolidated_state_dict()
    assert state["a.weight"].dtype == torch.float32 and torch.equal(
        state["a.weight"].bfloat16(), model.a.weight.detach()
    )
    engine.close()


def test_user_optimizer_with_state_cannot_be_rebound() -> None:
    model = _Model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already has state"):
        slipstream.initialize(model, {"train_batch_size": 2, "bf16": {"enabled": True}}, optimizer=optimizer)


def test_config_scheduler_and_callable_scheduler() -> None:
    engine = slipstream.initialize(
        _Model(),
        _config(
            scheduler={
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
            }
        ),
    )
    lrs = []
    for _ in range(5):
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
        lrs.append(engine.get_lr()[0])
    # DeepSpeed's WarmupLR: the first step still runs at warmup_min_lr, then rises linearly.
    assert lrs == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01], abs=1e-12)
    engine.close()
    engine = slipstream.initialize(
        _Model(),
        {"train_batch_size": 2},
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    assert engine.get_lr() == [0.125]
    engine.close()


@dataclasses.dataclass
class _Squares(torch.utils.data.Dataset):
    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def test_training_dataloader_yields_micro_batches() -> None:
    engine = slipstream.initialize(_Model(), _config(train_batch_size=4), training_data=_Squares(10))
    batches = list(engine.training_dataloader)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(int(v) for b in batches for v in b.view(-1)) == list(range(10))
    assert [int(v) for b in list(engine.training_dataloader) for v in b.view(-1)] != [
        int(v) for b in batches for v in b.view(-1)
    ]
    engine.close()


def test_fp16_auto_cast_casts_float_inputs() -> None:
    seen = {}

    class Probe(_Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["dtype"] = x.dtype
            return super().forward(x)

    engine = slipstream.initialize(Probe(), _config(fp16={"enabled": True, "auto_cast": True}))
    engine(torch.randn(2, 4))
    assert seen["dtype"] == torch.float16
    engine.close()


def test_close_detaches_hooks() -> None:
    model = _Model()  # the stage's own hooks (on one process fp32 has none: test_single_rank.py)
    engine = slipstream.initialize(model, _config(zero_optimization={"partition_single_rank": True}))
    engine.close()
    model(torch.randn(2, 4)).backward()
    assert model.a.weight.grad is not None and not any(engine.strategy.used.local)


def test_wrapping_a_model_again_detaches_the_old_engine() -> None:
    model = _Model()
    first = slipstream.initialize(model, _config(bf16={"enabled": True}))
    second = slipstream.initialize(model, _config(bf16={"enabled": True}))
    assert first.strategy.hooks == []
    second.backward(second(torch.randn(2, 4, dtype=torch.bfloat16)))
    second.step()
    assert second.global_steps == 1
    second.close()


def test_grads_are_final_when_backward_returns() -> None:
    model = _Model()
    engine = slipstream.initialize(model, _config(gradient_clipping=0.0))
    x = torch.randn(2, 4)
    engine.backward(engine(x))
    reference = _Model()
    reference(x).backward()
    torch.testing.assert_close(model.a.weight.grad, reference.a.weight.grad)
    engine.step()
    engine.close()
