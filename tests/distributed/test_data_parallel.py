"""Stage 0 (plain data parallelism) reproduces single-process training, at world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from tests.harness import run_distributed
from tests.reference import (
    assert_close_trajectory,
    assert_weights_match,
    global_batches,
    gpt2_loss,
    micro_batch,
    tiny_gpt2,
    train_engine,
    train_reference,
)

STEPS = 20


def _config(world: int, gas: int, mb: int = 2, **extra: object) -> dict:
    return {
        "train_batch_size": mb * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "steps_per_print": 0,
        **extra,
    }


def _parity_body(gas: int, bucket: int | None) -> tuple[list[float], list[float]]:
    world = dist.get_world_size()
    extra = {"zero_optimization": {"stage": 0, "reduce_bucket_size": bucket}} if bucket else {}
    config = _config(world, gas, **extra)
    engine = slipstream.initialize(tiny_gpt2(seed=dist.get_rank()), config)  # ranks start differently: rank 0 wins
    batches = global_batches(STEPS, config["train_batch_size"])
    ours = train_engine(engine, batches)
    engine.close()
    if dist.get_rank() == 0:
        ref = train_reference(tiny_gpt2(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0)
        # Losses agree to ~2e-7 relative. Weights agree to ~1.4e-5 absolute: Adam divides by sqrt(v), so
        # for the few weights whose gradient is ~0 a last-bit difference in the clip coefficient or in
        # the all-reduce summation order moves them by a visible fraction of one lr-sized step (1e-3).
        assert_close_trajectory(ours, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
        for a, b in zip(ours.grad_norms, ref.grad_norms):
            assert abs(a - b) <= 1e-4 * b, (a, b)
        assert ours.losses[-1] < ours.losses[0] - 0.1
    return ours.losses


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("gas", [1, 4])
def test_stage0_matches_single_process(world: int, gas: int) -> None:
    losses = run_distributed(world, _parity_body, gas, None)
    assert all(ls == losses[0] for ls in losses), "every rank must see the same global loss"


def test_stage0_many_small_buckets_match() -> None:
    # ~20 buckets instead of one: launch ordering and overlap must not change the numbers.
    run_distributed(2, _parity_body, 2, 20_000)


def _mixed_precision_body(precision: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = _config(world, 2, **{precision: {"enabled": True}})
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    assert next(engine.module.parameters()).dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    batches = global_batches(STEPS, config["train_batch_size"])
    ours = train_engine(engine, batches)
    engine.close()
    result = {"skipped": engine.skipped_steps, "scale": engine.loss_scale()}
    if rank == 0:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        ref = train_reference(tiny_gpt2(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0, dtype=dtype)
        ref32 = train_reference(tiny_gpt2(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0)
        # Tolerance: bf16 keeps 8 significand bits (rounding 2^-9 ≈ 2e-3), fp16 11. The engine sums
        # per-micro-batch low-precision gradients in fp32 while the reference computes one low-precision
        # gradient over the whole batch, so rounding differs at that level every step. Observed over
        # 20 steps: losses within 7e-5 (bf16) / 1.5e-5 (fp16) relative, all weights within 0.35% in
        # relative L2 norm (single weights with ~0 gradient may differ by an lr-sized Adam step, so an
        # element-wise check would test Adam's sign sensitivity, not us). Limits: ~15x / ~6x the
        # observed gaps, still far below the loss drop (> 0.3) that training produces.
        assert_close_trajectory(ours, ref, loss_rtol=1e-3, param_rel_norm=2e-2)
        assert ours.losses[-1] < ours.losses[0] - 0.3
        assert abs(ours.losses[-1] - ref32.losses[-1]) < 1e-3 * ref32.losses[-1]  # same training as fp32
        result["max_loss_gap"] = max(abs(a - b) / b for a, b in zip(ours.losses, ref.losses))
    return result


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_like_reference(precision: str) -> None:
    results = run_distributed(2, _mixed_precision_body, precision)
    assert results[0]["skipped"] == 0, "fp16 at the initial 2^16 scale must not overflow on this tiny model"


def _overflow_body(hysteresis: int, stage: int = 0, **zero: object) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = _config(world, 1, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": hysteresis})
    config["zero_optimization"] = {"stage": stage, "reduce_bucket_size": 20_000, **zero}
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
    }
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    poison = {"step": 2}
    param = engine.module.transformer.h[0].mlp.c_fc.weight

    def inject(grad: torch.Tensor) -> torch.Tensor:
        # Only rank 0 overflows: every rank must still skip, or the replicas would diverge.
        if rank == 0 and engine.global_steps == poison["step"]:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(inject)
    batches = global_batches(4, config["train_batch_size"])
    record = []
    params = list(engine.module.parameters())

    def weights() -> dict[str, torch.Tensor]:  # gathered under ZeRO-3, as they are at stages 0-2
        with slipstream.zero.GatheredParameters(params):
            return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}

    for step, tokens in enumerate(batches):
        before = weights()
        lr_before = engine.get_lr()[0]
        scale_before = engine.loss_scale()
        engine.backward(gpt2_loss(engine, micro_batch(tokens, 0, rank, world, 2)))
        engine.step()
        after = weights()
        changed = any(not torch.equal(before[n], after[n]) for n in before)
        record.append((step, changed, scale_before, engine.loss_scale(), lr_before, engine.get_lr()[0]))
    engine.close()
    return {"record": record, "skipped": engine.skipped_steps, "global_steps": engine.global_steps}


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_overflow_on_one_rank_skips_everywhere(hysteresis: int) -> None:
    results = run_distributed(2, _overflow_body, hysteresis)
    assert results[0] == results[1], "ranks disagree about the overflow step"
    record = results[0]["record"]
    step, changed, scale_before, scale_after, lr_before, lr_after = record[2]
    assert not changed, "weights moved on the overflow step"
    assert lr_after == lr_before, "the LR schedule advanced on a skipped step"
    # DeepSpeed's hysteresis: with 2, the first overflow is absorbed and the scale stays.
    assert scale_after == (scale_before / 2 if hysteresis == 1 else scale_before)
    assert all(r[1] for i, r in enumerate(record) if i != 2), "normal steps must update the weights"
    assert results[0]["skipped"] == 1 and results[0]["global_steps"] == 4


class _Branchy(torch.nn.Module):
    """A frozen layer, a branch only some ranks use, and a layer nobody uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.trunk = torch.nn.Linear(8, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(self.frozen(x)))
        if use_branch:
            h = h + torch.tanh(self.branch(x))
        return self.head(h).pow(2).mean()


class _BranchLast(_Branchy):
    """The branch registered and called last: under ZeRO-3 with a unit per Linear, the unit kept gathered from forward into backward."""

    def __init__(self) -> None:
        super().__init__()
        branch = self.branch
        del self.branch
        self.branch = branch

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(self.frozen(x)))
        out = self.head(h)
        if use_branch:
            out = out + torch.tanh(self.branch(h)).sum(-1, keepdim=True)
        return out.pow(2).mean()


def _unused_body(stage: int = 0, gas: int = 1, model_class: type[_Branchy] = _Branchy, **zero: object) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = _config(world, gas, mb=4)
    config["zero_optimization"] = {
        "stage": stage,
        "reduce_bucket_size": 80,
        **zero,
    }  # several buckets, one stalled by the branch
    engine = slipstream.initialize(model_class(), config)
    reference = model_class()
    ref_opt = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01, fused=True
    )
    gen = torch.Generator().manual_seed(7)

    def branch(r: int, step: int, micro: int) -> bool:
        # Used by rank 0 only, every other step, and only in the first micro-step of the window.
        return r == 0 and step % 2 == 0 and micro == 0

    for step in range(6):
        x = torch.randn(gas, world, 4, 8, generator=gen)
        for micro in range(gas):
            engine.backward(engine(x[micro, rank], use_branch=branch(rank, step, micro)))
            engine.step()
        ref_loss = sum(reference(x[m, r], use_branch=branch(r, step, m)) for m in range(gas) for r in range(world)) / (
            gas * world
        )
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    state = engine.consolidated_state_dict()
    engine.close()
    if rank == 0:
        assert_weights_match(state, reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["unused.weight"], _Branchy().unused.weight.detach(), rtol=0, atol=0)
        assert engine.module.frozen.weight.grad is None


@pytest.mark.parametrize(("world", "gas"), [(2, 1), (4, 1), (2, 2)])
def test_frozen_and_unused_parameters(world: int, gas: int) -> None:
    run_distributed(world, _unused_body, 0, gas)


def _comms_body() -> dict:
    world = dist.get_world_size()
    config = _config(world, 2, zero_optimization={"reduce_bucket_size": 30_000})
    model = tiny_gpt2(seed=0)
    engine = slipstream.initialize(model, config)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batches = global_batches(2, config["train_batch_size"])
    counts = []
    for tokens in batches:
        for micro in range(2):
            comms_log.next_step()
            engine.backward(gpt2_loss(engine, micro_batch(tokens, micro, dist.get_rank(), world, 2)))
            counts.append((dict(comms_log.counts()), comms_log.bytes_by_op().get("all_reduce", 0)))
            engine.step()
    n_buckets = len(engine.strategy.reducer.buckets)
    engine.close()
    return {"counts": counts, "buckets": n_buckets, "numel": numel, "flags": len(engine.strategy.trainable)}


def test_gradient_communication_only_at_boundaries() -> None:
    result = run_distributed(2, _comms_body)[0]
    assert result["buckets"] > 3
    non_boundary, boundary = result["counts"][0], result["counts"][1]
    assert non_boundary == ({}, 0), "no collective may run on a non-boundary micro-step"
    # The boundary backward reduces every bucket, once each; the used-parameter flags ride the last bucket
    # (grad_buckets.py, [Note: a tail on the last bucket]): DDP's one collective per bucket, no other.
    assert boundary[0] == {"all_reduce": result["buckets"]}
    assert boundary[1] == 4 * result["numel"] + 4 * result["flags"], "stage 0 moves each fp32 gradient exactly once"


def _no_sync_body() -> str:
    world = dist.get_world_size()
    engine = slipstream.initialize(tiny_gpt2(seed=0), _config(world, 2))
    tokens = global_batches(1, engine.train_batch_size())[0]
    with engine.no_sync():
        engine.backward(gpt2_loss(engine, micro_batch(tokens, 0, dist.get_rank(), world, 2)))
        engine.step()
        with pytest.raises(RuntimeError, match="run it outside engine.no_sync"):
            engine.backward(gpt2_loss(engine, micro_batch(tokens, 1, dist.get_rank(), world, 2)))
    engine.backward(gpt2_loss(engine, micro_batch(tokens, 1, dist.get_rank(), world, 2)))  # recovers
    engine.step()
    assert engine.global_steps == 1
    engine.close()
    return "ok"


def test_step_after_unsynced_boundary_is_refused() -> None:
    assert run_distributed(2, _no_sync_body) == ["ok", "ok"]


def _timeout_body() -> str:
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        return "skipped the collective"
    with pytest.raises(slipstream.comm.CollectiveError) as info:
        slipstream.comm.all_reduce(torch.ones(4), group=group, tag="probe tensor").wait()
    return str(info.value)


def test_hung_collective_names_rank_and_operation() -> None:
    message = run_distributed(2, _timeout_body)[0]
    assert "rank 0/2" in message and "all_reduce of probe tensor" in message and "timed out" in message
    # No launcher here: the rings are exchanged through the job's store, and rank 1 never published one.
    assert (
        "Flight record: rank 1 did not answer (stopped, dead, or busy outside slipstream's collectives) while rank 0 waits in all_reduce #1 of ranks 0-1 "
        in message
    )


def _divergent_body() -> str:
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    tensor = torch.ones(4 if dist.get_rank() == 0 else 3)
    call = (
        slipstream.comm.all_reduce
        if dist.get_rank() == 0
        else (lambda t, group, tag: slipstream.comm.broadcast(t, 1, group, tag))
    )
    with pytest.raises(slipstream.comm.CollectiveError) as info:
        call(tensor, group=group, tag="probe").wait()
    return str(info.value)


def test_divergent_collectives_are_named_through_the_store() -> None:
    messages = run_distributed(2, _divergent_body)
    for message in messages:  # both ranks published their rings out of band and both name the divergence
        assert (
            "Flight record: ranks 0,1 disagree (no majority): the first divergence is collective #1 of ranks 0-1 in step"
            in message
        ), message
        assert "rank 0 issued all_reduce ([4] float32); rank 1 issued broadcast ([3] float32)" in message, message


def _bad_world_config_body() -> str:
    with pytest.raises(slipstream.ConfigError) as info:
        slipstream.initialize(tiny_gpt2(), {"train_batch_size": 3, "optimizer": {"type": "Adam"}})
    return str(info.value)


def test_batch_not_divisible_by_world_size() -> None:
    message = run_distributed(2, _bad_world_config_body)[0]
    assert message.startswith("train_batch_size: 3 is not divisible by the data-parallel world size 2")
