"""The twin check on the first real micro-batch: what the synthetic batch at ``initialize`` cannot carry.

[Note: why the first batch] The twin check at ``initialize`` runs random tokens in one plain row:
no padding, no documents, no keyword a data collator adds, the model's short length. Real batches
carry all of those, and a feature nobody wrote a rule for (a 4-D mask, a new collator keyword, a
length-dependent position scheme) would train wrong silently. So the first training micro-batch
is checked too, before it trains: one row of it (rank 0's, [Note: one window for the world]), cut to a
window of ``FIRST_BATCH_TOKENS`` tokens
around the row's first boundary (padding edge or document start), with every key the batch
carries sliced alike (its positions kept, varlen offsets recomputed for the window), runs through
the model's own attention and through the sharded step, and any difference refuses the batch in one
line naming the first module that differs and the batch's keys.

Cost: two forward/backward passes of one ``FIRST_BATCH_TOKENS``-token row, once per engine (the
window is a fixed token budget, so its memory is below any step's; ``benchmarks/bench_first_batch.py``
measures it against the first step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream import comm
from slipstream.engine.parallel.segments import VARLEN_KEYS, read_segments

FIRST_BATCH_TOKENS = 64


def first_batch_window(batch: dict[str, Any], key: str, model: torch.nn.Module, divisor: int) -> tuple[dict[str, Any], str] | None:
    """One row and a window of the batch, every key sliced alike, and a phrase naming it; None when the batch has
    no token ids to make labels from (nothing to compare then)."""
    source = batch.get("input_ids", batch.get("inputs_embeds"))
    if source is None or source.dim() < 2:
        return None
    rows, length = int(source.shape[0]), int(source.shape[1])
    segments = read_segments(batch, key, model)
    row, start = 0, 0
    window = min(length, max(FIRST_BATCH_TOKENS, 2 * divisor))
    if segments is not None:
        changes = (torch.diff(segments.documents, dim=1) != 0) | (torch.diff(segments.valid.long(), dim=1) != 0)  # [b, L-1]
        row = int(changes.sum(dim=1).argmax())
        found = changes[row].nonzero()
        if found.numel():
            start = max(0, min(int(found[0]) + 1 - window // 2, length - window))
    stop = start + window
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if name in VARLEN_KEYS:
            continue  # recomputed for the window below
        out[name] = _slice(name, value, rows, length, row, start, stop)
    if out.get("position_ids") is None:  # the window keeps its global positions (rotary, learned positions)
        out["position_ids"] = torch.arange(start, stop, device=source.device).unsqueeze(0)
    if segments is not None and any(batch.get(k) is not None for k in VARLEN_KEYS):
        documents = segments.documents[row, start:stop]
        starts = torch.cat([torch.zeros(1, dtype=torch.long), (torch.diff(documents) != 0).nonzero().flatten().cpu() + 1])
        offsets = torch.cat([starts, torch.tensor([window])]).to(torch.int32)
        longest = int(torch.diff(offsets).max())
        out.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets.clone(), max_length_q=longest, max_length_k=longest)
    if out.get("labels") is None and out.get("shift_labels") is None:
        if batch.get("input_ids") is None:
            return None
        out["labels"] = out["input_ids"].clone()
    keys = ", ".join(_describe(k, v) for k, v in batch.items() if v is not None)
    return out, f"the first batch (row {row}, tokens {start}-{stop} of {length}; keys {keys})"


def _slice(name: str, value: Any, rows: int, length: int, row: int, start: int, stop: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == length:
            return value[:, start:stop]  # unsqueezed, not expanded (position ids often are)
        return value
    value = value[row : row + 1]
    if value.dim() >= 2 and value.shape[1] == length:
        value = value[:, start:stop]
    if name == "attention_mask" and value.dim() == 4:  # [b, 1, q, k]: a window of both
        value = value[..., start:stop, start:stop]
    return value


def _describe(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{name}[{'×'.join(str(d) for d in value.shape)}]"
    return f"{name}={value!r}" if isinstance(value, (bool, int, float)) or value is None else name


def first_batch_check(model: torch.nn.Module, sharder: Any, run: Callable[[dict[str, Any], str], None]) -> Callable[[dict[str, Any]], None]:
    """What the runner calls with its first training batch: rank 0's window on every rank, then ``run(window, what)``.

    [Note: one window for the world] Every rank runs the check at once, and a rank's reference can depend on
    other ranks' batches (expert parallel sends its tokens to experts on ranks of other data-parallel
    replicas, whose batches differ). As with the synthetic batch at ``initialize``, every rank checks the
    same window: rank 0's, broadcast (one small object; the window is a few dozen tokens of one row)."""

    def check(batch: dict[str, Any]) -> None:
        found = first_batch_window(batch, sharder.key, model, sharder.divisor)
        found = _on(comm.broadcast_object(_on(found, torch.device("cpu"))), next(model.parameters()).device)
        if found is not None:
            run(*found)

    return check


def _on(found: tuple[dict[str, Any], str] | None, device: torch.device) -> tuple[dict[str, Any], str] | None:
    if found is None:
        return None
    window, what = found
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in window.items()}, what
