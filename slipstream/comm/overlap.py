"""Two computations of one rank taking turns, each computing while the other's collective is in flight.

[Note: taking turns] DualPipe's "F&B" pairs the forward of one micro-batch with the backward of
another so that one's expert all-to-all hides behind the other's compute. An unchanged model's
forward cannot be cut at its all-to-alls by hand (DeepSeek's code is written in chunks for this),
so each half of a pair runs on its own thread, and a turn passes between them:

* only the half holding the turn runs; a half gives the turn away right after it has *issued* a
  collective that it waits on through :func:`wait`, and takes it back before waiting on it;
* the half whose turn it is next was blocked, so the two never compute at once (no contention for
  cores or Python state): only a collective of one overlaps the other's compute, as DualPipe means;
* the order in which a pair issues its collectives is fixed by the program, not by timing: every
  rank of an expert group runs the same pairs, so it issues the same collectives in the same order
  (backends match collectives by their order in a group);
* once a half has finished, the other keeps the turn to its own end;
* the default generators (CPU and device) are process-wide, so each half keeps its own state across
  hand-overs: a backward recomputing a checkpointed block replays the forward's generator state
  (``torch.utils.checkpoint``) and must not see the other half's dropout draws in between, nor the
  forward see the replay's. After the pair the generator is where the forward left it (a
  backward's replays restore the state they found, so run one after the other it draws nothing).

A hand-over to a half still running is one overlapped collective; :class:`Pair` counts them (on
CPU, with gloo's worker threads moving the data, this is real overlap; on CUDA the collective runs
on the comm context's stream meanwhile). Outside a pair :func:`wait` is a plain wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from slipstream.accelerator import get_accelerator
from slipstream.comm.process import PROCESS


class _Waitable(Protocol):
    def wait(self) -> object: ...


def wait(work: _Waitable) -> None:
    """Wait for ``work``, a collective this thread has just issued; inside a :class:`Pair`, the other half runs meanwhile."""
    pair: Pair | None = getattr(PROCESS.overlap_local, "pair", None)
    if pair is not None:
        pair.hand_over(PROCESS.overlap_local.side)
    work.wait()


class Pair:
    """Run two callables as the halves of one pair (see [Note: taking turns]); the first holds the turn first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self._since = 0.0
        self.overlapped = 0  # hand-overs while the other half was still running
        self.held = [0.0, 0.0]  # seconds each half held the turn: its own compute and waits
        self._rng: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None, None]  # each half's generator states

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        """``first`` on this thread, ``second`` on a helper thread; returns when both are done, raising the first error."""
        errors: list[BaseException | None] = [None, None]
        grad_enabled = torch.is_grad_enabled()
        accelerator = get_accelerator()
        device = accelerator.device().index  # the current device is per thread: the helper takes the caller's

        def second_half() -> None:
            if device is not None:
                accelerator.set_device(device)
            with torch.set_grad_enabled(grad_enabled):
                self._half(1, second, errors)

        helper = threading.Thread(target=second_half, name="slipstream-pair", daemon=True)
        self._since = time.perf_counter()
        helper.start()
        self._half(0, first, errors)
        helper.join()
        self._set_rng(self._rng[0])  # where the forward left it
        for error in errors:
            if error is not None:
                raise error

    def hand_over(self, side: int) -> None:
        """Give the turn to the other half while it still runs, and block until it comes back."""
        with self._cond:
            if self._done[1 - side]:
                return
            self.overlapped += 1
            self._switch(1 - side)
            self._cond.wait_for(lambda: self._turn == side)

    def _half(self, side: int, fn: Callable[[], None], errors: list[BaseException | None]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side)
        PROCESS.overlap_local.pair, PROCESS.overlap_local.side = self, side
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - re-raised by run() on the caller's thread
            errors[side] = error
        finally:
            PROCESS.overlap_local.pair = None
            with self._cond:
                self._done[side] = True
                self._switch(1 - side)

    def _switch(self, to: int) -> None:
        """Pass the turn (the condition's lock is held): charge the time since the last pass to its holder,
        keep its generator states and give the next holder its own."""
        now = time.perf_counter()
        self.held[self._turn] += now - self._since
        accelerator = get_accelerator()
        self._rng[self._turn] = (torch.get_rng_state(), accelerator.rng_state())
        self._set_rng(self._rng[to])
        self._since, self._turn = now, to
        self._cond.notify_all()

    @staticmethod
    def _set_rng(state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
        if state is None:  # a half's first turn: it starts from the state it finds
            return
        torch.set_rng_state(state[0])
        if state[1] is not None:
            get_accelerator().set_rng_state(state[1])
