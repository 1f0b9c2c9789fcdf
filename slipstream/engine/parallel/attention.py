"""Routing an unchanged Hugging Face model's attention to a Slipstream kernel through the model's own seam.

transformers' models look their attention function up by ``config._attn_implementation`` in
``AttentionInterface`` (and their mask builder in ``AttentionMaskInterface``). Registering a
kernel under a new name and switching the model's config to it replaces attention in every layer
without touching the model's code. Used by Ulysses (sequence/) and ring attention (context/).

[Note: only inside the engine's step] The kernels expect the engine's sequence shards. The model
is switched to them only while the engine runs a sharded step (``SequenceSharder.activate`` in
``engine(...)``, ``deactivate`` once its backward is done, or at once under no_grad): a direct
call of the model (``generate()``, an evaluation callback, ``engine.module(...)``) runs the
model's own attention on the whole input. A kernel called outside a step raises.

[Note: no keyword dropped] transformers passes attention functions keywords that change the
arithmetic (``sliding_window``, ``softcap``, sinks, relative position biases, packed-sequence
boundaries). ``attention_features`` reads them all; each kernel implements the ones it can and
refuses the rest in one line naming the keyword (at ``initialize``, through the twin check's
first forward), so none is silently ignored. An unknown floating-point tensor keyword is treated
as a bias we do not understand and refused too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.segments import Segments

RECORDER = "slipstream_recorder"  # the name ``recording_attention_callers`` registers
# Keywords that carry no arithmetic (bookkeeping transformers threads through every layer).
_HARMLESS = {
    "position_ids",
    "cache_position",
    "use_cache",
    "output_hidden_states",
    "return_dict",
    "layer_idx",
    "labels",
    "shift_labels",
    "num_items_in_batch",
    "token_type_ids",
    "past_key_values",
    "cache",
    "past_key_value",
    "output_router_logits",
    "logits_to_keep",
    "inputs_embeds",
    "input_ids",
}
# Keywords that change the result when set; None (or False) means "not used".
# The varlen keywords never reach a kernel from the engine (the sharder reads them into the kernels' segments,
# parallel/segments.py): arriving here they describe tokens the kernel does not know.
_REFUSED_WHEN_SET = (
    "position_bias",
    "s_aux",
    "sinks",
    "head_mask",
    "alibi",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "cu_seqlens",
    "max_length_q",
    "max_length_k",
)


class UnsupportedAttention(ConfigError):
    """A model's attention asks for something this kernel does not implement (raised before any collective)."""


@dataclasses.dataclass(frozen=True)
class AttentionFeatures:
    """What one attention call asks for beyond plain scaled-dot-product attention."""

    causal: bool
    scaling: float | None
    dropout: float
    sliding_window: int | None  # token i sees j when 0 <= i - j < window (transformers' convention)
    softcap: float | None


def attention_features(
    method: str, module: torch.nn.Module, dropout: float, scaling: float | None, kwargs: dict[str, Any]
) -> AttentionFeatures:
    """Read (and check) one call's keywords; :class:`UnsupportedAttention` for any keyword no kernel here implements.

    ``method``: "<config key>: <kernel name>", e.g. "context_parallel.method: ring attention"."""
    key, _, kernel = method.partition(": ")
    model = type(module).__name__
    for name in _REFUSED_WHEN_SET:
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(
                f"{key}: {model} passes attention keyword {name!r}, which {kernel} does not implement; train this model without {kernel}"
            )
    if kwargs.get("output_attentions"):
        raise UnsupportedAttention(
            f"{key}: {model} asks for the attention weights (output_attentions=True), which {kernel} does not compute; turn it off"
        )
    for name, value in kwargs.items():
        if (
            name in _HARMLESS
            or name in ("is_causal", "sliding_window", "softcap", "output_attentions")
            or name in _REFUSED_WHEN_SET
        ):
            continue
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            raise UnsupportedAttention(
                f"{key}: {model} passes an unknown tensor keyword {name!r} to attention (a bias {kernel} would ignore); "
                "train this model without sequence/context parallelism"
            )
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    return AttentionFeatures(
        bool(causal),
        scaling,
        float(dropout or 0.0),
        int(window) if window is not None else None,
        float(softcap) if softcap else None,
    )


def allowed(
    features: AttentionFeatures, q_pos: torch.Tensor, k_pos: torch.Tensor, segments: Segments | None = None
) -> torch.Tensor | None:
    """Boolean mask of the pairs a query may attend to: [q, k], or [b, 1, q, k] with the batch's ``segments``
    (padding and packed documents, parallel/segments.py); None: every pair."""
    mask = None
    if features.causal or features.sliding_window is not None:
        distance = q_pos[:, None] - k_pos[None, :]
        mask = torch.ones_like(distance, dtype=torch.bool)
        if features.causal:
            mask &= distance >= 0
        if features.sliding_window is not None:
            mask &= distance < features.sliding_window if features.causal else distance.abs() < features.sliding_window
    if segments is not None:
        pairs = segments.pairs(q_pos, k_pos)
        mask = pairs if mask is None else pairs & mask
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: AttentionFeatures,
    mask: torch.Tensor | None,
    training: bool,
) -> torch.Tensor:
    """Attention of [b, H, q, d] queries to [b, H, k, d] keys honouring every feature: SDPA, or explicit math for softcap.
    A query no key may see gets a zero output (what SDPA gives a fully masked row, so one process's left padding)."""
    dropout = features.dropout if training else 0.0
    if features.softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=features.scaling
        )
    scale = features.scaling if features.scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / features.softcap) * features.softcap  # Gemma 2's logit soft-capping
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # finite: a fully masked row stays NaN-free
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if mask is not None:
        probs = probs * mask.any(-1, keepdim=True)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    return probs @ v


def route_attention(model: torch.nn.Module, name: str, kernel: Callable[..., object], key: str) -> str:
    """Register ``kernel`` as ``name``; returns the model's own implementation (the model is not switched yet).

    ``key`` names the config key in the error for a model that does not dispatch this way.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigError(
            f"{key}: the model does not dispatch attention through transformers' attention interface (no "
            "config._attn_implementation); this needs a Hugging Face model such as Llama, GPT-2, Mistral or Qwen"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, kernel)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)  # the local mask is ignored: the kernel knows the positions
    return config._attn_implementation


@contextlib.contextmanager
def recording_attention_callers(model: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """While open, the model's attention function is a recorder that lists each module calling it (the attention
    interface's first argument: the attention module, whatever its class is called) and returns zeros of the
    output's shape: what the forward computes is not used, only who calls. Empty for a model without the interface."""
    configs = attention_configs(model)
    found: list[torch.nn.Module] = []
    if not configs:
        yield found
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def record(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any
    ) -> Any:
        if not any(m is module for m in found):
            found.append(module)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None  # [b, s, H, d_v]

    AttentionInterface.register(RECORDER, record)
    ALL_MASK_ATTENTION_FUNCTIONS.register(RECORDER, sdpa_mask)
    saved = [c._attn_implementation for c in configs]
    set_attention(configs, RECORDER)
    try:
        yield found
    finally:
        for config, name in zip(configs, saved):
            config._attn_implementation = name


def attention_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct configs the model's modules read their attention implementation from (one in most models)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        sub = getattr(module, "config", None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found.setdefault(id(sub), sub)
    return list(found.values())


def set_attention(configs: list[Any], name: str) -> None:
    """Point every config (``attention_configs``) at attention ``name``."""
    for config in configs:
        config._attn_implementation = name
