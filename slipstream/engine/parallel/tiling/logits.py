"""Tiled logits and loss: a causal LM's loss computed over token tiles, its ``[tokens × vocab]`` logits never whole.

[Note: deferred logits] At 32k tokens and a 128k vocabulary the logits and their gradient are 16 GB
each in fp32: once attention is sharded they bound the sequence. The model's own forward is left
as it is. While a training forward with labels runs, the output embeddings (the head) return a
``DeferredLogits`` instead of computing anything: a tensor of the logits' shape and dtype with no
storage, holding the head's input. Then:

* elementwise ops the model applies before its loss (Gemma's soft-capping, Cohere's and Granite's
  scaling, a dtype cast) are recorded on it and replayed on each tile;
* the model's loss function (transformers' ``ForCausalLMLoss``, wrapped) receives it and computes
  the same loss over tiles of ``tile_tokens`` (``tiles.py``): per tile the head, the recorded ops,
  fp32 cross entropy summed; then divided by ``num_items_in_batch`` or the labelled-token count,
  as transformers does. ``shift_labels`` (the engine's shift-then-shard under sequence
  parallelism) are used as given, so the tiles compose with Ulysses, ring and tensor parallel's
  vocabulary-sharded head (whose per-tile logits are gathered one tile at a time);
* anything else — the user reading ``out.logits``, a model that slices or views its logits before
  the loss, a loss that is not transformers' causal-LM loss — computes the real logits once, on
  first use (the head called normally, gradients included), and carries on with them: a result is
  never wrong, only not tiled; a model that forces this inside its forward is named once in a
  warning (no memory saved).

A learnable tensor in a recorded op (a trained logit scale) is not recorded: the tiles could not
return its gradient, so the logits are materialised instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from slipstream.engine.parallel.tiling.tiles import call_with, replace_forward, replace_loss, tiled
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

# reads that do not need the values: answered by the storage-less stand-in (same shape, dtype, device)
_METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "nelement", "is_floating_point", "is_complex", "element_size", "get_device", "__len__"}
)
_METADATA_PROPERTIES = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "requires_grad",
        "is_leaf",
        "layout",
        "is_cuda",
        "is_meta",
        "grad_fn",
        "is_sparse",
        "is_quantized",
    }
)
# elementwise ops a model applies to its logits before its loss: recorded and replayed per tile
_RECORDABLE = frozenset(
    {
        "div",
        "mul",
        "add",
        "sub",
        "neg",
        "tanh",
        "float",
        "to",
        "contiguous",
        "clamp",
        "clamp_min",
        "clamp_max",
        "__truediv__",
        "__mul__",
        "__rmul__",
        "__add__",
        "__radd__",
        "__sub__",
        "__rsub__",
        "__neg__",
    }
)
_CAUSAL_LOSS = "ForCausalLMLoss"


def is_causal_lm_loss(fn: Any) -> bool:
    """Whether ``fn`` is transformers' causal-LM loss (the one the tiles reproduce)."""
    return getattr(fn, "__name__", None) == _CAUSAL_LOSS and str(getattr(fn, "__module__", "")).startswith(
        "transformers."
    )


def head_vocab(head: torch.nn.Module) -> int | None:
    """The head's output width: ``out_features`` (``nn.Linear``, tensor parallel's vocabulary head), or None."""
    width = getattr(head, "out_features", None)
    return width if isinstance(width, int) else None


class _Forward:
    """One forward of the model with labels: the head's input, and whether its logits had to be computed whole."""

    def __init__(self, owner: TiledLogits, hidden: torch.Tensor) -> None:
        self.owner, self.hidden = owner, hidden
        self.grad_enabled = torch.is_grad_enabled()
        self._logits: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        """The head's real output on the whole input, computed once."""
        if self._logits is None:
            self.owner.materialized(self)
            with torch.set_grad_enabled(self.grad_enabled):
                self._logits = self.owner.call_head(self.hidden)
        return self._logits


class DeferredLogits(torch.Tensor):
    """The head's logits, not computed: see [Note: deferred logits]."""

    _forward: _Forward
    _ops: tuple[tuple[Callable[..., Any], int, tuple[Any, ...], dict[str, Any]], ...]
    _value: torch.Tensor | None

    @staticmethod
    def make(forward: _Forward, shape: Sequence[int], dtype: torch.dtype, ops: tuple[Any, ...] = ()) -> DeferredLogits:
        stand_in = torch.full((1,) * len(shape), float("nan"), dtype=dtype, device=forward.hidden.device).expand(*shape)
        made = torch.Tensor._make_subclass(DeferredLogits, stand_in, False)
        made._forward, made._ops, made._value = forward, ops, None
        return made

    def replay(self, logits: torch.Tensor) -> torch.Tensor:
        """The recorded ops applied to ``logits`` (a tile's or the whole's), in order."""
        for func, position, args, kwargs in self._ops:
            logits = func(*args[:position], logits, *args[position + 1 :], **kwargs)
        return logits

    def value(self) -> torch.Tensor:
        """The real values: the whole logits, the recorded ops applied (computed on first use)."""
        if self._value is None:
            self._value = self.replay(self._forward.logits())
        return self._value

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _METADATA_METHODS or (
            name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
        ):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        recorded = _record(func, name, args, kwargs)
        if recorded is not None:
            return recorded
        return func(*tree_map(_real, args), **tree_map(_real, kwargs))


def _real(value: Any) -> Any:
    return value.value() if isinstance(value, DeferredLogits) else value


def _record(func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DeferredLogits | None:
    """A new ``DeferredLogits`` with ``func`` appended to its ops, or None when ``func`` is not a replayable
    elementwise op on it with constant other arguments."""
    if name not in _RECORDABLE or not any(
        func is getattr(home, name, None) for home in (torch.Tensor, torch._C.TensorBase, torch)
    ):
        return None
    mine = [i for i, a in enumerate(args) if isinstance(a, DeferredLogits)]
    if len(mine) != 1 or any(isinstance(v, DeferredLogits) for v in kwargs.values()):
        return None
    others = [a for i, a in enumerate(args) if i != mine[0]] + list(kwargs.values())
    for other in others:
        if isinstance(other, torch.Tensor) and (other.dim() > 0 or other.requires_grad):
            return None  # a per-element or learnable operand: its gradient would not come back from the tiles
        if not isinstance(other, (torch.Tensor, int, float, bool, torch.dtype, torch.device)) and other is not None:
            return None
    me: DeferredLogits = args[mine[0]]
    probe = torch.zeros(1, dtype=me.dtype, device=me.device)
    try:
        with torch.no_grad():
            result = func(*args[: mine[0]], probe, *args[mine[0] + 1 :], **kwargs)
    except (RuntimeError, TypeError):
        return None
    if not isinstance(result, torch.Tensor) or result.shape != probe.shape or result.device != probe.device:
        return None
    return DeferredLogits.make(me._forward, me.shape, result.dtype, me._ops + ((func, mine[0], args, kwargs),))


class TiledLogits:
    """The model's head deferred and its causal-LM loss tiled, while a training forward with labels runs."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module, tile_tokens: int) -> None:
        self.model, self.head, self.tile = model, head, tile_tokens
        self.vocab = head_vocab(head)
        self.names = [n for n, _ in head.named_parameters()]
        self._armed = False
        self._warned = False
        self.tiled_losses = 0  # losses computed over tiles so far (the logits never whole): what tests and logs read
        self.whole_logits = 0  # training forwards whose logits something computed whole before the loss (warned once)
        self._head_forward = head.forward  # its own (or an instance-level one someone set before us)
        self._restore_head = replace_forward(head, self._deferring_forward)
        loss = model.loss_function
        self._restore_loss = replace_loss(model, functools.partial(self._loss, loss, inspect.signature(loss)))
        try:
            names = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            names = []
        # where labels may come positionally (by the forward's signature), besides as keywords
        self._label_positions = [(names.index(k), k) for k in ("labels", "shift_labels") if k in names]
        self._hooks = [
            model.register_forward_pre_hook(self._arm, with_kwargs=True),
            model.register_forward_hook(self._disarm, always_call=True),
        ]

    # ------------------------------------------------------------------ the forward
    def _arm(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = any(kwargs.get(k) is not None for k in ("labels", "shift_labels"))
        given = given or any(i < len(args) and args[i] is not None for i, _ in self._label_positions)
        self._armed = torch.is_grad_enabled() and given

    def _disarm(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._armed = False

    def _deferring_forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if len(args) == 1 and not kwargs else None
        if not self._armed or not isinstance(hidden, torch.Tensor) or self.vocab is None:
            return self._head_forward(*args, **kwargs)
        dtype = (
            torch.get_autocast_dtype(hidden.device.type)
            if torch.is_autocast_enabled(hidden.device.type)
            else hidden.dtype
        )
        return DeferredLogits.make(_Forward(self, hidden), (*hidden.shape[:-1], self.vocab), dtype)

    def call_head(self, hidden: torch.Tensor, params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The head's own forward on ``hidden`` (with ``params`` in place of its parameters when given)."""
        if params is None:
            return self._head_forward(hidden)
        return call_with(self.head, self._head_forward, self.names, params, hidden)

    def materialized(self, forward: _Forward) -> None:
        """Called when a forward's logits are computed whole: a warning the first time it happens inside the forward."""
        if not self._armed:
            return
        self.whole_logits += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "long_context.tiled_logits: %s uses its logits before its loss in a way the tiles cannot replay (an op "
                "other than an elementwise one with constants); they were computed whole, so no memory was saved",
                type(self.model).__name__,
            )

    # ------------------------------------------------------------------ the loss
    def _loss(self, original: Callable[..., Any], signature: inspect.Signature, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        logits = bound.arguments.get("logits")
        if not isinstance(logits, DeferredLogits) or logits._value is not None or not is_causal_lm_loss(original):
            return original(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        loss = self._tiled_loss(
            logits, a["labels"], a["vocab_size"], a["num_items_in_batch"], a["ignore_index"], a["shift_labels"]
        )
        return original(*args, **kwargs) if loss is None else loss

    def _tiled_loss(
        self,
        logits: DeferredLogits,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items: Any,
        ignore_index: int,
        shift_labels: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """transformers' ``ForCausalLMLoss`` over tiles; None where its own code would do something else (raise)."""
        hidden = logits._forward.hidden
        if shift_labels is None:
            if labels is None:
                return None
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        if logits.shape[-1] != vocab_size or targets.numel() != hidden.shape[:-1].numel():
            return None
        params = [p for _, p in self.head.named_parameters()]

        def tile_loss(start: int, piece: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
            out = logits.replay(self.call_head(piece, weights)).float()
            return F.cross_entropy(
                out, targets[start : start + piece.shape[0]], ignore_index=ignore_index, reduction="sum"
            )

        total = tiled(tile_loss, hidden.reshape(-1, hidden.shape[-1]), params, self.tile, "sum")
        self.tiled_losses += 1
        if num_items is None:
            return total / (targets != ignore_index).sum()
        return total / (num_items.to(total.device) if isinstance(num_items, torch.Tensor) else num_items)

    def close(self) -> None:
        """The head's and the loss's own back."""
        for hook in self._hooks:
            hook.remove()
        self._restore_head()
        self._restore_loss()
