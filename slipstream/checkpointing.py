"""Activation checkpointing: keep a region's inputs, recompute its activations during backward.

``checkpoint(fn, *args)`` runs ``fn`` without keeping the tensors autograd would save inside it
and replays it when backward first needs one (``torch.utils.checkpoint``, non-reentrant by
default). ``apply_activation_checkpointing(model, ["GPT2Block"])`` does the same to every module
of the named classes of an unchanged model, keeping parameter names and hooks as they are.

[Note: recomputation and ZeRO-3] A module that is itself a ZeRO-3 unit needs nothing special: its
forward hooks fire around the checkpointed call, and backward gathers the unit (a hook on its
outputs) before any node inside it runs, so before the recomputation. A unit *inside* a
checkpointed region, however, sees its forward hooks fire a second time during backward, in a
graph that is never backpropagated. Stage 3 asks :func:`is_recomputing` and then only makes sure
the unit is gathered — no second post-backward registration, hence no second reduce.

[Note: cpu_checkpointing] With ``cpu_checkpointing`` the region's saved inputs (the only tensors a
checkpointed region keeps) are copied to pinned host memory when saved and copied back, the next
one ahead of time, when the recomputation needs them (``saved_tensor_offload.HostOffload``). That
lowers *device* memory on an accelerator. On a CPU-only machine the activations already live in
host memory: offloading would copy a tensor to where it is, so the tensors are kept as they are
and nothing changes (measured, see docs/activation_checkpointing.md). With ``offload_path`` they go
to files in that directory instead, on any device, read back ahead of their backward
(``saved_tensor_offload.FileOffload``): for when host memory is the limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint

from slipstream.saved_tensor_offload import FileOffload, HostOffload

__all__ = [
    "CheckpointOptions",
    "apply_activation_checkpointing",
    "checkpoint",
    "configure",
    "is_recomputing",
    "offload_saved_tensors",
    "remove_activation_checkpointing",
]


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Defaults for :func:`checkpoint` (set from the ``activation_checkpointing`` config section)."""

    cpu_checkpointing: bool = False
    use_reentrant: bool = False
    synchronize_checkpoint_boundary: bool = False
    offload_path: str | None = None  # checkpointed inputs to files in this directory (any device)


_defaults = CheckpointOptions()
_state = threading.local()
_offloads: dict[str | None, HostOffload | FileOffload] = {}  # by path (None: pinned host memory)


def _offload(path: str | None) -> HostOffload | FileOffload:
    """The one offload per destination: its order of saved tensors spans every checkpointed region."""
    if path not in _offloads:
        _offloads[path] = FileOffload(path) if path is not None else HostOffload()
    return _offloads[path]


def configure(options: CheckpointOptions | None = None, **changes: Any) -> CheckpointOptions:
    """Set the defaults every later :func:`checkpoint` call uses; returns them."""
    global _defaults
    _defaults = dataclasses.replace(options or _defaults, **changes)
    return _defaults


def is_recomputing() -> bool:
    """True while a non-reentrant checkpoint replays its forward during backward."""
    return getattr(_state, "recomputing", 0) > 0


@contextlib.contextmanager
def _recomputation() -> Iterator[None]:
    _state.recomputing = getattr(_state, "recomputing", 0) + 1
    try:
        yield
    finally:
        _state.recomputing -= 1


def _context_fn() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext(), _recomputation()


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    cpu_checkpointing: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` without keeping its activations; they are recomputed in backward.

    Non-reentrant unless ``use_reentrant=True`` (the reentrant variant binds keyword arguments
    into the function, so tensors passed by keyword get no gradient, and needs a positional input
    that requires grad). ``cpu_checkpointing`` (default: the
    configured one) keeps the saved inputs in host memory. Under ``torch.no_grad`` it simply calls
    ``function``.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    reentrant = _defaults.use_reentrant if use_reentrant is None else use_reentrant
    offload = _defaults.cpu_checkpointing if cpu_checkpointing is None else cpu_checkpointing
    extra: dict[str, Any] = {} if reentrant else {"context_fn": _context_fn}
    if reentrant and kwargs:  # torch's reentrant variant takes positional inputs only
        function, kwargs = functools.partial(function, **kwargs), {}
    path = _defaults.offload_path
    with offload_saved_tensors(path) if offload or path is not None else contextlib.nullcontext():
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=reentrant, **extra, **kwargs)
    if _defaults.synchronize_checkpoint_boundary:
        from slipstream.accelerator import get_accelerator

        get_accelerator().synchronize()
    return out


# --------------------------------------------------------------------------- host offload


def offload_saved_tensors(path: str | None = None) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved tensors on an accelerator go to pinned host memory, and come back (the next one ahead) when unpacked;
    with ``path``, each saved tensor of 64 KiB or more goes to a file in that directory instead.

    Tensors already on the CPU are kept as they are by the host offload (see [Note: cpu_checkpointing]).
    """
    where = _offload(path)
    return torch.autograd.graph.saved_tensors_hooks(where.pack, where.unpack)


# --------------------------------------------------------------------------- modules by class


_WRAPPED = "_slipstream_checkpointed_forward"


def apply_activation_checkpointing(
    model: torch.nn.Module,
    module_classes: Sequence[str],
    number_checkpoints: int | None = None,
    cpu_checkpointing: bool | None = None,
    strict: bool = True,
) -> list[str]:
    """Checkpoint the forward of every module whose class name is in ``module_classes``.

    The module's ``forward`` is replaced on the instance (names, parameters and hooks are
    unchanged). With ``number_checkpoints`` only the first that many matching modules, in
    registration order, are checkpointed: fewer recomputations for more memory. Returns the
    qualified names of the checkpointed modules. Raises ``ValueError`` naming the classes the model
    has when a class is not found, unless ``strict=False`` (a pipeline stage holds only some of them).
    """
    wanted = set(module_classes)
    matches = outermost_of_classes(model, module_classes)
    missing = wanted - {type(m).__name__ for _, m in matches}
    if missing and strict:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"activation_checkpointing.module_classes: no module of class {', '.join(sorted(missing))} in the model "
            f"(its classes: {', '.join(classes)})"
        )
    if number_checkpoints is not None:
        matches = matches[:number_checkpoints]
    for _, module in matches:
        _wrap(module, cpu_checkpointing)
    return [name for name, _ in matches]


def outermost_of_classes(model: torch.nn.Module, module_classes: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module whose class name is in ``module_classes`` and that no other such module
    contains, in registration order."""
    wanted = set(module_classes)
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in wanted and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return found


def remove_activation_checkpointing(model: torch.nn.Module) -> None:
    """Undo :func:`apply_activation_checkpointing`: every module runs its own forward again."""
    for module in model.modules():
        if _WRAPPED in module.__dict__:
            _unwrap(module)


def _unwrap(module: torch.nn.Module) -> None:
    """The forward the module had before :func:`_wrap`: its class's, or what was on the instance (a compiled one)."""
    previous = module.__dict__.pop(_WRAPPED)
    if previous is None:
        del module.forward
    else:
        module.forward = previous


# [Note: no cache under recomputation] A layer that writes a key/value cache in its forward would
# write it a second time when backward replays the forward (and then attend over the doubled
# cache: wrong gradients, or a metadata mismatch in the non-reentrant variant). Training needs no
# cache, so a checkpointed module gets none, as the transformers library does for its own gradient
# checkpointing. Caches are found two ways, so a renamed argument cannot slip through (transformers
# 5.24 renamed ``past_key_values`` to ``cache``): by the argument names below, and by value: any
# argument that behaves like a cache (``update`` and ``get_seq_length``) is replaced by None.
_CACHE_ARGUMENTS = {
    "past_key_values": None,
    "past_key_value": None,
    "layer_past": None,
    "cache": None,
    "use_cache": False,
}


def _is_cache(value: Any) -> bool:
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def without_caches(
    signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """The call's arguments with every cache argument set to its no-cache value."""
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            for name, value in list(bound.arguments.items()):
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    bound.arguments[name] = without_caches(None, (), value)[1]
                elif kind is inspect.Parameter.VAR_POSITIONAL:
                    bound.arguments[name] = without_caches(None, value, {})[0]
                elif name in _CACHE_ARGUMENTS and value not in (None, False):
                    bound.arguments[name] = _CACHE_ARGUMENTS[name]
                elif _is_cache(value):
                    bound.arguments[name] = None
            return bound.args, bound.kwargs
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {
        k: (_CACHE_ARGUMENTS[k] if k in _CACHE_ARGUMENTS and v not in (None, False) else None if _is_cache(v) else v)
        for k, v in kwargs.items()
    }
    return args, kwargs


def _wrap(module: torch.nn.Module, cpu_checkpointing: bool | None) -> None:
    if _WRAPPED in module.__dict__:
        _unwrap(module)  # wrapped before: wrap what it had then afresh
    previous = module.__dict__.get("forward")
    original = module.forward
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # see [Note: no cache under recomputation]
            args, kwargs = without_caches(signature, args, kwargs)
        return checkpoint(original, *args, cpu_checkpointing=cpu_checkpointing, **kwargs)

    module.forward = forward
    module.__dict__[_WRAPPED] = previous
