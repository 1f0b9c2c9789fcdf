"""What every integration does with a DeepSpeed config dict before ``slipstream.initialize``.

[Note: "auto" values] A host fills the ``"auto"`` values it knows (the Trainer from its
arguments, Accelerate from its data loader and dummy optimizer); the few left that depend on the
model (bucket sizes from the hidden size) are filled here the way Hugging Face fills them. A value
still ``"auto"`` after that reaches Slipstream's config parser, which says which key needs a value.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from slipstream.engine.config.source import read_config_source

_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


def read_config(source: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """A private copy of a config given as a dict or a JSON/HJSON file (errors name the file)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    return read_config_source(source)


def node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding ``dotted``'s last key, and that key (None when a parent section is absent)."""
    *parents, key = dotted.split(".")
    current: Any = config
    for part in parents:
        current = current.get(part) if isinstance(current, dict) else None
        if current is None:
            return None, key
    return current, key


def get(config: dict[str, Any], dotted: str) -> Any:
    parent, key = node(config, dotted)
    return None if parent is None else parent.get(key)


def is_auto(config: dict[str, Any], dotted: str) -> bool:
    return get(config, dotted) == "auto"


def fill_auto(config: dict[str, Any], dotted: str, value: Any) -> None:
    """Replace ``"auto"`` at ``dotted`` by ``value``; anything else stays."""
    parent, key = node(config, dotted)
    if parent is not None and parent.get(key) == "auto":
        parent[key] = value


def model_hidden_size(model: torch.nn.Module) -> int | None:
    """The hidden size Hugging Face's DeepSpeed integration reads from ``model.config``."""
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None:
            continue
        if getattr(holder, "hidden_size", None) is not None:
            return int(holder.hidden_size)
        if getattr(holder, "hidden_sizes", None):
            return int(max(holder.hidden_sizes))
    return None


def fill_hidden_size_autos(config: dict[str, Any], model: torch.nn.Module) -> None:
    """Bucket sizes from the hidden size, with Hugging Face's formulas and its error when there is none."""
    autos = [key for key in _HIDDEN_SIZE_KEYS if is_auto(config, key)]
    if not autos:
        return
    hidden = model_hidden_size(model)
    if hidden is None:
        raise ValueError(
            "The model's config file has neither `hidden_size` nor `hidden_sizes` entry, therefore it's not possible "
            f"to automatically fill out the following `auto` entries in the DeepSpeed config file: {autos}. You can fix "
            "that by replacing `auto` values for these keys with an integer value of your choice."
        )
    fill_auto(config, "zero_optimization.reduce_bucket_size", hidden * hidden)
    if get(config, "zero_optimization.stage") == 3:
        fill_auto(config, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        fill_auto(config, "zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def apply_mixed_precision(config: dict[str, Any], mixed_precision: str, flag: str) -> None:
    """The host's mixed-precision switch (``--bf16``, ``mixed_precision="fp16"``...) in the config, as Accelerate does for DeepSpeed.

    A config without the section gets it (``{"enabled": true}``); an explicit section for the other
    half-precision dtype is a contradiction named with ``flag``, the host's own name for the switch.
    An explicit ``"enabled": false`` against the switch is left to the host's mismatch check.
    """
    if mixed_precision not in ("fp16", "bf16"):
        return
    other = "bf16" if mixed_precision == "fp16" else "fp16"
    if str(get(config, f"{other}.enabled")).lower() == "true":
        raise ValueError(f"{flag} asks for {mixed_precision}, but the DeepSpeed config enables {other}; keep one")
    if mixed_precision not in config and not (mixed_precision == "bf16" and "bfloat16" in config):
        config[mixed_precision] = {"enabled": True}


def inference_config(config: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """A config for an engine without an optimizer: no optimizer or schedule, no batch-size "auto" left."""
    config = copy.deepcopy(config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) == "auto":
            config.pop(key)
    if not any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        config["train_micro_batch_size_per_gpu"] = 1  # nothing trains; the triad still needs one value
    for section in ("fp16", "bf16"):
        if isinstance(config.get(section), dict) and config[section].get("enabled") == "auto":
            config[section]["enabled"] = False
    if config.get("gradient_clipping") == "auto":
        config.pop("gradient_clipping")
    fill_hidden_size_autos(config, model)
    return config
