"""Which ZeRO-3 unit to gather when: the rank-consistent gather cursor and prefetch.

[Note: the gather cursor] Collectives must be issued in the same order on every rank, but ranks
may run different units (data-dependent control flow). Each pass therefore walks a fixed order
(registration order forward, the reverse backward) with a cursor: needing unit k gathers every
unit from the cursor up to k, whether this rank runs them or not; units passed over are freed
(and, in backward, reduce-scatter zeros). At the end of each pass the cursor runs to the end, so
every rank gathers every unit once per pass and reduce-scatters every unit once per backward.
All-gathers and reduce-scatters travel on separate process groups (``GroupLanes``), so each kind
only has to match its own order. A unit needed again after the cursor passed it (a module called
twice) is gathered once more; ranks must agree on such repeats. Unlike a prefetch recorded from
a runtime trace, the order is static and cannot go stale when control flow changes.

[Note: how far to gather ahead] A unit gathered ahead is memory held before it is needed, and
it is held at the worst moment: the start of backward, when every activation is alive. With
DeepSpeed's default bound (5e7 elements), a model of up to 50M parameters was gathered whole at
the start of each pass: measured on gpt2-large (29.5M, 2 ranks) that was 100 MB of the 340 MB a
step added to a rank's heap, the same model's worth that ZeRO-3 exists to shard. Gathering one
unit ahead already hides the gather behind the running unit's compute (FSDP2 prefetches one
too), so that is the default (``prefetch_numel`` None). A bound the user sets is read as
DeepSpeed reads it: gather another unit while fewer than that many elements are on their way,
so any bound above zero gathers at least the next unit (a bound below one unit, as the HF
integration's ``0.9 * hidden**2`` is, no longer turns prefetch off); ``0`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.engine.zero.stage3.unit import ParamUnit, UnitState


class Pass:
    """One forward or backward walk over the block units."""

    def __init__(self, order: list[ParamUnit]) -> None:
        self.order = order
        self.position = {u.index: i for i, u in enumerate(order)}
        self.cursor = 0


class GatherSchedule:
    def __init__(
        self, blocks: list[ParamUnit], units: list[ParamUnit], prefetch_numel: int | None, max_live_numel: int,
        skipped_in_backward: Callable[[ParamUnit], None],
    ) -> None:  # fmt: skip
        """``skipped_in_backward(unit)``: the backward cursor passed a unit this rank did not run."""
        self.blocks, self.units = blocks, units
        self.prefetch_numel, self.max_live_numel = prefetch_numel, max_live_numel
        self.skipped_in_backward = skipped_in_backward
        self.forward: Pass | None = None
        self.backward: Pass | None = None

    def begin_forward(self) -> None:
        self.forward = Pass(self.blocks)
        self._prefetch(self.forward)

    def end_forward(self, backward_follows: bool) -> None:
        current, self.forward = self.forward, None
        if current is not None:
            keep = self.first_in_backward() if backward_follows else None
            self._participate_in_rest(current, keep)
            for unit in current.order:
                if unit.depth == 0 and unit is not keep:
                    unit.reshard()

    def first_in_backward(self) -> ParamUnit | None:
        """The unit backward needs first: kept gathered from the forward into the backward.

        [Note: the last unit stays] The forward's last block is the backward's first, needed right
        after the loss. Freeing it at the end of the forward only to gather it again a moment later
        costs a gather and a wait with nothing to overlap (FSDP2 and torchtitan keep it the same
        way). The rule is static, one unit decided by the order alone, so every rank skips the same
        gather: a rank that did not run the block gathered it at the end of the forward like the
        others (``_participate_in_rest``) and keeps it too.
        """
        return self.blocks[-1] if self.blocks else None

    def begin_backward(self) -> None:
        if self.backward is None:
            self.backward = Pass(list(reversed(self.blocks)))

    def end_backward(self) -> list[ParamUnit]:
        """Finish the backward walk; returns its order (every block, each gathered once on every rank)."""
        current = self.backward or Pass(list(reversed(self.blocks)))
        self._participate_in_rest(current)
        self.backward = None
        return current.order

    def prefetch(self, backward: bool) -> None:
        """Gather ahead in the current pass (e.g. once the root unit is live for backward)."""
        current = self.backward if backward else self.forward
        if current is not None:
            self._prefetch(current)

    def ensure(self, unit: ParamUnit, backward: bool) -> None:
        """Make ``unit`` live, keeping every rank's sequence of all-gathers identical."""
        current = self.backward if backward else self.forward
        if current is not None and current.position[unit.index] >= current.cursor:
            self._advance(current, current.position[unit.index] + 1)
        else:
            unit.unshard()  # repeated use (or no pass): every rank must repeat it alike
        unit.wait()
        if current is not None:
            self._prefetch(current)
            self._drop_skipped(current, current.position[unit.index], backward)

    def _advance(self, current: Pass, until: int) -> None:
        while current.cursor < until:
            current.order[current.cursor].unshard()
            current.cursor += 1

    def _participate_in_rest(self, current: Pass, keep: ParamUnit | None = None) -> None:
        """Gather the units this rank did not reach (other ranks may run them), one at a time; ``keep`` stays gathered."""
        while current.cursor < len(current.order):
            unit = current.order[current.cursor]
            current.cursor += 1
            unit.unshard()
            if unit is keep:
                unit.wait()  # the backward needs it first on the ranks that ran it: every rank keeps it alike
            else:
                unit.reshard()

    def _prefetch(self, current: Pass) -> None:
        live = sum(u.numel for u in self.units if u.state is not UnitState.FREE)
        ahead = sum(u.numel for u in current.order[: current.cursor] if u.state is UnitState.GATHERING)
        bound = 1 if self.prefetch_numel is None else self.prefetch_numel
        while current.cursor < len(current.order):
            nxt = current.order[current.cursor]
            if ahead >= bound or live + nxt.numel > self.max_live_numel:
                return
            nxt.unshard()
            ahead += nxt.numel
            live += nxt.numel
            current.cursor += 1

    def _drop_skipped(self, current: Pass, before: int, backward: bool) -> None:
        """Free units the cursor passed that this rank did not run (reduce zeros for them in backward)."""
        for unit in current.order[:before]:
            if unit.idle(backward):
                unit.reshard()
                if backward:
                    self.skipped_in_backward(unit)
