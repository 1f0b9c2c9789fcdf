"""Routing an unchanged Hugging Face model's attention to a Slipstream kernel through the model's own seam.

transformers' models look their attention function up by ``config._attn_implementation`` in
``AttentionInterface`` (and their mask builder in ``AttentionMaskInterface``). Registering a
kernel under a new name and switching the model's config to it replaces attention in every layer
without touching the model's code. Used by Ulysses (sequence/) and ring attention (context/).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def route_attention(model: torch.nn.Module, name: str, kernel: Callable[..., object], key: str) -> str:
    """Register ``kernel`` as ``name`` and switch the model to it; returns the implementation it replaced.

    ``key`` names the config key in the error for a model that does not dispatch this way.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(
            f"{key}: the model does not dispatch attention through transformers' attention interface (no "
            "config._attn_implementation); this needs a Hugging Face model such as Llama, GPT-2, Mistral or Qwen"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, kernel)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)  # the local mask is ignored: the kernel knows the positions
    previous = config._attn_implementation
    set_attention(model, name)
    return previous


def set_attention(model: torch.nn.Module, name: str) -> None:
    """Point every config the model's modules read (one object in most models) at attention ``name``."""
    for module in model.modules():
        sub = getattr(module, "config", None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = name
