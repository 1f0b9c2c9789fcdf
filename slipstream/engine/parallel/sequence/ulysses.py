"""Ulysses attention: all-to-all from a sequence shard to a head shard, attention on the whole
sequence, all-to-all back.

[Note: Ulysses] Each of the ``u`` ranks of the sequence group holds ``s/u`` tokens of every head
after the model's own projections (and its rotary embedding, computed from the global positions
the engine passes). One all-to-all of the packed Q|K|V turns that into all ``s`` tokens of ``H/u``
heads; attention runs locally on whole sequences, so causality and softmax are exact; one
all-to-all of the output turns it back. Backward runs the two inverse all-to-alls. Per layer and
micro-batch: 2 all-to-alls forward and 2 backward, each rank sending ``(u-1)/u`` of its
``b·(H+2·Hkv')·(s/u)·d`` (Q|K|V) and ``b·H·(s/u)·d`` (output) elements.

[Note: Ulysses × ring] With a context-parallel group as well (USP), the batch is cut in ``u·c``
contiguous shards over both groups (sp innermost), so the all-to-all over the ``u`` ranks of the
sequence group gathers the ``c``-th part of the sequence that its context rank holds, for ``H/u``
heads; ring (or all-gathered K/V) attention over the context group then attends the whole
sequence for those heads. Ulysses' head limit (``u`` ≤ heads) no longer bounds the sequence split.

With fewer KV heads than ``u`` each KV head is repeated ``u/Hkv`` times before the exchange
(``Hkv' = u``: every rank receives the one KV head its query heads use); autograd sums the
repeats' gradients. The model reaches this code through transformers' attention interface (the
model's own seam): ``config._attn_implementation`` is switched to ``"slipstream_ulysses"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream import comm
from slipstream.comm import overlap
from slipstream.engine.parallel.attention import UnsupportedAttention, allowed, attend, attention_features
from slipstream.engine.parallel.segments import Segments
from slipstream.errors import UsageError
from slipstream.utils.eager_island import declare, island

ATTENTION_NAME = "slipstream_ulysses"
# transformers' own kernels (their names contain these): the built-in Ulysses kernel reproduces them
BUILT_IN_KERNELS = ("eager", "sdpa", "flash", "flex", "paged", "slipstream")


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` in ``u`` chunks to the ranks, gather theirs along ``gather_dim``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, tag: str
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.dims, ctx.group, ctx.tag = (scatter_dim, gather_dim), group, tag
        return _exchange(x, scatter_dim, gather_dim, group, tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return (
            _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group, ctx.tag + " (backward)"),
            None,
            None,
            None,
            None,
        )


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, tag: str) -> torch.Tensor:
    u = dist.get_world_size(group)
    send = torch.stack(x.chunk(u, dim=scatter_dim)).contiguous()  # [u, ...]: chunk i goes to rank i
    received = torch.empty_like(send)
    overlap.wait(
        comm.all_to_all_single(received, send, group=group, tag=tag)
    )  # a DualPipeV pair's other half computes meanwhile
    return torch.cat(received.unbind(0), dim=gather_dim)


def _exchanged_meta(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, tag: str
) -> torch.Tensor:
    u = dist.get_world_size(group)
    shape = list(x.shape)
    shape[scatter_dim] //= u
    shape[gather_dim] *= u
    return x.new_empty(shape)


declare(_AllToAll, _exchanged_meta)


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, tag: str = "ulysses all-to-all"
) -> torch.Tensor:
    """Differentiable all-to-all (the inverse exchange in backward); one eager island in a compiled block."""
    return island(_AllToAll, (x,), (scatter_dim, gather_dim, group, tag))


class UlyssesAttention:
    """The attention function registered with transformers: ``(module, q, k, v, mask, ...) -> (out [b, s, H, d], None)``.

    Each rank attends whole sequences, so causality, sliding windows, soft-capping and dropout are
    all honoured exactly (parallel/attention.py); anything else a model asks for is refused.
    """

    def __init__(self, group: dist.ProcessGroup, inner: Any = None) -> None:
        """``inner``: the attention over the heads this rank gathered when the sequence is also split over a
        context-parallel group (ring or all-gathered K/V: [Note: Ulysses × ring]); None: local attention."""
        self.group, self.inner = group, inner
        self.size = dist.get_world_size(group)
        self._active = False
        self._segments: Segments | None = None
        # [Note: the model's own attention function] set by ``use_own`` for an attention function the user registered
        self.own: tuple[str, Any] | None = None
        self.whole_positions: torch.Tensor | None = (
            None  # the running micro-batch's [rows, s] positions (the sharder's)
        )

    def use_own(self, name: str) -> None:
        """Run the function registered as ``name`` (the model's own) on this rank's heads of the whole sequence,
        instead of the built-in kernel, when it is not one of transformers' own kernels."""
        if self.inner is not None or any(part in name for part in BUILT_IN_KERNELS):
            return
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if name in ALL_ATTENTION_FUNCTIONS:
            self.own = (name, ALL_ATTENTION_FUNCTIONS[name])

    @property
    def segments(self) -> Segments | None:
        """The step's padding and documents over the whole sequence (parallel/segments.py), set by the sharder."""
        return self._segments

    @segments.setter
    def segments(self, value: Segments | None) -> None:
        self._segments = value
        if self.inner is not None:
            self.inner.segments = value

    @property
    def active(self) -> bool:
        """Set by the engine's sharder for its steps only (and passed on to the inner attention)."""
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        if self.inner is not None:
            self.inner.active = value

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
        if not self.active:
            raise UsageError(
                "sequence_parallel_size: Ulysses attention called outside the engine's sharded step (the model's own attention runs there)"
            )
        features = attention_features("sequence_parallel_size: Ulysses attention", module, dropout, scaling, kwargs)
        # attention_mask: the model built it for the local tokens only; the whole sequence's padding and
        # documents come from the sharder (self.segments), applied below with causality and the window.
        u = self.size
        b, heads, s_local, d = query.shape
        kv_heads = key.shape[1]
        if kv_heads < u:  # see the module note: one KV head per rank
            key, value = key.repeat_interleave(u // kv_heads, dim=1), value.repeat_interleave(u // kv_heads, dim=1)
            kv_heads = u
        hq, hk = heads // u, kv_heads // u
        packed = torch.cat(
            [query.view(b, u, hq, s_local, d), key.view(b, u, hk, s_local, d), value.view(b, u, hk, s_local, d)], dim=2
        )  # [b, u, hq + 2hk, s/u, d]: part i holds rank i's heads
        whole = all_to_all(packed, 1, 3, self.group, "ulysses q|k|v all-to-all")  # [b, 1, hq + 2hk, s, d]
        whole = whole.squeeze(1)
        q, k, v = whole.split([hq, hk, hk], dim=1)
        if self.inner is not None:
            out, _ = self.inner(module, q, k, v, attention_mask, dropout, scaling, **kwargs)  # [b, s/c, hq, d]
            back = all_to_all(out.transpose(1, 2).unsqueeze(1), 3, 1, self.group, "ulysses output all-to-all")
            return back.reshape(b, heads, s_local, d).transpose(1, 2).contiguous(), None
        if self.own is not None:
            out, _ = self._own_attention(module, q, k, v, features, dropout, scaling, kwargs)  # [b, s, hq, d]
            back = all_to_all(out.transpose(1, 2).unsqueeze(1), 3, 1, self.group, "ulysses output all-to-all")
            return back.reshape(b, heads, s_local, d).transpose(1, 2).contiguous(), None
        if hk != hq:
            k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
        s = s_local * u
        training = module.training
        if (
            self._segments is None
            and features.softcap is None
            and (features.sliding_window is None or features.sliding_window >= s)
        ):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=features.dropout if training else 0.0,
                is_causal=features.causal,
                scale=features.scaling,
            )
        else:
            positions = torch.arange(s, device=q.device)
            out = attend(
                q, k, v, features, allowed(features, positions, positions, self._segments), training
            )  # [b, hq, s, d]
        back = all_to_all(out.unsqueeze(1), 3, 1, self.group, "ulysses output all-to-all")  # [b, u, hq, s/u, d]
        return back.reshape(b, heads, s_local, d).transpose(1, 2).contiguous(), None

    def _own_attention(
        self,
        module: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        features: Any,
        dropout: float,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """[Note: the model's own attention function] After the all-to-all this rank holds whole sequences of its
        heads, so an attention function the user registered with transformers can run unchanged on them, with no
        rule written for what it computes (a bias from positions, its own masking). It gets what one process would
        give it: the whole sequence's mask in the form its mask function builds (none without one: the function
        masks by itself, as in one process) and the whole sequence's ``position_ids``. What it computes per head
        from the model's head count would see this rank's heads only; the twin check refuses such a function."""
        name, function = self.own  # type: ignore[misc]
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

        s = q.shape[2]
        mask: Any = None
        if name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name]
            if builder not in (sdpa_mask, eager_mask):
                raise UnsupportedAttention(
                    f"sequence_parallel_size: attention {name!r} builds its mask with {getattr(builder, '__name__', builder)!r}, "
                    "which Ulysses cannot rebuild for the whole sequence; register it with sdpa_mask or eager_mask, or none"
                )
            positions = torch.arange(s, device=q.device)
            allowed_pairs = allowed(features, positions, positions, self._segments)
            allowed_pairs = (
                torch.ones(s, s, dtype=torch.bool, device=q.device) if allowed_pairs is None else allowed_pairs
            )
            allowed_pairs = allowed_pairs.expand(q.shape[0], 1, s, s)
            mask = (
                allowed_pairs
                if builder is sdpa_mask
                else torch.zeros(allowed_pairs.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~allowed_pairs, torch.finfo(q.dtype).min
                )
            )
        extra = dict(kwargs)
        if self.whole_positions is not None and extra.get("position_ids") is not None:
            extra["position_ids"] = self.whole_positions
        return function(module, q, k, v, mask, dropout=dropout, scaling=scaling, **extra)
