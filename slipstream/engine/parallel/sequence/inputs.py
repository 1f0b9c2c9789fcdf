"""The engine's side of sequence parallelism: shard each micro-batch on the sequence, report the
whole sequence's loss.

[Note: shift, then shard] A causal LM's loss pairs token ``i``'s logits with label ``i+1``. The
model shifts labels itself, which, done on a shard, would lose the pair that crosses the shard
boundary and pair each shard's last token with nothing. So the engine shifts first (labels padded
with -100 at the end, passed as ``shift_labels``, which transformers' loss uses unshifted), then
cuts ``input_ids``, ``shift_labels`` and ``position_ids`` (the *global* positions of the local
tokens, so rotary and learned positions are right) into ``u`` contiguous chunks; rank ``r`` of the
sequence group keeps chunk ``r``. Every rank of the group received the same micro-batch. A model
whose loss pairs token ``i``'s logits with label ``i`` (transformers' masked-LM and token
classification losses, ``UNSHIFTED_LOSSES``) gets its labels cut as they are.

[Note: the loss and its gradient] Rank ``r``'s model returns ``l_r``, the mean over its ``n_r``
labelled tokens. The whole sequence's loss is ``L = Σ n_r·l_r / N`` with ``N = Σ n_r`` (one
all-reduce of the counts). The engine reports ``L`` (the value every rank of the group sees) and
backpropagates ``u·n_r·l_r / N`` on rank ``r``: ZeRO averages gradients over dp·sp, and the mean
over the ``u`` ranks of a group of ``∇(u·n_r·l_r/N)`` is ``∇L``, so the result is the dp-mean of
whole-sequence gradients: exactly the unsharded run's.

[Note: rotary tables of the whole sequence] The model's rotary module turns position ids into
cos/sin tables. Length-dependent scalings (dynamic NTK, Phi-3's "longrope") pick their factors from
``max(position_ids) + 1``, which on a shard is that shard's last position, so shards would rotate
with different frequencies (2-3% off above the original length, silently). So every rotary module
(a module with a ``rope_type``, called with ``(x, position_ids)``) runs on the whole micro-batch's
positions and each rank keeps its own tokens' rows of the tables: the factors come from the whole
length whatever the scaling, for the cost of ``b·s·d`` table entries instead of ``b·s/u·d``.

[Note: the engine's fill] A length that does not divide by the group's shard count (``u``, or
``2c`` chunks for zig-zag) is extended at the end to the next multiple: input ids and token types
0, labels -100, positions 0 (inside any position table), embeddings zero. The fill tokens are
invalid keys in a document of their own (segments.py's ``with_fill``), so no real token attends
to them, and their labels are ignored, so the loss, its token count and every gradient are one
process's on the unfilled batch; per-token outputs read whole are cut back to the caller's
length (logits.py).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.attention import attention_configs, set_attention
from slipstream.engine.parallel.context.token_layout import Layout
from slipstream.engine.parallel.segments import VARLEN_KEYS, Segments, read_segments, with_fill
from slipstream.engine.parallel.sequence.logits import gather_sequence, with_whole_sequence
from slipstream.engine.parallel.sequence.router import whole_router_logits

IGNORE_INDEX = -100
# transformers' per-token losses that pair logits and labels at the same position (``model.loss_type``)
UNSHIFTED_LOSSES = ("ForMaskedLM", "ForTokenClassification")
SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "inputs_embeds", "token_type_ids")


@dataclasses.dataclass(frozen=True)
class _Step:
    """What the sharder read from one micro-batch for its forward: segments (None: plain causal rows) and lengths."""

    segments: Segments | None
    positions: torch.Tensor  # [rows, padded]: the whole micro-batch's position ids (the rotary note)
    rows: int  # the micro-batch's
    length: int  # the caller's sequence length
    padded: int  # after the engine's fill (a multiple of the divisor)

    @functools.cached_property
    def valid(self) -> torch.Tensor | None:
        """[rows, length] bool: the caller's tokens that count (not padding); None when all do (worked out once per
        micro-batch: every MoE layer asks)."""
        if self.segments is None:
            return None
        valid = self.segments.valid[:, : self.length]
        return None if bool(valid.all()) else valid


def _filled(key: str, value: Any, padded: int) -> Any:
    """A sequence tensor extended to ``padded`` tokens by the engine's fill ([Note: the engine's fill])."""
    if key not in SEQUENCE_KEYS or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    fill = padded - value.shape[1]
    pad = [0, 0] * (value.dim() - 2) + [0, fill]  # F.pad counts from the last dimension
    return torch.nn.functional.pad(value, pad, value=IGNORE_INDEX if key in ("labels", "shift_labels") else 0)


class SequenceSharder:
    """Cuts keyword-argument batches on the sequence for one rank of a sequence group of size ``u``."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        key: str = "sequence_parallel_size",
        layout: Layout | None = None,
        routing: tuple[torch.nn.Module, str, str, Any] | None = None,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.key = key
        # which tokens each rank holds (context/token_layout.py): context parallel's chunks, else contiguous shards
        self.layout: Layout = layout if layout is not None else Layout(self.size, zigzag=False)
        self.divisor = self.layout.divisor
        # (model, our attention's name, the model's own, our kernel): see parallel/attention.py's notes
        self.routing = routing
        self.active = False
        # Found once: every step switches them twice (a walk over the modules per switch would be on the hot path).
        self.configs: list[Any] = []
        if routing is not None:
            self.configs = attention_configs(routing[0])
        self.caller_normalizes = False
        self.shifts = routing is None or getattr(routing[0], "loss_type", None) not in UNSHIFTED_LOSSES
        # The twin check on the first training batch (first_batch.py), set once the synthetic one passed.
        self.first_batch: Callable[[dict[str, Any]], None] | None = None
        # by id of the local position ids (tensors compare elementwise, so no WeakKeyDictionary); gone with them
        self._structure: dict[int, tuple[weakref.ref[torch.Tensor], _Step]] = {}
        self.current: _Step | None = None  # the micro-batch whose forward runs now (its segments and lengths)
        self._hook = (
            routing[0].register_forward_pre_hook(self._before_forward, with_kwargs=True)
            if routing is not None
            else None
        )
        # rotary tables from the whole sequence's positions ([Note: rotary tables of the whole sequence])
        self._rotary = [
            handle
            for module in (routing[0].modules() if routing is not None else ())
            if getattr(module, "rope_type", None) is not None
            for handle in (
                module.register_forward_pre_hook(self._whole_positions, with_kwargs=True),
                module.register_forward_hook(self._own_rows),
            )
        ]
        # a mixture of experts' balancing loss over the whole micro-batch (router.py's note)
        self.router = (
            whole_router_logits(routing[0], group, self.layout.positions, self._router_step)
            if routing is not None
            else None
        )

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
            kernel.segments = self.current = None

    def resume(self, step: _Step | None) -> None:
        """Hand the kernel an earlier micro-batch's segments again (its backward is still to run)."""
        self.current = step
        if self.routing is not None:
            kernel = self.routing[3]
            kernel.segments = step.segments if step is not None else None
            if hasattr(kernel, "whole_positions"):  # Ulysses running the model's own function (ulysses.py)
                kernel.whole_positions = step.positions if step is not None else None

    def close(self) -> None:
        """Give the model its own attention back (the engine is discarded; the model may be trained again)."""
        self.deactivate()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.router is not None:
            self.router.close()
        for handle in self._rotary:
            handle.remove()
        self._rotary = []
        self.routing = None

    def positions(self, length: int) -> torch.Tensor:
        """The global positions of this rank's tokens in a sequence of ``length``, in local order."""
        return self.layout.positions(self.rank, length)

    def shard(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The local keyword arguments, and this rank's count of labelled tokens (None without labels).

        The batch's padding and packed documents are read from the whole batch first (parallel/segments.py) and
        reach the kernels with this micro-batch's forward ([Note: structure per micro-batch]); a length that does
        not divide is filled up to one that does ([Note: the engine's fill])."""
        source = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if source is None:
            raise ConfigError(
                f"{self.key}: sequence parallel needs the batch as keyword arguments with input_ids (or inputs_embeds)"
            )
        batch, length = source.shape[0], source.shape[1]
        segments = read_segments(kwargs, self.key, self.routing[0] if self.routing is not None else None)
        padded = -(-length // self.divisor) * self.divisor
        # transformers' num_items_in_batch: the model divides its token sum by the caller's count, not its own
        self.caller_normalizes = kwargs.get("num_items_in_batch") is not None
        out = {k: v for k, v in kwargs.items() if k not in ("attention_mask", *VARLEN_KEYS)}
        labels = out.pop("labels", None)
        if labels is not None and not self.shifts:
            out["labels"] = labels  # cut as they are (the module note)
        elif labels is not None and "shift_labels" not in out:
            out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        if out.get("position_ids") is None:
            out["position_ids"] = torch.arange(length, device=source.device).unsqueeze(0).expand(batch, length)
        if padded != length:
            out = {k: _filled(k, v, padded) for k, v in out.items()}
        segments = with_fill(segments, batch, length, padded, source.device)
        index = self.positions(padded).to(source.device)
        whole_positions = out["position_ids"]
        for key in SEQUENCE_KEYS:
            if key in out and out[key] is not None:
                out[key] = out[key].index_select(1, index)
        self._file(out["position_ids"], _Step(segments, whole_positions, batch, length, padded))
        count = None
        if "shift_labels" in out:
            # transformers' loss only runs when labels are given: hand it the local labels, unused once shifted
            out["labels"] = out["shift_labels"]
            count = (out["shift_labels"] != IGNORE_INDEX).sum().to(torch.float32)
        elif out.get("labels") is not None:
            count = (out["labels"] != IGNORE_INDEX).sum().to(torch.float32)
        return out, count

    def take_first_batch_check(self) -> Callable[[dict[str, Any]], None] | None:
        """The twin check for the first training batch (first_batch.py's note), handed out once."""
        check, self.first_batch = self.first_batch, None
        return check

    def _file(self, positions: torch.Tensor, step: _Step) -> None:
        key = id(positions)
        structure = self._structure
        self._structure[key] = (weakref.ref(positions, lambda _: structure.pop(key, None)), step)

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Hand the kernel this micro-batch's segments (found by its local position ids, made in ``shard``).

        [Note: structure per micro-batch] A pipeline shards all its micro-batches before the schedule runs
        them, and runs them interleaved; so the segments travel with the micro-batch, not with the sharder:
        ``shard`` files them under the local ``position_ids`` tensor it made, and this pre-hook of the model
        (every stage calls the whole model) sets them on the kernel when that micro-batch's forward starts.
        Each kernel keeps what its backward needs (masks in the graph, the ring's in its context)."""
        if not self.active or self.routing is None:
            return
        positions = kwargs.get("position_ids")
        filed = self._structure.get(id(positions))
        step = filed[1] if filed is not None and filed[0]() is positions else None
        self.resume(step)

    def _rotary_step(self, position_ids: Any) -> _Step | None:
        """The running micro-batch, if ``position_ids`` are its local ones (not a call of the model's own)."""
        step = self.current if self.active else None
        if step is None or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
            return None
        return step if position_ids.shape[1] * self.size == step.padded else None

    def _whole_positions(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        positional = len(args) >= 2
        step = self._rotary_step(args[1] if positional else kwargs.get("position_ids"))
        if step is None:
            return None
        if positional:
            return (args[0], step.positions, *args[2:]), kwargs
        return args, {**kwargs, "position_ids": step.positions}

    def _own_rows(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        step = self.current if self.active else None
        tables = output if isinstance(output, tuple) else (output,)
        if step is None or not all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == step.padded for t in tables
        ):
            return None  # not the whole sequence's tables (the pre-hook left this call alone)
        index = self.positions(step.padded).to(tables[0].device)
        own = tuple(t.index_select(1, index) for t in tables)
        return own if isinstance(output, tuple) else own[0]

    def _router_step(self) -> tuple[int, int, torch.Tensor | None] | None:
        step = self.current if self.active else None
        return None if step is None else (step.length, step.padded, step.valid)

    def combine(self, output: Any, count: torch.Tensor | None) -> Any:
        """Replace the output's local loss by the whole sequence's (value) with the gradient of the note, and let its
        logits and other per-token outputs be read whole (logits.py, [Note: logits on read]); router logits are the
        whole micro-batch's (router.py's note)."""
        step = self.current
        routed = self.router is not None and step is not None and self.router.apply(output, step.rows)
        if step is not None:
            local_length = step.padded // self.size
            output = with_whole_sequence(
                output,
                local_length,
                lambda local: gather_sequence(local, self.group, self.layout.positions, step.length),
            )
        loss = getattr(output, "loss", None)
        if loss is None or count is None:
            return output
        if self.caller_normalizes:
            local = loss  # already (shard's token sum) / (the caller's count for the whole batch): shards add up
            aux = getattr(output, "aux_loss", None)
            if routed and isinstance(aux, torch.Tensor):  # the balancing term is whole on every rank: count it once
                if self.router.coefficient is None:  # type: ignore[union-attr]
                    raise ConfigError(
                        f"{self.key}: the model returns aux_loss from whole-micro-batch router logits but has no "
                        "router_aux_loss_coef, so its share of the loss cannot be counted once across shards summed "
                        "for num_items_in_batch; train without num_items_in_batch or give the model router_aux_loss_coef"
                    )
                local = loss - (self.size - 1) / self.size * self.router.coefficient * aux  # type: ignore[union-attr]
        else:
            total = count.detach().clone()
            comm.all_reduce(total, group=self.group, tag="sequence-parallel token count").wait()
            # A shard with no labelled token (prompt masking) has a NaN mean: it contributes nothing, not 0 × NaN.
            local = torch.where(count > 0, loss * count / total.clamp(min=1.0), torch.zeros_like(loss))  # n_r·l_r / N
        reported = local.detach().clone()
        comm.all_reduce(reported, group=self.group, tag="sequence-parallel loss").wait()
        output.loss = self.size * local + (reported - self.size * local).detach()
        return output
