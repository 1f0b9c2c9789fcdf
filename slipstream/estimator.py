"""Will it fit? Per-device memory by ZeRO stage, from the ZeRO paper's formulas. Pure Python.

Importing this module never imports torch: ``slipstream estimate`` answers as quickly as
``slipstream --help``. :func:`estimate` accepts a parameter count or an ``nn.Module`` (then
torch is already loaded) and, for a transformers model, reads layers/hidden/heads/vocab from its
config.

[Note: the formulas] Model states per device for Ψ parameters and data-parallel degree N, with
mixed-precision Adam (ZeRO paper, §3): 2Ψ bf16/fp16 weights, 2Ψ gradients and K = 12 bytes per
parameter of fp32 master weights, momentum and variance:

    stage 0: (2 + 2 + K)Ψ    stage 1: (2 + 2)Ψ + KΨ/N    stage 2: 2Ψ + (2 + K)Ψ/N    stage 3: (2 + 2 + K)Ψ/N

With fp32 training the weights are their own masters: 4 + 4 + 8 bytes. Offload (stages 1-3) moves
the optimizer's share, plus an fp32 gradient copy for the host Adam (16Ψ/N in all), off the device;
at stage 3 it moves the parameter shards too (ZeRO-Infinity), leaving the gathered units.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation", no tensor
parallelism): s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations, where s = sequence length,
b = micro-batch, h = hidden size, a = attention heads; the 5·a·s/h term is the s×s attention
matrices, which memory-efficient attention (SDPA/flash) does not keep. fp32 doubles it. With
activation checkpointing each layer keeps only its input (2·s·b·h bytes at 16 bit) and one layer's
activations exist at a time during recomputation. The loss adds ``LOSS_BYTES``·s·b·V: what
transformers' (unfused) causal-LM loss holds at its peak in the backward — the logits, their fp32
copy, the log-softmax and the gradients of both — measured with ``LiveTensorMeter`` on a Llama
(vocabulary 32,000, 1024 and 2048 tokens): 16.2 bytes per token per vocabulary entry in fp32, 14.1 in
bf16 (the paper's fused loss keeps 4).

[Note: sequence shards and tiles] Ulysses and ring attention (``seq_shards`` = u·c) divide every
term by the shard count: each rank holds s/(u·c) tokens of every layer (Ulysses' attention holds the
whole sequence for a u-th of the heads: the same bytes). Of the 34 (16-bit bytes per token per
hidden unit), the MLP's are ``3·h + 4·I`` per token (its input, the up projection's output and the
activation's, a dropout mask; 19·h at I = 4h). ``long_context.tiled_mlp`` keeps only the MLP's
input (2·h) per token and per layer, plus one tile's ``(3·h + 4·I)·t`` while an MLP runs;
``long_context.tiled_logits`` holds one tile's ``LOSS_BYTES``·t·V at a time instead of the whole
sequence's (measured: 14.0 and 13.5 bytes per token of a tile in fp32 and bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

from slipstream.launcher.textfile import read_small_text  # standard library only, like this module
from slipstream.launcher.usage import fail, shown

GB = 1e9  # the paper's unit: 1e9 bytes
STAGES = (0, 1, 2, 3)
HEADROOM = 0.9  # fraction of device memory a recommendation may plan for (allocator slack, buffers)
# Bytes per token per vocabulary entry that transformers' loss holds at its peak (the logits, their fp32 copy, the
# log-softmax and the gradients of both), by whether the model is fp32; measured with LiveTensorMeter (see the note).
LOSS_BYTES = {True: 16, False: 14}


@dataclasses.dataclass(frozen=True)
class Tiling:
    """``long_context``'s tiles as the estimate sees them: tokens per tile (None: untiled), and the sequence shards."""

    logits_tile: int | None = None
    mlp_tile: int | None = None
    seq_shards: int = 1  # Ulysses × ring ranks the sequence is cut over

    def variants(self) -> dict[str, Tiling]:
        """Untiled, each tiling and both, over the same shards (tiles of this size, else 2048)."""
        logits, mlp, u = self.logits_tile or 2048, self.mlp_tile or 2048, self.seq_shards
        return {"untiled": Tiling(None, None, u), "tiled logits": Tiling(logits, None, u), "tiled MLP": Tiling(None, mlp, u), "both": Tiling(logits, mlp, u)}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the activation estimate needs; ``None`` fields make it skip activations."""

    params: int
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    intermediate: int | None = None  # the MLP's width (None: 4 × hidden)


@dataclasses.dataclass(frozen=True)
class StageEstimate:
    stage: int
    params: float  # bytes per device
    grads: float
    optimizer: float
    offloaded: float  # bytes per rank kept in host memory or on NVMe instead
    activations: float | None

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0)


@dataclasses.dataclass(frozen=True)
class Estimate:
    shape: ModelShape
    dp: int
    precision: str
    offload: str
    seq_len: int | None
    micro_batch: int
    activation_checkpointing: bool
    stages: list[StageEstimate]
    recommendation: str | None = None
    tiling: Tiling = Tiling()
    flash: bool = True

    def stage(self, stage: int) -> StageEstimate:
        return self.stages[stage]

    def tiling_line(self) -> str | None:
        """Activations with and without each of ``long_context``'s tilings (tiles of the given size, else 2048)."""
        if not (self.seq_len and self.shape.vocab and self.shape.layers and self.shape.hidden):
            return None
        act = functools.partial(activation_bytes, self.shape, self.seq_len, self.micro_batch, self.precision, self.activation_checkpointing, self.flash)
        parts = [f"{name} {_gb(act(tiling=v) or 0.0)}" for name, v in self.tiling.variants().items()]
        return f"activations by long_context tiling (GB per device): {', '.join(parts)}"

    def table(self) -> str:
        """The per-stage table ``slipstream estimate`` prints."""
        s = self.shape
        head = (
            f"{_count(s.params)} parameters, data-parallel degree {self.dp}, {self.precision}"
            + (f", offload {self.offload}" if self.offload != "none" else "")
        )
        if self.seq_len and s.layers and s.hidden:
            head += (
                f"; activations for micro-batch {self.micro_batch} × sequence {self.seq_len}, {s.layers} layers, hidden {s.hidden}"
                + (", checkpointed" if self.activation_checkpointing else "")
                + (f", sequence over {self.tiling.seq_shards} ranks" if self.tiling.seq_shards > 1 else "")
                + (f", logits tiled by {self.tiling.logits_tile}" if self.tiling.logits_tile else "")
                + (f", MLP tiled by {self.tiling.mlp_tile}" if self.tiling.mlp_tile else "")
            )
        lines = [head, f"{'stage':<6}{'params':>10}{'grads':>10}{'optimizer':>11}{'model states':>14}{'activations':>13}{'total':>10}"
                 + ("   offloaded/rank" if self.offload != "none" else "")]  # fmt: skip
        for e in self.stages:
            act = "-" if e.activations is None else _gb(e.activations)
            line = f"{e.stage:<6}{_gb(e.params):>10}{_gb(e.grads):>10}{_gb(e.optimizer):>11}{_gb(e.model_states):>14}{act:>13}{_gb(e.total):>10}"
            if self.offload != "none":
                line += f"   {_gb(e.offloaded) if e.stage else 'n/a (offload needs stage 1-3)'}"
            lines.append(line)
        lines.append("(GB = 1e9 bytes per device; ZeRO paper formulas, see docs/monitoring.md#memory-estimator)")
        tiles = self.tiling_line()
        if tiles:
            lines.append(tiles)
        if self.recommendation:
            lines.append(self.recommendation)
        return "\n".join(lines)


def model_state_bytes(
    params: float, dp: int, stage: int, precision: str = "bf16", offload: str = "none", fp32_grads: bool = False
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, offloaded) bytes per device for ``stage``; see [Note: the formulas].

    ``fp32_grads``: gradients accumulate in fp32 even with bf16/fp16 weights (4 bytes, not 2), as
    slipstream's stage 0 does.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    w, g, k = (4, 4, 8) if precision == "fp32" else (2, 4 if fp32_grads else 2, 12)
    n = params
    shard = {0: (w * n, g * n, k * n), 1: (w * n, g * n, k * n / dp), 2: (w * n, g * n / dp, k * n / dp), 3: (w * n / dp, g * n / dp, k * n / dp)}[stage]
    p, gr, opt = shard
    offloaded = 0.0
    if offload != "none" and stage > 0:
        offloaded = 16 * n / dp  # fp32 masters, m, v and an fp32 gradient copy for the host optimizer
        opt = 0.0
        if stage == 3:  # ZeRO-Infinity: the parameter shards live off the device as well
            offloaded += p
            p = 0.0
    return p, gr, opt, offloaded


def activation_bytes(
    shape: ModelShape, seq_len: int, micro_batch: int, precision: str = "bf16", checkpointing: bool = False, flash: bool = True,
    tiling: Tiling = Tiling(),
) -> float | None:  # fmt: skip
    """Peak activation bytes per device for one micro-batch (None without layers/hidden); see [Note: the formulas]
    and [Note: sequence shards and tiles]."""
    if not (shape.layers and shape.hidden):
        return None
    b, h, layers = micro_batch, shape.hidden, shape.layers
    s = -(-seq_len // tiling.seq_shards)  # this rank's tokens per row
    n = s * b
    a = shape.heads or max(1, h // 64)
    inter = shape.intermediate or 4 * h
    scale = 2.0 if precision == "fp32" else 1.0
    mlp = n * (3 * h + 4 * inter)
    mlp_kept, mlp_tile = mlp, 0.0
    if tiling.mlp_tile is not None:
        mlp_kept, mlp_tile = 2 * n * h, min(n, tiling.mlp_tile) * (3 * h + 4 * inter)
    per_layer = (n * h * (15 + (0 if flash else 5 * a * s / h)) + mlp_kept) * scale
    tokens_with_logits = n if tiling.logits_tile is None else min(n, tiling.logits_tile)
    logits = LOSS_BYTES[precision == "fp32"] * tokens_with_logits * (shape.vocab or 0)
    transient = mlp_tile * scale
    if checkpointing:
        return layers * 2 * n * h * scale + per_layer + transient + logits
    return layers * per_layer + transient + logits


def longest_sequence(
    shape: ModelShape, budget: float, micro_batch: int, precision: str, checkpointing: bool, flash: bool, tiling: Tiling, step: int = 256
) -> int:  # fmt: skip
    """The longest sequence (a multiple of ``step``) whose activations fit in ``budget`` bytes; 0 if none does."""
    def fits(seq: int) -> bool:
        return (activation_bytes(shape, seq, micro_batch, precision, checkpointing, flash, tiling) or 0.0) <= budget

    if budget <= 0 or not fits(step):
        return 0
    high = step
    while fits(high) and high < MAX_COUNT:
        high *= 2
    low = high // 2  # fits(low); not fits(high) (or the cap)
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def training_flops_per_token(matmul_params: float, layers: int, attention_dim: int, seq_len: int) -> float:
    """Model FLOPs to train on one token: ``6·N + 12·L·d_attn·s``.

    ``N`` counts the parameters that multiply activations (every weight matrix, the output head
    included; not embedding lookups, biases or norms): 2 FLOPs per parameter forward, 4 backward.
    The attention scores ``QKᵀ`` and the weighted sum with ``V`` add ``2·2·s·d_attn`` per layer
    forward, 3× that for training; causal masking is not discounted (PaLM appendix B, Megatron).
    Activation recomputation is not counted: these are *model* FLOPs, the basis of MFU.
    """
    return 6.0 * matmul_params + 12.0 * layers * attention_dim * seq_len


def estimate(
    model: Any,
    dp: int = 1,
    *,
    seq_len: int | None = None,
    micro_batch: int = 1,
    precision: str = "bf16",
    offload: str = "none",
    activation_checkpointing: bool = False,
    device_memory: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    flash_attention: bool = True,
    fp32_grads: bool = False,
    intermediate: int | None = None,
    tiling: Tiling = Tiling(),
) -> Estimate:
    """Per-device memory for every ZeRO stage; ``model`` is a parameter count, an ``nn.Module`` or a config dict.

    For a transformers model (or its ``config.json`` as a dict) layers, hidden size, heads, vocabulary
    and sequence length are read from the config unless given. With ``device_memory`` (bytes) the
    result carries a recommendation.
    """
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload must be none, cpu or nvme, got {offload!r}")
    found = _describe(model)
    shape = ModelShape(
        params=int(found.get("params", 0)),
        layers=layers or found.get("layers"), hidden=hidden or found.get("hidden"),
        heads=heads or found.get("heads"), vocab=vocab or found.get("vocab"),
        intermediate=intermediate or found.get("intermediate"),
    )  # fmt: skip
    if shape.params <= 0:
        raise ValueError("the parameter count is unknown: pass a number of parameters, a model or a config with one")
    seq = seq_len or found.get("seq_len")
    result = _estimate(shape, dp, seq, micro_batch, precision, offload, activation_checkpointing, flash_attention, fp32_grads, tiling)
    if device_memory:
        result = dataclasses.replace(result, recommendation=recommend(shape, dp, seq, micro_batch, precision, device_memory, flash_attention))
    return result


def _estimate(
    shape: ModelShape, dp: int, seq: int | None, mb: int, precision: str, offload: str, ac: bool, flash: bool, fp32_grads: bool,
    tiling: Tiling = Tiling(),
) -> Estimate:  # fmt: skip
    act = activation_bytes(shape, seq, mb, precision, ac, flash, tiling) if seq else None
    stages = []
    for stage in STAGES:
        p, g, o, off = model_state_bytes(shape.params, dp, stage, precision, offload, fp32_grads)
        stages.append(StageEstimate(stage, p, g, o, off, act))
    return Estimate(shape, dp, precision, offload, seq, mb, ac, stages, tiling=tiling, flash=flash)


def recommend(shape: ModelShape, dp: int, seq: int | None, micro_batch: int, precision: str, device_memory: float, flash: bool = True) -> str:
    """The cheapest configuration that fits in ``HEADROOM`` of ``device_memory`` bytes.

    Cheapest first: no offload before CPU before NVMe offload; without activation checkpointing
    (which costs about a third more compute) before with it; lower stages (less communication:
    stage 3 moves 1.5× the bytes) before higher; then smaller micro-batches.
    """
    budget = HEADROOM * device_memory
    batches = [micro_batch]
    while batches[-1] > 1:
        batches.append(batches[-1] // 2)
    for mb in batches:
        for offload in ("none", "cpu", "nvme"):
            for ac in (False, True):
                for stage in STAGES:
                    if offload != "none" and stage == 0:
                        continue
                    p, g, o, _ = model_state_bytes(shape.params, dp, stage, precision, offload)
                    act = (activation_bytes(shape, seq, mb, precision, ac, flash) if seq else 0.0) or 0.0
                    if p + g + o + act <= budget:
                        parts = [f"ZeRO stage {stage}"]
                        parts.append(f"offload {offload}" if offload != "none" else "no offload")
                        if seq:
                            parts.append("activation checkpointing on" if ac else "no activation checkpointing")
                            parts.append(f"micro-batch {mb}")
                        return (
                            f"recommended for {_gb(device_memory)} GB per device: {', '.join(parts)} "
                            f"({_gb(p + g + o + act)} GB, within {HEADROOM:.0%} of the device)"
                        )
    return (
        f"does not fit in {_gb(device_memory)} GB per device even with NVMe offload, activation checkpointing and "
        f"micro-batch 1: add data-parallel ranks (--dp) or shorten the sequence"
    )


# --------------------------------------------------------------------------- model description


_CONFIG_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "seq_len": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}


def shape_from_config(config: Any) -> dict[str, int]:
    """layers/hidden/heads/vocab/seq_len from a transformers config (object or dict)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    found: dict[str, int] = {}
    for field, keys in _CONFIG_KEYS.items():
        for key in keys:
            value = get(key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found[field] = value
                break
    return found


def _describe(model: Any) -> dict[str, int]:
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return {"params": _whole_params(model)}
    if isinstance(model, dict):
        found = shape_from_config(model)
        if "params" in model or "num_parameters" in model:
            found["params"] = _whole_params(model.get("params", model.get("num_parameters")))
        elif {"layers", "hidden", "vocab"} <= found.keys():
            found["params"] = gpt_params(found["layers"], found["hidden"], found["vocab"], found.get("seq_len", 0), model.get("intermediate_size"))
        return found
    if hasattr(model, "parameters"):  # an nn.Module: torch is loaded already
        seen: set[int] = set()
        params = 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params += p.numel()
        found = shape_from_config(getattr(model, "config", None) or {})
        found["params"] = params
        return found
    raise TypeError(f"estimate: expected a parameter count, an nn.Module or a config dict, got {type(model).__name__}")


def _whole_params(value: Any) -> int:
    """A parameter count as an int; ValueError (not OverflowError) for inf/NaN or a non-number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the parameter count must be a finite number, got {value!r}")
    return int(value)


def gpt_params(layers: int, hidden: int, vocab: int, positions: int = 0, intermediate: int | None = None) -> int:
    """Parameters of a GPT-style model: embeddings + per layer (attention 4h², MLP 2·h·ffn, biases, norms)."""
    ffn = intermediate or 4 * hidden
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden


# --------------------------------------------------------------------------- command line

# The largest values the command line takes. Beyond them no model exists, and the arithmetic stays
# far from float overflow: activations multiply four of these counts (about 1e36 at most).
MAX_PARAMS = 1e15
_MAX_PARAMS_TEXT = "1e15 (1000T)"
MAX_COUNT = 1_000_000_000  # ranks, tokens, layers, hidden size, heads, vocabulary, micro-batch
MIN_DEVICE_GB, MAX_DEVICE_GB = 0.001, 1_000_000.0
_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """What ``--model-config`` gives: the file as named on the command line and its JSON object."""

    path: str
    data: dict[str, Any]


def parse_params(text: str) -> int:
    """``--params``: a finite count from 1 to ``MAX_PARAMS``, as ``7e9``, ``7.5e9`` or ``7B`` (K, M, B, T)."""
    number, scale = text.strip(), 1.0
    if number[-1:].upper() in _SUFFIXES:
        number, scale = number[:-1], _SUFFIXES[number[-1].upper()]
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"{shown(text)}: must be a finite positive number of parameters (e.g. 7e9 or 7B)")
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"{shown(text)}: must be at most {_MAX_PARAMS_TEXT} parameters")
    return round(value)


def parse_device_memory(text: str) -> float:
    """``--device-memory``: GB (1e9 bytes) per device, finite, from ``MIN_DEVICE_GB`` to ``MAX_DEVICE_GB``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_DEVICE_GB <= value <= MAX_DEVICE_GB:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(
            f"{shown(text)}: must be a number of GB (1e9 bytes) per device from {MIN_DEVICE_GB:g} to {MAX_DEVICE_GB:,.0f} (e.g. 80)"
        )
    return value


def whole_number(meaning: str) -> Callable[[str], int]:
    """A ``type=`` converter for a count from 1 to ``MAX_COUNT``; ``meaning`` says what it counts in errors."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also thousands of digits (Python's int size limit)
            value = 0
        if not 1 <= value <= MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{shown(text)}: must be a whole number from 1 to {MAX_COUNT:,} ({meaning})")
        return value

    convert.__name__ = f"whole number ({meaning})"
    return convert


def read_model_config(text: str) -> ConfigFile:
    """``--model-config``: a readable UTF-8 file (at most 1 MiB) holding a JSON object whose sizes are in range.

    The numbers the estimate reads are checked here, so a config with ``"n_embd": 1e400`` (infinity
    to JSON) or ``"num_parameters": -1`` is refused, naming the file and the key, like a bad option.
    """
    try:
        content = read_small_text(text, "--model-config", ValueError)
    except ValueError as err:  # cannot be read, larger than 1 MiB, not UTF-8
        raise argparse.ArgumentTypeError(str(err).removeprefix("--model-config: ")) from None
    try:
        data = json.loads(content)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"{text} is not valid JSON: nested too deeply") from None
    except ValueError:  # Python's int size limit
        raise argparse.ArgumentTypeError(f"{text}: a number in it has too many digits (over 4300) to read") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{text} holds a JSON {type(data).__name__}, not an object; give a transformers config.json")
    for key in ("params", "num_parameters"):
        if key in data and not (_is_number(data[key]) and 1 <= data[key] <= MAX_PARAMS):
            raise argparse.ArgumentTypeError(f"{text}: {key!r} is {_as_json(data[key])}; it must be a number of parameters from 1 to {_MAX_PARAMS_TEXT}")
    for key in [*(k for keys in _CONFIG_KEYS.values() for k in keys), "intermediate_size"]:
        value = data.get(key)
        if key == "intermediate_size":  # gpt_params multiplies by it: absent, null or a whole number
            wrong = value is not None and not (isinstance(value, int) and _is_number(value) and 1 <= value <= MAX_COUNT)
        else:  # shape_from_config passes over what is not a number; a number must be in range
            wrong = _is_number(value) and not 1 <= value <= MAX_COUNT
        if wrong:
            raise argparse.ArgumentTypeError(f"{text}: {key!r} is {_as_json(value)}; it must be a whole number from 1 to {MAX_COUNT:,}")
    return ConfigFile(text, data)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_json(value: Any, limit: int = 60) -> str:
    """``value`` spelled as in the file (``Infinity``, ``"big"``, ``true``), shortened past ``limit``."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``slipstream estimate`` options; every value is checked by its ``type=`` converter above."""
    parser.add_argument("--params", type=parse_params, metavar="N", help="number of parameters, e.g. 7.5e9 or 7.5B (or give --model-config)")
    parser.add_argument("--dp", type=whole_number("the data-parallel degree"), default=1, metavar="N", help="data-parallel degree: ranks the states are partitioned over (default 1)")
    parser.add_argument("--model-config", type=read_model_config, metavar="JSON", help="a transformers config.json: layers, hidden, heads, vocab, sequence length")
    parser.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none", help="optimizer (and at stage 3 parameter) offload")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="bf16/fp16 with fp32 masters (default) or fp32")
    parser.add_argument("--seq-len", type=whole_number("tokens per sequence"), metavar="S", help="sequence length for the activation estimate")
    parser.add_argument("--micro-batch", type=whole_number("sequences per device"), default=1, metavar="B", help="micro-batch per device (default 1)")
    parser.add_argument("--layers", type=whole_number("transformer layers"), metavar="L", help="transformer layers (activation estimate)")
    parser.add_argument("--hidden", type=whole_number("the hidden size"), metavar="H", help="hidden size (activation estimate)")
    parser.add_argument("--heads", type=whole_number("attention heads"), metavar="A", help="attention heads (only for --no-flash-attention)")
    parser.add_argument("--vocab", type=whole_number("the vocabulary size"), metavar="V", help="vocabulary size (the loss's logits)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="estimate activations with checkpointing on")
    parser.add_argument("--no-flash-attention", action="store_true", help="attention keeps the s×s score matrices")
    parser.add_argument("--fp32-grads", action="store_true", help="gradients accumulate in fp32 with bf16/fp16 weights (slipstream's stage 0)")
    parser.add_argument("--device-memory", type=parse_device_memory, metavar="GB", help="memory per device in GB (1e9 bytes): adds a recommendation")
    parser.add_argument("--intermediate", type=whole_number("the MLP's width"), metavar="I", help="the MLP's intermediate size (default 4 × hidden)")
    parser.add_argument("--seq-shards", type=whole_number("ranks the sequence is cut over"), default=1, metavar="N", help="Ulysses × context-parallel ranks the sequence is cut over (default 1)")
    parser.add_argument("--tiled-logits", type=whole_number("tokens per tile"), metavar="T", help="long_context.tiled_logits with tiles of T tokens")
    parser.add_argument("--tiled-mlp", type=whole_number("tokens per tile"), metavar="T", help="long_context.tiled_mlp with tiles of T tokens")
    parser.add_argument("--max-seq", action="store_true", help="the longest sequence that fits in --device-memory, by stage, with and without the tilings")


def main(args: argparse.Namespace) -> int:
    """Run ``slipstream estimate``; returns the exit code. Usage errors are one line, status 2."""
    prog = "slipstream estimate"
    source: Any = args.params
    if args.model_config is not None:
        source = dict(args.model_config.data)
        if args.params:
            source["params"] = args.params
        params = _describe(source).get("params", 0)
        if not 1 <= params <= MAX_PARAMS:
            why = "no parameter count (params or num_parameters) and not all of layers, hidden size and vocabulary size to derive one" if not params else f"describes {params:.2g} parameters, more than {_MAX_PARAMS_TEXT}"
            fail(prog, f"--model-config {args.model_config.path}: {why}; give --params")
    if source is None:
        fail(prog, f"give --params N (e.g. 7e9 or 7B) or --model-config config.json; see '{prog} --help'")
    if args.max_seq and not args.device_memory:
        fail(prog, "--max-seq needs --device-memory GB (the memory the sequence must fit in)")
    tiling = Tiling(args.tiled_logits, args.tiled_mlp, args.seq_shards)
    try:
        result = estimate(
            source, args.dp, seq_len=args.seq_len, tiling=tiling, intermediate=args.intermediate, micro_batch=args.micro_batch, precision=args.precision,
            offload=args.offload, activation_checkpointing=args.activation_checkpointing,
            device_memory=args.device_memory * GB if args.device_memory else None, layers=args.layers,
            hidden=args.hidden, heads=args.heads, vocab=args.vocab, flash_attention=not args.no_flash_attention,
            fp32_grads=args.fp32_grads,
        )  # fmt: skip
    except (ValueError, TypeError) as err:
        fail(prog, str(err))
    if args.max_seq:
        if not (result.shape.layers and result.shape.hidden):
            fail(prog, "--max-seq needs the model's layers and hidden size (--layers/--hidden or --model-config)")
        print(max_sequence_table(result, args.device_memory * GB))
        return 0
    print(result.table())
    return 0


def max_sequence_table(result: Estimate, device_memory: float) -> str:
    """``--max-seq``: per stage, the longest sequence whose activations fit beside the model states in ``HEADROOM``
    of ``device_memory``, untiled and with each tiling (the given tile sizes, else 2048)."""
    t = result.tiling
    variants = t.variants()
    lines = [
        f"longest sequence in {HEADROOM:.0%} of {_gb(device_memory)} GB per device: {_count(result.shape.params)} parameters, "
        f"micro-batch {result.micro_batch}, {result.precision}, sequence over {t.seq_shards} rank(s)"
        + (", checkpointed" if result.activation_checkpointing else ""),
        f"{'stage':<6}{'model states':>14}" + "".join(f"{name:>14}" for name in variants),
    ]
    for e in result.stages:
        budget = HEADROOM * device_memory - e.model_states
        cells = [
            longest_sequence(result.shape, budget, result.micro_batch, result.precision, result.activation_checkpointing, result.flash, v)
            for v in variants.values()
        ]  # fmt: skip
        lines.append(f"{e.stage:<6}{_gb(e.model_states):>14}" + "".join(f"{c:>14,}" if c else f"{'none':>14}" for c in cells))
    return "\n".join(lines)


def _gb(nbytes: float) -> str:
    value = nbytes / GB
    if value >= 1e6:  # keeps the table's columns apart (a million GB and more: 1.6e+07)
        return f"{value:.2g}"
    return f"{value:.1f}" if value >= 0.05 or value == 0 else f"{value:.3f}"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{1 if n / size < 100 else 0}f}{unit}"
    return str(int(n)) if math.isfinite(n) else str(n)
