"""Eager islands: run an engine function inside a compiled graph as one opaque op, its autograd kept.

[Note: eager islands] The engine's code that runs *inside* a block (tensor parallel's f/g pairs,
Ulysses' all-to-alls, ring attention, expert dispatch, tiled MLPs) talks to process groups, keeps Python
state and is written as ``torch.autograd.Function``\\ s. Dynamo cannot trace it, so a compiled
block would break its graph at every such call. :func:`island` makes each call one custom op
(``slipstream::island``) instead: dynamo and inductor see an opaque node with known output shapes
(the ``meta`` function, run on fake tensors) and compile everything around it into one graph.

At run time the op calls the function eagerly, with autograd switched back on (a custom op runs
below autograd), on detached copies of its inputs that require grad. It keeps the inputs and
outputs under an integer handle, which it returns as one more (CPU) output; the op's backward,
``slipstream::island_backward``, takes that handle and runs ``torch.autograd.backward`` through
the kept graph: the input gradients come back from the copies' ``.grad``, and any parameter the
function used gets its gradient as in eager (its ``AccumulateGrad`` hooks fire: ZeRO's reductions).

A kept graph lives until its backward, or until its handle tensor is freed: activation
checkpointing drops a forward's saved handle and recomputes, so the first forward's entry is
dropped with it, never leaked. Outside a compiled region :func:`island` just calls the function.

Identities: a function is declared once, at import (:func:`declare`, with its ``meta``), and a
process group or another long-lived engine object (an attention function's state) when the engine
makes it (:func:`register`); both get small integers in the order they were made. A call passes
those integers and its other non-tensor arguments (ints, floats, strings, None) to the op as
constants of the graph, so the blocks of a model that make the same call share one graph, and a
graph's text is the same in every process (inductor's cache hits).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

Meta = Callable[..., Any]  # (*fake tensors, *statics) -> fake output tensor(s) of the right shape and dtype
Static = Any  # a registered object (a process group), an int, a float, a bool, a string or None

_DECLARED: dict[int, int] = {}  # id(fn) -> its number
_BY_NUMBER: dict[int, tuple[Any, Meta]] = {}
_OBJECTS: dict[int, int] = {}  # id(object) -> its number
_OBJECT_BY_NUMBER: dict[int, Callable[[], Any]] = {}
_KEPT: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
_HANDLES = itertools.count(1)
_SEPARATOR = "\x1f"  # the string arguments travel as one (a custom op takes no list of strings)
# The dispatch state of ordinary eager code (autograd on), taken at import: inside a custom op autograd is excluded.
_EAGER_INCLUDE = torch._C._dispatch_tls_local_include_set()
_EAGER_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


def declare(fn: Callable[..., Any] | type[torch.autograd.Function], meta: Meta) -> None:
    """Make ``fn`` callable through :func:`island` (at import: its number is its place in the import order)."""
    if id(fn) not in _DECLARED:
        number = len(_BY_NUMBER)
        _DECLARED[id(fn)] = number
        _BY_NUMBER[number] = (fn, meta)


def register(obj: Any) -> None:
    """Make ``obj`` usable as an island's static argument (the mesh registers each group it makes). Held weakly
    where it can be (an engine's attention state, experts and tiles go with the engine), else for good (groups)."""
    if id(obj) not in _OBJECTS or _OBJECT_BY_NUMBER[_OBJECTS[id(obj)]]() is not obj:
        number = len(_OBJECT_BY_NUMBER)
        _OBJECTS[id(obj)] = number
        try:
            _OBJECT_BY_NUMBER[number] = weakref.ref(obj)
        except TypeError:
            _OBJECT_BY_NUMBER[number] = lambda: obj


def number_of(obj: Any) -> int:
    """``obj``'s number (registering it first): a constant a graph can carry in place of the object."""
    register(obj)
    return _OBJECTS[id(obj)]


def object_of(number: int) -> Any:
    """The object registered under ``number`` (None once an object held weakly is gone)."""
    return _OBJECT_BY_NUMBER[number]()


def island(
    fn: Callable[..., Any] | type[torch.autograd.Function],
    tensors: Sequence[torch.Tensor],
    statics: tuple[Static, ...] = (),
) -> Any:
    """``fn(*tensors, *statics)`` (``fn.apply`` for an autograd Function class); inside a compiled region, as one
    opaque op (see [Note: eager islands]). ``fn`` was declared; ``tensors`` are floating-point."""
    if not torch.compiler.is_compiling():
        return _call(fn, tensors, statics)
    number = _DECLARED[id(fn)]
    codes, ints, floats, strings = "", [], [], []
    for value in statics:
        if value is None:
            codes += "n"
        elif isinstance(value, bool):
            codes, ints = codes + "b", [*ints, int(value)]
        elif isinstance(value, int):
            codes, ints = codes + "i", [*ints, value]
        elif isinstance(value, float):
            codes, floats = codes + "f", [*floats, value]
        elif isinstance(value, str):
            codes, strings = codes + "s", [*strings, value]
        else:
            codes, ints = codes + "o", [*ints, _OBJECTS[id(value)]]
    outs = _island(list(tensors), number, codes, ints, floats, _SEPARATOR.join(strings), torch.is_grad_enabled())
    results = outs[:-1]
    return tuple(results) if len(results) > 1 else results[0]


def _statics(codes: str, ints: Sequence[int], floats: Sequence[float], strings: str) -> tuple[Static, ...]:
    out: list[Static] = []
    next_int, next_float, next_string = iter(ints), iter(floats), iter(strings.split(_SEPARATOR))
    for code in codes:
        if code == "n":
            out.append(None)
        elif code == "b":
            out.append(bool(next(next_int)))
        elif code == "i":
            out.append(next(next_int))
        elif code == "f":
            out.append(next(next_float))
        elif code == "s":
            out.append(next(next_string))
        else:
            out.append(object_of(next(next_int)))
    return tuple(out)


def _call(fn: Any, tensors: Sequence[torch.Tensor], statics: tuple[Any, ...]) -> Any:
    return fn.apply(*tensors, *statics) if isinstance(fn, type) else fn(*tensors, *statics)


def _as_list(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@torch.library.custom_op("slipstream::island", mutates_args=())
def _island(
    inputs: list[torch.Tensor],
    number: int,
    codes: str,
    ints: list[int],
    floats: list[float],
    strings: str,
    build_graph: bool,
) -> list[torch.Tensor]:
    fn, _ = _BY_NUMBER[number]
    statics = _statics(codes, ints, floats, strings)
    if not build_graph:
        with torch._C._ForceDispatchKeyGuard(_EAGER_INCLUDE, _EAGER_EXCLUDE), torch.no_grad():
            outs = _as_list(_call(fn, inputs, statics))
        return [_unaliased(o, inputs) for o in outs] + [torch.zeros((), dtype=torch.int64)]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch._C._ForceDispatchKeyGuard(_EAGER_INCLUDE, _EAGER_EXCLUDE), torch.enable_grad():
        outs = _as_list(_call(fn, leaves, statics))
    number = next(_HANDLES)
    handle = torch.full((), number, dtype=torch.int64)
    _KEPT[number] = (leaves, outs)
    weakref.finalize(handle, _KEPT.pop, number, None)  # dropped unused (a checkpointed forward): freed with it
    return [_unaliased(o.detach(), inputs) for o in outs] + [handle]


@_island.register_fake
def _island_fake(
    inputs: list[torch.Tensor],
    number: int,
    codes: str,
    ints: list[int],
    floats: list[float],
    strings: str,
    build_graph: bool,
) -> list[torch.Tensor]:
    _, meta = _BY_NUMBER[number]
    outs = _as_list(meta(*inputs, *_statics(codes, ints, floats, strings)))
    return [o.new_empty(o.shape) for o in outs] + [torch.empty((), dtype=torch.int64)]  # contiguous: see _unaliased


def _unaliased(out: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """``out`` contiguous (the strides the fake promised inductor) and not sharing storage with an input (a custom
    op's output may not alias one: an identity's view is copied)."""
    storage = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in inputs):
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


@torch.library.custom_op("slipstream::island_backward", mutates_args=())
def _island_backward(
    grads: list[torch.Tensor | None], handle: torch.Tensor, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    leaves, outs = _KEPT.pop(int(handle))
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
    with torch._C._ForceDispatchKeyGuard(_EAGER_INCLUDE, _EAGER_EXCLUDE):
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    # laid out as its input (``empty_like``, as the fake says); zeros where no gradient reached (None for ints: _backward)
    return [_like(leaf, leaf.grad) for leaf in leaves]


def _like(leaf: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty_like(leaf)
    if grad is None:
        return out.zero_()
    return grad if grad.stride() == out.stride() else out.copy_(grad)


@_island_backward.register_fake
def _island_backward_fake(
    grads: list[torch.Tensor | None], handle: torch.Tensor, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in inputs]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    ctx.save_for_backward(output[-1], *inputs[0])
    ctx.empty_lists = (not inputs[3], not inputs[4])  # an empty list argument takes an empty list as its "gradient"


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[Any, ...]:
    handle, *inputs = ctx.saved_tensors
    grads_in = _island_backward(list(grads[:-1]), handle, inputs)
    grads_in = [g if t.is_floating_point() else None for g, t in zip(grads_in, inputs)]
    no_ints, no_floats = ctx.empty_lists
    return grads_in, None, None, [] if no_ints else None, [] if no_floats else None, None, None


_island.register_autograd(_backward, setup_context=_setup_context)
