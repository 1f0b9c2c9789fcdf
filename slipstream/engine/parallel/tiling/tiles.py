"""Run a module's computation over token tiles: forward without keeping any tile's intermediates, backward by
recomputing one tile at a time.

[Note: tiles and their gradients] ``tiled(fn, x, params, tile, reduce)`` splits ``x`` ([n, h], one row
per token) into tiles of ``tile`` rows and computes ``fn(start, x_tile, params)`` for each under
``no_grad``: only the inputs are saved, never a tile's activations (an MLP's ``n × intermediate``,
a head's ``n × vocab`` logits). ``reduce`` is ``"sum"`` (a loss: the tiles' scalars added) or
``"cat"`` (per-token outputs put back in order). The backward recomputes each tile with gradients
on *detached* copies of the parameters, ``torch.autograd.grad`` over that tile alone, writes the
tile's input gradient into its rows and adds its parameter gradients in fp32; the function returns
one gradient per parameter, once, at the end. So autograd accumulates each parameter's gradient
once per backward, as for any op, and the hooks the engine put on the parameters (ZeRO's
post-accumulate hooks, tensor parallel's partial-gradient reductions) fire once with the whole
gradient, never once per tile. The recomputation replays the random number generators' state at
the tiled forward's start (dropout inside a tile draws the same masks), as activation
checkpointing does.

The module runs with its parameters swapped for the detached copies (``_reparametrize_module``,
the mechanism of ``torch.func.functional_call``) and its own forward called directly: hooks on the
module itself fire once, around the whole tiled call, not once per tile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.nn.utils.stateless import _reparametrize_module

TileFn = Callable[[int, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


def replace_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Set ``module.forward`` on the instance; returns the undo, which puts back what was there (an instance-level
    forward someone set before us, or the class's)."""
    own = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if own is not None:
            module.forward = own
        else:
            module.__dict__.pop("forward", None)

    return undo


def replace_loss(model: torch.nn.Module, loss: Callable[..., Any]) -> Callable[[], None]:
    """Set ``model.loss_function``; returns the undo, which puts back what the instance held before.

    transformers keeps a set ``loss_function`` in ``_loss_function`` (behind a property); a plain module holds it in
    the attribute itself: the undo restores whichever the instance had, and drops what this call set."""
    own = {k: model.__dict__[k] for k in ("loss_function", "_loss_function") if k in model.__dict__}
    model.loss_function = loss

    def undo() -> None:
        for key in ("loss_function", "_loss_function"):
            model.__dict__.pop(key, None)
        model.__dict__.update(own)

    return undo


def call_with(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    *args: Any,
) -> Any:
    """``forward(*args)`` with ``module``'s parameters ``names`` replaced by ``params`` for the call."""
    with _reparametrize_module(module, dict(zip(names, params)), tie_weights=True):
        return forward(*args)


class _RngState:
    """The CPU generator's state, and the device's when ``x`` lives on one, at the tiled forward's start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accel = (
            torch.get_device_module(device.type).get_rng_state() if device.type not in ("cpu", "meta") else None
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accel is not None:
            torch.get_device_module(self.device.type).set_rng_state(self.accel)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: TileFn, reduce: str, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.fn, ctx.reduce, ctx.tile, ctx.rng = fn, reduce, tile, _RngState(x.device)
        ctx.params = params  # by reference: under ZeRO-3 their storage is gathered again when the backward runs
        ctx.save_for_backward(x)
        outputs = [fn(start, x[start : start + tile], params) for start in range(0, x.shape[0], tile)]
        return torch.stack(outputs).sum(0) if reduce == "sum" else torch.cat(outputs, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[3]
        wants = [ctx.needs_input_grad[4 + i] for i in range(len(ctx.params))]
        leaves = [p.detach().requires_grad_(w) for p, w in zip(ctx.params, wants)]
        sums: list[torch.Tensor | None] = [None] * len(ctx.params)  # fp32, from the first tile that reaches each
        grad_x = torch.empty_like(x) if wants_x else None
        on_host = x.device.type in ("cpu", "meta")
        with torch.random.fork_rng(
            devices=[] if on_host else [x.device], device_type="cuda" if on_host else x.device.type
        ):
            ctx.rng.restore()
            for start in range(0, x.shape[0], ctx.tile):
                piece = x[start : start + ctx.tile].detach().requires_grad_(wants_x)
                with torch.enable_grad():
                    out = ctx.fn(start, piece, leaves)
                inputs = ([piece] if wants_x else []) + [leaf for leaf, w in zip(leaves, wants) if w]
                if not inputs:
                    continue
                got = list(
                    torch.autograd.grad(
                        out, inputs, grad if ctx.reduce == "sum" else grad[start : start + ctx.tile], allow_unused=True
                    )
                )
                if wants_x:
                    g = got.pop(0)
                    grad_x[start : start + ctx.tile] = 0 if g is None else g  # type: ignore[index]
                for i, w in enumerate(wants):
                    if w and (g := got.pop(0)) is not None:
                        if sums[i] is None:
                            sums[i] = _accumulator(g, [grad, *(t for t in sums if t is not None)])
                        else:
                            sums[i].add_(g)  # type: ignore[union-attr]
        param_grads = tuple(
            None if not w else (torch.zeros_like(p) if s is None else s.to(p.dtype))
            for s, p, w in zip(sums, ctx.params, wants)
        )
        return (None, None, None, grad_x, *param_grads)


def _accumulator(first: torch.Tensor, others: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum over the tiles, started from the first tile's gradient: that tensor itself where it is fp32 and
    this backward's alone, else a copy.

    [Note: the first tile's gradient] A zero-filled fp32 buffer beside the first tile's gradient cost a parameter's
    size once more at the head's peak (2 GB for a 128k × 4096 head). The gradient autograd returned is adopted
    only where adding into it cannot write anywhere else: not a view, and sharing no storage with ``others`` (the
    incoming gradient, which an addition passes through unchanged, and the sums already started: two parameters
    added together get one gradient tensor)."""
    taken = {t.untyped_storage().data_ptr() for t in others}
    own = first._base is None and first.untyped_storage().data_ptr() not in taken
    return first if own and first.dtype == torch.float32 else first.to(torch.float32, copy=True)


def tiled(
    fn: TileFn, x: torch.Tensor, params: Sequence[torch.Tensor], tile: int, reduce: Literal["sum", "cat"]
) -> torch.Tensor:
    """``fn`` over ``x``'s rows in tiles of ``tile`` (see [Note: tiles and their gradients]); ``params``: every tensor
    ``fn`` uses that may need a gradient, passed back to it (as detached copies in the backward) in this order."""
    return _Tiled.apply(fn, reduce, tile, x, *params)
