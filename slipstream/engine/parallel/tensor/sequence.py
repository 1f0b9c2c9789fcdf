"""Megatron-style sequence parallelism on top of tensor parallelism.

[Note: the region] Between a row layer and the next column layer the activations are identical on
every tp rank: norms, dropout and residual adds compute the same thing t times and store t
copies. With sequence parallelism that region holds ``s / t`` of the sequence: the row layer's
all-reduce becomes a reduce-scatter on the sequence and the column layer's input an all-gather
(the same bytes as the all-reduce, which *is* a reduce-scatter plus an all-gather). The region
starts at the first block's input (split, backward all-gather) and ends at the last block's output
(all-gather, backward keep the chunk), so embeddings, the final norm and the head see whole
sequences and the model's loss is untouched.

[Note: replicated gradients] A replicated parameter inside the blocks (norm weights, a row
layer's bias) now sees only this rank's part of the sequence, so its gradient is a partial sum,
summed over tp by ``partial_grads.sum_gradients_over_tp``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from slipstream.engine.parallel.router_logits import RouterLogitsHook
from slipstream.engine.parallel.tensor import ops
from slipstream.engine.parallel.tensor.layers import ShardedLinear, SharedInput, TPContext
from slipstream.engine.parallel.tensor.partial_grads import sum_gradients_over_tp


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    if args and isinstance(args[0], torch.Tensor):
        return "arg", 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "kwarg", "hidden_states"
    raise ValueError(
        "sequence parallel: the first block received no hidden-state tensor (first argument or hidden_states=)"
    )


def _gather_at_entry(parent: torch.nn.Module, share: SharedInput, ctx: TPContext) -> Any:
    """The sub-block sees the whole sequence from its entry (it may read the length off its input, as Llama's attention does)."""
    share.gathered_by_parent = True

    def gather(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _gathered_hidden(args, kwargs, ctx, "sp gather") if ctx.sp else None

    return parent.register_forward_pre_hook(gather, with_kwargs=True)


def _gathered_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], ctx: TPContext, tag: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A module's call with its hidden state (first argument or ``hidden_states=``) gathered on the sequence."""
    kind, key = _first_tensor(args, kwargs)
    if kind == "arg":
        return (ops.gather_sequence(args[0], ctx.seq_dim, ctx.group, tag, ctx.sp_length), *args[1:]), kwargs
    return args, {**kwargs, key: ops.gather_sequence(kwargs[key], ctx.seq_dim, ctx.group, tag, ctx.sp_length)}


def _whole_sequence_around(module: torch.nn.Module, ctx: TPContext) -> list[Any]:
    """[Note: replicated attention] An attention the plan leaves replicated (no sharded layer inside it: DeepSeek's
    multi-head latent attention under transformers' plan, which shards the MLPs only) mixes tokens, so inside the
    region it must see the whole sequence, not this rank's part. It is gathered at its entry (backward:
    reduce-scatter) and only this rank's chunk of its output goes on (backward: that chunk's gradient, zeros
    elsewhere). Every tp rank computes the same whole-sequence attention, as tp without sp does; each holds the
    part of the gradients its own chunk contributes, which the gather's reduce-scatter sums for the input and the
    replicated parameters' sum over tp sums for the weights."""

    def enter(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _gathered_hidden(args, kwargs, ctx, "sp gather (replicated attention)") if ctx.sp else None

    def leave(_: torch.nn.Module, args: Any, output: Any) -> Any:
        if not ctx.sp:
            return None
        if isinstance(output, torch.Tensor):
            return ops.keep_chunk(output, ctx.seq_dim, ctx.group)
        return (ops.keep_chunk(output[0], ctx.seq_dim, ctx.group), *output[1:])

    return [module.register_forward_pre_hook(enter, with_kwargs=True), module.register_forward_hook(leave)]


def enable(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    ctx: TPContext,
    shared: dict[str, SharedInput],
    not_replicated: Collection[int] = frozenset(),
    attention: Sequence[torch.nn.Module] = (),
) -> list[Any]:
    """Install the region edges, the sub-block entries and the gradient reductions; return the handles.

    ``not_replicated``: ids of block parameters that differ between tp ranks though no tp layer holds
    them (expert parallelism's experts), left out of the replicated gradients' sum over tp. ``attention``: the
    modules that call the model's attention function; those with no sharded layer inside see whole sequences
    ([Note: replicated attention]).

    [Note: where to gather] A sub-block below the block (an attention or MLP module) is gathered at
    its entry: its code may take the sequence length from its input. When the column leaves sit
    directly in the block (the block is the sub-block), the gather stays at the leaves, since the
    block's residual add must see the sharded sequence.
    """
    block_ids = {id(b) for b in blocks}
    handles = [
        _gather_at_entry(model.get_submodule(name), share, ctx)
        for name, share in shared.items()
        if share.opens
        and id(model.get_submodule(name)) not in block_ids  # a module holding only a row reads sharded input
    ]

    def enter(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not ctx.sp:
            return None
        kind, key = _first_tensor(args, kwargs)
        hidden = args[0] if kind == "arg" else kwargs[key]
        ctx.sp_length = hidden.shape[ctx.seq_dim]  # a length that does not divide is extended (ops.py's note)
        ctx.sp_rows = hidden.shape[0] if ctx.seq_dim == 1 else None  # for flattened tokens (ops.py's note)
        if kind == "arg":
            return (ops.split_sequence(args[0], ctx.seq_dim, ctx.group), *args[1:]), kwargs
        return args, {**kwargs, key: ops.split_sequence(kwargs[key], ctx.seq_dim, ctx.group)}

    def leave(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not ctx.sp:
            return None
        if isinstance(output, torch.Tensor):
            return ops.gather_keep(output, ctx.seq_dim, ctx.group, "sp gather (region end)", ctx.sp_length)
        first = ops.gather_keep(output[0], ctx.seq_dim, ctx.group, "sp gather (region end)", ctx.sp_length)
        return (first, *output[1:])

    def whole_router_logits(local: torch.Tensor, rows: int) -> torch.Tensor | None:
        """[Note: router logits in the region] A router inside the region sees this rank's part of the sequence;
        the model's balancing loss (a product of two means over the micro-batch's tokens) needs all of them, so
        each layer's logits are gathered along the sequence like the region's end, and their backward keeps this
        rank's part: every tp rank computes the same loss, as for the head (the routers' partial gradients are
        summed over tp with the other replicated ones)."""
        if not ctx.sp:
            return None
        gathered = ops.gather_keep(
            local.reshape(rows, -1, local.shape[-1]), 1, ctx.group, "sp router logits gather", ctx.sp_length
        )
        return gathered if local.dim() == 3 else gathered.reshape(-1, local.shape[-1])

    in_blocks = {id(m) for b in blocks for m in b.modules()}
    for module in attention:
        if (
            id(module) in in_blocks
            and id(module) not in block_ids
            and not any(isinstance(m, ShardedLinear) for m in module.modules())
        ):
            handles += _whole_sequence_around(module, ctx)
    ctx.enabled_sequence = True
    router = RouterLogitsHook(model, whole_router_logits)
    handles += [
        blocks[0].register_forward_pre_hook(enter, with_kwargs=True),
        blocks[-1].register_forward_hook(leave),
        *([router.handle] if router.handle is not None else []),
    ]
    sharded = {id(p) for m in model.modules() if isinstance(m, ShardedLinear) for p in m.parameters()}
    sharded -= {
        id(m.bias) for m in model.modules() if isinstance(m, ShardedLinear) and m.style == "row" and m.bias is not None
    }
    sharded |= set(not_replicated)

    seen: set[int] = set()
    replicated = []
    for block in blocks:
        for param in block.parameters():
            if id(param) not in sharded and id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                replicated.append(param)
    return handles + sum_gradients_over_tp(replicated, ctx, "sp replicated gradient", only_under_sp=True)
