"""DualPipeV: each "F&B" pair hides one micro-batch's all-to-alls (experts, Ulysses) behind the other's compute.

World 4 = pp 2 × dp 2 with ep 2 over the data-parallel ranks, ZeRO-1 and ZeRO-3, a four-layer Mixtral cut into a
V of four one-layer stages, 4 micro-batches. Against one process on the same global batches: losses
1e-5 relative per step, weights 1e-4 / 5e-5. The overlap is counted ([Note: taking turns] in
``comm/overlap.py``): a pair's forward waits on 4 all-to-alls per MoE layer (counts, expert ids,
dispatch, combine), its backward on 2 (combine and dispatch in reverse); the halves hand the turn
over at each, so with ``nF`` and ``nB`` of them a pair overlaps ``2·nB + 1`` collectives when
``nF > nB`` (the forward's last ones run after the backward is done) and ``2·nF`` otherwise.
Ulysses (pp 2 × sp 2, no experts): 2 all-to-alls per layer each way (packed Q|K|V, output), so
``2·nF`` = 4 per pair with one layer per stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slipstream
from slipstream.engine.parallel.pipeline.actions import Op
from slipstream.engine.parallel.pipeline.schedules import Schedule
from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import tiny_mixtral, train_lm_reference, train_step_on_global_batch

SEQ, MICRO, STEPS, VOCAB, LR, LAYERS, M = 16, 2, 3, 128, 1e-3, 4, 4


def _mixtral() -> torch.nn.Module:
    return tiny_mixtral(vocab=VOCAB, positions=SEQ, layers=LAYERS)


def _batches(dp: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (MICRO * dp * M, SEQ), generator=g) for _ in range(STEPS)]


def _expected_overlaps(
    schedule: Schedule, rank: int, layers: dict[int, int], forward_waits: int, backward_waits: int
) -> int:
    total = 0
    for forward, backward in schedule.partners(rank).items():
        assert forward.op is Op.FORWARD
        n_f, n_b = forward_waits * layers[forward.stage], backward_waits * layers[backward.stage]
        total += 2 * n_b + 1 if n_f > n_b else 2 * n_f
    return total


# axis -> (config, all-to-alls a forward / a backward waits on per layer)
AXES = {
    "experts": ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, 2),
    "ulysses": ({"sequence_parallel_size": 2}, 2, 2),
}


def _body(stage: int, axis: str) -> dict[str, Any]:
    extra, forward_waits, backward_waits = AXES[axis]
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": M,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1,
        "pipeline": {"stages": 2, "schedule": "dualpipev", "virtual_stages": 2},
        **extra,
    }
    engine = slipstream.initialize(_mixtral(), config)
    pipeline = engine.pipeline
    dp = engine.mesh.size("dp")
    losses, overlapped = [], []
    for tokens in _batches(dp):
        losses.append(train_step_on_global_batch(engine, tokens, MICRO))
        overlapped.append(pipeline.last_report.timing.overlapped)
    recorded = engine.monitor.last.get("pipeline_overlapped_collectives")  # the step record (rank 0 writes it)
    layers_per_stage = {stage: len(blocks) for stage, blocks in enumerate(pipeline.ranges)}
    expected = _expected_overlaps(pipeline.schedule, pipeline.rank, layers_per_stage, forward_waits, backward_waits)
    state = engine.consolidated_state_dict()
    engine.close()
    return {
        "losses": losses,
        "state": state,
        "dp": dp,
        "overlapped": overlapped,
        "expected": expected,
        "recorded": recorded,
        "pairs": len(pipeline.schedule.partners(pipeline.rank)),
        "layers": layers_per_stage,
    }


@pytest.mark.parametrize("stage,axis", [(1, "experts"), (3, "experts"), (1, "ulysses")])
def test_dualpipev_overlaps_all_to_alls_and_matches_one_process(stage: int, axis: str) -> None:
    results = run_distributed(4, _body, stage, axis)
    ours = results[0]
    assert ours["layers"] == {0: 1, 1: 1, 2: 1, 3: 1}, ours["layers"]
    losses, params = train_lm_reference(_mixtral(), _batches(ours["dp"]), LR)
    assert ours["losses"] == pytest.approx(losses, rel=1e-5)
    assert_weights_close(ours["state"], params, rtol=1e-4, atol=5e-5)
    for rank, r in enumerate(results):
        assert r["pairs"] > 0, rank
        assert r["expected"] == {"experts": 5, "ulysses": 4}[axis] * r["pairs"]  # one layer per stage
        assert r["overlapped"] == [r["expected"]] * STEPS, (rank, r["overlapped"], r["expected"])
    assert ours["recorded"] == float(ours["expected"])
