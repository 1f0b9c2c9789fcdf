"""Every ZeRO stage on one process runs the plain step (engine/zero/single_rank.py, [Note: a world of one shards
nothing]): the same losses and weights as a plain PyTorch loop, unused parameters skipped as PyTorch skips them, fp32
accumulation in mixed precision, GatheredParameters' changes kept, and the stage's own partitioning on request."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.accelerator import get_accelerator
from slipstream.engine.zero.single_rank import SingleRankStrategy

STEPS, ACCUMULATION, ROWS = 3, 2, 4


class _Net(torch.nn.Module):
    """Two layers in use and one that never is (its gradient stays None; AdamW must not decay it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().mean()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, 6, generator=generator) for _ in range(STEPS * ACCUMULATION)]


def _config(stage: int, clip: float, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": clip,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, **extra},
    }


def _plain(clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _Net()
    fused = get_accelerator().supports_fused_adam()  # the config's AdamW is torch's, fused where it can be
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, **{"fused" if fused else "foreach": True}
    )
    losses = []
    for i, batch in enumerate(_batches()):
        loss = model(batch)
        (loss / ACCUMULATION).backward()
        losses.append(loss.item())
        if (i + 1) % ACCUMULATION == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_run(config: dict) -> tuple[list[float], dict[str, torch.Tensor], tuple[type, int]]:
    """Losses, final weights, and the strategy's kind with its number of hooks."""
    engine = slipstream.initialize(_Net(), config)
    losses = []
    dtype = next(engine.module.parameters()).dtype
    for batch in _batches():
        loss = engine(batch.to(dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    solo = isinstance(engine.strategy, SingleRankStrategy)
    strategy = type(engine.strategy), engine.strategy.arrivals.hooks() if solo else -1
    engine.close()
    return losses, weights, strategy


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_on_one_process_is_the_plain_step(stage: int) -> None:
    # Without clipping the step is the plain loop's, operation for operation: bit-identical.
    losses, weights, strategy = _engine_run(_config(stage, 0.0))
    assert strategy == (SingleRankStrategy, 0)  # fp32: no hook per parameter
    plain_losses, plain_weights = _plain(0.0)
    assert losses == plain_losses
    for name, value in plain_weights.items():
        assert torch.equal(weights[name], value), name
    # The unused layer got no gradient: AdamW skipped it (weight decay would have moved it).
    assert torch.equal(weights["unused.weight"], _Net().unused.weight.detach())


@pytest.mark.parametrize("stage", [0, 3])
def test_clipping_on_one_process_matches_clip_grad_norm(stage: int) -> None:
    # The clipping coefficient is computed in double on the host (the engine reads the norm), torch's in float32:
    # within float noise, and the clip is active (a norm of 1e-3 cuts every step's gradients).
    losses, weights, _ = _engine_run(_config(stage, 1e-3))
    plain_losses, plain_weights = _plain(1e-3)
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_on_one_process_equals_the_stage_partitioned(stage: int) -> None:
    """bf16 with fp32 masters and fp32 accumulation: the stage's own machinery on one process gives the same run."""
    config = {**_config(stage, 1.0), "bf16": {"enabled": True}}
    solo_losses, solo_weights, solo = _engine_run(config)
    assert solo == (SingleRankStrategy, 3 * 2)  # one per parameter: bf16 freed at once
    partitioned = {**config, "zero_optimization": {"stage": stage, "partition_single_rank": True}}
    losses, weights, strategy = _engine_run(partitioned)
    assert strategy[0] is not SingleRankStrategy
    assert solo_losses == pytest.approx(losses, rel=1e-6)
    # The norm is summed in another order (float noise in the clipping coefficient, so in the fp32 masters): now and
    # then a master lands on the other side of a bf16 rounding boundary. Each weight is within one bf16 step of the
    # partitioned run's, and most are equal; bf16 accumulation or a lost gradient moves far more than that.
    for name, value in weights.items():
        differs = solo_weights[name] != value
        assert differs.float().mean() <= 0.1, name
        torch.testing.assert_close(solo_weights[name], value, rtol=2**-7, atol=0, msg=name)


def test_a_change_in_gathered_parameters_survives_the_next_step() -> None:
    """ZeRO-3 keeps a change made under GatheredParameters(modifier_rank=0) in its fp32 masters; on one process,
    where the stage runs unpartitioned, the masters take it too, so the step does not overwrite it."""
    config = {**_config(3, 0.0), "bf16": {"enabled": True}, "gradient_accumulation_steps": 1}
    del config["optimizer"]
    engine = slipstream.initialize(_Net(), config, optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    assert isinstance(engine.strategy, SingleRankStrategy)
    weight = engine.module.a.weight
    with slipstream.zero.GatheredParameters(weight, modifier_rank=0), torch.no_grad():
        weight.fill_(0.5)
    loss = engine(_batches()[0].bfloat16())
    engine.backward(loss)
    engine.step()
    assert torch.all(engine.module.a.weight == 0.5)
    engine.close()


def test_close_detaches_the_mixed_precision_hooks() -> None:
    model = _Net().bfloat16()
    engine = slipstream.initialize(model, {**_config(2, 1.0), "bf16": {"enabled": True}})
    engine.close()
    model(_batches()[0].bfloat16()).backward()
    assert model.a.weight.grad is not None and not any(engine.strategy.used)
