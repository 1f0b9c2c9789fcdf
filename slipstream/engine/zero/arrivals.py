"""Gradient arrivals: what stages 0-2 do each time a parameter's gradient has been accumulated.

Per parameter and per backward a strategy must mark the parameter used, keep its gradient where the
step reads it (stage 0 and stage 1: ``.grad`` is a view into the flat buffer; mixed precision: the
low-precision gradient is added into fp32 and freed), and count its bucket down, so the bucket's
collective launches once its last gradient has landed (``ordered_launch.py``).

[Note: arrivals in C++] Written as a Python ``post_accumulate_grad_hook`` that is 3-5 Python calls
per parameter tensor per step: 35 µs of a 460 µs step at 10 tensors, 30 ms of a 250 ms step at
10,000 (issue 50). The compiled op (``csrc/hooks/grad_arrivals.cpp``) does it in a C++ post hook on
each parameter's gradient accumulator, as DDP's reducer does, and calls Python once per complete
bucket. Where the op cannot be built (no compiler, ``SLIPSTREAM_DISABLE_OPS``) :class:`PythonArrivals`
does the same in Python hooks, with the same semantics, one call per parameter.

Both take their parameters in *slots* (the order given) and write used flags at each slot's
``index`` in the strategy's ``used`` bytearray.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from slipstream.ops import builder
from slipstream.ops.specs import GRAD_ARRIVALS
from slipstream.utils import eager_island

COUNT, ADOPT, ADD_AND_FREE = 0, 1, 2  # what happens to the gradient before it is counted (see the C++ Mode)


class Arrivals(Protocol):
    sync: bool  # this backward completes the window: buckets count down and launch
    aside: bool  # the strategy stands aside (the first-batch twin check): arrivals do nothing
    launch: bool  # a complete bucket launches from the hook (overlap_comm); else at the flush

    def arrive(self, slot: int) -> None:
        """Slot's gradient reached ``.grad`` without autograd's accumulator (a pipeline's weight pass)."""

    def reset(self) -> None:
        """A new window: every bucket waits for all of its gradients again."""

    def remove(self) -> None:
        """Detach from the parameters."""

    def hooks(self) -> int:
        """How many parameters are attached."""


def attach(
    params: Sequence[torch.nn.Parameter],
    indices: Sequence[int],
    views: Sequence[torch.Tensor],
    mode: int,
    bucket_of: Sequence[int],
    buckets: int,
    used: bytearray,
    on_bucket: Callable[[int], None],
    on_twice: Callable[[int], None],
) -> Hooked:
    """Hooks on ``params``: the compiled op's where it loads ([Note: arrivals in C++]), else Python's.

    ``views[k]``: slot k's gradient place (empty with COUNT); ``bucket_of[k]``: its bucket (-1: none);
    ``on_bucket(b)``: bucket b's last gradient arrived; ``on_twice(index)``: a gradient arrived twice in a
    window (raises)."""
    args = (list(params), list(indices), list(views), mode, list(bucket_of), buckets, used, on_bucket, on_twice)
    return Hooked(args)


def _compiled_autograd() -> bool:
    """Whether a backward now would run under compiled autograd (never imports dynamo: not loaded, not on)."""
    dynamo, compiled = sys.modules.get("torch._dynamo"), sys.modules.get("torch._dynamo.compiled_autograd")
    if dynamo is None or compiled is None:
        return False
    return bool(compiled.compiled_autograd_enabled or dynamo.config.compiled_autograd)


class Hooked:
    """One strategy's arrivals: the compiled op's hooks, or :class:`PythonArrivals`.

    [Note: compiled autograd traces Python hooks] Compiled autograd traces every hook of the graph it
    compiles; a C++ hook it cannot trace fails the backward (``compiled_args nyi``). So before each
    backward (:meth:`before_backward`) a backward that compiled autograd would run moves these
    parameters to the Python hooks, once, with the same flags and state: the counting starts fresh at
    the window's first backward, the used flags live in the strategy's bytearray.
    """

    def __init__(self, args: tuple) -> None:  # type: ignore[type-arg]
        self.args = args
        op = builder.load(GRAD_ARRIVALS) if args[0] and not _compiled_autograd() else None  # nothing to hook: no build
        self.impl: Arrivals = (op.GradArrivals if op is not None else PythonArrivals)(*args)

    def before_backward(self, sync: bool) -> None:
        if not isinstance(self.impl, PythonArrivals) and _compiled_autograd():
            aside, launch = self.impl.aside, self.impl.launch
            self.impl.remove()
            self.impl = PythonArrivals(*self.args)
            self.impl.aside, self.impl.launch = aside, launch
        self.impl.sync = sync

    @property
    def sync(self) -> bool:
        return self.impl.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.impl.sync = value

    @property
    def aside(self) -> bool:
        return self.impl.aside

    @aside.setter
    def aside(self, value: bool) -> None:
        self.impl.aside = value

    @property
    def launch(self) -> bool:
        return self.impl.launch

    @launch.setter
    def launch(self, value: bool) -> None:
        self.impl.launch = value

    def arrive(self, slot: int) -> None:
        self.impl.arrive(slot)

    def reset(self) -> None:
        self.impl.reset()

    def remove(self) -> None:
        self.impl.remove()

    def hooks(self) -> int:
        return self.impl.hooks()


# [Note: an arrival is one opaque op under compiled autograd] Compiled autograd hands every hook of the
# backward to dynamo, which traces into it: an arrival writes a flag into a bytearray and may launch a
# bucket's collective from Python, neither of which dynamo can trace, so the backward's graph broke at
# every parameter (ZeRO-2 on four Linear layers: 9 graphs and 18 breaks for one backward). While dynamo
# traces, the hook instead calls ``slipstream::gradient_arrived``, a custom op dynamo keeps in the graph
# without looking inside; when the graph runs, the op runs the arrival in Python, unchanged. The op
# "mutates" a one-element token, so no pass drops it as unused (it returns nothing) and the arrivals keep
# their order in the graph. The arrivals object travels as its number (``eager_island.number_of``, the
# registry the islands' objects use). Outside dynamo the hook calls the arrival directly, as before.
_TOKEN = torch.zeros(1)


@torch.library.custom_op("slipstream::gradient_arrived", mutates_args=("token",))
def _gradient_arrived(param: torch.Tensor, token: torch.Tensor, owner: int, slot: int) -> None:
    eager_island.object_of(owner).arrive(slot)


@_gradient_arrived.register_fake
def _(param: torch.Tensor, token: torch.Tensor, owner: int, slot: int) -> None:
    return None


class PythonArrivals:
    """The compiled op's semantics in Python hooks (its fallback): see ``csrc/hooks/grad_arrivals.cpp``."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        indices: list[int],
        views: list[torch.Tensor],
        mode: int,
        bucket_of: list[int],
        buckets: int,
        used: bytearray,
        on_bucket: Callable[[int], None],
        on_twice: Callable[[int], None],
    ) -> None:
        self.params, self.indices, self.views, self.mode = params, indices, views, mode
        self.bucket_of, self.used, self.on_bucket, self.on_twice = bucket_of, used, on_bucket, on_twice
        self.sizes = [0] * buckets
        for bucket in bucket_of:
            if bucket >= 0:
                self.sizes[bucket] += 1
        self.sync = self.aside = False
        self.launch = True
        self.reset()
        self.key = eager_island.number_of(self)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(k)) for k, p in enumerate(params)]

    def _hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        def arrived(param: torch.Tensor) -> None:
            if torch.compiler.is_compiling():  # [Note: an arrival is one opaque op under compiled autograd]
                torch.ops.slipstream.gradient_arrived(param, _TOKEN, self.key, slot)
            else:
                self.arrive(slot)

        return arrived

    def arrive(self, slot: int) -> None:
        if self.aside:
            return
        param = self.params[slot]
        if self.mode == ADOPT:
            view = self.views[slot]
            if param.grad is not None and param.grad is not view:
                if param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view
        elif self.mode == ADD_AND_FREE and param.grad is not None:
            self.views[slot].add_(param.grad)
            param.grad = None
        self.used[self.indices[slot]] = 1
        if not self.sync:
            return
        if self.ready[slot]:
            self.on_twice(self.indices[slot])
            return
        self.ready[slot] = 1
        bucket = self.bucket_of[slot]
        if bucket >= 0:
            self.pending[bucket] -= 1
            if not self.pending[bucket] and self.launch:
                self.on_bucket(bucket)

    def reset(self) -> None:
        self.pending = list(self.sizes)
        self.ready = bytearray(len(self.params))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.on_bucket = self.on_twice = _removed

    def hooks(self) -> int:
        return len(self.handles)


def _removed(_: int) -> None:
    raise AssertionError("gradient arrivals: called after remove()")
