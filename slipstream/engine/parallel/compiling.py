"""``compile``: ``torch.compile`` on each repeated block this rank runs, with the engine's hooks outside the graphs.

[Note: what is compiled] torchtitan's shape: each block (``anatomy.find_blocks``, or the classes in
``compile.module_classes``) gets its ``forward`` replaced on the instance by a compiled one. Only
the forward *body* is compiled, not ``Module.__call__``: the module hooks every parallelism hangs
on a block (ZeRO-3's gather and release, the pipeline's stage boundary, tensor parallel's sequence
region, the twin check's recorders) run eagerly around the compiled graph, so dynamo never traces
a collective, a storage resize or a Python-side counter. Gradients leave a compiled graph through
ordinary ``AccumulateGrad`` nodes, so stages 0-2's post-accumulate hooks fire as in eager. One
compiled code object serves every block of a class: the blocks differ only in their parameters,
which dynamo lifts to graph inputs, so twenty-four layers are one graph, not twenty-four.

[Note: caches recompile] A decoder layer handed a key/value cache writes its layer's slot, and
dynamo guards on which slots exist: every layer, and every step, would be a new graph (and past
``recompile_limit`` dynamo silently runs the rest eagerly). Training never reads the cache, so a
compiled block gets none while gradients are on, as a checkpointed one does
(``checkpointing.without_caches``). A forward without gradients (evaluation, generation) keeps it.

[Note: counted, never silent] Each call records how many graphs dynamo made and how many graph
breaks it took (dynamo's own counters, read around the call, so they are this block's). The first
break warns once with dynamo's reasons, naming the class; the monitor reports graphs, breaks,
graphs made after the first optimizer step (recompiles) and compile seconds each step.
``compile.kwargs.fullgraph`` turns a break into an error instead.

[Note: the loss is compiled too] transformers' causal-LM loss upcasts the ``[tokens x vocab]``
logits to fp32 and runs ``log_softmax`` and ``nll_loss`` eagerly: at its peak it holds the logits,
their log-probabilities and the gradients of both. Compiled, the reductions fuse into the kernel
that reads the logits and the backward writes only the logits' gradient: measured on the CPU
(4 x 512 tokens, vocabulary 32,000) the loss's peak above the logits fell from 750 to 251 MiB and
its forward + backward from 134 to 69 ms (8,192 entries: 20 to 10 ms). So the model's own
``loss_function`` (any of transformers' losses, or a model's attribute of that name) is compiled
as well, counted with the blocks under the name ``loss``; ``compile.loss: false`` leaves it eager.
Not when ``long_context.tiled_logits`` replaced it: the tiles never hold the whole logits, and
their deferred logits are not a tensor dynamo can trace. The loss runs outside every module, so no
engine hook is inside its graph.

Compiling comes before activation checkpointing (``parallelize``'s order), so a checkpointed block
runs its compiled forward, and again when backward recomputes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from slipstream.checkpointing import outermost_of_classes, without_caches
from slipstream.engine.config import ConfigError, MeshSizes, SlipstreamConfig
from slipstream.engine.config.sections import CompileConfig
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.tiling.tiles import replace_forward, replace_loss
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """``compile``: the backend, ``torch.compile``'s arguments and the classes to compile (empty: the blocks)."""

    backend: str
    kwargs: Mapping[str, Any]
    module_classes: tuple[str, ...]
    loss: bool = True  # the model's loss_function too ([Note: the loss is compiled too])
    compiled_autograd: bool = False  # each backward under compiled autograd (:meth:`CompiledBlocks.backward`)

    @classmethod
    def from_config(cls, cfg: SlipstreamConfig, sizes: MeshSizes, model: torch.nn.Module) -> CompileOptions | None:
        if cfg.compile.compiled_autograd and not cfg.compile.on:
            raise ConfigError("compile.compiled_autograd: set compile.enabled too (it compiles with that backend)")
        if cfg.compile.compiled_autograd and sizes.pp > 1:
            raise ConfigError(
                "compile.compiled_autograd: not with pipeline parallelism (its schedule runs each stage's backward "
                "in pieces); turn one of them off"
            )
        return cls.build(cfg.compile, model, sizes.tp) if cfg.compile.on else None

    @classmethod
    def build(
        cls,
        section: CompileConfig,
        model: torch.nn.Module,
        tp: int,
        key: str = "compile",
        backend: str | None = None,
        kwargs: Mapping[str, Any] | None = None,
        classes: Sequence[str] | None = None,
    ) -> CompileOptions:
        """:class:`ConfigError` naming ``key``'s field: an unknown backend, or a class the model does not have.

        With tensor parallelism (``tp`` > 1) a model with dropout is refused too: a compiled graph draws its
        random numbers from one seed, the same on every tp rank, so the heads and MLP columns each rank holds
        would get the same masks (parallel/rng.py's [Note: two streams] cannot fork inside a graph).
        ``backend``, ``kwargs``, ``classes``: what ``engine.compile`` was given instead of the section's values."""
        backend = backend or section.backend
        kwargs = section.kwargs if kwargs is None else kwargs
        classes = tuple(section.module_classes or ()) if classes is None else tuple(classes)
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ConfigError(
                f"{key}.backend: {backend!r} is not a torch.compile backend (these are: {', '.join(sorted(known))})"
            )
        missing = set(classes) - {type(m).__name__ for m in model.modules()}
        if missing:
            raise ConfigError(f"{key}.module_classes: no module of class {', '.join(sorted(missing))} in the model")
        if not classes and find_blocks(model) is None:
            raise ConfigError(
                f"{key}: the model has no repeated blocks to compile; name the classes in {key}.module_classes"
            )
        dropout = find_dropout(model) if tp > 1 else None
        if dropout is not None:
            raise ConfigError(
                f"{key}: tensor parallelism with dropout ({dropout}) would give every tp rank's shard the same "
                "dropout masks in a compiled graph; set the model's dropout to 0, or turn compile off"
            )
        return cls(backend, dict(kwargs), classes, section.loss, section.compiled_autograd)


@dataclasses.dataclass
class CompileCounts:
    """What dynamo did in the compiled blocks so far (cumulative, this rank)."""

    graphs: int = 0  # graphs dynamo made (one per block class without breaks; more per break or recompile)
    graph_breaks: int = 0
    recompiles: int = 0  # graphs made after the first optimizer step for a (class, grad mode) that had one
    seconds: float = 0.0  # dynamo's compile time in this process (forward and backward graphs)


class CompiledBlocks:
    """The compiled forwards of this rank's blocks: counted per call, undone by :meth:`close`."""

    def __init__(
        self,
        modules: list[tuple[str, torch.nn.Module]],
        options: CompileOptions,
        loss_owner: torch.nn.Module | None = None,
    ) -> None:
        """``loss_owner``: the model whose ``loss_function`` is compiled too (None: the loss stays as it is)."""
        self.options = options
        self.names = [name for name, _ in modules]
        self.modules = [module for _, module in modules]
        self.counts = CompileCounts()
        self.loss_compiled = False
        self._settled = False  # after the first optimizer step, every new graph is a recompile
        self._warned: set[str] = set()
        self._kinds: set[tuple[str, bool]] = set()  # (class, with gradients) a graph was made for
        self._compiled: dict[Any, Any] = {}  # a class's forward function -> its compiled form
        self._undo: list[Callable[[], None]] = []  # puts back each block's forward, and the loss
        self._seconds_at_start = _compile_seconds()
        for module in self.modules:
            self._compile(module)
        if loss_owner is not None:
            self._compile_loss(loss_owner)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """Where the engine runs a backward: under compiled autograd with the blocks' backend and arguments when
        ``compile.compiled_autograd`` asks for it (stages 0-2's gradient hooks then run in Python, [Note: compiled
        autograd traces Python hooks] in zero/arrivals.py), else as it is."""
        if not self.options.compiled_autograd:
            return contextlib.nullcontext()
        from torch._dynamo import compiled_autograd

        compiler = torch.compile(backend=self.options.backend, **self.options.kwargs)
        return self._counted_backward(compiled_autograd._enable(compiler))

    @contextlib.contextmanager
    def _counted_backward(self, enabled: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        """Compiled autograd's graphs and breaks, counted under the name ``backward`` like a block's ([Note:
        counted, never silent]); a block recomputed inside the backward (checkpointing) counts its own graphs, which
        are taken out of the backward's so that nothing is counted twice."""
        graphs, breaks = _dynamo_totals()
        recorded = self.counts.graphs, self.counts.graph_breaks
        with enabled:
            yield
        made, broke = _dynamo_totals()
        made -= self.counts.graphs - recorded[0]
        broke -= self.counts.graph_breaks - recorded[1]
        if made != graphs or broke != breaks:
            self._record("backward", made - graphs, broke - breaks, True)

    def _torch_compile(self, function: Callable[..., Any]) -> Callable[..., Any]:
        # In a recompile region of its own: another engine's graphs in this process count against neither's limit.
        return torch.compile(function, backend=self.options.backend, isolate_recompiles=True, **self.options.kwargs)

    def _compile(self, module: torch.nn.Module) -> None:
        original = module.forward  # the class's, or what an earlier step put on the instance
        function = getattr(original, "__func__", None)
        if function is not None and getattr(original, "__self__", None) is module:
            # One compiled function per class forward, shared by its blocks (one graph for all of them).
            if function not in self._compiled:
                self._compiled[function] = self._torch_compile(function)
            compiled = functools.partial(self._compiled[function], module)
        else:
            compiled = self._torch_compile(original)
        try:
            signature: inspect.Signature | None = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None
        counted = self._counted(type(module).__name__, compiled)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():  # see [Note: caches recompile]
                args, kwargs = without_caches(signature, args, kwargs)
            return counted(*args, **kwargs)

        self._undo.append(replace_forward(module, forward))

    def _compile_loss(self, model: torch.nn.Module) -> None:
        """The model's ``loss_function`` compiled (see [Note: the loss is compiled too]); ``close`` puts its own back."""
        loss = getattr(model, "loss_function", None)
        if not callable(loss) or isinstance(loss, torch.nn.Module):
            return
        self._undo.append(replace_loss(model, functools.wraps(loss)(self._counted("loss", self._torch_compile(loss)))))
        self.loss_compiled = True

    def _counted(self, name: str, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` with what dynamo made and broke during each call recorded under ``name``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            graphs, breaks = _dynamo_totals()
            # data-dependent shapes and scalars (MoE routing's nonzero, a count) stay in the graph instead of breaking it
            with (
                _captured_outputs_readable(),
                torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True),
            ):
                out = compiled(*args, **kwargs)
            made, broke = _dynamo_totals()
            if made != graphs or broke != breaks:
                self._record(name, made - graphs, broke - breaks, torch.is_grad_enabled())
            return out

        return call

    def _record(self, name: str, graphs: int, breaks: int, training: bool) -> None:
        self.counts.graphs += graphs
        self.counts.graph_breaks += breaks
        if self._settled and (name, training) in self._kinds:  # a first evaluation's graph is not a recompile
            self.counts.recompiles += graphs
        self._kinds.add((name, training))
        if breaks and name not in self._warned:
            self._warned.add(name)
            reasons = "; ".join(sorted(torch._dynamo.utils.counters["graph_break"]))[:600]
            logger.warning(
                "compile: %s breaks its graph (%d break(s); the parts between run eagerly, correct but slower): %s",
                name,
                breaks,
                reasons or "see TORCH_LOGS=graph_breaks",
            )

    def on_step(self) -> dict[str, float]:
        """At each optimizer step: the counts so far, by name, for the step record (later graphs are recompiles)."""
        self._settled = True
        self.counts.seconds = _compile_seconds() - self._seconds_at_start
        return {k: float(v) for k, v in dataclasses.asdict(self.counts).items()}

    def close(self) -> None:
        """Every block runs the forward it had before compiling."""
        for undo in self._undo:
            undo()
        self._undo = []


def compile_blocks(
    model: torch.nn.Module, options: CompileOptions | None, loss_tiled: bool = False
) -> CompiledBlocks | None:
    """Compile the forward of each block this rank runs (see [Note: what is compiled]) and the model's loss unless
    ``loss_tiled`` (the long-context tiles compute it); None when off."""
    if options is None:
        return None
    if options.module_classes:
        modules = outermost_of_classes(model, options.module_classes)
    else:
        blocks = find_blocks(model)
        modules = list(zip(blocks.names, blocks.modules)) if blocks is not None else []
    if not modules:  # a pipeline stage without blocks of its own
        return None
    compiled = CompiledBlocks(modules, options, model if options.loss and not loss_tiled else None)
    log_rank0(
        logger,
        "compile: %d modules%s with backend %s (%s%s)",
        len(modules),
        " and the loss" if compiled.loss_compiled else "",
        options.backend,
        ", ".join(compiled.names[:3]),
        ", ..." if len(modules) > 3 else "",
    )
    return compiled


@contextlib.contextmanager
def _captured_outputs_readable() -> Iterator[None]:
    """[Note: captured outputs] transformers records router logits, hidden states and attentions with forward
    hooks on modules inside the blocks, which find the running collector through a ``ContextVar`` wrapper
    (``CompileableContextVar``); dynamo cannot read a ``ContextVar``, and the wrapper only switches to a plain
    attribute when the *whole* model is compiled. A compiled block makes the running collector that attribute
    for its call, so the hooks trace into the block's graph (their appends replay after it) and every router
    logit still reaches the loss."""
    holder = _collector_holder()
    if holder is None or holder.compiling:
        yield
        return
    value = holder.context_var.get()
    if value is None:
        yield
        return
    holder.global_var, holder.compiling = value, True
    try:
        yield
    finally:
        holder.global_var, holder.compiling = None, False


@functools.cache
def _collector_holder() -> Any:
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    holder = getattr(output_capturing, "_active_collector", None)
    return holder if all(hasattr(holder, a) for a in ("context_var", "global_var", "compiling")) else None


def find_dropout(model: torch.nn.Module) -> str | None:
    """Where the model drops out, or None: a dropout module with ``p`` above 0, or a module's float attribute named
    ``*dropout*`` above 0 (the rate an attention module hands its attention function, as Llama's does)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                return f"{name}.p = {module.p}"
            continue
        for key, value in vars(module).items():
            if "dropout" in key and not key.startswith("_") and isinstance(value, float) and value > 0:
                return f"{name}.{key} = {value}"
    return None


def _dynamo_totals() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _compile_seconds() -> float:
    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))
