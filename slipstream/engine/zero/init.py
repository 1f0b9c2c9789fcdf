"""``zero.Init``: build a model partitioned from the start, with the values an unsharded build has.

[Note: record on meta, replay one tensor at a time] Inside the context a dispatch mode sends
every CPU allocation to the meta device and records each operation on meta tensors, so the
model's own initialisation (``reset_parameters``, transformers' ``post_init``...) runs unchanged
and costs no memory. On exit the log is replayed on real tensors in the original order, so the
random number generator is consumed exactly as an unsharded build would consume it. A write that
a later full overwrite makes irrelevant (a constructor's init before ``post_init`` re-initialises
the weight) is replayed into a scratch tensor when it draws random numbers, and skipped when it
does not, so each parameter is materialised only from its last full overwrite to its last use;
when it is final, this rank keeps its ZeRO-3 chunk and the rest is freed. Peak memory is about
one parameter, not the model. Buffers are materialised whole (they are replicated anyway).

Nothing is monkey-patched: parameters are found with torch's public parameter-registration hook.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.accelerator import get_accelerator
from slipstream.engine.config.base import ConfigError
from slipstream.engine.zero.flat_layout import FlatLayout
from slipstream.engine.zero.storage import alias, copy_pieces, hollow
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

_RANDOM = {
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    "bernoulli",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "randn",
    "rand",
    "randint",
    "randperm",
    "normal",
    "rand_like",
    "randn_like",
    "randint_like",
    "multinomial",
    "native_dropout",
    "poisson",
}
_OVERWRITE = {
    "uniform_",
    "normal_",
    "fill_",
    "zero_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "copy_",
}
_META = torch.device("meta")


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A meta tensor in the log: which storage, and the view of it."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


@dataclasses.dataclass
class _Op:
    func: Any
    args: Any
    kwargs: Any
    writes: set[int]
    reads: set[int]
    creates: list[tuple[int, int]]  # (storage key, index of the output leaf)
    random: bool
    overwrites: set[int]  # storages this op fills completely, independently of their old values
    reseed: torch.Tensor | None = None  # generator state set by the constructor just before this draw


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[_Op] = []
        self.storages: dict[int, torch.UntypedStorage] = {}  # kept alive so keys are never reused
        self.first_rng: torch.Tensor | None = None
        self.last_rng: torch.Tensor | None = None

    def _ref(self, t: torch.Tensor) -> _Ref:
        storage = t.untyped_storage()
        key = storage._cdata
        self.storages.setdefault(key, storage)
        return _Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        schema_args = func._schema.arguments
        if any(a.name == "device" for a in schema_args) and not any(
            isinstance(a, torch.Tensor) for a in pytree.tree_leaves(args)
        ):
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "cpu":
                kwargs["device"] = _META
        out = func(*args, **kwargs)
        in_leaves = pytree.tree_leaves((args, kwargs))
        out_leaves = pytree.tree_leaves(out)
        if not any(isinstance(t, torch.Tensor) and t.is_meta for t in (*in_leaves, *out_leaves)):
            return out
        known = set(self.storages)
        ref_args, ref_kwargs = pytree.tree_map(self._as_ref, (args, kwargs))
        writes: set[int] = set()
        for i, a in enumerate(schema_args):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(value, torch.Tensor) and value.is_meta:
                writes.add(self._ref(value).key)
        reads = {r.key for r in pytree.tree_leaves((ref_args, ref_kwargs)) if isinstance(r, _Ref)}
        creates = []
        for index, t in enumerate(out_leaves):
            if isinstance(t, torch.Tensor) and t.is_meta:
                ref = self._ref(t)
                if ref.key not in known:
                    creates.append((ref.key, index))
                    writes.add(ref.key)
        name = func.overloadpacket.__name__
        overwrites = {key for key, _ in creates}
        if name in _OVERWRITE and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            target = self._ref(args[0])
            if target.numel() * args[0].element_size() == self.storages[target.key].nbytes() and target.offset == 0:
                overwrites.add(target.key)
        reseed = None
        if name in _RANDOM:
            # Meta draws consume nothing, so the generator only changes here if the constructor
            # reseeded it (torch.manual_seed); replay must reseed at the same point.
            state = torch.get_rng_state()
            if self.last_rng is None:
                self.first_rng = state
            elif not torch.equal(state, self.last_rng):
                reseed = state
            self.last_rng = state
        self.log.append(_Op(func, ref_args, ref_kwargs, writes, reads, creates, name in _RANDOM, overwrites, reseed))
        return out

    def _as_ref(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self._ref(value)
        return value


class Init:
    """Context manager: modules built inside are partitioned for ZeRO-3 without ever being whole.

    ``with slipstream.zero.Init(config=ds_config): model = MyModel(...)`` and then
    ``slipstream.initialize(model, ds_config)``. Initial values equal those of an unsharded build
    under the same seed (the model's own initialisation, e.g. transformers' ``post_init``, runs
    unchanged), so every rank must be seeded alike. Random draws on other devices inside the
    context, or ``torch.manual_seed`` calls in a constructor, break that equality (a warning says so).

    This class takes the unit settings (``unit_classes``, ``persistence_threshold``) that decide
    the layout; ``slipstream.zero.Init`` reads them from a config.
    """

    def __init__(
        self, unit_classes: list[str] | None = None, persistence_threshold: int = 100_000, enabled: bool = True
    ) -> None:
        self.unit_classes, self.persistence_threshold, self.enabled = unit_classes, persistence_threshold, enabled
        self._recorder: _Recorder | None = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._rng = torch.get_rng_state()
        self._modules: dict[int, torch.nn.Module] = {}
        registration = torch.nn.modules.module
        self._hooks = [
            registration.register_module_parameter_registration_hook(self._on_registration),
            registration.register_module_module_registration_hook(self._on_registration),
            registration.register_module_buffer_registration_hook(self._on_registration),
        ]
        self._recorder = _Recorder()
        self._recorder.__enter__()
        return self

    def _on_registration(self, module: torch.nn.Module, name: str, value: Any) -> None:
        self._modules[id(module)] = module  # every module that gets a parameter, buffer or child

    def __exit__(self, *exc: Any) -> None:
        if self._recorder is None:
            return
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        if exc[0] is not None:
            return
        children = {id(c) for m in self._modules.values() for c in m.modules() if c is not m}
        models = [m for key, m in self._modules.items() if key not in children]
        at_exit = torch.get_rng_state()
        torch.set_rng_state(self._rng)
        _Replay(recorder, models, self.unit_classes, self.persistence_threshold).run()
        if not torch.equal(at_exit, recorder.last_rng if recorder.last_rng is not None else self._rng):
            torch.set_rng_state(at_exit)  # reseeded after the last random draw


@dataclasses.dataclass
class _Preshard:
    """What zero.Init leaves for initialize(): this rank's chunk of every unit, per layout."""

    world: int
    unit_numels: list[int]
    shard: torch.Tensor

    def __call__(self, layout: FlatLayout) -> torch.Tensor:
        if layout.world != self.world or [b.numel for b in layout.buckets] != self.unit_numels:
            raise ConfigError(
                "zero_optimization: the model is already partitioned (by zero.Init or an engine without an optimizer) with "
                f"other ZeRO-3 settings (world size {self.world}, units of {self.unit_numels} elements, now "
                f"{layout.world} and {[b.numel for b in layout.buckets]}); use the same zero_optimization section"
            )
        return self.shard


_preshards: weakref.WeakKeyDictionary[torch.nn.Module, _Preshard] = weakref.WeakKeyDictionary()


def take_preshard(model: torch.nn.Module) -> _Preshard | None:
    """The shards zero.Init built for ``model`` (consumed: a second initialize needs a new build)."""
    return _preshards.pop(model, None)


def is_presharded(model: torch.nn.Module) -> bool:
    return model in _preshards


def leave_presharded(model: torch.nn.Module, world: int, unit_numels: list[int], shard: torch.Tensor) -> None:
    """An engine hands ``model`` on still partitioned: the next initialize() starts from ``shard`` as from zero.Init's."""
    _preshards[model] = _Preshard(world, unit_numels, shard)


class _Replay:
    def __init__(
        self, recorder: _Recorder, models: list[torch.nn.Module], unit_classes: list[str] | None, threshold: int
    ) -> None:
        from slipstream.comm import init_distributed

        init_distributed()
        get_accelerator().return_freed_memory(0)  # the replay frees one materialised parameter after another
        self.unit_classes, self.threshold = unit_classes, threshold
        self.recorder, self.models, self.log = recorder, models, recorder.log
        self.world, self.rank = dist.get_world_size(), dist.get_rank()

    def run(self) -> None:
        from slipstream.engine.zero.stage3.units import find_units

        targets: dict[
            int, list[tuple[torch.Tensor, torch.Tensor, list[Any]]]
        ] = {}  # storage key -> [(param, shard, pieces)]
        layouts = []
        for model in self.models:
            specs = find_units(model, self.unit_classes, self.threshold)
            managed = [p for s in specs for p in s.params]
            index = {id(p): i for i, p in enumerate(managed)}
            layout = FlatLayout(
                [p.numel() for p in managed],
                [],
                0,
                self.world,
                self.rank,
                buckets=[[index[id(p)] for p in s.params] for s in specs],
            )
            shard = torch.zeros(layout.shard_numel, dtype=managed[0].dtype if managed else torch.float32)
            pieces: dict[int, list[Any]] = {}
            for piece in layout.pieces:
                pieces.setdefault(piece.index, []).append(piece)
            for i, p in enumerate(managed):
                if p.is_meta:
                    targets.setdefault(p.untyped_storage()._cdata, []).append((p, shard, pieces.get(i, [])))
                else:
                    copy_pieces(p.detach(), shard, pieces.get(i, []))
            layouts.append((model, layout, shard))
        buffers = {b.untyped_storage()._cdata for m in self.models for b in m.buffers() if b.is_meta}
        real = self._replay(targets, buffers)
        replaced: dict[int, torch.nn.Parameter] = {}
        for model, layout, shard in layouts:
            _materialize_buffers(model, real)
            _hollow_parameters(model, replaced)
            _preshards[model] = _Preshard(self.world, [b.numel for b in layout.buckets], shard)

    def _replay(self, targets: dict[int, list[Any]], keep: set[int]) -> dict[int, torch.UntypedStorage]:
        last_use: dict[int, int] = {}
        last_overwrite: dict[int, int] = {}
        first_foreign_read: dict[int, int] = {}
        for i, op in enumerate(self.log):
            for key in op.reads | op.writes:
                last_use[key] = i
            for key in op.overwrites:
                last_overwrite[key] = i
            for key in op.reads - op.writes:
                first_foreign_read.setdefault(key, i)
        # Writes before this index are irrelevant: a later full overwrite replaces them unread.
        live_from = {key: (i if first_foreign_read.get(key, i) >= i else 0) for key, i in last_overwrite.items()}
        real: dict[int, torch.UntypedStorage] = {}
        ends: dict[int, list[int]] = {}
        for key, i in last_use.items():
            ends.setdefault(i, []).append(key)
        first_draw = True
        for i, op in enumerate(self.log):
            if op.random:
                if first_draw:  # the state of the first draw: after any seeding in the constructor
                    torch.set_rng_state(self.recorder.first_rng)
                elif op.reseed is not None:
                    torch.set_rng_state(op.reseed)
                first_draw = False
            if not op.writes:
                pass  # views and reads have no effect of their own: later ops rebuild views from refs
            elif all(i < live_from.get(key, 0) for key in op.writes):
                if op.random:  # draw the same numbers an unsharded build draws, into scratch
                    op.func(*pytree.tree_map(_scratch, op.args), **_on_cpu(pytree.tree_map(_scratch, op.kwargs)))
            else:
                self._run(op, real)
            for key in ends.get(i, []):
                if key in targets and key in real:
                    for p, shard, pieces in targets[key]:
                        ref = self.recorder._ref(p)
                        copy_pieces(alias(real[key], ref.offset, ref.size, ref.dtype, ref.stride), shard, pieces)
                if key not in keep:
                    real.pop(key, None)
        return real

    def _run(self, op: _Op, real: dict[int, torch.UntypedStorage]) -> None:
        def materialize(value: Any) -> Any:
            if not isinstance(value, _Ref):
                return value
            if value.key not in real:
                real[value.key] = torch.UntypedStorage(self.recorder.storages[value.key].nbytes())
            return alias(real[value.key], value.offset, value.size, value.dtype, value.stride)

        args, kwargs = pytree.tree_map(materialize, (op.args, op.kwargs))
        out = op.func(*args, **_on_cpu(kwargs))
        leaves = pytree.tree_leaves(out)
        for key, index in op.creates:
            real[key] = leaves[index].untyped_storage()


def _scratch(value: Any) -> Any:
    if isinstance(value, _Ref):
        return torch.empty_strided(value.size, value.stride, dtype=value.dtype)
    return value


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "meta":
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


def _materialize_buffers(model: torch.nn.Module, real: dict[int, torch.UntypedStorage]) -> None:
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                key = buffer.untyped_storage()._cdata
                storage = real.get(key) or torch.UntypedStorage(buffer.untyped_storage().nbytes())
                module._buffers[name] = alias(
                    storage, buffer.storage_offset(), buffer.shape, buffer.dtype, buffer.stride()
                )


def _hollow_parameters(model: torch.nn.Module, replaced: dict[int, torch.nn.Parameter]) -> None:
    """Swap meta parameters for hollow CPU ones (a meta tensor cannot become a CPU one in place)."""
    from slipstream.engine.zero.stage3.unit import ReleasedParameter

    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in {id(p): p for p in model.parameters() if p.is_meta and id(p) not in replaced}.values():
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, metas in by_dtype.items():
        for source, tensor in zip(metas, hollow([p.shape for p in metas], dtype, torch.device("cpu"))):
            replaced[id(source)] = torch.nn.Parameter(tensor, requires_grad=source.requires_grad)
            replaced[
                id(source)
            ].__class__ = ReleasedParameter  # computing with it before initialize() raises, not crashes
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in replaced:
                module._parameters[name] = replaced[id(p)]


def prepare_presharded(model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """initialize()'s ``model.to(device, dtype)`` for a zero.Init model: recast hollow parameters, move buffers."""
    params = [p for p in model.parameters() if p.device != device or (dtype is not None and p.dtype != dtype)]
    if params:
        for p, tensor in zip(params, hollow([p.shape for p in params], dtype or params[0].dtype, device)):
            p.data = tensor
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                cast = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = buffer.to(device=device, dtype=cast)
