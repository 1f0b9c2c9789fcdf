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

Cost: two forward/backward passes of one window row, once per engine: ``FIRST_BATCH_TOKENS`` tokens unless the
model declares a longer range ([Note: a window that crosses the model's ranges]), and never more activation memory
than one rank's share of the step itself (``benchmarks/bench_first_batch.py`` measures it against the first step).

[Note: a window that crosses the model's ranges] A fixed window cannot see what happens beyond it: a kernel that
dropped a 4096-token sliding window, or computed a length-dependent rotary factor from its shard's positions, gives
the same numbers as the reference on any 64 tokens. So the window is as long as the longest attention range the
model declares (a ``*window``, ``*window_size`` or ``*chunk_size`` length on its config or modules: sliding windows, chunked
attention) plus ``FIRST_BATCH_TOKENS``, where the row is longer than that range, and it spans the first token whose
position reaches a length-dependent rotary module's threshold (dynamic NTK, longrope), placed so the window's first
shard stays below it. Its length is capped by the estimator (``slipstream.estimator.activation_bytes``): the whole-
window reference may need no more activation memory than one rank's share of the step or half the device's free
memory, whichever is larger, so the check fits wherever the step does; a window the cap cuts short of a range is
logged, naming the range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream import comm, estimator, estimator_shape
from slipstream.accelerator import get_accelerator
from slipstream.engine.parallel.attention import attention_configs
from slipstream.engine.parallel.segments import VARLEN_KEYS, read_segments
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

FIRST_BATCH_TOKENS = 64  # the least window: a boundary with a few dozen tokens on each side
FREE_MEMORY_SHARE = 0.5  # of the device's free memory, the most a window's activations may plan for
_RANGE_NAMES = (
    "window",
    "window_size",
    "chunk_size",
)  # name endings: sliding_window, attention_window, attention_chunk_size


def first_batch_window(
    batch: dict[str, Any], key: str, model: torch.nn.Module, divisor: int, size: int
) -> tuple[dict[str, Any], str] | None:
    """One row and a window of the batch, every key sliced alike, and a phrase naming it; None when the batch has
    no token ids to make labels from (nothing to compare then). ``size``: the ranks the step's sequence is split over."""
    source = batch.get("input_ids", batch.get("inputs_embeds"))
    if source is None or source.dim() < 2:
        return None
    rows, length = int(source.shape[0]), int(source.shape[1])
    segments = read_segments(batch, key, model)
    row, edges = 0, []
    if segments is not None:
        changes = (torch.diff(segments.documents, dim=1) != 0) | (
            torch.diff(segments.valid.long(), dim=1) != 0
        )  # [b, L-1]
        row = int(changes.sum(dim=1).argmax())
        edges = (changes[row].nonzero().flatten() + 1).tolist()[:2]  # the first boundary and the next
    reach, thresholds = model_ranges(model)
    positions = _row_positions(batch, row, length)
    crossing = next((int(hit[0]) for t in thresholds if (hit := (positions >= t).nonzero().flatten()).numel()), None)
    window, start = _place(length, divisor, reach, edges, crossing, affordable_tokens(model, rows, length, size))
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
        starts = torch.cat(
            [torch.zeros(1, dtype=torch.long), (torch.diff(documents) != 0).nonzero().flatten().cpu() + 1]
        )
        offsets = torch.cat([starts, torch.tensor([window])]).to(torch.int32)
        longest = int(torch.diff(offsets).max())
        out.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets.clone(), max_length_q=longest, max_length_k=longest)
    if out.get("labels") is None and out.get("shift_labels") is None:
        if batch.get("input_ids") is None:
            return None
        out["labels"] = out["input_ids"].clone()
    keys = ", ".join(_describe(k, v) for k, v in batch.items() if v is not None)
    return out, f"the first batch (row {row}, tokens {start}-{stop} of {length}; keys {keys})"


def model_ranges(model: torch.nn.Module) -> tuple[int, list[int]]:
    """The longest attention range the model declares (0: none) and the positions where a length-dependent rotary
    module changes its factors ([Note: a window that crosses the model's ranges])."""
    reach, thresholds = 0, set()
    sources: list[Any] = list(model.modules())
    stack, seen = [getattr(m, "config", None) for m in sources], set()
    while stack:  # the configs the modules read and every sub-config they hold (text_config, vision_config, ...)
        config = stack.pop()
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        sources.append(config)
        stack.extend(v for v in vars(config).values() if hasattr(v, "to_dict"))
    for source in sources:
        fields = vars(source)
        for name, value in fields.items():
            if name.endswith(_RANGE_NAMES) and fields.get(f"use_{name}") is not False:  # Qwen2's use_sliding_window
                reach = max([reach, *_lengths(value)])
        rope_type = getattr(source, "rope_type", None)
        if (
            isinstance(source, torch.nn.Module)
            and isinstance(rope_type, str)
            and ("dynamic" in rope_type or rope_type == "longrope")
        ):
            thresholds.update(_lengths(getattr(source, "original_max_seq_len", None)))
    return reach, sorted(thresholds)


def _lengths(value: Any) -> list[int]:
    """The positive token counts in a config value: an int, or a per-layer list of them (Longformer's windows)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]


def affordable_tokens(model: torch.nn.Module, rows: int, length: int, size: int) -> int:
    """The longest window (one row, whole, at most the row) whose activations the estimator fits in the larger of
    one rank's share of the step's (``rows`` × ``length`` tokens over ``size`` ranks, whose kernels keep no s × s
    scores) and half the memory the device has free now, with the model's own attention (eager keeps the scores):
    the check then fits wherever the step does, and uses the room there is."""
    found = estimator_shape.shape_from_config(getattr(model, "config", None) or {})
    shape = estimator.ModelShape(1, found.get("layers"), found.get("hidden"), found.get("heads"), found.get("vocab"))
    first = next(model.parameters(), None)
    precision = "fp32" if first is None or first.dtype in (torch.float32, torch.float64) else "bf16"
    flash = not any(getattr(c, "_attn_implementation", None) == "eager" for c in attention_configs(model))
    step = estimator.activation_bytes(shape, length, rows, precision)
    if step is None:  # no shape to estimate from: activations grow with the tokens
        return max(1, rows * length // size)
    budget, low, high = max(step / size, FREE_MEMORY_SHARE * get_accelerator().free_memory()), 1, length
    while low < high:  # activation_bytes grows with the length: bisect
        middle = (low + high + 1) // 2
        fits = (estimator.activation_bytes(shape, middle, 1, precision, flash=flash) or 0.0) <= budget
        low, high = (middle, high) if fits else (low, middle - 1)
    return low


def _row_positions(batch: dict[str, Any], row: int, length: int) -> torch.Tensor:
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[1] == length:
        return positions[min(row, positions.shape[0] - 1)].detach().cpu()
    return torch.arange(length)


def _place(
    length: int, divisor: int, reach: int, edges: list[int], crossing: int | None, affordable: int
) -> tuple[int, int]:
    """(window length, first token) for a row with document/padding ``edges`` (the first two), an attention
    ``reach`` and a rotary ``crossing`` token: the first edge with ``FIRST_BATCH_TOKENS // 2`` tokens on one side and
    the longer of its runs on the other, long enough to cross ``reach`` where the row is longer, spanning the crossing
    too where both fit (alone, the crossing goes in the window's last quarter: its first shard below the threshold),
    all capped by ``affordable``."""
    side = FIRST_BATCH_TOKENS // 2
    least = min(length, max(FIRST_BATCH_TOKENS, 2 * divisor))
    wanted = reach + FIRST_BATCH_TOKENS + side if 0 < reach < length else least
    boundary = edges[0] if edges else None
    if (
        crossing is not None
        and boundary is not None
        and abs(crossing - boundary) + FIRST_BATCH_TOKENS > max(affordable, least)
    ):
        crossing = None  # both do not fit: the boundary is what every real batch carries
    if crossing is not None and boundary is not None:
        wanted = max(wanted, abs(crossing - boundary) + FIRST_BATCH_TOKENS)
    window = min(length, max(least, min(wanted, affordable)))
    if window < min(length, wanted) and 0 < reach < length:
        logger.warning(
            "the first-batch twin check's window (%d tokens) does not cross the model's attention range of %d tokens: "
            "the memory cap (one rank's share of the step, or half the free memory) allows no more",
            window,
            reach,
        )
    if boundary is None:
        start = 0 if crossing is None else crossing - 3 * window // 4
    elif crossing is not None:
        start = (boundary + crossing) // 2 - window // 2
    else:  # the longer run beside the boundary fills the window (a sliding window is crossed inside one document)
        before, after = boundary, (edges[1] if len(edges) > 1 else length) - boundary
        start = boundary - side if after >= before else boundary + side - window
    return window, max(0, min(start, length - window))


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


def first_batch_check(
    model: torch.nn.Module, sharder: Any, run: Callable[[dict[str, Any], str], None]
) -> Callable[[dict[str, Any]], None]:
    """What the runner calls with its first training batch: rank 0's window on every rank, then ``run(window, what)``.

    [Note: one window for the world] Every rank runs the check at once, and a rank's reference can depend on
    other ranks' batches (expert parallel sends its tokens to experts on ranks of other data-parallel
    replicas, whose batches differ). As with the synthetic batch at ``initialize``, every rank checks the
    same window: rank 0's, broadcast (one small object; the window is a few dozen tokens of one row)."""

    def check(batch: dict[str, Any]) -> None:
        found = first_batch_window(batch, sharder.key, model, sharder.divisor, sharder.size)
        found = _on(comm.broadcast_object(_on(found, torch.device("cpu"))), next(model.parameters()).device)
        if found is not None:
            with torch.compiler.set_stance("force_eager"):  # compiled blocks run eagerly under the check's hooks
                run(*found)

    return check


def _on(found: tuple[dict[str, Any], str] | None, device: torch.device) -> tuple[dict[str, Any], str] | None:
    if found is None:
        return None
    window, what = found
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in window.items()}, what
