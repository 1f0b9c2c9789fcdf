"""What Ulysses sequence parallelism and context (ring) parallelism need from the config and the model."""

from __future__ import annotations

import dataclasses

import torch

from slipstream.engine.config import ConfigError, MeshSizes, SlipstreamConfig

_NEEDS_HF = (
    "needs a Hugging Face model that dispatches attention through transformers' attention interface (Llama, GPT-2, "
    "Mistral, Qwen...)"
)
# what the refusal offers instead: these modes do not depend on how the model attends or computes its loss
_OTHERS = " (ZeRO-3, tensor parallel and pipeline parallel do not depend on how a model attends)"


@dataclasses.dataclass(frozen=True)
class SequenceOptions:
    """``sequence_parallel_size`` (Ulysses: heads split over the group) or ``context_parallel.*`` (ring: K/V passed)."""

    ulysses: int
    context: int
    method: str  # context_parallel.method
    twin_check: bool
    # the model does not attend through transformers' interface: its blocks run on shards (blockwise.py's note)
    blockwise: bool = False
    refusal: str = ""  # what the kernels' route says of such a model (raised if the blockwise route is refused too)

    @classmethod
    def from_config(cls, cfg: SlipstreamConfig, sizes: MeshSizes, model: torch.nn.Module) -> SequenceOptions | None:
        """None when neither is on; :class:`ConfigError` naming the key for a model whose attention cannot be sharded."""
        u, c = sizes.size("sp"), sizes.size("cp")
        method = cfg.context_parallel.method
        if u > 1 and c > 1 and method not in ("ring", "allgather_kv"):
            raise ConfigError(
                f"context_parallel.method: {method!r} with sequence_parallel_size {u}: zig-zag chunks (a head and a tail per "
                "rank) are not contiguous after Ulysses' all-to-all gathers a sequence group's shards; use \"ring\" or "
                '"allgather_kv"'
            )
        if u == 1 and c == 1:
            return None
        config = getattr(model, "config", None)
        dispatches = hasattr(config, "_attn_implementation")
        try:
            if c > 1 and not dispatches:
                raise ConfigError(f"context_parallel.size: {c} {_NEEDS_HF}; {type(model).__name__} does not{_OTHERS}")
            if u > 1:
                _check_heads(config, dispatches, u, sizes.size("tp"), type(model).__name__)
        except ConfigError as err:
            # blockwise sequence parallel needs the twin check (it decides), and runs alone on its group's axis
            alone = all(sizes.size(axis) == 1 for axis in ("tp", "pp", "ep"))
            if not cfg.twin_check or not alone:
                raise
            return cls(u, c, method, cfg.twin_check, blockwise=True, refusal=str(err))
        return cls(u, c, method, cfg.twin_check)


def _check_heads(config: object, dispatches: bool, u: int, tp: int, name: str) -> None:
    """Ulysses splits attention heads over ``u`` ranks: the model's heads (after tensor parallel) must allow it."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not dispatches or heads is None:
        raise ConfigError(f"sequence_parallel_size: {u} {_NEEDS_HF}; {name} does not{_OTHERS}")
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % (u * tp):
        raise ConfigError(
            f"sequence_parallel_size: the model's {heads} attention heads do not divide by {u}{f' × tensor parallel {tp}' if tp > 1 else ''}"
        )
    local_kv = max(kv // tp, 1)
    if local_kv % u and u % local_kv:
        raise ConfigError(
            f"sequence_parallel_size: {local_kv} key/value heads per rank neither divide by {u} nor divide it (they are "
            "split across the group, or repeated when fewer than it)"
        )
