"""ZeRO stage 3 trains exactly like one process, frees what it promises and moves ~3Ψ per step."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from slipstream.engine.zero.stage3.unit import UnitState
from tests.distributed.test_data_parallel import _BranchLast, _unused_body
from tests.harness import run_distributed
from tests.reference import (
    assert_close_trajectory,
    assert_weights_match,
    global_batches,
    gpt2_loss,
    micro_batch,
    tiny_gpt2,
    tiny_llama,
    train_engine,
    train_reference,
)

STEPS = 20
MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def _config(world: int, gas: int, mb: int = 2, prefetch: int = 0, threshold: int = 0, **zero: object) -> dict:
    return {
        "train_batch_size": mb * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": threshold,
            **zero,
        },
    }


def _parity_body(
    model_name: str, gas: int, prefetch: int, threshold: int = 0, precision: str = "fp32", **zero: object
) -> dict:
    world = dist.get_world_size()
    build = MODELS[model_name]
    extra = {precision: {"enabled": True}} if precision != "fp32" else {}
    config = {**_config(world, gas, prefetch=prefetch, threshold=threshold, **zero), **extra}
    engine = slipstream.initialize(build(seed=dist.get_rank()), config)  # rank 0's weights win
    batches = global_batches(STEPS, config["train_batch_size"])
    ours = train_engine(engine, batches)
    engine.close()
    if dist.get_rank() == 0:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        ref = train_reference(build(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0, dtype=dtype)
        if precision == "fp32":
            # The bounds of stages 0-2: 1e-5 relative loss per step, weights to a fraction of an Adam step.
            assert_close_trajectory(ours, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
        else:  # bf16 gradients reduced in bf16, as for stages 1/2 (see test_zero_partitioned)
            assert_close_trajectory(ours, ref, loss_rtol=1e-3, param_rel_norm=2e-2)
        assert ours.losses[-1] < ours.losses[0] - 0.3
    return {"losses": ours.losses}


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("gas", "prefetch"), [(1, 0), (4, 50_000_000)])
def test_stage3_matches_single_process(model_name: str, world: int, gas: int, prefetch: int) -> None:
    results = run_distributed(world, _parity_body, model_name, gas, prefetch)
    assert all(r["losses"] == results[0]["losses"] for r in results)


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_stage3_blocks_kept_into_the_backward_match_single_process(model_name: str) -> None:
    # [Note: kept from the forward into the backward]: every block stays gathered from its forward
    # into its backward (DeepSpeed's 1e9 elements covers the tiny models), over accumulated micro-steps.
    results = run_distributed(2, _parity_body, model_name, 2, None, stage3_max_reuse_distance=1_000_000_000)
    assert all(r["losses"] == results[0]["losses"] for r in results)


def test_stage3_persistent_small_parameters_and_bf16() -> None:
    run_distributed(2, _parity_body, "gpt2", 2, 50_000_000, 100_000)
    run_distributed(2, _parity_body, "llama", 1, 50_000_000, 0, "bf16")


# ---------------------------------------------------------------- edge cases


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    extras: dict


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.scale = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return torch.tanh(self.linear(x)) * self.scale, {"note": "not a tensor", "pre": x}


class _Tricky(torch.nn.Module):
    """A block called twice, a block parameter used by the root, a frozen block, dataclass outputs."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(4))
        self.blocks[3].requires_grad_(False)
        self.head = torch.nn.Linear(width, 1)
        slipstream.zero.register_external_parameter(self, self.blocks[2].scale)

    def forward(self, x: torch.Tensor) -> _Output:
        h, _ = self.blocks[0](x)
        h, _ = self.blocks[1](h)
        h, _ = self.blocks[1](h)  # called twice in one forward
        h, extras = self.blocks[2](h)
        h, _ = self.blocks[3](h)
        h = h * self.blocks[2].scale.mean()  # used outside its owning module's forward
        return _Output(self.head(h).pow(2).mean(), extras)


def _tricky_body() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = _config(world, 1, mb=4)
    engine = slipstream.initialize(_Tricky(), config)
    reference = _Tricky()
    ref_opt = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01, fused=True
    )
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(world, 4, 16, generator=gen)
        out = engine(x[rank])
        assert isinstance(out, _Output) and out.extras["note"] == "not a tensor"
        engine.backward(out.loss)
        engine.step()
        ref_loss = sum(reference(x[r]).loss for r in range(world)) / world
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 2:  # evaluation in between: eval(), no_grad, then back to training
            engine.eval()
            reference.eval()
            with torch.no_grad():
                torch.testing.assert_close(engine(x[rank]).loss, reference(x[rank]).loss, rtol=1e-5, atol=1e-7)
            engine.train()
            reference.train()
    state = engine.consolidated_state_dict()
    engine.close()
    if rank == 0:
        assert_weights_match(state, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_stage3_edge_cases_match_reference(world: int) -> None:
    run_distributed(world, _tricky_body)


@pytest.mark.parametrize(("world", "gas"), [(2, 1), (4, 1), (2, 2)])
def test_stage3_forward_path_differs_between_ranks(world: int, gas: int) -> None:
    # Each Linear is a unit: a frozen one, a branch only rank 0 runs (every other step, first
    # micro-step only), one nobody runs; prefetch small enough to leave units to the cursor.
    zero = {
        "stage3_unit_modules": ["Linear"],
        "stage3_prefetch_bucket_size": 100,
        "stage3_param_persistence_threshold": 0,
    }
    run_distributed(world, _unused_body, 3, gas, **zero)


def test_stage3_kept_units_some_ranks_skip() -> None:
    # Every unit kept into the backward, including the branch only rank 0 runs and the one nobody
    # runs: the ranks that skipped them gathered them at the forward's cursor and keep them alike,
    # so no rank gathers them for the backward alone (the gathers would no longer pair up).
    zero = {
        "stage3_unit_modules": ["Linear"],
        "stage3_prefetch_bucket_size": 100,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 1_000_000_000,
    }
    run_distributed(2, _unused_body, 3, 2, **zero)


@pytest.mark.parametrize("prefetch", [None, 0])
def test_stage3_last_unit_run_by_some_ranks_only(prefetch: int | None) -> None:
    # The last unit stays gathered from the forward into the backward ([Note: the last unit stays]):
    # here only rank 0 runs it, every other step, so the others gather it at the end of the forward
    # and must keep it exactly as rank 0 does, or the gathers of backward would no longer pair up.
    zero = {
        "stage3_unit_modules": ["Linear"],
        "stage3_prefetch_bucket_size": prefetch,
        "stage3_param_persistence_threshold": 0,
    }
    run_distributed(2, _unused_body, 3, 1, _BranchLast, **zero)


# ---------------------------------------------------------------- memory and communication


def _memory_body(prefetch: int | None) -> dict:
    world = dist.get_world_size()
    model = tiny_gpt2(seed=0, n_layer=4, n_embd=128)
    psi = sum(p.numel() for p in model.parameters())
    config = _config(world, 1, prefetch=prefetch, reduce_bucket_size=1)  # one send buffer in flight at a time
    engine = slipstream.initialize(model, {**config, "bf16": {"enabled": True}})
    strategy = engine.strategy
    largest = max(u.nbytes for u in strategy.units)
    live_seen: list[int] = []

    def record_live(*_: object) -> None:
        live_seen.append(sum(u.nbytes for u in strategy.units if u.state is not UnitState.FREE))

    hooks = [block.register_forward_hook(record_live) for block in model.transformer.h]
    tokens = global_batches(1, engine.train_batch_size())[0]
    pool = []  # (buffers allocated so far, bytes the pool holds) after each step
    for _ in range(4):
        engine.backward(gpt2_loss(engine, micro_batch(tokens, 0, dist.get_rank(), world, 2)))
        engine.step()
        pool.append((strategy.buffers.fresh, strategy.buffers.held_bytes()))
    for hook in hooks:
        hook.remove()
    held = strategy.memory_breakdown()
    freed = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    engine.close()
    return {
        "psi": psi,
        "largest": largest,
        "live_seen": max(live_seen),
        "freed": freed,
        "pool": pool,
        "units": len(strategy.units),
        **held,
    }


@pytest.mark.parametrize(("world", "prefetch"), [(2, 0), (4, 0), (2, None)])
def test_stage3_memory_is_sixteen_psi_over_n_plus_live_units(world: int, prefetch: int | None) -> None:
    # Mixed-precision Adam (ZeRO paper): 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, m, v) bytes
    # per parameter, all divided by N. Between steps no unit is gathered: every parameter's storage is empty.
    for rank, held in enumerate(run_distributed(world, _memory_body, prefetch)):
        expected = 16 * held["psi"] / world
        total = held["params"] + held["grads"] + held["optimizer"]
        assert abs(total - expected) <= 0.05 * expected + held["largest"], (
            f"rank {rank}: {total} vs {expected:.0f} ({held})"
        )
        # Besides model states: the pool's idle buffers, never more than the schedule had in use at once
        # (the root, the running block, the one gathered ahead, a send buffer in flight).
        assert held["buffers"] <= 4 * held["largest"], held
        # [Note: gathered units borrow resident buffers]: once the schedule has run, a step allocates only the
        # few buffers the end of its forward handed back ([Note: nothing idle into the backward]) or a send
        # still in flight needs, fewer than it has units (each unit is gathered twice and sent once a step).
        allocated = [b[0] - a[0] for a, b in zip(held["pool"][1:], held["pool"][2:])]
        assert max(allocated) < held["units"], held
        assert all(nbytes <= 4 * held["largest"] for _, nbytes in held["pool"]), held
        assert held["freed"], "a parameter kept its gathered storage after the step"
        # During forward: the root unit (embeddings + head) plus the running block, and with the
        # default prefetch (None) the next block too, never the whole model.
        assert held["live_seen"] <= (2 if prefetch == 0 else 3) * held["largest"], held


def _comms_body(prefetch: int | None, **zero: object) -> list[tuple[str, int, str]]:
    world = dist.get_world_size()
    engine = slipstream.initialize(tiny_gpt2(seed=0, n_layer=3), _config(world, 1, prefetch=prefetch, **zero))
    tokens = global_batches(2, engine.train_batch_size())
    comms_log.keep_history = 1
    try:
        for step in range(2):  # the engine closes each step's log after its optimizer step
            engine.backward(gpt2_loss(engine, micro_batch(tokens[step], 0, dist.get_rank(), world, 2)))
            engine.step()
        records = [(r.op, r.moved, r.tag) for r in comms_log.history[-1]]
    finally:
        comms_log.keep_history = 0
        comms_log.history.clear()
    engine.close()
    return records


@pytest.mark.parametrize("prefetch", [0, None, 50_000_000])
def test_stage3_moves_three_psi_with_one_gather_per_unit_per_pass(prefetch: int | None) -> None:
    records = run_distributed(2, _comms_body, prefetch)[0]
    psi_bytes = 4 * sum(p.numel() for p in tiny_gpt2(seed=0, n_layer=3).parameters())
    gathers = [re.search(r"unit \d+", tag).group() for op, _, tag in records if op == "all_gather"]
    reductions = [re.search(r"unit \d+", tag).group() for op, _, tag in records if op == "reduce_scatter"]
    units = sorted(set(reductions))
    assert len(units) == 4, units  # root + 3 blocks
    # Each block: once forward, once backward. The root (unit 0) and the last block (unit 3) stay
    # gathered from the forward into the backward that needs them first thing, so each is gathered
    # once (FSDP2 keeps its root, torchtitan its last block, the same way).
    assert sorted(gathers) == sorted(["unit 0", "unit 3", *(units[1:3] * 2)]), gathers
    assert sorted(reductions) == units
    kept = sum(m for op, m, tag in records if op == "all_gather" and re.search(r"unit [03] ", tag))
    moved = sum(m for op, m, _ in records if op in ("all_gather", "reduce_scatter"))
    assert 3 * psi_bytes - kept <= moved <= (3 * psi_bytes - kept) * 1.02, moved / psi_bytes
    assert {op for op, _, _ in records} <= {"all_gather", "reduce_scatter", "all_reduce"}


def _block_numel() -> int:
    return sum(p.numel() for p in tiny_gpt2(seed=0, n_layer=3).transformer.h[0].parameters())


@pytest.mark.parametrize(("blocks_within", "backward_gathers"), [(1, ["unit 1", "unit 2"]), (2, ["unit 1"]), (3, [])])
def test_stage3_reuse_distance_skips_the_backward_gathers_of_kept_blocks(
    blocks_within: int, backward_gathers: list[str]
) -> None:
    # Block i's backward comes 2 * (elements of the blocks above it) after its forward. A distance
    # just above 2 * (k - 1) blocks keeps the top k blocks: their backward gathers are skipped, so at
    # k = 3 (the whole model) a step moves 2Ψ, as DDP's all-reduce does.
    distance = 2 * (blocks_within - 1) * _block_numel() + 1
    records = run_distributed(2, _comms_body, None, stage3_max_reuse_distance=distance)[0]
    psi_bytes = 4 * sum(p.numel() for p in tiny_gpt2(seed=0, n_layer=3).parameters())
    gathers = [re.search(r"unit \d+", tag).group() for op, _, tag in records if op == "all_gather"]
    assert sorted(gathers) == sorted(["unit 0", "unit 1", "unit 2", "unit 3", *backward_gathers]), gathers
    assert sorted(re.search(r"unit \d+", tag).group() for op, _, tag in records if op == "reduce_scatter") == [
        "unit 0",
        "unit 1",
        "unit 2",
        "unit 3",
    ]
    if not backward_gathers:
        moved = sum(m for op, m, _ in records if op in ("all_gather", "reduce_scatter"))
        assert 2 * psi_bytes <= moved <= 2 * psi_bytes * 1.02, moved / psi_bytes


# ---------------------------------------------------------------- zero.Init and GatheredParameters


def _init_values_body(model_name: str) -> None:
    world = dist.get_world_size()
    build = MODELS[model_name]
    config = _config(world, 1)
    torch.manual_seed(0)
    with slipstream.zero.Init(config=config):
        model = build(seed=0)
    after_build = torch.rand(1)  # the RNG moved on exactly as after an unsharded build
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    engine = slipstream.initialize(model, config)
    state = engine.consolidated_state_dict()
    reference = build(seed=0)
    reference_after = torch.rand(1)
    if dist.get_rank() == 0:
        assert state.keys() == dict(reference.named_parameters()).keys()
        for name, value in reference.named_parameters():
            assert torch.equal(state[name], value.detach()), name
        assert torch.equal(after_build, reference_after)
        for name, buffer in reference.named_buffers():
            assert torch.equal(dict(engine.module.named_buffers())[name], buffer), name
    batches = global_batches(3, config["train_batch_size"])
    ours = train_engine(engine, batches)
    engine.close()
    if dist.get_rank() == 0:
        ref = train_reference(build(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0)
        assert_close_trajectory(ours, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
        assert 5.0 < ours.losses[0] < 6.0  # ln(256) ≈ 5.55: initialised, not empty shards


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_zero_init_builds_the_unsharded_initial_values(model_name: str) -> None:
    run_distributed(2, _init_values_body, model_name)


def _gathered_body() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = _config(world, 1)
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    wte = engine.module.transformer.wte.weight
    block_weight = engine.module.transformer.h[1].mlp.c_fc.weight
    expected = tiny_gpt2(seed=0).transformer.h[1].mlp.c_fc.weight.detach()
    with slipstream.zero.GatheredParameters([block_weight]):
        torch.testing.assert_close(block_weight.detach(), expected, rtol=0, atol=0)
    assert block_weight.untyped_storage().nbytes() == 0
    with slipstream.zero.GatheredParameters([wte, block_weight], modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                wte[0].fill_(0.5)
                block_weight.mul_(2)
    state = engine.consolidated_state_dict()
    batches = global_batches(2, config["train_batch_size"])
    train_engine(engine, batches)  # the modified weights train on (masters were updated too)
    engine.close()
    if rank == 0:
        assert torch.all(state["transformer.wte.weight"][0] == 0.5)
        torch.testing.assert_close(state["transformer.h.1.mlp.c_fc.weight"], expected * 2, rtol=0, atol=0)


def test_gathered_parameters_reads_and_modifies_full_weights() -> None:
    run_distributed(2, _gathered_body)


class _Sneaky(_Tricky):
    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.blocks = torch.nn.ModuleList(_Block(8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.blocks[0](x)
        return self.head(h * self.blocks[1].scale).mean()  # block 1's parameter, never declared


def _undeclared_body() -> str:
    engine = slipstream.initialize(_Sneaky(), _config(dist.get_world_size(), 1))
    with pytest.raises(RuntimeError, match="register_external_parameter"):
        engine(torch.randn(2, 8))
    engine.close()
    return "ok"


def test_undeclared_outside_use_is_explained() -> None:
    assert run_distributed(2, _undeclared_body) == ["ok", "ok"]


def _vm_data_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _capped_body() -> dict:
    """Build a 24-layer GPT-2 (~300 MB of fp32 weights) under a data-size limit below that size."""
    import gc
    import resource

    world = dist.get_world_size()
    config = {**_config(world, 1, mb=1), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    warm = slipstream.initialize(tiny_gpt2(seed=0, n_layer=2), config)  # process groups and ring threads exist
    warm.close()
    del warm
    gc.collect()
    full_bytes = 4 * sum(p.numel() for p in tiny_gpt2(seed=0, n_layer=24, n_embd=512).parameters())
    gc.collect()
    cap = int(0.9 * full_bytes)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data_bytes() + cap, hard))
    try:  # the cap is below the size of the fp32 weights alone: this process cannot hold the model whole
        with slipstream.zero.Init(config=config):
            model = tiny_gpt2(seed=0, n_layer=24, n_embd=512)
        model.requires_grad_(False)  # fine-tune the last block and the final norm (see the note in the test)
        model.transformer.h[-1].requires_grad_(True)
        model.transformer.ln_f.requires_grad_(True)
        engine = slipstream.initialize(model, config)
        losses = []
        for tokens in global_batches(3, config["train_batch_size"]):
            loss = gpt2_loss(engine, micro_batch(tokens, 0, dist.get_rank(), world, 1))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        held = engine.strategy.memory_breakdown()
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    engine.close()
    return {"losses": losses, "cap": cap, "full": full_bytes, **held}


def test_zero_init_trains_a_model_larger_than_the_memory_cap() -> None:
    # At 2 ranks, training *every* parameter needs at least 8 bytes/parameter/N (fp32 weights and
    # gradients) = the whole fp32 model, so a cap below the model's size leaves room only for a
    # fine-tune: a frozen backbone costs its 4/N shard and no gradient or optimizer memory.
    for result in run_distributed(2, _capped_body):
        assert result["cap"] < result["full"]
        losses = result["losses"]
        assert 5.0 < losses[0] < 6.0 and all(math.isfinite(x) for x in losses), losses  # ln(256) ≈ 5.55 at init
        assert result["params"] + result["grads"] + result["optimizer"] < result["cap"], result


# ---------------------------------------------------------------- shared behaviours of every stage


@pytest.mark.parametrize("threshold", [0, 100_000])  # every parameter partitioned / all in the persistent unit
def test_stage3_param_groups_user_optimizer_and_fp16_overflow(threshold: int) -> None:
    from tests.distributed.test_data_parallel import _overflow_body
    from tests.distributed.test_zero_partitioned import _param_groups_body, _user_optimizer_body

    zero = {"stage3_param_persistence_threshold": threshold}
    run_distributed(2, _param_groups_body, 3, **zero)
    run_distributed(2, _user_optimizer_body, 3, **zero)
    results = run_distributed(2, _overflow_body, 1, 3, **zero)
    assert results[0] == results[1]
    step, changed, scale_before, scale_after, *_ = results[0]["record"][2]
    assert not changed and scale_after == scale_before / 2


def _discarded_body() -> bool:
    import gc
    import weakref

    def build() -> tuple[weakref.ref, weakref.ref]:
        model = tiny_gpt2(seed=0)
        engine = slipstream.initialize(model, _config(dist.get_world_size(), 1))
        with slipstream.zero.GatheredParameters([model.transformer.h[0].mlp.c_fc.weight]):
            pass
        return weakref.ref(engine.strategy), weakref.ref(model)

    strategy, model = build()  # neither closed nor kept: nothing global may hold on to them
    gc.collect()
    return strategy() is None and model() is None


def test_a_discarded_engine_and_model_are_freed() -> None:
    assert run_distributed(2, _discarded_body) == [True, True]


def _idle_at_last_block_body() -> list[int]:
    model = tiny_gpt2(seed=0, n_layer=4)
    engine = slipstream.initialize(model, _config(dist.get_world_size(), 1))
    idle: list[int] = []
    # registered after the engine's pre-hook, so it sees the pool as the last block's forward runs
    model.transformer.h[-1].register_forward_pre_hook(lambda *_: idle.append(engine.strategy.buffers.held_bytes()))
    for batch in global_batches(3, 2 * dist.get_world_size()):
        ids = micro_batch(batch, 0, dist.get_rank(), dist.get_world_size(), 2)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.close()
    return idle


def test_no_gather_buffer_is_idle_while_the_last_block_the_head_and_the_loss_run() -> None:
    """[Note: nothing idle into the backward]: the forward's peak is its end (the head's logits, the loss); the
    buffers earlier blocks gave back have no use until the backward and are freed at the last gather."""
    for idle in run_distributed(2, _idle_at_last_block_body):
        assert idle == [0, 0, 0], f"bytes idle in the gather pool as the last block ran, per step: {idle}"
