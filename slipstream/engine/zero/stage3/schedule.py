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

[Note: kept from the forward into the backward] A unit freed after its forward is gathered again
for its backward: a third pass of the model's parameters over the wire, which DDP does not pay
(measured: 1.09x DDP's step at 4 ranks on 2 cores against 1.03x at 2). ``stage3_max_reuse_distance``
trades memory for that pass, as DeepSpeed reads it: a unit whose next use is fewer than that many
parameter elements away stays gathered. The next use of block ``i`` is its backward, after the
blocks above it run forward and then backward: ``2 * numel(blocks after i)`` elements away. The
distance is decided from the static order alone, so every rank keeps the same units, and a rank
that skipped a kept unit keeps it too (otherwise it would gather it for the backward alone, out of
step with the ranks that kept it). Unset, only the last block is kept (distance 0; see [Note: the
last unit stays]): DeepSpeed's default of 1e9 elements would keep up to ~5e8 elements of blocks
gathered at the start of backward (a model below that whole): ZeRO-3's parameter sharding given up
at the peak, when every activation is alive.
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.engine.zero.stage3.unit import ParamUnit, UnitState


class Pass:
    """One forward or backward walk over the block units; ``kept``: the units a forward leaves gathered for the backward."""

    def __init__(self, order: list[ParamUnit], kept: frozenset[int] = frozenset()) -> None:
        self.order, self.kept = order, kept
        self.position = {u.index: i for i, u in enumerate(order)}
        self.cursor = 0


class GatherSchedule:
    def __init__(
        self,
        blocks: list[ParamUnit],
        units: list[ParamUnit],
        prefetch_numel: int | None,
        max_live_numel: int,
        skipped_in_backward: Callable[[ParamUnit], None],
        max_reuse_numel: int | None = None,
    ) -> None:
        """``skipped_in_backward(unit)``: the backward cursor passed a unit this rank did not run;
        ``max_reuse_numel``: see [Note: kept from the forward into the backward]."""
        self.blocks, self.units = blocks, units
        self.prefetch_numel, self.max_live_numel = prefetch_numel, max_live_numel
        self.skipped_in_backward = skipped_in_backward
        self.kept = frozenset(u.index for u in kept_into_backward(blocks, max_reuse_numel))
        self.forward: Pass | None = None
        self.backward: Pass | None = None

    def begin_forward(self, backward_follows: bool) -> None:
        self.forward = Pass(self.blocks, self.kept if backward_follows else frozenset())
        self._prefetch(self.forward)

    def end_forward(self) -> None:
        current, self.forward = self.forward, None
        if current is not None:
            self._participate_in_rest(current)
            for unit in current.order:
                if unit.depth == 0 and unit.index not in current.kept:
                    unit.reshard()

    def forward_gathered_all(self) -> bool:
        """Whether the running forward has started every gather it will make: nothing more is gathered before
        the backward (a block run twice aside), so a buffer idle now waits for the backward."""
        return self.forward is not None and self.forward.cursor >= len(self.forward.order)

    def keeps(self, unit: ParamUnit) -> bool:
        """Whether the running forward leaves ``unit`` gathered for its backward."""
        return self.forward is not None and unit.index in self.forward.kept

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

    def _participate_in_rest(self, current: Pass) -> None:
        """Gather the units this rank did not reach (other ranks may run them), one at a time; kept ones stay gathered."""
        while current.cursor < len(current.order):
            unit = current.order[current.cursor]
            current.cursor += 1
            unit.unshard()
            if unit.index in current.kept:
                unit.wait()  # the backward needs it on the ranks that ran it: every rank keeps it alike
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
            if unit.idle(backward) and unit.index not in current.kept:
                unit.reshard()
                if backward:
                    self.skipped_in_backward(unit)


def kept_into_backward(blocks: list[ParamUnit], max_reuse_numel: int | None) -> list[ParamUnit]:
    """The blocks (forward order) a forward leaves gathered for the backward: the last one always, and
    each one whose backward comes fewer than ``max_reuse_numel`` elements after its forward.

    [Note: the last unit stays] The forward's last block is the backward's first, needed right
    after the loss. Freeing it at the end of the forward only to gather it again a moment later
    costs a gather and a wait with nothing to overlap (FSDP2 and torchtitan keep it the same way).
    The rule is static, decided by the order alone, so every rank skips the same gathers: a rank
    that did not run a kept block gathered it at the end of the forward like the others
    (``_participate_in_rest``) and keeps it too.
    """
    kept, above = [], 0  # elements of the blocks after the current one
    for unit in reversed(blocks):
        if not kept or (max_reuse_numel is not None and 2 * above < max_reuse_numel):
            kept.append(unit)
        above += unit.numel
    return kept[::-1]
