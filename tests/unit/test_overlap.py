"""The two halves of an overlapped pair take turns at each collective they wait on ([Note: taking turns])."""

from __future__ import annotations

import threading

import pytest

from slipstream.comm import overlap


class _Work:
    """A collective already issued: waiting on it records the wait."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _half(log: list[str], name: str, collectives: int) -> None:
    for i in range(collectives):
        log.append(f"{name} computes {i}")
        overlap.wait(_Work(log, f"{name}{i}"))
    log.append(f"{name} ends")


def test_halves_alternate_at_each_collective_and_count_the_overlaps() -> None:
    log: list[str] = []
    pair = overlap.Pair()
    pair.run(lambda: _half(log, "F", 3), lambda: _half(log, "B", 1))
    assert log == [
        "F computes 0",  # F issues F0, hands the turn over
        "B computes 0",  # B computes while F0 is in flight, issues B0, hands back
        "wait F0",
        "F computes 1",  # F takes F0 and issues F1; B is still running: hand over
        "wait B0",
        "B ends",  # B takes B0 and finishes; the turn goes back
        "wait F1",
        "F computes 2",
        "wait F2",
        "F ends",  # no partner left: F2 is a plain wait
    ]
    assert pair.overlapped == 3  # 2·nB + 1 with nF 3 > nB 1
    assert all(t >= 0 for t in pair.held)


def test_an_error_in_one_half_is_raised_after_the_other_finishes() -> None:
    log: list[str] = []

    def failing() -> None:
        log.append("B computes")
        overlap.wait(_Work(log, "B0"))
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        overlap.Pair().run(lambda: _half(log, "F", 2), failing)
    assert log[-1] == "F ends"


def test_outside_a_pair_wait_is_a_plain_wait() -> None:
    log: list[str] = []
    overlap.wait(_Work(log, "x"))
    assert log == ["wait x"]
    seen: list[bool] = []
    pair = overlap.Pair()
    pair.run(lambda: seen.append(threading.current_thread() is threading.main_thread()), lambda: None)
    assert seen == [True]  # the first half runs on the caller's thread (its autocast and grad mode)
    overlap.wait(_Work(log, "y"))  # after a pair, this thread is outside one again
    assert log[-1] == "wait y"


def test_each_half_keeps_its_own_generator_state() -> None:
    """A backward replaying a checkpointed forward's generator state must not see the other half's draws."""
    import torch

    torch.manual_seed(3)
    alone = [torch.rand(1).item() for _ in range(2)]
    after = torch.rand(1).item()
    torch.manual_seed(7)
    replay = torch.rand(1).item()

    torch.manual_seed(3)
    draws: dict[str, list[float]] = {"F": [], "B": []}

    def forward() -> None:
        draws["F"].append(torch.rand(1).item())
        overlap.wait(_Work([], "F0"))
        draws["F"].append(torch.rand(1).item())
        overlap.wait(_Work([], "F1"))

    def backward() -> None:
        saved = torch.get_rng_state()
        torch.manual_seed(7)  # as checkpoint's recompute sets the forward's saved state ...
        overlap.wait(_Work([], "B0"))  # ... and hands over in the middle of the recompute
        draws["B"].append(torch.rand(1).item())
        torch.set_rng_state(saved)  # ... and restores what it found

    overlap.Pair().run(forward, backward)
    assert draws == {"F": alone, "B": [replay]}
    assert torch.rand(1).item() == after  # the forward's stream goes on
