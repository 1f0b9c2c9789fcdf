"""Make a model this rank's pipeline stages, and run a training step through them.

``parallelize_pipeline`` cuts the model (``cut.py``), builds and checks the schedule
(``schedules.py``, ``simulate.py``) and returns a :class:`Pipeline`, which the engine calls once
per accumulation window. The ZeRO strategy is reached only through the ``window`` it hands in
(a context in which gradients accumulate locally over every micro-batch and are reduced once on
exit), so ``parallel`` never imports ``zero``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm.agree import agree
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.pipeline import cut, profile
from slipstream.engine.parallel.pipeline.carry import RouterCarry
from slipstream.engine.parallel.pipeline.executor import Executor, StepTiming, predicted_bubble
from slipstream.engine.parallel.pipeline.options import PipelineOptions
from slipstream.engine.parallel.pipeline.schedules import Schedule, build
from slipstream.engine.parallel.pipeline.simulate import simulate
from slipstream.engine.parallel.twin import pipeline_step as twin
from slipstream.engine.parallel.twin.harness import synthetic_batches
from slipstream.utils.logging import get_logger, log_rank0
from slipstream.utils.placement import place, placement_of

logger = get_logger(__name__)


@dataclasses.dataclass
class StepReport:
    losses: list[float]  # every micro-batch's loss, on every rank
    timing: StepTiming | None
    predicted_bubble: float | None
    router_losses: list[float] | None = None  # every micro-batch's balancing loss, where the stages carry router logits


class Pipeline:
    def __init__(
        self,
        model: torch.nn.Module,
        mesh: Mesh,
        schedule: Schedule,
        gate: cut.StageGate,
        ranges: list[range],
        ties: Ties,
        handles: list[torch.utils.hooks.RemovableHandle],
        synchronized_timing: bool = False,
    ) -> None:
        self.handles = handles
        self.model, self.mesh, self.schedule, self.gate, self.ranges = model, mesh, schedule, gate, ranges
        self.ties = ties
        self.tied: list[torch.nn.Parameter] = []
        self.tie_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._stash: dict[int, torch.Tensor] = {}
        self._collecting = False
        self.rank = mesh.rank_of("pp")
        self.group = mesh.group("pp")
        self.peers = mesh.ranks("pp")
        self.last_rank = schedule.layout.rank_of(schedule.layout.num_stages - 1)
        self.executor = Executor(
            model,
            gate,
            schedule,
            self.rank,
            self.peers,
            self.group,
            lambda: [p for p in model.parameters() if p.requires_grad],
            synchronized_timing,
        )
        self.last_report: StepReport | None = None

    @property
    def micro_batches(self) -> int:
        return self.schedule.micro_batches

    def check_batch(self, batch: Any) -> None:
        """At ``engine(batch)``, before the schedule: what the stages cannot hand on is refused on every rank alike."""
        if self.gate.carry is not None:
            self.gate.carry.check_batch(batch)

    def train_step(
        self,
        batches: list[Any],
        scale: float,
        window: Callable[[], contextlib.AbstractContextManager[None]],
        finish: Callable[[Any, int], Any] | None = None,
    ) -> StepReport:
        """One accumulation window: the schedule over ``batches`` inside the strategy's ``window``.

        Tied embeddings have their gradients summed between the first and last stage before the
        window closes (so the ZeRO reduction sees the sum). ``finish(output, micro)``: the last
        stage's model output as the loss is read from it (the sequence sharder's combine).
        """
        if len(batches) != self.micro_batches:
            raise ValueError(
                f"pipeline: {len(batches)} micro-batches for a schedule of {self.micro_batches} (gradient_accumulation_steps)"
            )
        with self._finishing(finish), window():
            self._stash, self._collecting = {}, True
            self.executor.router_losses = {}
            try:
                losses, timing = self.executor.train(batches, scale)
            finally:
                self._collecting = False
            for param in self.tied:
                self._sum_tied(param)
        shared, routers = self._share_losses(losses, len(batches))
        report = StepReport(shared, timing, predicted_bubble(self.schedule, timing.costs, self.rank), routers)
        self.last_report = report
        return report

    def evaluate(self, batches: list[Any], finish: Callable[[Any, int], Any] | None = None) -> list[float]:
        with self._finishing(finish):
            return self._share_losses(self.executor.evaluate(batches), len(batches))[0]

    @contextlib.contextmanager
    def _finishing(self, finish: Callable[[Any, int], Any] | None) -> Iterator[None]:
        """The executor reads the last stage's loss through ``finish`` for one call (see ``train_step``)."""
        self.executor.finish = finish
        try:
            yield
        finally:
            self.executor.finish = None

    def _share_losses(self, losses: list[torch.Tensor], count: int) -> tuple[list[float], list[float] | None]:
        """The last stage's per-micro-batch losses, on every pipeline rank (one small broadcast); with router logits
        carried, each micro-batch's balancing loss too (NaN where the model reported none), in the same message."""
        carried = self.gate.carry is not None and self.gate.carry.sends
        values = torch.zeros((2 if carried else 1) * count, dtype=torch.float64)
        if self.rank == self.last_rank:
            values[:count].copy_(torch.stack([loss.double() for loss in losses]))
            if carried:
                routers = self.executor.router_losses
                values[count:].copy_(
                    torch.tensor([float(routers[i]) if i in routers else float("nan") for i in range(count)])
                )
        comm.broadcast(values, src=self.peers[self.last_rank], group=self.group, tag="pipeline losses").wait()
        shared = values.tolist()
        return shared[:count], shared[count:] if carried else None

    # [Note: tied gradients bypass the strategy's hooks] A strategy may move a gradient out of
    # ``.grad`` as autograd accumulates it (bf16 models at ZeRO 0-2 add it into fp32 buffers), so a
    # sum over the two ends taken from ``.grad`` after the schedule would see nothing. The tied
    # weight's gradients are caught before accumulation instead (a tensor hook stashes them in fp32
    # and hands autograd zeros), summed with whatever reached ``.grad`` by hand (zero-bubble weight
    # passes), all-reduced between the ends, and given to ``.grad`` (in place where it is a buffer
    # view) before the window closes, so the strategy adopts the whole sum once.
    def _stash_tied(self, param: torch.nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._collecting:
                return None
            held = self._stash.get(id(param))
            self._stash[id(param)] = grad.float() if held is None else held.add_(grad.float())
            return torch.zeros_like(grad)

        return hook

    def _sum_tied(self, param: torch.nn.Parameter) -> None:
        total = self._stash.pop(id(param), None)
        if total is None:
            total = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        if param.grad is not None:
            total = total + param.grad.float()
        comm.all_reduce(total, group=self.ties.group, tag="pipeline tied embedding gradient").wait()
        if param.grad is not None:
            param.grad.copy_(total)
        else:
            param.grad = total.to(param.dtype)

    def settle(self) -> None:
        """After the other parallelisms replaced modules: find the tied weights again, keep the stand-ins silent.

        Tensor parallel swaps the embedding and head for sharded ones; the names stay, so the tied
        weight is looked up by name, marked as the last stage's duplicate again (keeping its box)
        and a silenced embedding is silenced again.
        """
        named = dict(self.model.named_parameters())
        self.tied = [named[n] for n in self.ties.names if n in named]
        for handle in self.tie_hooks:
            handle.remove()
        self.tie_hooks = [param.register_hook(self._stash_tied(param)) for param in self.tied]
        for param in self.tied if self.ties.duplicate else ():
            placed = placement_of(param)
            place(
                param,
                placed.global_shape if placed else tuple(param.shape),
                placed.offsets if placed else None,
                duplicate=True,
            )
        for name in self.ties.silenced:
            cut.silence(self.model.get_submodule(name))

    def close(self) -> None:
        for handle in [*self.handles, *self.tie_hooks]:
            handle.remove()
        self.handles, self.tie_hooks = [], []


def parallelize_pipeline(model: torch.nn.Module, mesh: Mesh, options: PipelineOptions | None) -> Pipeline | None:
    """This rank's stages of ``model`` and their schedule; None without a pipeline. Collective over the world.

    With ``twin_check`` the cut's first step is checked against the whole model's (twin/pipeline_step.py). The
    weights are already every rank's same (``parallel/weights.py``): each stage cuts its blocks out of them.
    """
    if options is None:
        return None
    p, micro_batches = options.stages, options.micro_batches
    blocks = find_blocks(model)
    if blocks is None:
        single = next(
            (
                n
                for n, m in model.named_modules()
                if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
                and sum(1 for c in m.children() if any(True for _ in c.parameters())) == 1
            ),
            None,
        )
        if single is not None:
            raise ConfigError(
                f"pipeline.stages: {p} stages need at least {p} blocks; {type(model).__name__} has 1 ({single})"
            )
        raise ConfigError(
            f"pipeline.stages: {type(model).__name__} has no run of repeated blocks (a ModuleList or Sequential of "
            "identical layers) to cut into stages"
        )
    schedule = build(options.schedule, p, micro_batches, options.virtual_stages)
    simulate(schedule)  # refuses a schedule that would deadlock, before any rank waits on it
    layout = schedule.layout
    twin_batches, expected, order, probe = None, None, None, None
    if options.twin_check:
        twin_batches = synthetic_batches(model, micro_batches, target=16)
        if twin_batches is None:
            log_rank0(
                logger,
                "pipeline: %s takes no token batch the twin check could make; its cut is not checked numerically",
                type(model).__name__,
            )
        else:
            probe = twin.probe_blocks(model, blocks, twin_batches[0])
            if probe.problem is not None:
                raise ConfigError(
                    f"pipeline.stages: {type(model).__name__}: {probe.problem}; train it without a pipeline"
                )
            order = probe.order
            expected = twin.reference(model, twin_batches)
    prologue, epilogue = cut.outer_modules(model, blocks, order)
    keeping = probe.shape_keeping if probe is not None else frozenset()
    cut.check_prologue(model, prologue, keeping)
    numel = lambda names: sum(p.numel() for n in names for p in model.get_submodule(n).parameters(recurse=False))  # noqa: E731
    method = options.partition
    measured = (
        profile.block_times(model, blocks, prologue, epilogue, options.micro_batch_size, mesh.group("pp"))
        if method == "profile"
        else None
    )
    skipped = probe.skipped if probe is not None else frozenset()
    ranges = cut.partition(
        blocks, layout.num_stages, method, numel(prologue), numel(epilogue), measured, layout.rank_of, skipped
    )
    if measured is not None:
        log_rank0(logger, "pipeline: profiled stages: %s forward each", profile.describe(measured, ranges))
    rank = mesh.rank_of("pp")
    local = layout.stages_of(rank)
    owned = {i for s in local for i in ranges[s]}
    first, last = 0 in local, layout.num_stages - 1 in local
    ids = lambda names: {id(p) for n in names for p in model.get_submodule(n).parameters()}  # noqa: E731
    shared = ids(prologue) & ids(epilogue)  # a head tied to the embedding

    def surgery() -> tuple[cut.StageGate, list[torch.utils.hooks.RemovableHandle], list[str]]:
        try:
            for i, name in enumerate(blocks.names):
                if i not in owned:
                    cut.set_submodule(model, name, cut.Passthrough(model.get_submodule(name)))
            silenced = []
            if not first:
                for name in _outermost(prologue):
                    module = model.get_submodule(name)
                    if last and ids([name]) & shared:
                        silenced.append(name)
                    else:
                        cut.set_submodule(model, name, cut.absent_for(module, name, keeping))
            if not last:
                for name in _outermost(epilogue):
                    cut.set_submodule(model, name, torch.nn.Identity())
            carried = probe.carried if probe is not None else ()
            gate = cut.StageGate(
                {s: ranges[s] for s in local}, layout.num_stages, carry=RouterCarry.of(model), extras=carried
            )
            return gate, gate.hooks([model.get_submodule(n) for n in blocks.names]), silenced
        except ConfigError:
            raise
        except Exception as err:
            first_line = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(
                f"pipeline.stages: cannot cut {type(model).__name__} into stages ({type(err).__name__}: {first_line})"
            ) from err

    # Each rank cuts its own stages: one that fails must not leave the others waiting in the next collective.
    gate, handles, silenced = agree(surgery, "pipeline.stages: cutting the model", ConfigError)
    ties = _tie_ends(model, mesh, layout.rank_of(0), layout.rank_of(layout.num_stages - 1), shared, first)
    ties.silenced = silenced
    log_rank0(
        logger,
        "pipeline: %d stages on %d ranks, schedule %s, %d micro-batches; blocks per stage %s",
        layout.num_stages,
        p,
        schedule.name,
        micro_batches,
        [len(r) for r in ranges],
    )
    pipeline = Pipeline(model, mesh, schedule, gate, ranges, ties, handles, synchronized_timing=options.timed)
    pipeline.settle()
    if expected is not None:
        headline = f"pipeline.stages: the {p}-stage cut ({schedule.name}) does not reproduce {type(model).__name__} (twin check)"
        twin.dry_run(pipeline, twin_batches[0], probe, headline)
        twin.check(pipeline, twin_batches, expected, headline)
        pipeline.last_report = None
    return pipeline


def _outermost(names: list[str]) -> list[str]:
    """``names`` without those inside another of them: a module with weights of its own and weighted children (BERT's
    ``cls.predictions`` with its bias and ``transform``) is replaced whole, its children with it."""
    return [n for n in names if not any(n.startswith(other + ".") for other in names)]


@dataclasses.dataclass
class Ties:
    """Weights both pipeline ends hold (an embedding tied to the head), by name, and their pair's group."""

    names: list[str] = dataclasses.field(default_factory=list)
    group: dist.ProcessGroup | None = None
    duplicate: bool = False  # this rank holds the last stage's copy: saved and counted by the first stage's
    silenced: list[str] = dataclasses.field(default_factory=list)  # tied embedding modules kept but switched off


def _tie_ends(
    model: torch.nn.Module, mesh: Mesh, first_rank: int, last_rank: int, shared: set[int], first: bool
) -> Ties:
    """The weights the first and last stage both hold, and their pair's group (``mesh.pair_group``; every rank makes every pair).

    Both copies already hold the same values (``parallel/weights.py`` synced the model before the cut).
    """
    if not shared or first_rank == last_rank:
        return Ties()
    mine = mesh.pair_group("pp", (first_rank, last_rank))
    if mine is None:
        return Ties()
    names = [n for n, param in model.named_parameters() if id(param) in shared]
    return Ties(names, mine, duplicate=not first)
