"""The module and autograd hooks that drive ZeRO-3 units through forward and backward.

* forward: the model's pre-hook starts a pass and gathers the root units (kept for the whole
  forward and backward); a block unit's pre-hook makes it live (the schedule decides what else
  to gather) and its post-hook frees it;
* backward: a hook on a unit's outputs gathers it again before its backward; an autograd
  function wrapped around its inputs fires when its backward is done, and the reducer takes its
  gradients.

While registered, the hooks keep their ``owner`` (the strategy) alive, as the gradient hooks of
stages 0-2 do, so the strategy can still be closed when the model is wrapped again; nothing
global refers to either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.checkpointing import is_recomputing
from slipstream.engine.zero.stage3.buffers import UnitBuffers
from slipstream.engine.zero.stage3.reducer import UnitReducer
from slipstream.engine.zero.stage3.schedule import GatherSchedule
from slipstream.engine.zero.stage3.unit import ParamUnit
from slipstream.engine.zero.tensor_tree import tensors_in


class UnitHooks:
    def __init__(
        self,
        roots: list[ParamUnit],
        blocks: list[ParamUnit],
        schedule: GatherSchedule,
        reducer: UnitReducer,
        buffers: UnitBuffers,
        owner: object,
    ) -> None:
        self.roots, self.blocks, self.schedule, self.reducer, self.owner = roots, blocks, schedule, reducer, owner
        self.buffers = buffers
        self.held = False  # every unit gathered for a whole accumulation window (a pipeline step): hooks stand aside

    def register(self, module: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        hooks = [
            module.register_forward_pre_hook(self._begin_forward_pass, prepend=True),
            module.register_forward_hook(self._end_forward_pass),
        ]
        for unit in self.blocks:
            hooks.append(unit.spec.module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True))
            hooks.append(unit.spec.module.register_forward_hook(self._post_forward(unit)))
        return hooks

    # ------------------------------------------------------------------ forward
    def _begin_forward_pass(self, module: torch.nn.Module, args: Any) -> None:
        if self.held:
            return
        for root in self.roots:
            root.gathered()
            if torch.is_grad_enabled():
                root.pending_backward += 1
        self.schedule.begin_forward(backward_follows=torch.is_grad_enabled())

    def _end_forward_pass(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.held:
            return output
        self.schedule.end_forward()
        for root in self.roots:
            if torch.is_grad_enabled():  # backward needs it first thing: keep it (FSDP2 keeps its root too)
                self._on_output_grad(root, output)
            else:
                root.reshard()
        if torch.is_grad_enabled():
            self.buffers.shrink()  # nothing idle at the peak ([Note: nothing idle into the backward] in buffers.py)
        return output

    def _pre_forward(self, unit: ParamUnit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.held:
                return None
            if is_recomputing():  # see [Note: recomputation and ZeRO-3] in slipstream.checkpointing
                unit.gathered()  # no depth count: a recomputation stops early, skipping post-hooks
                return None
            self.schedule.ensure(unit, backward=False)
            unit.pre_forward()
            if not torch.is_grad_enabled():
                return None
            if self.schedule.forward_gathered_all():
                self.buffers.shrink()  # [Note: nothing idle into the backward] in buffers.py
            return _wrap_inputs(self, unit, args, kwargs)

        return hook

    def _post_forward(self, unit: ParamUnit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self.held or is_recomputing():
                return output  # stays gathered for its backward, which comes next and releases it
            grad = torch.is_grad_enabled()
            unit.post_forward(keep=self.schedule.keeps(unit))
            if grad:
                self._on_output_grad(unit, output)
            return output

        return hook

    def _on_output_grad(self, unit: ParamUnit, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: self._pre_backward(unit), mode="any")

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: ParamUnit) -> None:
        self.schedule.begin_backward()
        if unit.kind == "block":
            self.schedule.ensure(unit, backward=True)
        else:
            unit.gathered()
            self.schedule.prefetch(backward=True)
        unit.pre_backward()
        self.reducer.remember_grads(unit)

    def post_backward(self, unit: ParamUnit) -> None:
        if unit.post_backward():
            self.reducer.unit_done(unit)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward is done."""

    @staticmethod
    def forward(ctx: Any, hooks: UnitHooks, unit: ParamUnit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.unit = hooks, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks.post_backward(ctx.unit)
        return (None, None, *grads)


def _wrap_inputs(hooks: UnitHooks, unit: ParamUnit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat = [(k, v) for k, v in enumerate(args) if isinstance(v, torch.Tensor) and v.requires_grad]
    named = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not flat and not named:
        return None
    wrapped = _PostBackward.apply(hooks, unit, *(v for _, v in flat), *(v for _, v in named))
    new_args = list(args)
    for (k, _), t in zip(flat, wrapped[: len(flat)]):
        new_args[k] = t
    new_kwargs = dict(kwargs)
    for (k, _), t in zip(named, wrapped[len(flat) :]):
        new_kwargs[k] = t
    return tuple(new_args), new_kwargs
