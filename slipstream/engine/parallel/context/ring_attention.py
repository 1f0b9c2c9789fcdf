"""Ring attention: K/V travel around the context-parallel group; each rank merges the blocks its
queries may see by log-sum-exp.

[Note: the ring] Rank ``r`` holds the Q, K and V of its tokens (see token_layout.py). In ``c`` steps it
computes its queries against the K/V it holds, then passes K|V (one packed tensor, ``Hkv`` heads)
to rank ``r+1`` and receives rank ``r-1``'s, on the group's own process-group lane. Blocks are
(query chunk, key chunk) pairs: full (all keys precede the queries), diagonal (causal mask inside)
or skipped (all keys follow). With the batch's segments (padding, packed documents:
parallel/segments.py) a block is skipped when no allowed pair spans it, runs unmasked when every
pair is allowed, and carries its own mask otherwise. Each block yields its output and log-sum-exp;
outputs merge as ``o = Σ exp(lse_i − lse) o_i`` with ``lse = logsumexp_i lse_i``, which is exact
softmax over the whole sequence (a query no key may see keeps lse −inf and a zero output). The exchange is differentiable (backward passes dK|dV the other way round the
ring), so per layer and micro-batch: ``c−1`` sends forward and ``c−1`` backward, each of
``b·2·Hkv·(s/c)·d`` elements.

[Note: flash blocks] On CPU each block is the fused flash-attention op, which returns the block's
log-sum-exp, and backward recomputes every block from the saved Q, K, V, the merged output and
the merged log-sum-exp (the flash identity: a block's gradients need only the final softmax
statistics), so a rank keeps ``O(s/c)`` activations per layer, never a block's probabilities.
Backward passes K|V with the travelling dK|dV around the ring again (``c−1`` sends of
``b·4·Hkv·(s/c)·d``) and one last send of dK|dV (``b·2·Hkv·(s/c)·d``) brings each rank's key
gradients home. Other devices use the same ring with autograd through plain block attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.parallel.attention import UnsupportedAttention, attention_features
from slipstream.engine.parallel.context.token_layout import Layout
from slipstream.engine.parallel.segments import Segments
from slipstream.errors import UsageError
from slipstream.utils.eager_island import declare, island, register


class _RingShift(torch.autograd.Function):
    """Forward: send to the next rank, receive from the previous; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, nxt: int, prev: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.nxt, ctx.prev = group, nxt, prev
        out = torch.empty_like(x)
        comm.shift_ring(x.contiguous(), out, nxt, prev, group=group, tag="ring k|v").wait()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out = torch.empty_like(grad)
        comm.shift_ring(grad.contiguous(), out, ctx.prev, ctx.nxt, group=ctx.group, tag="ring dk|dv (backward)").wait()
        return out, None, None, None


def _block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one (query chunk, key chunk) pair: output and log-sum-exp per query (-inf: no key allowed).
    ``mask``: [b, 1, n, n] or [n, n] allowed pairs (the batch's segments, parallel/segments.py, and a sliding window),
    in place of ``diagonal``; ``softcap``: Gemma 2's ``tanh(score / cap) · cap`` on the block's logits."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if diagonal:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - _finite(lse)) @ v, lse


def _window_mask(
    q0: int, k0: int, n: int, window: int, causal: bool, device: torch.device | None, keys: int | None = None
) -> torch.Tensor | bool | None:
    """What a sliding window leaves of the block of queries ``q0…q0+n`` against keys ``k0…k0+keys`` (``keys``: n by
    default): False (no pair within the window: the block is skipped), None (every pair within it: the window
    changes nothing) or the [n, keys] mask of allowed pairs (with causality: ``0 ≤ i − j < window``; without:
    ``|i − j| < window``)."""
    keys = n if keys is None else keys
    low, high = q0 - (k0 + keys - 1), q0 + n - 1 - k0  # the block's smallest and largest distance i − j
    if causal:
        if low >= window or high < 0:
            return False
        if high < window and low >= 0:
            return None
    else:
        nearest = low if low > 0 else (-high if high < 0 else 0)
        if nearest >= window:
            return False
        if max(abs(low), abs(high)) < window:
            return None
    distance = (torch.arange(n, device=device)[:, None] + q0) - (torch.arange(keys, device=device)[None, :] + k0)
    return (distance >= 0) & (distance < window) if causal else distance.abs() < window


def _window_tiles(
    q0: int, k0: int, n: int, window: int, causal: bool, tile: int, device: torch.device | None
) -> list[tuple[slice, slice, torch.Tensor | None]]:
    """A block the window cuts, as query tiles of ``tile`` tokens, each against the contiguous run of keys the
    window lets it see: ``(query slice, key slice, mask or None)`` within the block, tiles that see nothing left
    out ([Note: windows on the ring])."""
    found = []
    for a in range(0, n, tile):
        b = min(n, a + tile)
        first = q0 + a - (window - 1)  # the earliest key a query of the tile may see
        last = q0 + b - 1 + (0 if causal else window - 1)
        start, stop = max(0, first - k0), min(n, last - k0 + 1)
        if start >= stop:
            continue
        mask = _window_mask(q0 + a, k0 + start, b - a, window, causal, device, keys=stop - start)
        if mask is False:
            continue
        found.append((slice(a, b), slice(start, stop), mask if isinstance(mask, torch.Tensor) else None))
    return found


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A row no key may see has log-sum-exp -inf; 0 in its place keeps ``exp(score - lse)`` at 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results of the same queries as one (exact; rows empty in both stay 0 with -inf)."""
    merged = torch.logaddexp(lse, block_lse)
    base = _finite(merged)
    return out * torch.exp(lse - base) + o * torch.exp(block_lse - base), merged


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The flash op's mask form: 0 where allowed, -inf where not."""
    return (
        None
        if mask is None
        else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    )


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, diagonal, attn_mask=_additive(mask, q.dtype), scale=scale
    )
    lse = lse.unsqueeze(-1)
    if mask is not None:  # the op reports 0 for a row with no allowed key: it must weigh nothing in the merge
        lse = lse.masked_fill(~mask.any(-1, keepdim=True), float("-inf"))
    return out, lse


class _FlashRing(torch.autograd.Function):
    """The whole ring for one layer as one autograd node: see [Note: flash blocks]."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: RingAttention,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> torch.Tensor:  # type: ignore[override]
        groups = q.shape[1] // k.shape[1]
        segments = ring.segments  # this micro-batch's (the backward may run after another's forward)
        q_chunks = [c.contiguous() for c in q.chunk(ring.layout.chunks_per_rank, dim=2)]
        # a query no key may see (the batch's padding) keeps a zero output and log-sum-exp -inf
        outs = [torch.zeros_like(c) for c in q_chunks]
        lses = [torch.full((*c.shape[:3], 1), float("-inf"), dtype=torch.float32, device=c.device) for c in q_chunks]
        for source, k_chunks, v_chunks in ring.travel(torch.cat([k, v], dim=1)):
            for i, j, diagonal, mask, qs, ks in ring.tiles(
                source, causal, q_chunks[0].shape[2], segments, window, q.device
            ):
                keys, values = (
                    _heads(k_chunks[j][:, :, ks], groups).contiguous(),
                    _heads(v_chunks[j][:, :, ks], groups).contiguous(),
                )
                o, lse = _flash(q_chunks[i][:, :, qs].contiguous(), keys, values, scale, diagonal, mask)
                outs[i][:, :, qs], lses[i][:, :, qs] = _merge(outs[i][:, :, qs], lses[i][:, :, qs], o, lse)
        out = torch.cat(outs, dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, _finite(torch.cat(lses, dim=2)))
        ctx.ring, ctx.scale, ctx.causal, ctx.segments, ctx.window = ring, scale, causal, segments, window
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring, per = ctx.ring, ctx.ring.layout.chunks_per_rank
        kv_heads, groups = k.shape[1], q.shape[1] // k.shape[1]
        split = lambda t: [c.contiguous() for c in t.chunk(per, dim=2)]  # noqa: E731
        q_c, g_c, o_c, l_c = split(q), split(grad.contiguous()), split(out), split(lse.squeeze(-1))
        dq = [torch.zeros_like(c) for c in q_c]
        carried = torch.cat([k, v, torch.zeros_like(k), torch.zeros_like(v)], dim=1)  # K|V|dK|dV travel together
        for source, carried_now in ring.travel(carried, whole=True):
            carried = carried_now
            kk, vv, dk, dv = (c.chunk(per, dim=2) for c in carried.split(kv_heads, dim=1))
            for i, j, diagonal, mask, qs, ks in ring.tiles(
                source, ctx.causal, q_c[0].shape[2], ctx.segments, ctx.window, q.device, count=False
            ):
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g_c[i][:, :, qs].contiguous(),
                    q_c[i][:, :, qs].contiguous(),
                    _heads(kk[j][:, :, ks], groups).contiguous(),
                    _heads(vv[j][:, :, ks], groups).contiguous(),
                    o_c[i][:, :, qs].contiguous(),
                    l_c[i][:, :, qs].contiguous(),
                    0.0,
                    diagonal,
                    attn_mask=_additive(mask, q.dtype),
                    scale=ctx.scale,
                )
                dq[i][:, :, qs] += gq
                dk[j][:, :, ks].add_(_fold(gk, groups))  # views into `carried`
                dv[j][:, :, ks].add_(_fold(gv, groups))
        home = ring.shift(carried[:, 2 * kv_heads :].contiguous(), "ring dk|dv home (backward)")  # see the note
        dk, dv = home.split(kv_heads, dim=1)
        return torch.cat(dq, dim=2), dk, dv, None, None, None, None


def _heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of repeated KV heads back onto their head."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


class RingAttention:
    """The attention function registered with transformers for context parallelism."""

    def __init__(self, group: dist.ProcessGroup, layout: Layout) -> None:
        # K/V travel on the group's own lane (comm/lanes.py): sends never queue behind the
        # group's other collectives (the token count and loss all-reduces of the sharder).
        self.group, self.layout = comm.lane_group(group, "ring k|v") or group, layout
        self.rank = dist.get_rank(self.group)
        ranks = dist.get_process_group_ranks(self.group)
        self.nxt, self.prev = ranks[(self.rank + 1) % layout.size], ranks[(self.rank - 1) % layout.size]
        self.pairs = 0.0  # causal work done by this rank (token_layout.py's units), for tests and the monitor
        self.active = False  # set by the engine's sharder for its steps only
        self.segments: Segments | None = (
            None  # the step's padding and documents (parallel/segments.py), from the sharder
        )
        self.window_tile = (
            32  # the fewest queries per tile of a block a sliding window cuts ([Note: windows on the ring])
        )
        register(self)  # a static argument of its eager island (utils/eager_island.py)

    def shift(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """One ring step outside autograd: send ``x`` to the next rank, return the previous rank's."""
        out = torch.empty_like(x)
        comm.shift_ring(x, out, self.nxt, self.prev, group=self.group, tag=tag).wait()
        return out

    def travel(self, kv: torch.Tensor, whole: bool = False) -> Any:
        """Yield ``(source rank, K chunks, V chunks)`` (``whole``: the travelling tensor itself) for ``c`` steps, shifting in between."""
        per = self.layout.chunks_per_rank
        source = self.rank
        for step in range(self.layout.size):
            if step:
                kv = self.shift(kv.contiguous(), "ring k|v" + (" with dk|dv (backward)" if whole else ""))
                source = (source - 1) % self.layout.size
            if whole:
                yield source, kv
            else:
                k, v = kv.chunk(2, dim=1)
                yield source, k.chunk(per, dim=2), v.chunk(per, dim=2)

    def blocks(
        self,
        source: int,
        causal: bool,
        chunk: int,
        segments: Segments | None,
        count: bool = True,
        window: int | None = None,
        device: torch.device | None = None,
    ) -> list[tuple[int, int, bool, torch.Tensor | None]]:
        """``(query chunk, key chunk, diagonal, mask)`` of this rank against ``source``'s keys, ``chunk`` tokens each;
        skipped blocks left out. Without the batch's segments a block is full or causal-diagonal (``mask`` None);
        with them (padding, packed documents) a block no allowed pair spans is skipped too, one all of whose
        pairs are allowed runs unmasked, and the rest carry their [b, 1, chunk, chunk] mask. A sliding ``window``
        (tokens) skips the blocks wholly outside it and masks the ones it cuts ([Note: windows on the ring]).
        ``count``: add their work to ``pairs`` (forward only)."""
        found: list[tuple[int, int, bool, torch.Tensor | None]] = []
        for i, qc in enumerate(self.layout.chunks(self.rank)):
            for j, kc in enumerate(self.layout.chunks(source)):
                if causal and kc > qc:
                    continue
                near = (
                    _window_mask(qc * chunk, kc * chunk, chunk, window, causal, device) if window is not None else None
                )
                if near is False:
                    continue
                if segments is not None:
                    mask, work = segments.block(qc * chunk, kc * chunk, chunk, causal)
                    if mask is False:
                        continue
                    if isinstance(near, torch.Tensor):
                        mask = near if mask is None else mask & near.to(mask.device)
                        work = float(mask.float().mean())
                    found.append((i, j, False, mask))  # type: ignore[arg-type]
                elif isinstance(near, torch.Tensor):
                    work = float(near.float().mean())
                    found.append((i, j, False, near))
                else:
                    diagonal = causal and kc == qc
                    work = 0.5 if diagonal else 1.0
                    found.append((i, j, diagonal, None))
                self.pairs += work if count else 0.0
        return found

    def tiles(
        self,
        source: int,
        causal: bool,
        chunk: int,
        segments: Segments | None,
        window: int | None,
        device: torch.device,
        count: bool = True,
    ) -> list[tuple[int, int, bool, torch.Tensor | None, slice, slice]]:
        """:meth:`blocks` with the slices of each block's queries and keys it runs on: a block a sliding window cuts
        (without the batch's segments) as query tiles against the keys each can see; the others whole."""
        whole = slice(None)
        found = []
        for i, j, diagonal, mask in self.blocks(source, causal, chunk, segments, count, window, device):
            if window is None or segments is not None or mask is None:
                found.append((i, j, diagonal, mask, whole, whole))
                continue
            q0, k0 = self.layout.chunks(self.rank)[i] * chunk, self.layout.chunks(source)[j] * chunk
            tile = min(chunk, max(self.window_tile, window // 4))
            found += [
                (i, j, False, m, qs, ks) for qs, ks, m in _window_tiles(q0, k0, chunk, window, causal, tile, device)
            ]
        return found

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # The causal pattern comes from the global positions, padding and documents from the step's segments.
        if not self.active:
            raise UsageError(
                "context_parallel: ring attention called outside the engine's sharded step (the model's own attention runs there)"
            )
        features = attention_features("context_parallel.method: ring attention", module, dropout, scaling, kwargs)
        b, heads, n, d = query.shape
        model = type(module).__name__
        if features.dropout:
            raise UnsupportedAttention(
                f"context_parallel.method: {model} uses attention dropout {features.dropout}, which ring attention does not implement; set the model's attention dropout to 0"
            )
        # [Note: windows on the ring] A sliding window shorter than the sequence skips every block wholly
        # outside it (a query chunk meets only the key chunks within ``window`` tokens) and, on the fused CPU
        # op, cuts each block it crosses into query tiles of max(window/4, window_tile) tokens, each run
        # against the contiguous run of keys its queries may see (masked at the band's edges), so the ring's
        # work per rank falls from ~s²/2c to ~s·(window + tile)/c pairs. Soft-capping is elementwise on a
        # block's logits, before its log-sum-exp, so the merge stays exact; the fused op takes masks but not
        # soft-capping, so soft-capped models run the ring with autograd through plain (masked) block attention.
        window = (
            features.sliding_window
            if features.sliding_window is not None and features.sliding_window < n * self.layout.size
            else None
        )
        scale = features.scaling if features.scaling is not None else d**-0.5
        # one eager island in a compiled block: the ring's shifts, its block plan and its counters run eagerly
        return island(_ring, (query, key, value), (self, scale, features.causal, window, features.softcap)), None

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        causal: bool,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """The ring over ``[b, H, n, d]`` queries and keys: ``[b, n, H, d]`` out."""
        b, heads, n, d = query.shape
        groups = heads // key.shape[1]
        if (
            softcap is None
            and query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            out = _FlashRing.apply(query, key, value, self, scale, causal, window)
            return out.transpose(1, 2).contiguous()
        per = self.layout.chunks_per_rank
        q_chunks = query.chunk(per, dim=2)
        outs: list[Any] = [None] * per
        lses: list[Any] = [None] * per
        kv = torch.cat([key, value], dim=1)
        source = self.rank
        anchor = None
        for step in range(self.layout.size):
            if step:
                kv = _RingShift.apply(kv, self.group, self.nxt, self.prev)
                source = (source - 1) % self.layout.size
                # [Note: every rank runs every backward shift] A rank may skip a whole block (causal),
                # which would leave its shift out of the graph and its peer waiting in backward. A
                # zero-weighted use keeps every shift in every rank's graph, so all ranks pass dK|dV
                # around the ring in the same order.
                touch = kv.flatten()[:1].sum() * 0.0
                anchor = touch if anchor is None else anchor + touch
            k_all, v_all = kv.chunk(2, dim=1)
            k_chunks, v_chunks = k_all.chunk(per, dim=2), v_all.chunk(per, dim=2)
            for i, j, diagonal, mask in self.blocks(
                source, causal, q_chunks[0].shape[2], self.segments, window=window, device=query.device
            ):
                o, lse = _block(
                    q_chunks[i],
                    _heads(k_chunks[j], groups),
                    _heads(v_chunks[j], groups),
                    scale,
                    diagonal,
                    mask,
                    softcap,
                )
                if outs[i] is None:
                    outs[i], lses[i] = o, lse
                else:
                    outs[i], lses[i] = _merge(outs[i], lses[i], o, lse)
        outs = [
            o if o is not None else torch.zeros_like(q_chunks[i]) for i, o in enumerate(outs)
        ]  # no key at all: zero
        out = torch.cat(outs, dim=2)  # [b, H, n, d]
        if anchor is not None:
            out = out + anchor
        return out.transpose(1, 2).contiguous()


def _ring(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ring: RingAttention,
    scale: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    return ring.attend(query, key, value, scale, causal, window, softcap)


def _ring_meta(query: torch.Tensor, *_: Any) -> torch.Tensor:
    return query.transpose(1, 2).contiguous()


declare(_ring, _ring_meta)
