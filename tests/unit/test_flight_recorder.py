"""The flight recorder's rings and their analysis (slipstream/utils/flight_record.py, flight_analysis.py), without a process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from slipstream.utils import flight_analysis, flight_record


def _rings(tmp_path, world: int = 4):
    return {
        rank: flight_record.FlightRecorder(rank, world, flight_record.ring_path(tmp_path, 0, rank))
        for rank in range(world)
    }


def _steps(recorder: flight_record.FlightRecorder, steps: int, group: str = "world") -> None:
    for step in range(steps):
        recorder.finish(recorder.issue("reduce_scatter", group, 4096, "[1024] float32", "grads", step))
        recorder.finish(recorder.issue("all_gather", group, 4096, "[1024] float32", "weights", step))


def test_group_labels_are_compact_and_rank_order_independent():
    assert flight_record.group_label(None) == "world"
    assert flight_record.group_label([3, 0, 1, 2, 8, 10, 11]) == "ranks 0-3,8,10-11"
    assert flight_analysis._members("ranks 0-3,8,10-11", 16) == [0, 1, 2, 3, 8, 10, 11]


def test_a_rank_that_never_issued_the_awaited_collective_is_behind(tmp_path):
    rings = _rings(tmp_path)
    for rank, recorder in rings.items():
        _steps(recorder, 3)
        if rank != 2:
            recorder.issue("reduce_scatter", "world", 4096, "[1024] float32", "grads", 3)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 4)
    assert report.culprits == [2]
    assert report.summary.startswith(
        "rank 2 is behind: ranks 0,1,3 wait in reduce_scatter #7 of world ([1024] float32 'grads', step 3)"
    )
    assert "rank 2: running; last collective all_gather #6 of world" in report.summary


def test_a_gone_rank_is_blamed_not_a_slow_one_behind_with_it(tmp_path):
    """[Note: gone before slow]: on a loaded machine rank 3 had not reached the collective yet when rank 2 was
    killed; the report named both as behind (seen in CI under two suites at once)."""
    rings = _rings(tmp_path)
    for rank, recorder in rings.items():
        _steps(recorder, 3)
        if rank in (0, 1):
            recorder.issue("reduce_scatter", "world", 4096, "[1024] float32", "grads", 3)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 4, exited={2: "killed by signal SIGKILL"})
    assert report.culprits == [2]
    assert report.summary.startswith("rank 2 is behind: ranks 0,1 wait in reduce_scatter #7 of world"), report.summary
    assert "rank 2: killed by signal SIGKILL" in report.summary
    assert any(line.startswith("rank 3: running; last collective all_gather #6") for line in report.details), (
        report.details
    )
    # with no rank gone, both slow ones are behind, as before
    assert flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 4).culprits == [2, 3]


def test_the_first_divergence_names_the_minority_and_both_collectives(tmp_path):
    rings = _rings(tmp_path)
    for rank, recorder in rings.items():
        _steps(recorder, 2)
        if rank == 3:
            recorder.issue("broadcast", "world", 64, "[16] int64", "extra", 2)
        recorder.issue("reduce_scatter", "world", 4096, "[1024] float32", "grads", 2)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 4)
    assert report.culprits == [3]
    assert report.summary == (
        "rank 3 took a different code path: the first divergence is collective #5 of world in step 2: "
        "rank 3 issued broadcast ([16] int64); ranks 0,1,2 issued reduce_scatter ([1024] float32)"
    )


def test_a_different_shape_at_the_same_sequence_number_is_a_divergence(tmp_path):
    rings = _rings(tmp_path, 2)
    rings[0].issue("all_reduce", "world", 16, "[4] float32", "", 0)
    rings[1].issue("all_reduce", "world", 32, "[8] float32", "", 0)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 2)
    assert "first divergence is collective #1 of world in step 0" in report.summary
    assert report.culprits == [0, 1]  # two against one are not told apart: both are named


def test_point_to_point_order_is_not_compared(tmp_path):
    rings = _rings(tmp_path, 2)
    rings[0].finish(rings[0].issue("p2p", "p2p 0->1", 64, "[16] float32", "act", 0))
    rings[0].finish(rings[0].issue("p2p_recv", "p2p 1->0", 64, "[16] float32", "grad", 0))
    rings[1].finish(rings[1].issue("p2p", "p2p 1->0", 64, "[16] float32", "grad", 0))
    rings[1].finish(rings[1].issue("p2p_recv", "p2p 0->1", 64, "[16] float32", "act", 0))
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 2)
    assert report.culprits == [] and report.summary == "no rank waits in a collective slipstream issued"


def test_subgroups_are_compared_among_their_members(tmp_path):
    rings = _rings(tmp_path)
    for rank, recorder in rings.items():
        group = "ranks 0-1" if rank < 2 else "ranks 2-3"
        _steps(recorder, 2, group)
    rings[1].issue("all_reduce", "ranks 0-1", 4, "[1] float32", "norm", 2)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 4)
    assert report.culprits == [0]
    assert report.summary.startswith("rank 0 is behind: rank 1 waits in all_reduce #5 of ranks 0-1")


def test_a_collective_never_waited_on_is_not_where_a_rank_waits(tmp_path):
    rings = _rings(tmp_path, 2)
    for recorder in rings.values():
        recorder.issue("broadcast", "world", 4, "[1] float32", "dropped handle", 0)  # never waited on
        _steps(recorder, 2)
    rings[0].issue("all_reduce", "world", 4, "[1] float32", "norm", 2)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 2)
    assert report.culprits == [1] and "rank 0 waits in all_reduce #6 of world" in report.summary


def test_the_ring_keeps_the_newest_records_and_sequence_numbers(tmp_path):
    recorder = flight_record.FlightRecorder(0, 1, flight_record.ring_path(tmp_path, 0, 0), capacity=8)
    _steps(recorder, 10)
    records = flight_record.read_rings(tmp_path, 0)[0].records
    assert [r.seq for r in records] == list(range(13, 21))
    assert all(r.state == "completed" for r in records)
    recorder.finish(1)  # long overwritten: ignored, not written over a newer record
    assert flight_record.read_rings(tmp_path, 0)[0].records == records


def test_a_killed_process_ring_is_still_readable_and_it_is_named_exited(tmp_path):
    program = textwrap.dedent(
        f"""
        import os, signal
        from slipstream.utils import flight_record as flight
        r = flight.FlightRecorder(1, 2, flight.ring_path({str(tmp_path)!r}, 0, 1))
        r.finish(r.issue("all_reduce", "world", 4, "[1] float32", "x", 0))
        r.issue("all_gather", "world", 8, "[2] float32", "y", 1)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    other = flight_record.FlightRecorder(0, 2, flight_record.ring_path(tmp_path, 0, 0))
    other.finish(other.issue("all_reduce", "world", 4, "[1] float32", "x", 0))
    other.finish(other.issue("all_gather", "world", 8, "[2] float32", "y", 1))
    other.issue("all_reduce", "world", 4, "[1] float32", "z", 2)
    report = flight_analysis.analyze(flight_record.read_rings(tmp_path, 0), 2)
    assert report.culprits == [1]
    assert "rank 1: exited; last collective all_gather #2 of world ([2] float32 'y', step 1), issued" in report.summary


def test_process_state_reads_the_kernel(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):
            if flight_record.process_state(child.pid).startswith("stopped"):
                break
            subprocess.run(["sleep", "0.05"], check=False)
        assert flight_record.process_state(child.pid) == "stopped (SIGSTOP)"
    finally:
        child.kill()
        child.wait()
    assert flight_record.process_state(child.pid) == "exited"


@pytest.mark.parametrize(
    "exitcode, text",
    [(-9, "killed by signal SIGKILL"), (1, "exited with code 1"), (-200, "killed by signal number 200")],
)
def test_exit_descriptions(exitcode, text):
    from slipstream.launcher.flight_report import exit_description

    assert exit_description(exitcode) == text
