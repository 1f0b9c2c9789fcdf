"""A model's shape for the estimator, read from a parameter count, a transformers config or a module. Pure Python.

The estimator (``estimator.py``), its command line and the FLOPs counter (``engine/monitor/flops.py``) read layers,
hidden size, heads, vocabulary, MLP width and sequence length by the same config keys, here.
"""

from __future__ import annotations

import math
from typing import Any

CONFIG_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "seq_len": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}


def shape_from_config(config: Any) -> dict[str, int]:
    """layers/hidden/heads/vocab/seq_len from a transformers config (object or dict)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    found: dict[str, int] = {}
    for field, keys in CONFIG_KEYS.items():
        for key in keys:
            value = get(key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found[field] = value
                break
    return found


def describe_model(model: Any) -> dict[str, int]:
    """What :func:`slipstream.estimate` reads from its ``model``: a parameter count, a config dict (its shape, and the
    count given or derived) or an ``nn.Module`` (its unique parameters, the largest, and its config's shape)."""
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return {"params": whole_params(model)}
    if isinstance(model, dict):
        found = shape_from_config(model)
        if "params" in model or "num_parameters" in model:
            found["params"] = whole_params(model.get("params", model.get("num_parameters")))
        elif {"layers", "hidden", "vocab"} <= found.keys():
            found["params"] = gpt_params(
                found["layers"],
                found["hidden"],
                found["vocab"],
                found.get("seq_len", 0),
                model.get("intermediate_size"),
            )
        return found
    if hasattr(model, "parameters"):  # an nn.Module: torch is loaded already
        seen: set[int] = set()
        params = largest = 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params += p.numel()
                largest = max(largest, p.numel())
        found = shape_from_config(getattr(model, "config", None) or {})
        found["params"], found["largest_param"] = params, largest
        return found
    raise TypeError(f"estimate: expected a parameter count, an nn.Module or a config dict, got {type(model).__name__}")


def whole_params(value: Any) -> int:
    """A parameter count as an int; ValueError (not OverflowError) for inf/NaN or a non-number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the parameter count must be a finite number, got {value!r}")
    return int(value)


def gpt_params(layers: int, hidden: int, vocab: int, positions: int = 0, intermediate: int | None = None) -> int:
    """Parameters of a GPT-style model: embeddings + per layer (attention 4h², MLP 2·h·ffn, biases, norms)."""
    ffn = intermediate or 4 * hidden
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden
