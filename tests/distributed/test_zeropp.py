"""ZeRO++ (hpZ, qwZ, qgZ) and MiCS on 4 ranks simulated as 2 nodes × 2 (``LOCAL_WORLD_SIZE=2``).

hpZ moves the same bytes from another copy, so it must equal ZeRO-3 bit for bit; MiCS sums in
another order, so it must match the single-process reference as ZeRO-3 does; the quantized
collectives change the values on the wire, so their loss must follow the unquantized run's. Bytes
per step on each link class are checked against the formulas of docs/zero.md ("ZeRO++ and MiCS").
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from slipstream.comm.quantized import packed_nbytes
from slipstream.comm.topology import INTER, INTRA, link_class
from slipstream.engine.config import ConfigError
from tests.harness import run_distributed
from tests.reference import (
    assert_close_trajectory,
    global_batches,
    noisy_batches,
    tiny_gpt2,
    train_engine,
    train_reference,
)

NODES_OF_TWO = "2"
LAYERS = 3


def _config(gas: int = 1, precision: str = "fp32", optimizer: str = "AdamW", **zero: object) -> dict:
    world = dist.get_world_size()
    config = {
        "train_batch_size": 2 * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": optimizer,
            "params": {"lr": 1e-3, **({"weight_decay": 0.01} if optimizer == "AdamW" else {})},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _train(
    zero: dict,
    steps: int,
    gas: int = 1,
    precision: str = "fp32",
    optimizer: str = "AdamW",
    batches=global_batches,
    layers: int = LAYERS,
):
    os.environ["LOCAL_WORLD_SIZE"] = NODES_OF_TWO  # the harness restores the environment after the body
    config = _config(gas, precision, optimizer, **zero)
    engine = slipstream.initialize(tiny_gpt2(seed=0, n_layer=layers), config)
    trajectory = train_engine(engine, batches(steps, config["train_batch_size"]))
    engine.close()
    return trajectory


def _layouts_body(precision: str) -> dict:
    plain = _train({}, 10, gas=2, precision=precision)
    hpz = _train({"zero_hpz_partition_size": 2}, 10, gas=2, precision=precision)
    mics = _train({"mics_shard_size": 2}, 10, gas=2, precision=precision)
    if dist.get_rank() != 0:
        return {}
    # hpZ gathers the same bytes from the node's copy and reduces over the same group: identical.
    assert hpz.losses == plain.losses, (hpz.losses, plain.losses)
    for name, value in plain.params.items():
        assert torch.equal(hpz.params[name], value), name
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    ref = train_reference(
        tiny_gpt2(seed=0, n_layer=LAYERS), global_batches(10, 16), lr=1e-3, weight_decay=0.01, clip=1.0, dtype=dtype
    )
    for ours in (plain, mics):  # MiCS sums inside its shard group, then across: the reference's bounds, as ZeRO-3
        if precision == "fp32":
            assert_close_trajectory(ours, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
        else:
            assert_close_trajectory(ours, ref, loss_rtol=1e-3, param_rel_norm=2e-2)
    return {}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hpz_equals_zero3_bit_for_bit_and_mics_matches_the_reference(precision: str) -> None:
    run_distributed(4, _layouts_body, precision)


def _sgd_body() -> None:
    plain = _train({}, 10, optimizer="SGD")
    mics = _train({"mics_shard_size": 2}, 10, optimizer="SGD")
    if dist.get_rank() == 0:  # no Adam to amplify rounding: the sums in another order agree to 1e-6
        for name, value in plain.params.items():
            torch.testing.assert_close(mics.params[name], value, rtol=1e-6, atol=1e-6)


def test_mics_weights_equal_zero3_within_float_rounding() -> None:
    run_distributed(4, _sgd_body)


def _traffic_body(zero: dict) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = NODES_OF_TWO
    engine = slipstream.initialize(tiny_gpt2(seed=0, n_layer=LAYERS), _config(**zero))
    batches = global_batches(2, engine.train_batch_size())
    comms_log.keep_history = 1
    try:
        train_engine(engine, batches)
        records = comms_log.history[-1]
        traffic = {INTRA: 0, INTER: 0}
        for r in records:
            if r.tag.startswith(("ZeRO-3", "MiCS")):
                traffic[link_class(r.ranks)] += r.moved
        ops = [(r.op, r.tag) for r in records]
    finally:
        comms_log.keep_history = 0
        comms_log.history.clear()
    engine.close()
    return {"traffic": traffic, "ops": ops}


def _unit_numels() -> list[int]:
    """Each unit's gathered size (root, then the blocks), padded to a multiple of the 4 ranks as the layout pads it."""
    model = tiny_gpt2(seed=0, n_layer=LAYERS)
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    return [-(-n // 4) * 4 for n in (root, *blocks)]


# Per step (one micro-step), bytes per rank in comms_log's accounting (an all-gather or reduce-scatter
# counts its full tensor, an all-reduce twice, an all-to-all what leaves the rank). The root and the last
# block stay gathered from the forward into the backward, so the backward gathers the middle blocks only.
def _expected(layout: str) -> dict[str, int]:
    units = _unit_numels()
    psi, middle = 4 * sum(units), 4 * sum(units[1:-1])
    if layout == "zero3":
        return {INTER: 3 * psi - 4 * (units[0] + units[-1]), INTRA: 0}
    if layout == "hpz":  # the backward's gathers from the node's copy
        return {INTER: 2 * psi, INTRA: middle}
    if layout == "mics":  # everything inside the shard group, the gradient chunks summed across (all-reduce: 2x)
        return {INTER: 2 * psi // 2, INTRA: 3 * psi - 4 * (units[0] + units[-1])}
    # INT8 forward gathers over all 4 ranks; gradients reduce-scattered in full precision inside each node (the whole
    # unit), then the node's sums of the other node's chunk (1/4 of the unit) cross as one INT4 all-to-all row
    forward = sum(4 * packed_nbytes(n // 4, 8) for n in units)
    grads = sum(packed_nbytes(n // 4, 4) for n in units)
    if layout == "qwz+qgz":  # the backward re-gathers the middle blocks from the primary shards, INT8 too
        backward = sum(4 * packed_nbytes(n // 4, 8) for n in units[1:-1])
        return {INTER: forward + backward + grads, INTRA: psi}
    assert layout == "hpz+qwz+qgz"  # the backward's gathers from the node's copy
    return {INTER: forward + grads, INTRA: middle + psi}


@pytest.mark.parametrize(
    ("layout", "zero"),
    [
        ("zero3", {}),
        ("hpz", {"zero_hpz_partition_size": 2}),
        ("mics", {"mics_shard_size": 2}),
        ("qwz+qgz", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
        (
            "hpz+qwz+qgz",
            {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True},
        ),
    ],
)
def test_bytes_per_link_class_equal_the_formulas(layout: str, zero: dict) -> None:
    results = run_distributed(4, _traffic_body, zero)
    expected = _expected(layout)
    for rank, result in enumerate(results):
        assert result["traffic"] == expected, (rank, layout, result["traffic"], expected)
    if layout == "hpz+qwz+qgz":  # ZeRO++'s promise: a small fraction of ZeRO-3's inter-node bytes
        assert expected[INTER] <= 0.3 * _expected("zero3")[INTER]
        ops = {(op, tag.rsplit("(", 1)[-1]) for op, tag in results[0]["ops"] if tag.startswith("ZeRO-3 gradients")}
        assert ops == {("reduce_scatter", "inside the node)"), ("all_to_all", "INT4 reduce-scatter)")}, ops


def _windows(losses: list[float], size: int = 10) -> list[float]:
    """What a trainer logs: the mean loss since the last log, every ``size`` steps."""
    return [sum(losses[i : i + size]) / len(losses[i : i + size]) for i in range(0, len(losses), size)]


def _quantized_body(precision: str, steps: int) -> dict:
    plain = _train({}, steps, precision=precision, batches=noisy_batches, layers=2)
    zeropp = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    quantized = _train(zeropp, steps, precision=precision, batches=noisy_batches, layers=2)
    return {"plain": _windows(plain.losses), "quantized": _windows(quantized.losses)}


@pytest.mark.parametrize(("precision", "steps"), [("fp32", 300), ("bf16", 100)])
def test_quantized_weights_and_gradients_follow_the_unquantized_loss(precision: str, steps: int) -> None:
    result = run_distributed(4, _quantized_body, precision, steps)[0]
    plain, quantized = result["plain"], result["quantized"]
    assert plain[-1] < plain[0] - 1.0  # it trained
    for step, (a, b) in enumerate(zip(quantized, plain, strict=True)):
        assert abs(a - b) <= 0.01 * b, f"logged step {step * 10}: quantized loss {a:.4f} vs {b:.4f} (1%)"
    assert abs(quantized[-1] - plain[-1]) <= 0.005 * plain[-1], (quantized[-1], plain[-1])


def _shared_dir() -> str:
    holder = [tempfile.mkdtemp(prefix="slipstream-zeropp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


def _checkpoint_body() -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = NODES_OF_TWO
    save_dir = _shared_dir()
    batches = global_batches(5, 8)
    try:
        saved = slipstream.initialize(tiny_gpt2(seed=0, n_layer=LAYERS), _config(mics_shard_size=2))
        train_engine(saved, batches[:3])
        saved.save_checkpoint(save_dir, tag="mics")
        weights = saved.consolidated_state_dict()
        rest = train_engine(saved, batches[3:])
        saved.close()
        out = {}
        layouts = (
            ("zero3", {}),
            ("hpz", {"zero_hpz_partition_size": 2}),
            ("mics", {"mics_shard_size": 2}),
            ("stage 2", {"stage": 2}),
        )
        for name, zero in layouts:
            engine = slipstream.initialize(tiny_gpt2(seed=1, n_layer=LAYERS), _config(**zero))
            engine.load_checkpoint(save_dir, tag="mics")
            loaded = engine.consolidated_state_dict()
            if dist.get_rank() == 0:
                for key, value in weights.items():
                    assert torch.equal(loaded[key], value), (name, key)
            resumed = train_engine(engine, batches[3:])
            engine.close()
            out[name] = resumed.losses
        if dist.get_rank() == 0:  # the optimizer state came along: the continuation matches the uninterrupted run
            for name, losses in out.items():
                for a, b in zip(losses, rest.losses, strict=True):
                    assert abs(a - b) <= 1e-5 * abs(b), (name, losses, rest.losses)
            assert out["hpz"] == out["zero3"]
        return out
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(save_dir, ignore_errors=True)


def test_checkpoints_move_between_mics_hpz_and_plain_zero_stages() -> None:
    run_distributed(4, _checkpoint_body)


def _refusal_body(zero: dict, stage: int) -> str:
    config = _config(**zero)
    config["zero_optimization"]["stage"] = stage
    try:
        slipstream.initialize(tiny_gpt2(seed=0, n_layer=1), config)
    except ConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize(
    ("zero", "stage", "message"),
    [
        (
            {"zero_hpz_partition_size": 3},
            3,
            r"zero_optimization\.zero_hpz_partition_size: 3 does not divide the data-parallel group of 4",
        ),
        ({"mics_shard_size": 2}, 2, r"zero_optimization\.mics_shard_size: needs stage 3"),
        ({"zero_quantized_gradients": True}, 1, r"zero_optimization\.zero_quantized_gradients: needs stage 3"),
        (
            {"mics_shard_size": 2, "zero_hpz_partition_size": 2},
            3,
            r"zero_optimization\.zero_hpz_partition_size: hpZ and MiCS",
        ),
    ],
)
def test_layouts_that_cannot_be_honoured_are_refused_naming_the_key(zero: dict, stage: int, message: str) -> None:
    assert re.search(message, run_distributed(4, _refusal_body, zero, stage)[0])


def _exact_body() -> None:
    os.environ["LOCAL_WORLD_SIZE"] = NODES_OF_TWO
    zero = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    model = tiny_gpt2(seed=0, n_layer=LAYERS)
    engine = slipstream.initialize(model, _config(**zero))
    train_engine(engine, global_batches(2, engine.train_batch_size()))
    weights = engine.consolidated_state_dict()  # the fp32 masters: exact
    weights = [weights] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(weights)
    named = dict(model.named_parameters())
    block = "transformer.h.1.mlp.c_fc.weight"
    with slipstream.zero.GatheredParameters([named[block]]):  # INT8 on the wire in training; exact here
        assert torch.equal(named[block].detach(), weights[0][block])
    engine.close()  # the weights handed back are the masters, not a forward's decoded INT8 values
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), weights[0][name]), name


def test_quantized_weights_never_leave_training() -> None:
    run_distributed(4, _exact_body)


def _composed_run(extra: dict, layout: dict, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from tests.reference import tiny_mixtral, train_step_on_global_batch

    os.environ["LOCAL_WORLD_SIZE"] = NODES_OF_TWO
    extra = dict(extra)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **layout, **extra.pop("zero", {})}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        **extra,
    }
    engine = slipstream.initialize(tiny_mixtral(seed=0) if name == "mixtral" else tiny_gpt2(seed=0), config)
    rows = 2 * dist.get_world_size() * engine.gradient_accumulation_steps()
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (rows, 16), generator=generator) for _ in range(4)]
    losses = [train_step_on_global_batch(engine, tokens, 2) for tokens in batches]
    state = engine.consolidated_state_dict()
    engine.close()
    return losses, state


def _composed_body(extra: dict, name: str) -> None:
    plain = _composed_run(extra, {}, name)
    hpz = _composed_run(extra, {"zero_hpz_partition_size": 2}, name)
    mics = _composed_run(extra, {"mics_shard_size": 2}, name)
    if dist.get_rank() == 0:
        assert hpz[0] == plain[0], (hpz[0], plain[0])
        assert all(torch.equal(hpz[1][k], v) for k, v in plain[1].items())
        for a, b in zip(mics[0], plain[0], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (mics[0], plain[0])


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "mixtral"),  # experts keep their own sharding group
        (
            {
                "zero": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
                "gradient_accumulation_steps": 2,
                "activation_checkpointing": {"module_classes": ["GPT2Block"]},
            },
            "gpt2",
        ),
    ],
    ids=["experts", "offload+recompute+accumulation"],
)
def test_layouts_compose_with_experts_offload_and_recompute(extra: dict, name: str) -> None:
    run_distributed(4, _composed_body, extra, name)
