"""``wall_clock_breakdown`` timers: where a step's time goes (forward, backward, reduce, step, ...).

Timers are named, accumulate over an optimizer step and are read (then cleared) once per step.
On an accelerator each start/stop synchronizes the device first — that is what makes the numbers
true and why they are off unless ``wall_clock_breakdown`` is set. Any component may time itself
under a new name (offload I/O: ``timers("offload_io")``); the report lists whatever was timed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# The order the report prints the engine's own timers in; other names follow alphabetically.
ENGINE_TIMERS = ("forward", "backward", "reduce", "step")


_OFF = contextlib.nullcontext()  # reusable: what a disabled timer enters, four times a step


class Timers:
    def __init__(self, enabled: bool, synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self._synchronize = synchronize or (lambda: None)
        self._totals: dict[str, float] = {}

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time the block under ``name``; disabled, a shared no-op (a generator-based context costs ~2.5 µs a use)."""
        return self._timed(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """Seconds per timer since the last call, engine timers first; clears them."""
        totals, self._totals = self._totals, {}
        ordered = [n for n in ENGINE_TIMERS if n in totals] + sorted(n for n in totals if n not in ENGINE_TIMERS)
        return {n: totals[n] for n in ordered}
