"""The engine's side of sequence parallelism: shard each micro-batch on the sequence, report the
whole sequence's loss.

[Note: shift, then shard] A causal LM's loss pairs token ``i``'s logits with label ``i+1``. The
model shifts labels itself, which, done on a shard, would lose the pair that crosses the shard
boundary and pair each shard's last token with nothing. So the engine shifts first (labels padded
with -100 at the end, passed as ``shift_labels``, which transformers' loss uses unshifted), then
cuts ``input_ids``, ``shift_labels`` and ``position_ids`` (the *global* positions of the local
tokens, so rotary and learned positions are right) into ``u`` contiguous chunks; rank ``r`` of the
sequence group keeps chunk ``r``. Every rank of the group received the same micro-batch.

[Note: the loss and its gradient] Rank ``r``'s model returns ``l_r``, the mean over its ``n_r``
labelled tokens. The whole sequence's loss is ``L = Σ n_r·l_r / N`` with ``N = Σ n_r`` (one
all-reduce of the counts). The engine reports ``L`` (the value every rank of the group sees) and
backpropagates ``u·n_r·l_r / N`` on rank ``r``: ZeRO averages gradients over dp·sp, and the mean
over the ``u`` ranks of a group of ``∇(u·n_r·l_r/N)`` is ``∇L``, so the result is the dp-mean of
whole-sequence gradients: exactly the unsharded run's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.attention import attention_configs, set_attention

IGNORE_INDEX = -100
SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "inputs_embeds", "token_type_ids")
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens_q", "cu_seqlens_k")


class SequenceSharder:
    """Cuts keyword-argument batches on the sequence for one rank of a sequence group of size ``u``."""

    def __init__(
        self, group: dist.ProcessGroup, key: str = "sequence_parallel_size", layout: Any = None,
        routing: tuple[torch.nn.Module, str, str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.key = key
        self.layout = layout  # context parallel's chunk layout (context/layout.py); None: contiguous shards
        self.divisor = layout.divisor if layout is not None else self.size
        # (model, our attention's name, the model's own, our kernel): see parallel/attention.py's notes
        self.routing = routing
        self.active = False
        # Found once: every step switches them twice (a walk over the modules per switch would be on the hot path).
        self.configs: list[Any] = []
        if routing is not None:
            self.configs = attention_configs(routing[0])
        self.caller_normalizes = False

    def activate(self) -> None:
        """Switch the model to the sharded kernel for one engine step."""
        if self.routing is not None and not self.active:
            _, ours, _, kernel = self.routing
            set_attention(self.configs, ours)
            kernel.active = self.active = True

    def deactivate(self) -> None:
        """The model's own attention again (after the step's backward, or a forward without gradients)."""
        if self.routing is not None and self.active:
            _, _, previous, kernel = self.routing
            set_attention(self.configs, previous)
            kernel.active = self.active = False

    def close(self) -> None:
        """Give the model its own attention back (the engine is discarded; the model may be trained again)."""
        self.deactivate()
        self.routing = None

    def positions(self, length: int) -> torch.Tensor:
        """The global positions of this rank's tokens in a sequence of ``length``, in local order."""
        if self.layout is not None:
            return self.layout.positions(self.rank, length)
        chunk = length // self.size
        return torch.arange(self.rank * chunk, (self.rank + 1) * chunk)

    def shard(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The local keyword arguments, and this rank's count of labelled tokens (None without labels)."""
        source = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if source is None:
            raise ConfigError(f"{self.key}: sequence parallel needs the batch as keyword arguments with input_ids (or inputs_embeds)")
        batch, length = source.shape[0], source.shape[1]
        if length % self.divisor:
            how = f"{self.key} = {self.size}" + (" × 2 (zig-zag chunks)" if self.divisor != self.size else "")
            raise ConfigError(
                f"{self.key}: the sequence length {length} does not divide by {how}; pad or cut sequences to a "
                f"multiple of {self.divisor}"
            )
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ConfigError(
                f"{self.key}: padded batches (attention_mask with zeros, right or left padding) are not supported with "
                "sequence sharding yet: the sharded attention would attend to the padding. Train this model without "
                "sequence sharding, or batch sequences of equal length without padding"
            )
        self._refuse_packing(kwargs)
        # transformers' num_items_in_batch: the model divides its token sum by the caller's count, not its own
        self.caller_normalizes = kwargs.get("num_items_in_batch") is not None
        out = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        labels = out.pop("labels", None)
        if labels is not None and "shift_labels" not in out:
            out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        if "position_ids" not in out:
            out["position_ids"] = torch.arange(length, device=source.device).unsqueeze(0).expand(batch, length)
        index = self.positions(length).to(source.device)
        for key in SEQUENCE_KEYS:
            if key in out and out[key] is not None:
                out[key] = out[key].index_select(1, index)
        count = None
        if "shift_labels" in out:
            # transformers' loss only runs when labels are given: hand it the local labels, unused once shifted
            out["labels"] = out["shift_labels"]
            count = (out["shift_labels"] != IGNORE_INDEX).sum().to(torch.float32)
        return out, count

    def _refuse_packing(self, kwargs: dict[str, Any]) -> None:
        """Packed (padding-free) batches are refused: one process attends within each document, our kernels would not.

        [Note: packed batches] transformers' collators for padding-free training (``DataCollatorWithFlattening``,
        TRL's ``padding_free``) concatenate documents in one row and restart ``position_ids`` at 0 for each, and
        may add flash-attention's varlen keywords (``cu_seq_lens_q`` …). One process builds a block-diagonal
        mask from the restarts (``find_packed_sequence_indices``) or runs varlen attention; the sharded kernels
        attend causally over the whole row, across documents: losses 1e-2 off, silently. Until the kernels
        honour document boundaries, such a batch is refused at its first step, in one line.
        """
        varlen = sorted(k for k in VARLEN_KEYS if kwargs.get(k) is not None)
        positions = kwargs.get("position_ids")
        restarts = False
        if positions is not None and positions.shape[-1] > 1:
            restarts = bool((torch.diff(positions, dim=-1) != 1).any())
        if varlen or restarts:
            what = f"varlen keywords {', '.join(varlen)}" if varlen else "position_ids that restart within a row"
            raise ConfigError(
                f"{self.key}: packed batches ({what}: several documents in one row, as DataCollatorWithFlattening or "
                "TRL's padding_free build them) are not supported with sequence sharding yet: the sharded attention would "
                "attend across documents. Train this model without sequence sharding, or give each document its own row"
            )

    def combine(self, output: Any, count: torch.Tensor | None) -> Any:
        """Replace the output's local loss by the whole sequence's (value) with the gradient of the note."""
        loss = getattr(output, "loss", None)
        if loss is None or count is None:
            return output
        if self.caller_normalizes:
            local = loss  # already (shard's token sum) / (the caller's count for the whole batch): shards add up
        else:
            total = count.detach().clone()
            comm.all_reduce(total, group=self.group, tag="sequence-parallel token count").wait()
            # A shard with no labelled token (prompt masking) has a NaN mean: it contributes nothing, not 0 × NaN.
            local = torch.where(count > 0, loss * count / total.clamp(min=1.0), torch.zeros_like(loss))  # n_r·l_r / N
        reported = local.detach().clone()
        comm.all_reduce(reported, group=self.group, tag="sequence-parallel loss").wait()
        output.loss = self.size * local + (reported - self.size * local).detach()
        return output
