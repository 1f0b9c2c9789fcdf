"""Calling an unchanged model on a batch and finding its loss, the way users' batches come (shared by the
pipeline executor and the twin checks)."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in what the model returned (``.loss``, the first of a tuple, or the tensor)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "pipeline: the last stage must compute the loss: the model's forward should return a scalar tensor, a tuple "
            f"starting with it, or an output with .loss (pass labels); got {type(output).__name__}"
        )
    return loss


def router_loss_of(output: Any) -> torch.Tensor | None:
    """The mixture-of-experts balancing loss a model reports beside its loss (transformers' ``aux_loss``), if any."""
    value = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
    return value if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """A micro-batch as the model's forward takes it: keyword arguments, positional ones, or one tensor."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def accepts_use_cache(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes a ``use_cache`` keyword (transformers models do)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in parameters


def without_cache(batch: Any) -> Any:
    """A keyword batch that does not ask for a cache gets ``use_cache=False``.

    [Note: no cache in a pipeline stage] A transformers model builds its key/value cache whenever
    ``use_cache`` is unset (the config's default is True), training or not. A pipeline stage hands
    on only its hidden states, and the user sees only the loss, so the cache is never read: it is
    per-layer concatenations (measured: 15 ms of a 5.4 s gpt2-large ZB-V step) and references
    that outlive the stage's forward. A batch that sets ``use_cache`` itself is left as it is.
    """
    if isinstance(batch, dict) and "use_cache" not in batch:
        return {**batch, "use_cache": False}
    return batch
