"""Activation checkpointing trains exactly like the run without it, at stage 0 and at stage 3.

Recomputation replays the same kernels on the same inputs, so on CPU in fp32 the recomputed
activations are bitwise those of the first forward: losses and weights must be *equal* to the
run without checkpointing, not merely close. Against the single-process reference the usual
stage tolerances apply. Stage 3 must neither gather nor reduce more: recomputing a unit
re-gathers it at most (nested units), and every unit is reduce-scattered once per backward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from tests.harness import run_distributed
from tests.reference import assert_close_trajectory, global_batches, tiny_gpt2, train_engine, train_reference

STEPS = 6


def _config(world: int, stage: int, gas: int, checkpointing: dict | None, **zero: object) -> dict:
    config = {
        "train_batch_size": 2 * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **zero},
    }
    if checkpointing is not None:
        config["activation_checkpointing"] = checkpointing
    return config


def _train(stage: int, gas: int, checkpointing: dict | None, **zero: object) -> tuple[object, Counter]:
    world = dist.get_world_size()
    config = _config(world, stage, gas, checkpointing, **zero)
    model = tiny_gpt2(seed=0, n_layer=3)
    engine = slipstream.initialize(model, config)
    comms_log.records.clear()  # what earlier tests' engines left (their close() gathers)
    comms_log.keep_history = STEPS
    try:
        trajectory = train_engine(engine, global_batches(STEPS, config["train_batch_size"]))
        ops = Counter(r.op for step in comms_log.history for r in step)
    finally:
        comms_log.keep_history = 0
        comms_log.history.clear()
    engine.close()
    slipstream.checkpointing.remove_activation_checkpointing(model)
    return trajectory, ops


def _parity_body(stage: int, gas: int, zero: dict) -> dict:
    plain, plain_ops = _train(stage, gas, None, **zero)
    checkpointed, ops = _train(stage, gas, {"module_classes": ["GPT2Block"]}, **zero)
    assert checkpointed.losses == plain.losses, (checkpointed.losses, plain.losses)
    if dist.get_rank() == 0:
        for name, value in plain.params.items():
            assert torch.equal(checkpointed.params[name], value), name
        config = _config(dist.get_world_size(), stage, gas, None)
        ref = train_reference(
            tiny_gpt2(seed=0, n_layer=3),
            global_batches(STEPS, config["train_batch_size"]),
            lr=1e-3,
            weight_decay=0.01,
            clip=1.0,
        )
        assert_close_trajectory(checkpointed, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
    return {"plain_ops": dict(plain_ops), "ops": dict(ops)}


@pytest.mark.parametrize(
    ("stage", "gas", "zero"),
    [
        (0, 2, {}),
        (3, 1, {"stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}),  # units are the blocks
        (
            3,
            2,
            {"stage3_unit_modules": ["GPT2Attention", "GPT2MLP"], "stage3_param_persistence_threshold": 0},
        ),  # units inside
    ],
    ids=["stage0", "stage3-block-units", "stage3-nested-units"],
)
def test_checkpointing_keeps_exact_parity(stage: int, gas: int, zero: dict) -> None:
    for result in run_distributed(2, _parity_body, stage, gas, zero):
        plain, ours = result["plain_ops"], result["ops"]
        # No double reduce: the same gradient reductions as without checkpointing.
        assert ours.get("reduce_scatter", 0) == plain.get("reduce_scatter", 0), result
        assert ours.get("all_reduce", 0) == plain.get("all_reduce", 0), result
        if stage == 3:
            # Whole units checkpointed: backward gathers them anyway. Units inside a checkpointed
            # block: the recomputation gathers them and they stay live for their backward just
            # after, so no gather is added either (the hooks see is_recomputing()).
            assert ours["all_gather"] == plain["all_gather"], result
