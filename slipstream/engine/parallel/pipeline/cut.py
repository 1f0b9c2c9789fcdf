"""Cut an unchanged model into pipeline stages: contiguous runs of its blocks, nothing model-specific.

[Note: replaying the model's own forward] A stage does not rebuild the model as a list of
layers (DeepSpeed's ``PipelineModule``). Every stage runs the model's own ``forward`` on the
micro-batch; a :class:`StageGate` hooked on the blocks makes it this stage's forward:

* blocks no local stage owns are swapped for parameter-free :class:`Passthrough` modules, and a
  local stage's blocks outside the running stage's range pass their input through as well;
* on the first block of the range, the hidden state is replaced by the activation received from
  the previous stage (so positions, rotary tables and masks, which need no weights, are
  recomputed by the model itself from the micro-batch);
* on the first block after the range, the gate raises :class:`StageOutput` with that block's
  input, ending the forward: non-last stages stop there. The last stage runs to the end and the
  model computes its own loss.

Prologue modules (embeddings) with weights live only on the rank that runs stage 0; elsewhere
they become :class:`Absent` modules producing zeros of the right shape, which the first block's
substitution discards. Epilogue modules (final norm, head) live only with the last stage. An
embedding tied to the head (GPT-2) stays on both ends: its forward is switched off where it is
not the first stage, and its gradients are summed between the two ends (``PipelineModel.tied``).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.anatomy import Blocks
from slipstream.engine.parallel.pipeline.carry import RouterCarry


class StageOutput(Exception):
    """Raised inside the model's forward at the end of a non-last stage, carrying its output: the hidden state,
    and with a carry (carry.py) the router logits collected so far."""

    def __init__(
        self, hidden: torch.Tensor, carried: torch.Tensor | None = None, extras: list[torch.Tensor] | None = None
    ) -> None:
        super().__init__("pipeline stage output")
        self.hidden, self.carried, self.extras = hidden, carried, extras or []

    @property
    def outputs(self) -> list[torch.Tensor]:
        """What the stage hands on: the hidden state, what the carry took, the blocks' other activations."""
        return [self.hidden, *([] if self.carried is None else [self.carried]), *self.extras]


class Passthrough(torch.nn.Module):
    """A block this rank does not own: returns its hidden-state input unchanged.

    It keeps the block's plain settings (strings, numbers, flags: ModernBERT's ``attention_type``, a layer index),
    which the model's forward may read off each block to choose its mask or positions, and those of its
    sub-modules as parameter-free shells (``nn.TransformerEncoder`` reads ``layers[0].self_attn.batch_first``);
    no tensor."""

    is_block_stand_in = True  # anatomy.BLOCK_STAND_IN: still a slot of the run of blocks

    def __init__(self, block: torch.nn.Module | None = None) -> None:
        super().__init__()
        if block is not None:
            _copy_settings(block, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _hidden_of(args, kwargs)


class _Shell(torch.nn.Module):
    """A sub-module of a block this rank does not own: its plain settings only, never called."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        _copy_settings(module, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("pipeline: a sub-module of a block another stage owns was called")


def _copy_settings(source: torch.nn.Module, target: torch.nn.Module) -> None:
    for name, value in vars(source).items():
        if not name.startswith("_") and name != "training" and isinstance(value, (str, int, float, bool, type(None))):
            setattr(target, name, value)
    for name, child in source.named_children():
        setattr(target, name, _Shell(child))


class Absent(torch.nn.Module):
    """A prologue module owned by stage 0's rank: zeros of its output's shape (discarded downstream)."""

    def __init__(self, features: int, dtype: torch.dtype, from_ids: bool) -> None:
        super().__init__()
        self.features, self.dtype, self.from_ids = features, dtype, from_ids

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shape = x.shape if self.from_ids else x.shape[:-1]
        return torch.zeros(*shape, self.features, dtype=self.dtype, device=x.device)


class HandsOn(torch.nn.Module):
    """A prologue module that keeps its input's shape (a norm or scaling after the embeddings), on a stage that does
    not run it: hands its input (the stand-ins' zeros) on, which the first block's substitution discards."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


# ----------------------------------------------------------------------------- partition
def partition(
    blocks: Blocks,
    stages: int,
    method: str,
    prologue_numel: int = 0,
    epilogue_numel: int = 0,
    measured: list[float] | None = None,
    rank_of: Callable[[int], int] | None = None,
    skipped: frozenset[int] = frozenset(),
) -> list[range]:
    """Contiguous block ranges, one per stage, by ``pipeline.partition``.

    [Note: blocks the forward skips] ``skipped``: blocks the model's forward does not call (twin/pipeline_step.py probe_blocks). A
    stage hands its output on at the next stage's first block and takes its input there, so every stage must start
    at a block that runs: the stages are balanced over the blocks that run, and each skipped block goes with the
    stage of the block before it (it holds its parameters, which get no gradient, as in one process).

    ``uniform``: equal block counts; ``parameters`` (DeepSpeed's default): balanced parameter
    counts, the embeddings counted on the first stage and the head on the last;
    ``type:<regex>``: balanced counts of blocks whose class name matches; ``profile``: balanced
    ``measured`` block times (``profile.py``). ``rank_of`` (stage → rank): where a rank runs several
    stages (interleaved, V), the weighted methods balance what each rank runs, not each stage.
    """
    n = len(blocks)
    if n < stages:
        ranks = len({rank_of(s) for s in range(stages)}) if rank_of is not None else stages
        key = "pipeline.stages" if ranks == stages else "pipeline.virtual_stages"
        how = (
            f"{stages} stages"
            if ranks == stages
            else f"{ranks} ranks × {stages // ranks} virtual stages = {stages} stages"
        )
        raise ConfigError(
            f"{key}: {how} need at least {stages} blocks; the model has {n} ({blocks.container or 'model'})"
        )
    if method == "uniform":
        weights = [1.0] * n
    elif method in ("parameters", "best"):
        weights = [float(sum(p.numel() for p in b.parameters())) for b in blocks.modules]
        weights[0] += prologue_numel
        weights[-1] += epilogue_numel
    elif method == "profile" and measured is not None:
        weights = list(measured)
    elif method.startswith("type:"):
        try:
            pattern = re.compile(method[5:], re.IGNORECASE)
        except re.error as err:
            raise ConfigError(
                f'pipeline.partition: {method!r}: {method[5:]!r} is not a regular expression ({err}); e.g. "type:DecoderLayer"'
            ) from None
        weights = [1.0 if pattern.search(type(b).__name__) else 0.0 for b in blocks.modules]
        if sum(weights) < stages:
            raise ConfigError(
                f"pipeline.partition: {method!r} matches {int(sum(weights))} blocks ({type(blocks.modules[0]).__name__}); need at least {stages}"
            )
    else:
        raise ConfigError(
            f"pipeline.partition: {method!r} is not a method; use parameters, uniform, profile or type:<regex>"
        )
    if skipped:
        running = [i for i in range(n) if i not in skipped]
        inner = partition(
            _Running(blocks, running),
            stages,
            method,
            prologue_numel,
            epilogue_numel,
            [measured[i] for i in running] if measured is not None else None,
            rank_of,
        )
        starts = [0] + [running[r.start] for r in inner[1:]]
        return [range(start, stop) for start, stop in zip(starts, [*starts[1:], n])]
    ranges = _balanced(weights, stages)
    if rank_of is not None and method != "uniform":
        ranges = _balance_ranks(weights, ranges, rank_of)
    return ranges


class _Running:
    """The blocks a forward runs, as ``Blocks`` for ``partition`` (see [Note: blocks the forward skips])."""

    def __init__(self, blocks: Blocks, running: list[int]) -> None:
        self.modules = [blocks.modules[i] for i in running]
        self.names = [blocks.names[i] for i in running]
        self.container = f"{blocks.container or 'model'}, {len(running)} of which run"

    def __len__(self) -> int:
        return len(self.modules)


def _balanced(weights: list[float], stages: int) -> list[range]:
    """Contiguous split minimizing the heaviest stage (every stage gets at least one block)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the lightest possible heaviest stage splitting the first i blocks into k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-9:  # ties go to the earliest cut: later stages get more blocks
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def _balance_ranks(weights: list[float], ranges: list[range], rank_of: Callable[[int], int]) -> list[range]:
    """Move stage boundaries one block at a time while the busiest rank gets lighter.

    [Note: balancing ranks] With several stages per rank (a V puts the first and the last stage on
    rank 0), equal stages do not make equal ranks: what a rank runs is the sum of its stages. Exact
    balancing of rank sums over contiguous cuts is a harder search; starting from the balanced
    stages, single-block moves of one boundary that lower (heaviest rank, spread of the loads)
    converge in a few passes and find the even split in the cases that matter (a heavy head or
    embedding on an end stage).
    """
    cuts = [r.start for r in ranges[1:]]
    n, stages = len(weights), len(ranges)

    def score(cuts: list[int]) -> tuple[float, float]:
        bounds = [0, *cuts, n]
        loads: dict[int, float] = {}
        for k in range(stages):
            loads[rank_of(k)] = loads.get(rank_of(k), 0.0) + sum(weights[bounds[k] : bounds[k + 1]])
        return max(loads.values()), sum(v * v for v in loads.values())

    current = score(cuts)
    for _ in range(4 * n):
        best = None
        for k in range(len(cuts)):
            for step in (-1, 1):
                trial = list(cuts)
                trial[k] += step
                bounds = [0, *trial, n]
                if any(bounds[j + 1] - bounds[j] < 1 for j in range(stages)):
                    continue
                candidate = score(trial)
                if candidate < current and (best is None or candidate < best[0]):
                    best = (candidate, trial)
        if best is None:
            break
        current, cuts = best
    bounds = [0, *cuts, n]
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]


# ----------------------------------------------------------------------------- the gate
@dataclasses.dataclass
class StageGate:
    """Turns the model's forward into one stage's forward (see the module note).

    Which stage runs (``active``) and its received activation are per thread: a DualPipeV pair runs one
    micro-batch's forward and another's backward on two threads (``comm/overlap.py``), and a block
    recomputed in that backward (activation checkpointing) must run whole, as outside a forward.
    """

    ranges: dict[int, range]  # local stage -> its block indices
    num_stages: int
    carry: RouterCarry | None = None  # what a stage hands on besides its hidden state (carry.py)
    # the blocks' other activation arguments (positional index or keyword: twin.Probe.carried), see the note below
    extras: tuple[int | str, ...] = ()
    _state: threading.local = dataclasses.field(default_factory=threading.local, repr=False)

    @property
    def active(self) -> int | None:
        return getattr(self._state, "active", None)

    @active.setter
    def active(self, stage: int | None) -> None:
        self._state.active = stage

    @property
    def received(self) -> list[torch.Tensor] | None:
        """The previous stage's hand-over: its hidden state, then (with a carry) the router logits it carried."""
        return getattr(self._state, "received", None)

    @received.setter
    def received(self, parts: list[torch.Tensor] | None) -> None:
        self._state.received = parts

    def hooks(self, blocks: list[torch.nn.Module]) -> list[torch.utils.hooks.RemovableHandle]:
        handles = []
        for index, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True, prepend=True))
            if not isinstance(block, Passthrough):
                original = block.forward
                block.forward = self._gated(index, original)  # type: ignore[method-assign]
        return handles

    def _gated(self, index: int, original: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.active is None or index in self.ranges[self.active]:
                return original(*args, **kwargs)
            return _hidden_of(args, kwargs)

        return forward

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor] | None]:
        """The received hand-over: hidden state, router logits (when the carry sends them), the other activations
        (None when they did not come: the dry run hands on the hidden state alone)."""
        assert self.received, "pipeline: no activation received for this stage"
        hidden, *rest = self.received
        router = rest.pop(0) if self.carry is not None and self.carry.sends and rest else None
        return hidden, router, (rest if self.extras and len(rest) == len(self.extras) else None)

    def _pre_hook(self, index: int) -> Any:
        """[Note: activations carried beside the hidden state] A block that reads another activation besides its
        hidden state, the same tensor for every block (a value-residual model's embedding output, ``block(x, x0)``),
        would get the stand-in's zeros on a later stage. The stage that computed it hands it on with the hidden
        state (each later stage hands on what it received), and every block the receiving stage runs reads the
        received tensor in its place; its gradient, summed over that stage's blocks and the stages after it, goes
        back with the hidden state's. An activation computed between blocks is not carried (twin/pipeline_step.py probe_blocks)."""

        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.active is None:
                return None
            span = self.ranges[self.active]
            if index == span.stop and self.active < self.num_stages - 1:
                hidden = _hidden_of(args, kwargs)
                extras = self._unpacked()[2] if self.active > 0 and self.received else None
                if extras is None:
                    extras = [kwargs[k] if isinstance(k, str) else args[k] for k in self.extras]
                raise StageOutput(hidden, self.carry.take(hidden) if self.carry is not None else None, extras)
            if index not in span or self.active == 0:
                return None
            hidden, router, extras = self._unpacked()
            if index == span.start:
                if router is not None:
                    self.carry.give(router)  # type: ignore[union-attr]
                args, kwargs = _with_hidden(args, kwargs, hidden)
            for key, value in zip(self.extras, extras or (), strict=False):
                if isinstance(key, str):
                    kwargs = {**kwargs, key: value}
                else:
                    args = (*args[:key], value, *args[key + 1 :])
            return args, kwargs

        return hook


# ----------------------------------------------------------------------------- surgery
def outer_modules(
    model: torch.nn.Module, blocks: Blocks, order: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Modules with their own parameters outside the blocks: before them (prologue) and after (epilogue).

    ``order``: the modules' first calls in one forward (twin/pipeline_step.py probe_blocks). With it a module is
    prologue or epilogue by when it runs (OPT registers its final norm before its layers); without
    it, or for a module the forward did not call, by registration order.
    """
    if order is not None and blocks.names and blocks.names[0] in order:
        position = {name: i for i, name in enumerate(order)}
        first_block = position[blocks.names[0]]
        by_registration = outer_modules(model, blocks)
        before, after = [], []
        for name in [*by_registration[0], *by_registration[1]]:
            if name in position:
                (before if position[name] < first_block else after).append(name)
            else:
                (before if name in by_registration[0] else after).append(name)
        return before, after
    container = blocks.container
    before, after, seen_blocks = [], [], False
    for name, module in model.named_modules():
        inside = container == "" or name == container or name.startswith(container + ".")
        if inside and container != "" and name != container:
            seen_blocks = True
            continue
        if container == "" and name != "":
            continue  # the model is the container: everything is a block or parameter-free
        if next(module.parameters(recurse=False), None) is None:
            continue
        (after if seen_blocks else before).append(name)
    return before, after


def set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def absent_for(module: torch.nn.Module, name: str, shape_keeping: frozenset[str] = frozenset()) -> torch.nn.Module:
    """The parameter-free stand-in for prologue module ``name`` on a stage that does not run it.

    ``shape_keeping``: the modules the probe forward saw return their input's shape and dtype (twin/pipeline_step.py probe_blocks);
    a weighted one of those (BERT's and Bloom's LayerNorm after the embeddings) hands its input on.
    """
    if isinstance(module, torch.nn.Embedding):
        return Absent(module.embedding_dim, module.weight.dtype, from_ids=True)
    if isinstance(module, torch.nn.Linear):
        return Absent(module.out_features, module.weight.dtype, from_ids=False)
    if name in shape_keeping:
        return HandsOn()
    raise ConfigError(
        f"pipeline.stages: cannot cut the model: its prologue module {name} ({type(module).__name__}) has weights, runs "
        "before the first block and changes its input's shape, and only embeddings, linear layers and shape-keeping "
        "modules (norms, seen by the twin check's probe forward) can be left out of later stages"
    )


def check_prologue(model: torch.nn.Module, prologue: list[str], shape_keeping: frozenset[str] = frozenset()) -> None:
    """Every rank refuses a prologue a later stage could not stand in for, before any rank cuts (no rank left waiting)."""
    for name in prologue:
        absent_for(model.get_submodule(name), name, shape_keeping)


def silence(module: torch.nn.Module) -> None:
    """Keep ``module`` (its weight is tied to a kept one) but let it compute zeros of its output's shape."""
    weight = module.weight

    def zeros(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, weight.shape[-1], dtype=weight.dtype, device=ids.device)

    module.forward = zeros  # type: ignore[method-assign]
