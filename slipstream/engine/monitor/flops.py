"""Model FLOPs per token, for achieved TFLOP/s and MFU.

Analytic for transformer models with a transformers-style config (layers and hidden size):
``6·N + 12·L·d_attn·s`` (:func:`slipstream.estimator.training_flops_per_token`), where ``N``
counts the weights that multiply activations. Any other model is measured once with
``torch.utils.flop_counter`` on its first forward (3× the forward: backward costs twice forward).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from slipstream.estimator import training_flops_per_token
from slipstream.estimator_shape import shape_from_config


def matmul_parameters(model: torch.nn.Module) -> int:
    """Elements of the weight matrices that multiply activations: 2-D+ parameters, not embedding lookups.

    An embedding whose weight is also used as an output projection (GPT-2's tied ``lm_head``)
    does multiply activations and counts once.
    """
    lookups: set[int] = set()
    projections: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        (lookups if isinstance(module, torch.nn.Embedding) else projections).add(id(weight))
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or p.dim() < 2:
            continue
        seen.add(id(p))
        if id(p) in lookups and id(p) not in projections:
            continue
        total += p.numel()
    return total


@dataclasses.dataclass(frozen=True)
class TransformerFlops:
    """``flops_per_token(seq_len)`` of a transformer from its parameters and config."""

    matmul_params: int
    layers: int
    attention_dim: int

    def per_token(self, seq_len: int) -> float:
        return training_flops_per_token(self.matmul_params, self.layers, self.attention_dim, seq_len)


def analytic_flops(model: torch.nn.Module) -> TransformerFlops | None:
    """The analytic counter for a model with a transformers-style ``config``; None otherwise."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    shape = shape_from_config(config)
    if "layers" not in shape or "hidden" not in shape:
        return None
    heads, head_dim = shape.get("heads"), getattr(config, "head_dim", None)
    attention_dim = heads * head_dim if heads and isinstance(head_dim, int) else shape["hidden"]
    return TransformerFlops(matmul_parameters(model), shape["layers"], attention_dim)


def _cpu_flash_attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_flash_attention_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


# torch's counter knows the CUDA attention kernels but not the CPU one scaled_dot_product_attention
# dispatches to (it would count attention as zero); same arithmetic, so the same formulas.
_CUSTOM: dict[Any, Any] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_attention),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_attention_backward),
):
    _op = getattr(torch.ops.aten, _name, None)
    if _op is not None:
        _CUSTOM[_op] = _fn


def flop_counter_mode(depth: int = 2) -> FlopCounterMode:
    """``torch.utils.flop_counter.FlopCounterMode`` that also counts CPU attention."""
    return FlopCounterMode(display=False, depth=depth, custom_mapping=_CUSTOM)


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn`` under the FLOP counter and return (its result, the FLOPs it performed)."""
    with flop_counter_mode() as counter:
        out = fn(*args, **kwargs)
    return out, counter.get_total_flops()
