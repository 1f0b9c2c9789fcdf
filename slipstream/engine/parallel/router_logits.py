"""Router logits the model's balancing loss reads, made the whole micro-batch's where a mode cuts its tokens.

A mixture-of-experts model trained with its load-balancing loss (transformers' ``output_router_logits``)
records every layer's router logits on its base model's output, which the causal-LM head passes to
its loss function. A mode that gives each rank part of the tokens (Ulysses / ring: the sequence
group; Megatron sequence parallel: the tp region) hands this hook the function that makes one
layer's local logits whole (``sequence/router.py``, ``tensor/sequence.py``); the rest is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ROUTER_FIELD = "router_logits"
_WHOLE = "_slipstream_whole"  # marks a tensor made whole already (the base model's, passed on by the head)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0])
    return None


class RouterLogitsHook:
    """``whole(local, rows)``: one layer's whole logits from this rank's ([rows·n, E] or [rows, n, E]), or None to
    leave them (not per token of this micro-batch, or the mode is off)."""

    def __init__(self, model: torch.nn.Module, whole: Callable[[torch.Tensor, int], torch.Tensor | None]) -> None:
        self.whole = whole
        self.coefficient: float | None = getattr(model, "router_aux_loss_coef", None)
        base = getattr(model, "base_model", None)
        target = base if isinstance(base, torch.nn.Module) and base is not model else None
        self.handle = target.register_forward_hook(self._made_whole, with_kwargs=True) if target is not None else None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _made_whole(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.apply(output, _rows(args, kwargs))

    def apply(self, output: Any, rows: int | None) -> bool:
        """Replace ``output.router_logits`` (a tensor per layer) by the whole micro-batch's; True if they are whole."""
        logits = getattr(output, ROUTER_FIELD, None) if hasattr(output, "keys") else None
        layers = logits if isinstance(logits, (tuple, list)) else (logits,)
        if logits is None or rows is None or not layers or not all(isinstance(t, torch.Tensor) for t in layers):
            return False
        made = []
        for local in layers:
            if getattr(local, _WHOLE, False):
                made.append(local)
                continue
            whole = self.whole(local, rows) if local.dim() in (2, 3) else None
            if whole is None:
                return False
            setattr(whole, _WHOLE, True)
            made.append(whole)
        setattr(output, ROUTER_FIELD, type(logits)(made) if isinstance(logits, (tuple, list)) else made[0])
        return True
