"""The monitor names a slow rank and the first rank whose loss went non-finite (engine/monitor/health.py)."""

from __future__ import annotations

import logging
import math
import time
import types

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.engine.monitor import health as health_module
from slipstream.engine.monitor.health import (
    SLOW_MARGIN,
    SLOW_MIN_EXCESS_S,
    SLOW_REPORTS,
    NonFinite,
    RankHealth,
    over_median,
)
from tests.harness import run_distributed
from tests.reference import global_batches, gpt2_loss, micro_batch, tiny_gpt2

WORLD, STEPS, EVERY, MB = 2, 6, 2, 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _train(
    slow_rank: int | None = None,
    delay: float = 0.0,
    nan_rank: int | None = None,
    nan_step: int = 0,
    cpu_clock: bool = False,
) -> dict:
    """STEPS optimizer steps, a progress line every EVERY; ``slow_rank`` sleeps ``delay`` before each forward,
    ``nan_rank``'s loss is NaN at optimizer step ``nan_step`` (1-based, as the progress line counts).

    ``cpu_clock``: the health check times each rank by its CPU time instead of the wall clock. On a shared
    test machine (two cores, other suites running) a rank starved by the scheduler really is 2-4x slower
    in wall time; CPU time counts only the work, which is the same on every rank when nobody sleeps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu_clock:
        health_module.time = types.SimpleNamespace(perf_counter=time.thread_time)  # type: ignore[assignment]
    config = {
        "train_batch_size": MB * world,
        "gradient_accumulation_steps": 1,
        "steps_per_print": EVERY,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},  # fp32, default clipping: a NaN norm must not crash it
    }
    handler = _Lines()
    try:
        engine = slipstream.initialize(tiny_gpt2(), config)
        logging.getLogger("slipstream").addHandler(handler)
        for tokens in global_batches(STEPS, MB * world):
            if rank == slow_rank:
                time.sleep(delay)  # a slow data loader or a throttled device
            loss = gpt2_loss(engine, micro_batch(tokens, 0, rank, world, MB))
            if rank == nan_rank and engine.global_steps + 1 == nan_step:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        engine.close()
    finally:
        logging.getLogger("slipstream").removeHandler(handler)
        health_module.time = time  # the pool's processes serve other tests
    health = engine.monitor.health
    return {
        "slow": sorted(health.slow_ranks),
        "nonfinite": health.first_nonfinite,
        "lines": [line for line in handler.lines if "slow" in line or "non-finite" in line],
    }


def test_a_slow_rank_is_named() -> None:
    results = run_distributed(WORLD, _train, slow_rank=1, delay=0.15)
    assert [r["slow"] for r in results] == [[1]] * WORLD  # every rank holds the verdict; rank 0 logs it
    lines = results[0]["lines"]
    # windows end at steps 2, 4, 6: slow in all three, named from the second on
    assert len(lines) == 2 and all(line.startswith("WARNING rank 1 is slow: ") for line in lines), lines
    assert lines[-1].endswith("for the last 3 reports"), lines
    assert results[1]["lines"] == []  # only rank 0 logs
    print("\n".join(lines))


def test_no_slow_rank_without_a_slowdown() -> None:
    results = run_distributed(WORLD, _train, cpu_clock=True)
    assert [r["slow"] for r in results] == [[]] * WORLD
    assert results[0]["lines"] == []
    assert all(r["nonfinite"] is None for r in results)


def test_the_first_nonfinite_loss_is_named() -> None:
    results = run_distributed(WORLD, _train, nan_rank=1, nan_step=3, cpu_clock=True)
    verdict = results[0]["nonfinite"]
    # step 3's NaN reaches rank 0 through the all-reduce: its own loss is NaN from step 4 on, rank 1 had it first
    assert verdict is not None and verdict.key() == results[1]["nonfinite"].key()
    assert (verdict.source, verdict.step, verdict.ranks) == ("loss", 3, (1,))
    assert math.isnan(verdict.losses[0])
    lines = results[0]["lines"]
    assert lines == ["ERROR non-finite loss first at step 3 on rank(s) 1 (loss nan)"], lines  # once, at step 4
    print("\n".join(lines))


# ------------------------------------------------------------------ the decisions, without processes
def test_over_median_threshold() -> None:
    base = 0.3
    above = base * (1 + SLOW_MARGIN) + 1e-3
    below = base * (1 + SLOW_MARGIN) - 1e-3
    assert over_median([base, base, above, base]) == {2: base}
    assert over_median([base, base, below, base]) == {}
    assert over_median([base, above]) == {1: base}  # two ranks: the other one is the median
    assert over_median([above, above, base, base]) == {0: base, 1: base}  # the others' median, without the rank itself
    # the median, not the mean: one very fast rank does not make the others slow
    assert over_median([0.01, base, base, base]) == {}
    # millisecond steps: 50% more but under SLOW_MIN_EXCESS_S is jitter
    tiny = SLOW_MIN_EXCESS_S / 2
    assert over_median([tiny, tiny * 1.5 + 1e-9]) == {}
    assert over_median([base]) == {}


def test_slow_needs_consecutive_windows() -> None:
    health = RankHealth(0, torch.device("cpu"))
    fast, slow = [0.3, 0.3, 0.3], [0.3, 0.3, 0.6]
    assert health._judge_speed(slow) == [] and health.slow_ranks == {}  # one window: a hiccup
    lines = health._judge_speed(slow)
    assert list(health.slow_ranks) == [2] and health.slow_ranks[2].reports == SLOW_REPORTS == 2
    assert lines == [
        (logging.WARNING, "rank 2 is slow: 2.00x the median step time (600 ms vs 300 ms) for the last 2 reports")
    ]
    assert health._judge_speed(fast) == [] and health.slow_ranks == {}  # recovered
    health._judge_speed(slow)
    assert health.slow_ranks == {}  # the count starts again
    health._judge_speed([0.6, 0.3, 0.3])
    assert health.slow_ranks == {}  # another rank: not consecutive for either


def test_nonfinite_verdicts() -> None:
    health = RankHealth(0, torch.device("cpu"))
    loss = torch.tensor(2.0)
    health.on_step(1, loss, 1, 1.0, False, 0.0)
    health.on_step(2, loss * math.inf, 1, math.nan, False, 0.0)  # the grad norm follows the loss: it is the loss
    health.on_step(3, loss * math.nan, 1, math.nan, False, 0.0)
    lines = health.exchange(4)
    assert lines == [(logging.ERROR, "non-finite loss first at step 2 on rank(s) 0 (loss inf)")]
    assert health.first_nonfinite == NonFinite(2, "loss", 2, (0,), (math.inf,))
    assert health.exchange(6) == []  # once

    global_first = RankHealth(0, torch.device("cpu"))
    global_first.on_step(5, torch.tensor(1.0), 1, math.inf, False, 0.0)  # e.g. an overflow in backward: loss fine
    assert global_first.exchange(6) == [
        (
            logging.ERROR,
            "non-finite gradient norm at step 5 (all ranks agree: it is global); the first non-finite local loss "
            "not yet seen (no rank's up to step 6)",
        )
    ]
    global_first.on_step(7, torch.tensor(math.nan), 2, math.nan, False, 0.0)
    [(_, line)] = global_first.exchange(8)
    assert line.endswith("the first non-finite local loss was at step 7 on rank(s) 0 (loss nan)"), line

    dynamic = RankHealth(0, torch.device("cpu"))
    dynamic.on_step(1, torch.tensor(1.0), 1, math.inf, True, 0.0)  # fp16 loss-scale search: not a symptom
    assert dynamic.exchange(2) == [] and dynamic.first_nonfinite is None


@pytest.mark.parametrize("on_device", [False, True])
def test_the_first_nonfinite_gradient_norm_is_kept_whether_the_host_read_it_or_not(on_device: bool) -> None:
    # a device scalar is the norm of a step that never waited for the device (optimizer_step.py)
    def norm(value: float) -> float | torch.Tensor:
        return torch.tensor(value) if on_device else value

    health = RankHealth(0, torch.device("cpu"))
    for step, value in ((1, 1.0), (2, math.inf), (3, math.nan), (4, 1.0)):
        health.on_step(step, torch.tensor(1.0), 1, norm(value), False, 0.0)
    [(_, line)] = health.exchange(5)
    assert line.startswith("non-finite gradient norm at step 2 "), line
