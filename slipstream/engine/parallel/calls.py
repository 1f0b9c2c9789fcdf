"""Calling an unchanged model on a batch and finding its loss, the way users' batches come (shared by the
pipeline executor and the twin checks)."""

from __future__ import annotations

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


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """A micro-batch as the model's forward takes it: keyword arguments, positional ones, or one tensor."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
