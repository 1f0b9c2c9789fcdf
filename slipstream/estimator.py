"""Will it fit? Per-device memory by ZeRO stage, from the ZeRO paper's formulas. Pure Python.

Importing this module never imports torch: ``slipstream estimate`` answers as quickly as
``slipstream --help``. :func:`estimate` accepts a parameter count or an ``nn.Module`` (then
torch is already loaded) and, for a transformers model, reads layers/hidden/heads/vocab from its
config.

[Note: the formulas] Model states per device for Ψ parameters and data-parallel degree N, with
mixed-precision Adam (ZeRO paper, §3): 2Ψ bf16/fp16 weights, 2Ψ gradients and K = 12 bytes per
parameter of fp32 master weights, momentum and variance:

    stage 0: (2 + 2 + K)Ψ    stage 1: (2 + 2)Ψ + KΨ/N    stage 2: 2Ψ + (2 + K)Ψ/N    stage 3: (2 + 2 + K)Ψ/N

With fp32 training the weights are their own masters: 4 + 4 + 8 bytes. Stage 2 also keeps two
send buffers of one gradient bucket each, reused every step (``grad_storage.SendBuffers``): a
bucket holds ``reduce_bucket_size`` elements (unset: 25 MiB of fp32, the engine's default), or the
largest parameter where that is larger (the embedding, vocabulary × hidden), never more than the
model; measured on gpt2-large (Ψ = 29.5M, fp32) 49 MiB, which the estimate had left out (+18%
against peak RSS at 2 ranks). Stages 0 and 1 reduce in the gradient buffer itself. Offload (stages 1-3) moves
the optimizer's share, plus an fp32 gradient copy for the host Adam (16Ψ/N in all), off the device;
at stage 3 it moves the parameter shards too (ZeRO-Infinity), leaving the gathered units.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation", no tensor
parallelism): s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations, where s = sequence length,
b = micro-batch, h = hidden size, a = attention heads; the 5·a·s/h term is the s×s attention
matrices, which memory-efficient attention (SDPA/flash) does not keep. fp32 doubles it. With
activation checkpointing each layer keeps only its input (2·s·b·h bytes at 16 bit) and one layer's
activations exist at a time during recomputation. The loss adds ``LOSS_BYTES``·s·b·V: what
transformers' (unfused) causal-LM loss holds at its peak in the backward of a training loop that
keeps the loss and drops the outputs (``loss = model(...).loss``, as the HF Trainer does) — the
fp32 log-softmax and the gradients of the loss's two steps, 12 bytes per token per vocabulary entry
in fp32 and in bf16, measured with ``LiveTensorMeter``. A loop that keeps the logits alive through
its backward (``out`` held, a z-loss) adds them: 4 bytes more in fp32, 2 in bf16 (16 and 14 were
this estimate's figures before, measured with the output kept). Against peak RSS under Ulysses on
2 ranks (``benchmarks/bench_long_context.py --curve``, vocabulary 32,000, 2k-16k tokens) 12 is
within 3% untiled, where 16 was 12-30% above it. The paper's fused loss keeps 4; compiled
(``compile.loss``), the loss keeps only the logits' gradient.

[Note: sequence shards and tiles] Ulysses and ring attention (``seq_shards`` = u·c) divide every
term by the shard count: each rank holds s/(u·c) tokens of every layer (Ulysses' attention holds the
whole sequence for a u-th of the heads: the same bytes). Of the 34 (16-bit bytes per token per
hidden unit), the MLP's are ``3·h + 4·I`` per token (its input, the up projection's output and the
activation's, a dropout mask; 19·h at I = 4h). ``long_context.tiled_mlp`` keeps only the MLP's
input (2·h) per token and per layer, plus one tile's ``(3·h + 4·I)·t`` while an MLP runs;
``long_context.tiled_logits`` holds one tile's ``LOSS_BYTES``·t·V at a time instead of the whole
sequence's (measured with the tile's logits alive: 14.0 and 13.5 bytes per token of a tile in fp32 and
bf16; the tiles free them, and the peak RSS follows 12 within 6%).

[Note: offloaded checkpoints] Checkpointed, every layer keeps its input (``2·s·b·h``) until its backward, and
one layer at a time holds all of its activations while it is recomputed (the ``34·s·b·h`` term, which
counts that layer's input among them). With the inputs offloaded (``Tiling.offload_checkpoints``:
``cpu_checkpointing`` to pinned host memory on an accelerator, ``offload_path`` to files) the kept term
is gone: an input comes back to the device only for its own layer's recomputation, where the layer's
term already counts it. The offloaded bytes (:func:`checkpointed_input_bytes`) wait in host memory
or in files instead; a file's pages are dropped from the page cache once written
(``saved_tensor_offload.py``), so on the CPU they are in no process's RSS.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from slipstream.engine.config.zero import DEFAULT_REDUCE_BUCKET_NUMEL
from slipstream.estimator_shape import describe_model
from slipstream.utils.host_rings import ring_bytes

GB = 1e9  # the paper's unit: 1e9 bytes
STAGES = (0, 1, 2, 3)
HEADROOM = 0.9  # fraction of device memory a recommendation may plan for (allocator slack, buffers)
# Bytes per token per vocabulary entry that transformers' loss holds at its peak (the fp32 log-softmax and the
# gradients of both steps; the outputs dropped), by whether the model is fp32; measured with LiveTensorMeter (see the note).
LOSS_BYTES = {True: 12, False: 12}


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Long context as the estimate sees it: ``long_context``'s tiles (tokens per tile, None: untiled), the
    sequence shards, and whether the checkpointed inputs wait off the device (``activation_checkpointing``'s
    ``cpu_checkpointing`` on an accelerator, ``offload_path``: [Note: offloaded checkpoints])."""

    logits_tile: int | None = None
    mlp_tile: int | None = None
    seq_shards: int = 1  # Ulysses × ring ranks the sequence is cut over
    offload_checkpoints: bool = False

    def variants(self, checkpointing: bool = False) -> dict[str, Tiling]:
        """Untiled, each tiling and both, over the same shards (tiles of this size, else 2048); checkpointed, also
        both with the checkpointed inputs offloaded ("all three")."""
        logits, mlp, u = self.logits_tile or 2048, self.mlp_tile or 2048, self.seq_shards
        found = {"untiled": Tiling(None, None, u), "tiled logits": Tiling(logits, None, u)}
        found.update({"tiled MLP": Tiling(None, mlp, u), "both": Tiling(logits, mlp, u)})
        if checkpointing:
            found["all three"] = Tiling(logits, mlp, u, offload_checkpoints=True)
        return found


@dataclasses.dataclass(frozen=True)
class Stage3Layout:
    """ZeRO++ hpZ and MiCS as the estimate sees them (stage 3 only; docs/zero.md): ``mics`` ranks share a partition
    (None: all ``dp``), and hpZ keeps a secondary copy of 1/``hpz`` of the weights (1: none)."""

    hpz: int = 1
    mics: int | None = None
    # Parameters held whole beyond the shard at stage 3's peak (gathered units, a unit's packed gradients):
    # estimator_measure.stage3_gathered_params(model); 0 leaves them out.
    gathered: float = 0.0

    def describe(self) -> str:
        return (
            (f", stage 3 with hpZ over {self.hpz}" if self.hpz > 1 else "")
            + (f", stage 3 with MiCS shards of {self.mics}" if self.mics else "")
            + (f", stage 3 holding {_count(self.gathered)} parameters gathered" if self.gathered else "")
        )


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
    collectives: float = 0.0  # ranks on CPU: the same-host collectives' buffers (host_collective_bytes)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0) + self.collectives


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
    layout: Stage3Layout = Stage3Layout()
    measured: bool = False  # activations measured on fake tensors (estimator_measure.py), not the formula
    bucket: float = 0.0  # elements of the largest gradient bucket: stage 2 keeps two send buffers of it
    on_cpu: bool = False  # ranks train on CPU on one host: totals count the shared-memory collectives' buffers

    def stage(self, stage: int) -> StageEstimate:
        return self.stages[stage]

    def tiling_line(self) -> str | None:
        """Activations with and without each of ``long_context``'s tilings (tiles of the given size, else 2048)."""
        if not (self.seq_len and self.shape.vocab and self.shape.layers and self.shape.hidden):
            return None
        act = functools.partial(
            activation_bytes,
            self.shape,
            self.seq_len,
            self.micro_batch,
            self.precision,
            self.activation_checkpointing,
            self.flash,
        )
        variants = self.tiling.variants(self.activation_checkpointing)
        parts = [f"{name} {_gb(act(tiling=v) or 0.0)}" for name, v in variants.items()]
        line = f"activations by long_context tiling (GB per device): {', '.join(parts)}"
        if self.activation_checkpointing:
            away = checkpointed_input_bytes(
                self.shape, self.seq_len, self.micro_batch, self.precision, self.tiling.seq_shards
            )
            line += f" (all three: both, and the checkpointed inputs, {_gb(away)} GB, in host memory or files)"
        return line

    def table(self) -> str:
        """The per-stage table ``slipstream estimate`` prints."""
        s = self.shape
        head = (
            f"{_count(s.params)} parameters, data-parallel degree {self.dp}, {self.precision}"
            + (f", offload {self.offload}" if self.offload != "none" else "")
            + self.layout.describe()
        )
        if self.seq_len and s.layers and s.hidden:
            head += (
                f"; activations for micro-batch {self.micro_batch} × sequence {self.seq_len}, {s.layers} layers, hidden {s.hidden}"
                + (", checkpointed" if self.activation_checkpointing else "")
                + (", measured on fake tensors" if self.measured else "")
                + (f", sequence over {self.tiling.seq_shards} ranks" if self.tiling.seq_shards > 1 else "")
                + (f", logits tiled by {self.tiling.logits_tile}" if self.tiling.logits_tile else "")
                + (f", MLP tiled by {self.tiling.mlp_tile}" if self.tiling.mlp_tile else "")
                + (", checkpointed inputs offloaded" if self.tiling.offload_checkpoints else "")
            )
        lines = [
            head,
            f"{'stage':<6}{'params':>10}{'grads':>10}{'optimizer':>11}{'model states':>14}{'activations':>13}{'total':>10}"
            + ("   offloaded/rank" if self.offload != "none" else ""),
        ]
        for e in self.stages:
            act = "-" if e.activations is None else _gb(e.activations)
            line = f"{e.stage:<6}{_gb(e.params):>10}{_gb(e.grads):>10}{_gb(e.optimizer):>11}{_gb(e.model_states):>14}{act:>13}{_gb(e.total):>10}"
            if self.offload != "none":
                line += f"   {_gb(e.offloaded) if e.stage else 'n/a (offload needs stage 1-3)'}"
            lines.append(line)
        lines.append(
            "(GB = 1e9 bytes per device; ZeRO paper formulas, see docs/monitoring.md#memory-estimator"
            + (f"; stage 2's grads include two send buffers of {_count(self.bucket)} elements" if self.bucket else "")
            + ")"
        )
        if self.on_cpu and any(e.collectives for e in self.stages):
            lines.append(
                "totals include, per rank on CPU, the same-host collectives' buffers: "
                + ", ".join(f"stage {e.stage} {_gb(e.collectives)}" for e in self.stages)
            )
        tiles = self.tiling_line()
        if tiles:
            lines.append(tiles)
        if self.recommendation:
            lines.append(self.recommendation)
        return "\n".join(lines)


def model_state_bytes(
    params: float,
    dp: int,
    stage: int,
    precision: str = "bf16",
    offload: str = "none",
    fp32_grads: bool = False,
    layout: Stage3Layout = Stage3Layout(),
    bucket: float = 0.0,
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, offloaded) bytes per device for ``stage``; see [Note: the formulas].

    ``fp32_grads``: gradients accumulate in fp32 even with bf16/fp16 weights (4 bytes, not 2), as
    slipstream's stage 0 does. ``layout``: at stage 3, MiCS partitions over its shard group instead
    of ``dp``, and hpZ adds its secondary copy of the weights (1/hpz of them). ``bucket``: elements of
    the largest gradient bucket (:func:`gradient_bucket`), whose two send buffers stage 2 keeps.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    for name, size in (
        ("--hpz (zero_hpz_partition_size)", layout.hpz),
        ("--mics-shard-size (mics_shard_size)", layout.mics or dp),
    ):
        if size < 1 or dp % size:
            raise ValueError(f"{name} must divide the data-parallel degree {dp}, got {size}")
    w, g, k = (4, 4, 8) if precision == "fp32" else (2, 4 if fp32_grads else 2, 12)
    n = params
    s3 = layout.mics or dp
    shard = {
        0: (w * n, g * n, k * n),
        1: (w * n, g * n, k * n / dp),
        2: (w * n, g * n / dp, k * n / dp),
        3: (w * n / s3, g * n / s3, k * n / s3),
    }[stage]
    p, gr, opt = shard
    if stage == 2:
        gr += 2 * g * min(bucket, n)  # the send buffers (grad_storage.SendBuffers)
    if stage == 3 and layout.hpz > 1:
        p += w * n / layout.hpz  # hpZ's secondary partition (stage3/unit.py)
    if stage == 3:
        p += w * layout.gathered
    offloaded = 0.0
    if offload != "none" and stage > 0:
        offloaded = (
            16 * n / (s3 if stage == 3 else dp)
        )  # fp32 masters, m, v and an fp32 gradient copy for the host optimizer
        opt = 0.0
        if stage == 3:  # ZeRO-Infinity: the parameter shards live off the device as well
            offloaded += p
            p = 0.0
    return p, gr, opt, offloaded


def gradient_bucket(params: float, reduce_bucket_size: int | None = None, largest_param: float = 0.0) -> float:
    """Elements of ZeRO-1/2's largest gradient bucket: ``reduce_bucket_size`` (None or 0: the engine's default), or
    the largest parameter where it is larger (a parameter is never split across buckets), at most the model."""
    cap = reduce_bucket_size or DEFAULT_REDUCE_BUCKET_NUMEL
    return float(min(params, max(cap, largest_param)))


def host_rings(stage: int, dp: int, layout: Stage3Layout = Stage3Layout()) -> list[int]:
    """The sizes of the rings that carry a stage's bulk traffic between ranks training on CPU on one host: one for
    the gradients at stages 0-2 (the data-parallel group's), two at stage 3 (its gather and reduce lanes, over
    MiCS's shard group where set) and one more for hpZ's secondary gathers. The rings' small all-reduces (flags,
    the gradient norm) touch a page or two and are not counted."""
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if stage < 3:
        return [dp]
    return [layout.mics or dp] * 2 + ([layout.hpz] if layout.hpz > 1 else [])


def host_collective_bytes(stage: int, dp: int, layout: Stage3Layout = Stage3Layout()) -> float:
    """Bytes per rank those rings (:func:`host_rings`) keep, each as ``utils/host_rings.py`` sizes it ([Note: a
    ring's resident bytes])."""
    return float(sum(ring_bytes(size) for size in host_rings(stage, dp, layout)))


def activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    precision: str = "bf16",
    checkpointing: bool = False,
    flash: bool = True,
    tiling: Tiling = Tiling(),
) -> float | None:
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
    if checkpointing:  # [Note: offloaded checkpoints]
        inputs = (
            0.0
            if tiling.offload_checkpoints
            else checkpointed_input_bytes(shape, seq_len, b, precision, tiling.seq_shards)
        )
        return inputs + per_layer + transient + logits
    return layers * per_layer + transient + logits


def checkpointed_input_bytes(
    shape: ModelShape, seq_len: int, micro_batch: int, precision: str = "bf16", seq_shards: int = 1
) -> float:
    """Bytes per rank the checkpointed inputs of every layer hold: on the device, or offloaded to host memory or
    files ([Note: offloaded checkpoints])."""
    if not (shape.layers and shape.hidden):
        return 0.0
    tokens = -(-seq_len // seq_shards) * micro_batch
    return float(shape.layers * tokens * shape.hidden * (4 if precision == "fp32" else 2))


def longest_sequence(
    shape: ModelShape,
    budget: float,
    micro_batch: int,
    precision: str,
    checkpointing: bool,
    flash: bool,
    tiling: Tiling,
    step: int = 256,
    host_budget: float | None = None,
) -> int:
    """The longest sequence (a multiple of ``step``) whose activations fit in ``budget`` bytes; 0 if none does.
    With the checkpointed inputs offloaded, ``host_budget`` (bytes per rank, None: unbounded) bounds what they put
    in host memory or files too."""
    offloaded = checkpointing and tiling.offload_checkpoints and host_budget is not None

    def fits(seq: int) -> bool:
        if offloaded and checkpointed_input_bytes(shape, seq, micro_batch, precision, tiling.seq_shards) > host_budget:
            return False
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
    layout: Stage3Layout = Stage3Layout(),
    activations: float | None = None,
    reduce_bucket_size: int | None = None,
    on_cpu: bool = False,
) -> Estimate:
    """Per-device memory for every ZeRO stage; ``model`` is a parameter count, an ``nn.Module`` or a config dict.

    For a transformers model (or its ``config.json`` as a dict) layers, hidden size, heads, vocabulary
    and sequence length are read from the config unless given. With ``device_memory`` (bytes) the
    result carries a recommendation. ``activations`` (bytes, from ``estimator_measure.measure_activations``)
    replaces the formula's activations at every stage. ``reduce_bucket_size`` (elements; None: the engine's
    default) sizes stage 2's send buffers. ``on_cpu``: the ranks train on CPU on one host (gloo), and each total
    counts the shared-memory collectives' buffers (:func:`host_collective_bytes`).
    """
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload must be none, cpu or nvme, got {offload!r}")
    found = describe_model(model)
    shape = ModelShape(
        params=int(found.get("params", 0)),
        layers=layers or found.get("layers"),
        hidden=hidden or found.get("hidden"),
        heads=heads or found.get("heads"),
        vocab=vocab or found.get("vocab"),
        intermediate=intermediate or found.get("intermediate"),
    )
    if shape.params <= 0:
        raise ValueError("the parameter count is unknown: pass a number of parameters, a model or a config with one")
    seq = seq_len or found.get("seq_len")
    largest = found.get("largest_param") or (shape.vocab or 0) * (shape.hidden or 0)  # else the embedding
    bucket = gradient_bucket(shape.params, reduce_bucket_size, largest)
    result = _estimate(
        shape,
        dp,
        seq,
        micro_batch,
        precision,
        offload,
        activation_checkpointing,
        flash_attention,
        fp32_grads,
        tiling,
        layout,
        activations,
        bucket,
        on_cpu,
    )
    if device_memory:
        result = dataclasses.replace(
            result,
            recommendation=recommend(
                shape, dp, seq, micro_batch, precision, device_memory, flash_attention, bucket, on_cpu
            ),
        )
    return result


def _estimate(
    shape: ModelShape,
    dp: int,
    seq: int | None,
    mb: int,
    precision: str,
    offload: str,
    ac: bool,
    flash: bool,
    fp32_grads: bool,
    tiling: Tiling = Tiling(),
    layout: Stage3Layout = Stage3Layout(),
    measured: float | None = None,
    bucket: float = 0.0,
    on_cpu: bool = False,
) -> Estimate:
    if measured is not None:  # estimator_measure.measure_activations: replaces the formula
        act: float | None = float(measured)
    else:
        act = activation_bytes(shape, seq, mb, precision, ac, flash, tiling) if seq else None
    stages = []
    for stage in STAGES:
        p, g, o, off = model_state_bytes(shape.params, dp, stage, precision, offload, fp32_grads, layout, bucket)
        comm = host_collective_bytes(stage, dp, layout) if on_cpu else 0.0
        stages.append(StageEstimate(stage, p, g, o, off, act, comm))
    return Estimate(
        shape,
        dp,
        precision,
        offload,
        seq,
        mb,
        ac,
        stages,
        tiling=tiling,
        flash=flash,
        layout=layout,
        measured=measured is not None,
        bucket=bucket,
        on_cpu=on_cpu,
    )


def recommend(
    shape: ModelShape,
    dp: int,
    seq: int | None,
    micro_batch: int,
    precision: str,
    device_memory: float,
    flash: bool = True,
    bucket: float = 0.0,
    on_cpu: bool = False,
) -> str:
    """The cheapest configuration that fits in ``HEADROOM`` of ``device_memory`` bytes (``on_cpu``: beside the
    shared-memory collectives' buffers, :func:`host_collective_bytes`).

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
                    p, g, o, _ = model_state_bytes(shape.params, dp, stage, precision, offload, bucket=bucket)
                    act = (activation_bytes(shape, seq, mb, precision, ac, flash) if seq else 0.0) or 0.0
                    act += host_collective_bytes(stage, dp) if on_cpu else 0.0
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


# --------------------------------------------------------------------------- command line

# The largest values the command line takes. Beyond them no model exists, and the arithmetic stays
# far from float overflow: activations multiply four of these counts (about 1e36 at most).
MAX_COUNT = 1_000_000_000  # ranks, tokens, layers, hidden size, heads, vocabulary, micro-batch


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
