"""Which tokens of a micro-batch may attend to which, read from the batch itself: padding masks and
packed documents, over the whole (global) sequence, for every sharded attention kernel.

[Note: the batch's structure] One process builds its attention mask from three things the batch
carries (transformers' ``masking_utils``, the model's own rules, which we reproduce exactly):
- a 2-D ``attention_mask``: a zero hides that token **as a key** (queries at padding still attend
  to the real keys before them; a left-padded query with no key at all gets a zero output, as SDPA
  gives for a fully masked row);
- ``position_ids`` that restart within a row, **only when no attention_mask is given and the forward
  keeps no cache** (transformers then treats each run as its own document,
  ``find_packed_sequence_indices``; with a mask, or with ``use_cache`` on, which a config's default
  ``use_cache=True`` turns on outside gradient checkpointing, one process attends across the
  documents, and so do we: TRL's trainers pass ``use_cache=False``);
- flash-attention's varlen keywords ``cu_seq_lens_q``/``cu_seq_lens_k`` (document boundaries over
  the flattened batch, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` builds them).
A sharded kernel sees only its own tokens, so the sharder reads all three from the whole batch
before cutting it and hands the kernels one :class:`Segments`: a document number and a validity
flag per global token. A query may attend to a key when the causal/window rule allows it, both lie
in the same document and the key is valid. Tokens the engine appends to make a length divide
(``SequenceSharder``) are invalid keys in a document of their own, so they change nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.engine.config import ConfigError

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens_q", "cu_seqlens_k")


class Segments:
    """Per global token of a [b, L] micro-batch: its document and whether it may be attended to."""

    def __init__(self, documents: torch.Tensor, valid: torch.Tensor) -> None:
        self.documents = documents  # [b, L] int64: equal numbers attend to each other (causally)
        self.valid = valid  # [b, L] bool: False hides the token as a key (padding, the engine's own fill)
        self._blocks: dict[
            tuple[int, int, int, bool], tuple[torch.Tensor | None | bool, float]
        ] = {}  # the ring's per-layer reuse

    def pairs(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[b, 1, q, k] bool: same document and the key valid (causality is the caller's, attention.allowed)."""
        q_doc = self.documents.index_select(1, q_pos.to(self.documents.device))
        k_doc = self.documents.index_select(1, k_pos.to(self.documents.device))
        k_ok = self.valid.index_select(1, k_pos.to(self.valid.device))
        return ((q_doc[:, :, None] == k_doc[:, None, :]) & k_ok[:, None, :]).unsqueeze(1)

    def block(self, q_start: int, k_start: int, size: int, causal: bool) -> tuple[torch.Tensor | None | bool, float]:
        """One (query chunk, key chunk) block of ``size`` tokens each, worked out once per step (every layer asks):
        its mask, a [b, 1, size, size] bool tensor, ``None`` when every pair is allowed, ``False`` when none is
        (skip it); and the share of its pairs allowed (the ring's work count)."""
        key = (q_start, k_start, size, causal)
        if key not in self._blocks:
            q = torch.arange(q_start, q_start + size, device=self.documents.device)
            k = torch.arange(k_start, k_start + size, device=self.documents.device)
            mask = self.pairs(q, k)
            if causal:
                mask = mask & (q[:, None] >= k[None, :])
            share = float(mask.float().mean())
            self._blocks[key] = (False if share == 0.0 else None if share == 1.0 else mask, share)
        return self._blocks[key]


def read_segments(kwargs: dict[str, Any], key: str, model: torch.nn.Module | None = None) -> Segments | None:
    """The whole batch's :class:`Segments` as one process would read them (the note); None for plain causal rows.
    ``model``: the one the batch goes to (whether its forward keeps a cache, which turns packing off)."""
    source = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    batch, length = int(source.shape[0]), int(source.shape[1])
    device = source.device
    mask = kwargs.get("attention_mask")
    documents = _varlen_documents(kwargs, batch, length, key, device)
    if documents is None and mask is None:
        documents = _restarting_positions(kwargs.get("position_ids"), batch)
        if documents is not None and _keeps_cache(model, kwargs):
            documents = None  # one process attends across the documents then (the note)
    valid = None
    if mask is not None and mask.dim() == 2:
        if tuple(mask.shape) != (batch, length):
            raise ConfigError(
                f"{key}: attention_mask has shape {tuple(mask.shape)}, expected {(batch, length)} (batch, sequence)"
            )
        if not bool(torch.all(mask != 0)):
            valid = (mask != 0).to(device)
    if documents is None and valid is None:
        return None
    if documents is None:
        documents = torch.zeros(batch, length, dtype=torch.int64, device=device)
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    return Segments(documents, valid)


def _keeps_cache(model: torch.nn.Module | None, kwargs: dict[str, Any]) -> bool:
    """Whether transformers' forward will hold a cache (``merge_with_config_defaults``: the keyword, else the
    config's ``use_cache``; off under gradient checkpointing while training with gradients)."""
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return True
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(model, "config", None), "use_cache", None)
    if not use_cache:
        return False
    checkpointing = (
        any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) if model is not None else False
    )
    return not (checkpointing and model is not None and model.training and torch.is_grad_enabled())


def _restarting_positions(positions: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """transformers' packed-sequence rule: a new document wherever a position is not its predecessor + 1."""
    if positions is None or positions.dim() != 2 or positions.shape[-1] < 2:
        return None
    positions = positions.expand(batch, -1)
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    documents = (step != 1).cumsum(-1)
    return documents if bool((documents[:, -1] != 0).any()) else None


def _varlen_documents(
    kwargs: dict[str, Any], batch: int, length: int, key: str, device: torch.device
) -> torch.Tensor | None:
    """Document numbers from ``cu_seq_lens_q`` (offsets into the flattened batch); the key lengths must be the same."""
    q = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens_q"))
    k = kwargs.get("cu_seq_lens_k", kwargs.get("cu_seqlens_k"))
    if q is None and k is None:
        return None
    if q is None or k is None or not torch.equal(q.cpu(), k.cpu()):
        raise ConfigError(
            f"{key}: the batch's varlen keywords give different query and key boundaries (cu_seq_lens_q vs cu_seq_lens_k); "
            "sequence sharding supports self-attention over packed documents only"
        )
    offsets = q.to(device=device, dtype=torch.int64)
    tokens = torch.arange(batch * length, device=device)
    # bucketize: token t is in document d when offsets[d] <= t < offsets[d + 1]; tokens past the last offset share one more
    return torch.bucketize(tokens, offsets[1:], right=True).view(batch, length)


def with_fill(segments: Segments | None, batch: int, length: int, padded: int, device: torch.device) -> Segments | None:
    """``segments`` for the batch extended from ``length`` to ``padded`` tokens by the engine's fill (invalid keys,
    a document of their own); unchanged when nothing is appended."""
    if padded == length:
        return segments
    if segments is None:
        segments = Segments(
            torch.zeros(batch, length, dtype=torch.int64, device=device),
            torch.ones(batch, length, dtype=torch.bool, device=device),
        )
    fill = padded - length
    own = segments.documents.max() + 1
    documents = torch.cat([segments.documents, own.expand(batch, fill)], dim=1)
    valid = torch.cat([segments.valid, torch.zeros(batch, fill, dtype=torch.bool, device=device)], dim=1)
    return Segments(documents, valid)
