"""Sharded replacements for linear-like leaves and the vocabulary layers; parameter names unchanged.

[Note: same names, same orientation] A replacement keeps the leaf's parameter names (``weight``,
``bias``) and its weight orientation (``nn.Linear`` is ``[out, in]``, transformers' ``Conv1D`` is
``[in, out]``), so the model's ``named_parameters()`` and the checkpoint's global shapes are those
of the unsharded model, and a tp 2 checkpoint loads at tp 1.

[Note: one copy per sub-block] The column layers of a sub-block (q, k, v; gate, up) read the same
input. Each wrapping it in its own ``copy`` would all-reduce its input gradient separately (three
all-reduces for attention instead of one). They share a :class:`SharedInput`: the first one wraps
the tensor, the others reuse the wrapped tensor (same object in, same object out), so autograd sums
their gradients before the one backward all-reduce. The row layer that closes the sub-block
forgets the cached tensor.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream.comm import all_reduce
from slipstream.engine.parallel.rng import ShardedRegionRng
from slipstream.engine.parallel.tensor import ops


@dataclasses.dataclass
class TPContext:
    """The tensor-parallel group and the switches every sharded layer reads at run time."""

    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool = False
    seq_dim: int = 1  # batch-first activations [batch, sequence, hidden]
    enabled_sequence: bool = True  # off while the self-check runs blocks on whole sequences
    sp_length: int | None = None  # the running region's whole sequence (ops.py's [Note: a length that does not divide])
    sp_rows: int | None = None  # the running region's batch rows (ops.py's [Note: flattened tokens])
    rng: ShardedRegionRng | None = None  # dropout between a sub-block's column and row layers (parallel/rng.py)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.enabled_sequence


class SharedInput:
    """The wrapped input of one sub-block's column layers (see [Note: one copy per sub-block])."""

    def __init__(self, ctx: TPContext) -> None:
        self.ctx = ctx
        self._source: torch.Tensor | None = None
        self._wrapped: torch.Tensor | None = None
        self.gathered_by_parent = False  # sequence parallel: the sub-block's entry hook gathers (sequence.py)
        self.closed_by_row = False  # a row layer ends the sharded region (only then is its RNG forked)
        self.opens = False  # column (or kv) layers read this input: a sharded region starts here

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self._source is x and self._wrapped is not None:
            return self._wrapped
        if self.closed_by_row and self.ctx.rng is not None:
            self.ctx.rng.enter()
        if self.ctx.sp and self.gathered_by_parent:
            return x
        if self.ctx.sp:
            ctx = self.ctx
            wrapped = ops.on_tokens(
                x, ctx.sp_rows, lambda t: ops.gather_sequence(t, ctx.seq_dim, ctx.group, length=ctx.sp_length)
            )
        else:
            wrapped = ops.copy_to_tp(x, self.ctx.group)
        self._source, self._wrapped = x, wrapped
        return wrapped

    def reset(self) -> None:
        self._source = self._wrapped = None


def shard_rows(full: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """This rank's slice of each of ``parts`` packed parts along ``dim``; and the offset of the first."""
    part = full.shape[dim] // parts
    local = part // size
    pieces = [full.narrow(dim, k * part + rank * local, local) for k in range(parts)]
    return torch.cat(pieces, dim).contiguous(), rank * local


class ShardedLinear(torch.nn.Module):
    """A column- or row-parallel ``nn.Linear`` / ``Conv1D`` (``transposed``: weight ``[in, out]``)."""

    def __init__(
        self,
        source: torch.nn.Module,
        style: str,
        ctx: TPContext,
        share: SharedInput,
        parts: int = 1,
        kv_heads: int = 0,
        gathered: bool = False,
    ) -> None:
        super().__init__()
        if style not in ("column", "row", "kv"):
            raise ValueError(f"tensor parallel: unknown style {style!r}")
        if gathered and (style == "kv" or parts > 1):
            raise ValueError(
                "tensor parallel: a gathered column is one contiguous piece (no packed parts, no kv style)"
            )
        self.style, self.ctx, self.share, self.parts, self.gathered = style, ctx, share, parts, gathered
        self.duplicate = False
        self.transposed = not isinstance(source, torch.nn.Linear)
        weight = source.weight.detach()
        bias = source.bias.detach() if getattr(source, "bias", None) is not None else None
        out_dim = 1 if self.transposed else 0
        self.global_weight_shape = tuple(weight.shape)
        self.global_bias_shape = tuple(bias.shape) if bias is not None else None
        if style == "kv":  # see [Note: replicated KV heads]
            self.shard_dim = out_dim
            ranks_per_head = ctx.size // kv_heads
            self.kv_heads, self.kv_slot = kv_heads, ctx.rank // ranks_per_head
            self.duplicate = ctx.rank % ranks_per_head != 0
            head = weight.shape[out_dim] // kv_heads
            self.offset = self.kv_slot * head
            w = weight.narrow(out_dim, self.offset, head).contiguous()
            b = bias.narrow(0, self.offset, head).clone() if bias is not None else None
        elif style == "column":
            self.shard_dim = out_dim
            w, self.offset = shard_rows(weight, out_dim, parts, ctx.rank, ctx.size)
            b = shard_rows(bias, 0, parts, ctx.rank, ctx.size)[0] if bias is not None else None
        else:
            self.shard_dim = 1 - out_dim
            w, self.offset = shard_rows(weight, 1 - out_dim, 1, ctx.rank, ctx.size)
            b = bias.clone() if bias is not None else None
        self.weight = torch.nn.Parameter(w, requires_grad=source.weight.requires_grad)
        if b is not None:
            self.bias = torch.nn.Parameter(b, requires_grad=source.bias.requires_grad)
        else:
            self.register_parameter("bias", None)
        if style == "kv":
            for param in self.parameters():
                param.register_hook(self._sum_over_head_sharers)
        # [Note: packed pieces] (utils/placement.py): a packed piece is stored part-major so each
        # part's box is one flat range. Linear's [parts·n, in] already is; Conv1D's [in, parts·n]
        # is kept as [parts, in, n] and put back together in forward.
        self.part_major = self.transposed and style == "column" and parts > 1
        if self.part_major:
            n = w.shape[1] // parts
            self.weight = torch.nn.Parameter(
                w.view(w.shape[0], parts, n).permute(1, 0, 2).contiguous(), requires_grad=source.weight.requires_grad
            )

    def packed_boxes(self, global_shape: tuple[int, ...], dim: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The boxes of a packed piece along ``dim`` of ``global_shape``, in storage order (one per part)."""
        part = global_shape[dim] // self.parts
        local = part // self.ctx.size
        boxes = []
        for k in range(self.parts):
            offsets, sizes = [0] * len(global_shape), list(global_shape)
            offsets[dim], sizes[dim] = k * part + self.offset, local
            boxes.append((tuple(offsets), tuple(sizes)))
        return boxes

    def _sum_over_head_sharers(self, grad: torch.Tensor) -> torch.Tensor:
        """[Note: replicated KV heads] With fewer KV heads than t, each rank keeps the one KV head its
        query heads use (ranks ``k·t/kv … (k+1)·t/kv − 1`` share head ``k``), so no rank idles and
        no rank computes heads it does not need. Each rank's gradient is then the contribution of
        its own query heads: the sharers' gradients are summed by one all-reduce over tp of a
        ``[kv_heads, ...]`` buffer, each rank writing its head's slot (no extra process groups)."""
        slots = grad.new_zeros((self.kv_heads, *grad.shape))
        slots[self.kv_slot] = grad
        all_reduce(slots, group=self.ctx.group, tag="tp kv-head gradient").wait()
        return slots[self.kv_slot]

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.part_major:  # [parts, in, n] -> [in, parts·n], as the unsharded Conv1D's columns
            y = x @ self.weight.permute(1, 0, 2).reshape(self.weight.shape[1], -1)
            return y + bias if bias is not None else y
        if self.transposed:
            y = x @ self.weight
            return y + bias if bias is not None else y
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[Note: gathered groups] transformers' ``colwise_gather_output`` / ``rowwise_split_input`` (Phi-3's packed
        ``qkv_proj`` sliced by the global head count, OLMo 2's q/k norm over the whole projection): the column's
        output is gathered along its last dimension, so what runs between the two sees whole tensors, computed
        alike on every rank; the row keeps this rank's slice of its input. The weights and the projections'
        compute stay sharded, the attention between them is not. The slice's backward is its gradient in place
        and zeros elsewhere (``keep_chunk``), so each rank holds a partial gradient of the region, as inside a
        sharded region: the gather's backward (a reduce-scatter) sums it for the input, and the region's
        replicated parameters are summed over tp with the sharded regions' ones (partial_grads.py)."""
        ctx = self.ctx
        if self.style in ("column", "kv"):
            y = self._matmul(self.share.enter(x), self.bias)
            return ops.gather_sequence(y, -1, ctx.group, "tp gather output") if self.gathered else y
        self.share.reset()
        if ctx.rng is not None:
            ctx.rng.leave()
        if self.gathered:
            x = ops.keep_chunk(x, -1, ctx.group)
        partial = self._matmul(x, None)
        if ctx.sp:
            y = ops.on_tokens(partial, ctx.sp_rows, lambda t: ops.reduce_scatter_sequence(t, ctx.seq_dim, ctx.group))
        else:
            y = ops.reduce_from_tp(partial, ctx.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        parts = f", packed {self.parts}" if self.parts > 1 else ""
        parts += (", output gathered" if self.style == "column" else ", input split") if self.gathered else ""
        return f"{self.style}-parallel, weight {tuple(self.weight.shape)} of {self.global_weight_shape}{parts}"


def vocab_rows(vocab: int, ctx: TPContext) -> tuple[int, int, int]:
    """This rank's rows ``[start, end)`` of a vocabulary cut in ``ceil(V / t)`` rows per rank, and that chunk size.

    [Note: vocabulary padding] A vocabulary that does not divide by ``t`` is cut unevenly (the last
    rank holds fewer rows) rather than padded in the weight, so the parameters, the checkpoint and
    the optimizer never see padding rows. Only the head's logits are padded to the chunk size for
    the all-gather, and the padding columns are cut off before the model's loss sees them.
    """
    chunk = -(-vocab // ctx.size)
    start = min(ctx.rank * chunk, vocab)
    return start, min(start + chunk, vocab), chunk


class VocabEmbedding(torch.nn.Module):
    """``nn.Embedding`` sharded on the vocabulary: look up the local rows, zero the rest, all-reduce."""

    def __init__(self, source: torch.nn.Embedding, ctx: TPContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings, self.embedding_dim = source.weight.shape
        self.padding_idx = source.padding_idx
        self.global_weight_shape = tuple(source.weight.shape)
        self.start, self.end, _ = vocab_rows(self.num_embeddings, ctx)
        self.weight = torch.nn.Parameter(
            source.weight.detach()[self.start : self.end].clone(), requires_grad=source.weight.requires_grad
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        # The padding row gets no gradient, as in nn.Embedding (OPT, Gemma, BART have one): its local index
        # where this rank holds it. Found by the tensor-parallel twin check (its rows were trained before).
        pad = (
            self.padding_idx - self.start
            if self.padding_idx is not None and self.start <= self.padding_idx < self.end
            else None
        )
        out = F.embedding(local, self.weight, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)
        return ops.reduce_from_tp(out, self.ctx.group)

    def extra_repr(self) -> str:
        return f"vocab-parallel, rows [{self.start}, {self.end}) of {self.global_weight_shape}"


class VocabHead(torch.nn.Module):
    """The LM head sharded on the vocabulary; the logits are gathered so the model's own loss is unchanged.

    [Note: gathered logits] Gathering ``[b, s, V]`` costs one all-gather of the logits and keeps a
    full copy per rank (the memory of the unsharded head's output); a vocabulary-parallel
    cross-entropy would avoid it but needs the loss, which belongs to the model.
    """

    def __init__(self, source: torch.nn.Linear, ctx: TPContext, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.global_weight_shape = tuple(source.weight.shape)
        self.vocab = self.global_weight_shape[0]
        self.out_features = self.vocab  # the logits' width, as nn.Linear names it (tiled logits read it)
        self.start, end, self.chunk = vocab_rows(self.vocab, ctx)
        if weight is None:  # untied: a slice of the head's own weight
            weight = torch.nn.Parameter(
                source.weight.detach()[self.start : end].clone(), requires_grad=source.weight.requires_grad
            )
        self.weight = weight  # tied: the embedding's (already sharded) parameter itself
        if source.bias is not None:
            raise ValueError("tensor parallel: an LM head with a bias is not sharded on the vocabulary")
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(ops.copy_to_tp(x, self.ctx.group), self.weight)
        if logits.shape[-1] < self.chunk:  # see [Note: vocabulary padding]
            logits = F.pad(logits, (0, self.chunk - logits.shape[-1]))
        full = ops.gather_keep(logits, logits.dim() - 1, self.ctx.group, "tp logits gather")
        return full[..., : self.vocab] if full.shape[-1] > self.vocab else full

    def extra_repr(self) -> str:
        return f"vocab-parallel, weight {tuple(self.weight.shape)} of {self.global_weight_shape}, logits gathered"
