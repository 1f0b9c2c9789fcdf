"""Goodput end to end (issue 32): 4 ranks of a tiny GPT-2 under ``slipstream run`` with injected faults.

* A hang (SIGSTOP), a killed rank (SIGKILL) and a rank-dependent extra collective are each
  reported with the right rank, group, op and sequence number, within the collective timeout.
* With in-memory snapshots every step, the killed rank's restart resumes from shared memory,
  loses no step, and ends on weights bit-equal to an uninterrupted run (same data order).

The fault steps are drawn from a seeded generator (printed on failure), so each run is reproducible.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from tests.integration.test_launcher_multinode import _slipstream

JOB = str(Path(__file__).with_name("goodput_job.py"))
STEPS = 8
# comms_timeout_seconds of the hang cases: every healthy rank must reach the collective the faulty one breaks before the
# first waiter gives up, or the report names a different state (at 5 s one of four runs with two suites at once missed)
TIMEOUT_S = 20
DRAW = random.Random(32)


def _job(tmp_path: Path, *extra: str, restarts: int = 0) -> tuple[int, str, list[dict]]:
    out = tmp_path / "out"
    out.mkdir()
    done = _slipstream(
        "run",
        "--nproc_per_node",
        "4",
        "--max_restarts",
        str(restarts),
        JOB,
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--comms_timeout",
        str(TIMEOUT_S),
        *extra,
        timeout=900,  # a hang guard: a loaded machine (two suites at once) is slow, not hung
    )
    events = (
        [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        if (out / "events.jsonl").exists()
        else []
    )
    return done.returncode, done.stderr, events


def _flight_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("slipstream run: flight recorder: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_stopped_rank_is_named_as_behind_with_its_last_collective(tmp_path):
    step, rank = DRAW.randint(2, 5), DRAW.randint(0, 3)
    code, stderr, events = _job(tmp_path, "--faults", f"stop@{step}:{rank}")
    assert code == 1, stderr
    line = _flight_line(stderr)
    waiters = ",".join(str(r) for r in range(4) if r != rank)
    # ZeRO-1 at world 4 issues 3 collectives per step on the world group (gradient reduce-scatter, the used-parameter
    # flags with the gradient norm, weight all-gather) after the initial broadcast: step s's reduce-scatter is #3s+2.
    assert (
        f"rank {rank} is behind: ranks {waiters} wait in reduce_scatter #{3 * step + 2} of world ([29568] float32 'gradient bucket 0', step {step})"
        in line
    ), (step, rank, line)
    assert f"(rank {rank}: stopped (SIGSTOP); last collective all_gather #{3 * step + 1} of world" in line, line
    # the wait is measured: on a loaded machine the first rank to give up reports a little more than the limit
    assert re.search(rf"timed out after \d+\.\ds \(the limit is comms_timeout_seconds = {TIMEOUT_S};", stderr), stderr[
        -3000:
    ]
    assert [e["step"] for e in events if e["event"] == "fault"] == [step]


def test_rank_taking_another_code_path_is_named_at_the_first_divergence(tmp_path):
    step, rank = DRAW.randint(2, 5), DRAW.randint(0, 3)
    code, stderr, _ = _job(tmp_path, "--faults", f"diverge@{step}:{rank}")
    assert code == 1, stderr
    others = ",".join(str(r) for r in range(4) if r != rank)
    assert (
        f"rank {rank} took a different code path: the first divergence is collective #{3 * step + 2} of world in step {step}: "
        f"rank {rank} issued broadcast ([16] float32); ranks {others} issued reduce_scatter ([29568] float32)"
    ) in _flight_line(stderr), (step, rank)


def test_rank_skipping_the_users_own_all_reduce_is_named_at_that_call(tmp_path):
    """The flight recorder sees the script's own ``dist.all_reduce`` (comm/watch.py): the report names the rank, the
    op, the group and the sequence number of the user's call, and the line of the script that made it."""
    step, rank = DRAW.randint(2, 5), DRAW.randint(0, 3)
    code, stderr, _ = _job(tmp_path, "--faults", f"skipuser@{step}:{rank}", "--user_allreduce", "1")
    assert code == 1, stderr
    others = ",".join(str(r) for r in range(4) if r != rank)
    # 4 collectives a step on world: ZeRO-1's 3, then the user's all_reduce (#4s+5) that rank `rank` skips at step `step`
    line = _flight_line(stderr)
    assert (
        f"rank {rank} took a different code path: the first divergence is collective #{4 * step + 5} of world" in line
    ), (step, rank, line)
    assert f"rank {rank} issued reduce_scatter ([29568] float32)" in line, line
    assert (
        f"ranks {others} issued all_reduce ([4] float32 'goodput_job.py:" in line
        or f"ranks {others} issued all_reduce ([4] float32)" in line
    ), line


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    code, stderr, events = _job(tmp, "--save_dir", str(tmp / "ck"), "--in_memory", "1")
    assert code == 0, stderr
    assert [e["steps"] for e in events if e["event"] == "done"] == [STEPS], stderr
    return torch.load(tmp / "out" / "final.pt", weights_only=True)


def test_killed_rank_resumes_from_shared_memory_with_no_lost_step_and_equal_weights(tmp_path, uninterrupted):
    step, rank = DRAW.randint(2, 5), DRAW.randint(0, 3)
    code, stderr, events = _job(
        tmp_path, "--save_dir", str(tmp_path / "ck"), "--in_memory", "1", "--faults", f"kill@{step}:{rank}", restarts=1
    )
    assert code == 0, stderr
    assert f"rank {rank} (local rank {rank}) was killed by signal SIGKILL" in stderr
    # Killed right after step `step`'s update: its peers are at the next step's first collective, or about to be.
    assert f"flight recorder: rank {rank} " in _flight_line(stderr) and "exited" in _flight_line(stderr), (step, rank)
    resumed = next(e for e in events if e["event"] == "attempt" and e["attempt"] == 1)
    assert "/snapshots/" in resumed["resumed_from"], (
        resumed
    )  # shared memory, not save_dir (no disk checkpoint was written)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    # The kill came after step `step` had updated the weights (global step step+1): its snapshot may still have
    # been in flight, so at most that one step is lost.
    assert step <= resumed["start_step"] <= step + 1, (step, resumed)
    final = torch.load(tmp_path / "out" / "final.pt", weights_only=True)
    assert final.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(final[name], value), name  # bit for bit: weights, moments, RNG and data order all resumed


def test_in_memory_snapshots_need_a_directory_outside_the_launcher(monkeypatch):
    import slipstream
    from slipstream.engine.config import ConfigError

    monkeypatch.delenv("SLIPSTREAM_SNAPSHOT_DIR", raising=False)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "checkpoint": {"save_dir": "/nonexistent", "auto_resume": True, "in_memory_interval": 1},
    }
    with pytest.raises(ConfigError, match="checkpoint.in_memory_interval: no shared-memory directory"):
        slipstream.initialize(torch.nn.Linear(2, 2), config)


def test_in_memory_snapshots_need_auto_resume():
    from slipstream.engine.config import ConfigError, SlipstreamConfig

    with pytest.raises((ConfigError, ValueError), match="in_memory_interval needs auto_resume"):
        SlipstreamConfig.load(
            {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"save_dir": "/x", "in_memory_interval": 1}}
        )
