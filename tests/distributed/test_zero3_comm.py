"""ZeRO-3 honours overlap_comm and communication_data_type (no silent no-ops)."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from tests.distributed.test_zero3 import _config, _parity_body
from tests.distributed.test_zero_partitioned import reductions_around_last_gradient
from tests.harness import run_distributed
from tests.reference import assert_close_trajectory, global_batches, tiny_gpt2, train_engine, train_reference


def _overlap_body(overlap: bool) -> list[int]:
    # The token embedding (root unit) gets its gradient last: by then the blocks' reduce-scatters
    # are on the wire when overlap is on, and none has started when it is off.
    engine = slipstream.initialize(
        tiny_gpt2(seed=0, n_layer=3), _config(dist.get_world_size(), 1, overlap_comm=overlap)
    )
    return reductions_around_last_gradient(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_overlap_comm_decides_when_reductions_start(overlap: bool) -> None:
    before_last_grad, after_backward = run_distributed(2, _overlap_body, overlap)[0]
    assert after_backward == 4  # root + 3 blocks, once each
    assert (before_last_grad > 0) == overlap, before_last_grad


def _comm_dtype_body() -> dict:
    world = dist.get_world_size()
    config = {**_config(world, 1), "communication_data_type": "bf16"}
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    batches = global_batches(8, config["train_batch_size"])
    comms_log.keep_history = 1
    try:
        ours = train_engine(engine, batches)
        records = [(r.nbytes, r.tag) for r in comms_log.history[-1] if r.op == "reduce_scatter"]
    finally:
        comms_log.keep_history = 0
        comms_log.history.clear()
    units = {u.index: u.numel for u in engine.strategy.units}
    engine.close()
    if dist.get_rank() == 0:  # gradients rounded to bf16 on the wire: the bf16 bounds of test_zero3
        ref = train_reference(tiny_gpt2(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0)
        assert_close_trajectory(ours, ref, loss_rtol=1e-3, param_rel_norm=2e-2)
    return {"records": records, "units": units}


def test_stage3_reduces_in_communication_data_type() -> None:
    result = run_distributed(2, _comm_dtype_body)[0]
    assert result["records"]
    for nbytes, tag in result["records"]:
        unit = int(re.search(r"unit (\d+)", tag).group(1))
        assert nbytes == 2 * result["units"][unit], (nbytes, tag)  # 2 bytes per element: bf16, not fp32


def test_stage3_without_overlap_trains_like_one_process() -> None:
    # Every reduce-scatter waits for the end of backward; with accumulation the slices add up.
    run_distributed(2, _parity_body, "gpt2", 2, 0, overlap_comm=False)
