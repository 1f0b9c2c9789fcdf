"""The CPU heap guard: no trim in the steady state, one trim when the heap has grown past it."""

from __future__ import annotations

from slipstream.accelerator.cpu import HeapGuard

MB = 2**20


def _guard(readings_mb: list[int]) -> tuple[HeapGuard, list[int]]:
    """A guard reading ``readings_mb`` (one per step it reads) and recording the reads after which it trimmed."""
    readings = iter(readings_mb)
    read: list[int] = []
    trims: list[int] = []

    def resident() -> int:
        read.append(next(readings))
        return read[-1] * MB

    return HeapGuard(resident, lambda: trims.append(len(read))), trims


def test_a_steady_process_is_never_trimmed() -> None:
    guard, trims = _guard([1100 + (i % 3) * 40 for i in range(60)])
    for _ in range(61):  # the first step settles and is not read
        guard.after_step()
    assert trims == [] and guard.trims == 0


def test_growth_past_a_quarter_trims_once_and_the_next_step_is_the_new_steady_state() -> None:
    # 1100 steady; +100, +200, +270 stay within a quarter (275 MB is the bound); +320 is past it.
    # After the trim the next step faults its pages back in (1100 again): that is the steady state.
    guard, trims = _guard([1100, 1200, 1300, 1370, 1420, 1100, 1150, 1190, 1250])
    for _ in range(10):
        guard.after_step()
    assert trims == [5], trims
    assert guard.steady == 1100 * MB


def test_the_floor_keeps_a_small_process_from_trimming_on_noise() -> None:
    # A 200 MB process: a quarter is 50 MB, but nothing under 256 MiB of growth trims.
    guard, trims = _guard([200, 300, 420, 460])
    for _ in range(5):
        guard.after_step()
    assert trims == [4], trims
