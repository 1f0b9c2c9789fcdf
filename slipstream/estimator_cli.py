"""``slipstream estimate``: its options, each value checked by its converter, and the run that prints the table.

The formulas live in :mod:`slipstream.estimator`; this module is the command line around them (split
off so each stays one job). Standard library only, like the estimator: the command answers as
quickly as ``slipstream --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from slipstream.estimator import (
    GB,
    HEADROOM,
    MAX_COUNT,
    Estimate,
    Stage3Layout,
    Tiling,
    _count,
    _gb,
    checkpointed_input_bytes,
    estimate,
    longest_sequence,
)
from slipstream.estimator_shape import CONFIG_KEYS, describe_model
from slipstream.launcher.textfile import read_small_text
from slipstream.launcher.usage import fail, shown

MAX_PARAMS = 1e15
_MAX_PARAMS_TEXT = "1e15 (1000T)"
MIN_DEVICE_GB, MAX_DEVICE_GB = 0.001, 1_000_000.0
_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """What ``--model-config`` gives: the file as named on the command line and its JSON object."""

    path: str
    data: dict[str, Any]


def parse_params(text: str) -> int:
    """``--params``: a finite count from 1 to ``MAX_PARAMS``, as ``7e9``, ``7.5e9`` or ``7B`` (K, M, B, T)."""
    return _parse_count(text, "parameters")


def parse_elements(text: str) -> int:
    """``--reduce-bucket-size``: elements, written as DeepSpeed configs write them (``5e8``, ``500000000``)."""
    return _parse_count(text, "elements")


def _parse_count(text: str, noun: str) -> int:
    number, scale = text.strip(), 1.0
    if number[-1:].upper() in _SUFFIXES:
        number, scale = number[:-1], _SUFFIXES[number[-1].upper()]
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"{shown(text)}: must be a finite positive number of {noun} (e.g. 7e9 or 7B)")
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"{shown(text)}: must be at most {_MAX_PARAMS_TEXT} {noun}")
    return round(value)


def gigabytes(per: str, example: str) -> Callable[[str], float]:
    """A ``type=`` converter for GB (1e9 bytes) ``per`` device or rank, finite, from ``MIN_DEVICE_GB`` to
    ``MAX_DEVICE_GB``; ``example`` is shown in the error."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not MIN_DEVICE_GB <= value <= MAX_DEVICE_GB:  # NaN fails every comparison
            raise argparse.ArgumentTypeError(
                f"{shown(text)}: must be a number of GB (1e9 bytes) per {per} from {MIN_DEVICE_GB:g} to {MAX_DEVICE_GB:,.0f} (e.g. {example})"
            )
        return value

    convert.__name__ = f"GB per {per}"
    return convert


parse_device_memory = gigabytes("device", "80")  # --device-memory
parse_host_memory = gigabytes("rank", "200")  # --host-memory: host memory or disk


def whole_number(meaning: str) -> Callable[[str], int]:
    """A ``type=`` converter for a count from 1 to ``MAX_COUNT``; ``meaning`` says what it counts in errors."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also thousands of digits (Python's int size limit)
            value = 0
        if not 1 <= value <= MAX_COUNT:
            raise argparse.ArgumentTypeError(
                f"{shown(text)}: must be a whole number from 1 to {MAX_COUNT:,} ({meaning})"
            )
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
        raise argparse.ArgumentTypeError(
            f"{text} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"{text} is not valid JSON: nested too deeply") from None
    except ValueError:  # Python's int size limit
        raise argparse.ArgumentTypeError(f"{text}: a number in it has too many digits (over 4300) to read") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(
            f"{text} holds a JSON {type(data).__name__}, not an object; give a transformers config.json"
        )
    for key in ("params", "num_parameters"):
        if key in data and not (_is_number(data[key]) and 1 <= data[key] <= MAX_PARAMS):
            raise argparse.ArgumentTypeError(
                f"{text}: {key!r} is {_as_json(data[key])}; it must be a number of parameters from 1 to {_MAX_PARAMS_TEXT}"
            )
    for key in [*(k for keys in CONFIG_KEYS.values() for k in keys), "intermediate_size"]:
        value = data.get(key)
        if key == "intermediate_size":  # gpt_params multiplies by it: absent, null or a whole number
            wrong = value is not None and not (isinstance(value, int) and _is_number(value) and 1 <= value <= MAX_COUNT)
        else:  # shape_from_config passes over what is not a number; a number must be in range
            wrong = _is_number(value) and not 1 <= value <= MAX_COUNT
        if wrong:
            raise argparse.ArgumentTypeError(
                f"{text}: {key!r} is {_as_json(value)}; it must be a whole number from 1 to {MAX_COUNT:,}"
            )
    return ConfigFile(text, data)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_json(value: Any, limit: int = 60) -> str:
    """``value`` spelled as in the file (``Infinity``, ``"big"``, ``true``), shortened past ``limit``."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``slipstream estimate`` options; every value is checked by its ``type=`` converter above."""
    parser.add_argument(
        "--params",
        type=parse_params,
        metavar="N",
        help="number of parameters, e.g. 7.5e9 or 7.5B (or give --model-config)",
    )
    parser.add_argument(
        "--dp",
        type=whole_number("the data-parallel degree"),
        default=1,
        metavar="N",
        help="data-parallel degree: ranks the states are partitioned over (default 1)",
    )
    parser.add_argument(
        "--model-config",
        type=read_model_config,
        metavar="JSON",
        help="a transformers config.json: layers, hidden, heads, vocab, sequence length",
    )
    parser.add_argument(
        "--offload",
        choices=("none", "cpu", "nvme"),
        default="none",
        help="optimizer (and at stage 3 parameter) offload",
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="bf16/fp16 with fp32 masters (default) or fp32",
    )
    parser.add_argument(
        "--seq-len",
        type=whole_number("tokens per sequence"),
        metavar="S",
        help="sequence length for the activation estimate",
    )
    parser.add_argument(
        "--micro-batch",
        type=whole_number("sequences per device"),
        default=1,
        metavar="B",
        help="micro-batch per device (default 1)",
    )
    parser.add_argument(
        "--layers",
        type=whole_number("transformer layers"),
        metavar="L",
        help="transformer layers (activation estimate)",
    )
    parser.add_argument(
        "--hidden", type=whole_number("the hidden size"), metavar="H", help="hidden size (activation estimate)"
    )
    parser.add_argument(
        "--heads",
        type=whole_number("attention heads"),
        metavar="A",
        help="attention heads (only for --no-flash-attention)",
    )
    parser.add_argument(
        "--vocab", type=whole_number("the vocabulary size"), metavar="V", help="vocabulary size (the loss's logits)"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="estimate activations with checkpointing on"
    )
    parser.add_argument("--no-flash-attention", action="store_true", help="attention keeps the s×s score matrices")
    parser.add_argument(
        "--fp32-grads",
        action="store_true",
        help="gradients accumulate in fp32 with bf16/fp16 weights (slipstream's stage 0)",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_device_memory,
        metavar="GB",
        help="memory per device in GB (1e9 bytes): adds a recommendation",
    )
    parser.add_argument(
        "--intermediate",
        type=whole_number("the MLP's width"),
        metavar="I",
        help="the MLP's intermediate size (default 4 × hidden)",
    )
    parser.add_argument(
        "--seq-shards",
        type=whole_number("ranks the sequence is cut over"),
        default=1,
        metavar="N",
        help="Ulysses × context-parallel ranks the sequence is cut over (default 1)",
    )
    parser.add_argument(
        "--tiled-logits",
        type=whole_number("tokens per tile"),
        metavar="T",
        help="long_context.tiled_logits with tiles of T tokens",
    )
    parser.add_argument(
        "--tiled-mlp",
        type=whole_number("tokens per tile"),
        metavar="T",
        help="long_context.tiled_mlp with tiles of T tokens",
    )
    parser.add_argument(
        "--offload-checkpoints",
        action="store_true",
        help="the checkpointed inputs wait in host memory or files (activation_checkpointing.cpu_checkpointing or "
        "offload_path; needs --activation-checkpointing)",
    )
    parser.add_argument(
        "--host-memory",
        type=parse_host_memory,
        metavar="GB",
        help="with --max-seq: host memory (or disk) per rank the offloaded checkpointed inputs may take; bounds the "
        "'all three' column (default: unbounded)",
    )
    parser.add_argument(
        "--hpz",
        type=whole_number("ranks of hpZ's secondary partition"),
        default=1,
        metavar="H",
        help="stage 3 with ZeRO++ hpZ over H ranks (zero_hpz_partition_size)",
    )
    parser.add_argument(
        "--mics-shard-size",
        type=whole_number("ranks per MiCS shard group"),
        metavar="S",
        help="stage 3 with MiCS shard groups of S ranks (mics_shard_size)",
    )
    parser.add_argument(
        "--reduce-bucket-size",
        type=parse_elements,
        metavar="N",
        help="zero_optimization.reduce_bucket_size in elements (default: the engine's 25 MiB of fp32): stage 2's two"
        " send buffers",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the ranks train on CPU on one host (gloo): count the shared-memory collectives' buffers per rank"
        " (16-20 MiB per ring: one at stages 0-2, two at stage 3)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with --model-config: build the model on fake tensors (transformers, torch) and measure its activations"
        " and stage 3's gathered units instead of the formulas",
    )
    parser.add_argument(
        "--max-seq",
        action="store_true",
        help="the longest sequence that fits in --device-memory, by stage, with and without the tilings",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``slipstream estimate``; returns the exit code. Usage errors are one line, status 2."""
    prog = "slipstream estimate"
    source: Any = args.params
    if args.model_config is not None:
        source = dict(args.model_config.data)
        if args.params:
            source["params"] = args.params
        params = describe_model(source).get("params", 0)
        if not 1 <= params <= MAX_PARAMS:
            why = (
                "no parameter count (params or num_parameters) and not all of layers, hidden size and vocabulary size to derive one"
                if not params
                else f"describes {params:.2g} parameters, more than {_MAX_PARAMS_TEXT}"
            )
            fail(prog, f"--model-config {args.model_config.path}: {why}; give --params")
    if source is None:
        fail(prog, f"give --params N (e.g. 7e9 or 7B) or --model-config config.json; see '{prog} --help'")
    if args.host_memory and not (args.max_seq and args.activation_checkpointing):
        fail(
            prog,
            "--host-memory bounds the offloaded checkpointed inputs of --max-seq; it needs --max-seq and --activation-checkpointing",
        )
    if args.max_seq and not args.device_memory:
        fail(prog, "--max-seq needs --device-memory GB (the memory the sequence must fit in)")
    if args.offload_checkpoints and not args.activation_checkpointing:
        fail(prog, "--offload-checkpoints offloads the checkpointed inputs; it needs --activation-checkpointing")
    tiling = Tiling(args.tiled_logits, args.tiled_mlp, args.seq_shards, args.offload_checkpoints)
    activations, gathered = _measured(prog, args, tiling) if args.measure else (None, 0)
    try:
        result = estimate(
            source,
            args.dp,
            seq_len=args.seq_len,
            tiling=tiling,
            intermediate=args.intermediate,
            micro_batch=args.micro_batch,
            precision=args.precision,
            offload=args.offload,
            activation_checkpointing=args.activation_checkpointing,
            device_memory=args.device_memory * GB if args.device_memory else None,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            vocab=args.vocab,
            flash_attention=not args.no_flash_attention,
            fp32_grads=args.fp32_grads,
            layout=Stage3Layout(args.hpz, args.mics_shard_size, gathered),
            activations=activations,
            reduce_bucket_size=int(args.reduce_bucket_size) if args.reduce_bucket_size else None,
            on_cpu=args.cpu,
        )
    except (ValueError, TypeError) as err:
        fail(prog, str(err))
    if args.max_seq:
        if not (result.shape.layers and result.shape.hidden):
            fail(prog, "--max-seq needs the model's layers and hidden size (--layers/--hidden or --model-config)")
        print(max_sequence_table(result, args.device_memory * GB, args.host_memory * GB if args.host_memory else None))
        return 0
    print(result.table())
    return 0


def _measured(prog: str, args: argparse.Namespace, tiling: Tiling) -> tuple[int, int]:
    """``--measure``: the plain model's activations and stage 3's gathered parameters, measured on fake tensors."""
    if args.model_config is None:
        fail(prog, "--measure builds the model from --model-config config.json; give one")
    combined = [
        flag
        for flag, on in (
            ("--activation-checkpointing", args.activation_checkpointing),
            ("--seq-shards", tiling.seq_shards > 1),
            ("--tiled-logits", tiling.logits_tile),
            ("--tiled-mlp", tiling.mlp_tile),
            ("--offload-checkpoints", tiling.offload_checkpoints),
            ("--max-seq", args.max_seq),
        )
        if on
    ]
    if combined:
        fail(prog, f"--measure runs the plain model once; it does not combine with {', '.join(combined)}")
    seq = args.seq_len or describe_model(dict(args.model_config.data)).get("seq_len")
    if not seq:
        fail(prog, "--measure needs --seq-len (the config gives no maximum sequence length)")
    from slipstream.estimator_measure import MeasureError, measure_config  # torch: only when asked for

    try:
        return measure_config(dict(args.model_config.data), seq, args.micro_batch, args.precision)
    except MeasureError as err:
        fail(prog, f"--measure: {err}")


def max_sequence_table(result: Estimate, device_memory: float, host_memory: float | None = None) -> str:
    """``--max-seq``: per stage, the longest sequence whose activations fit beside the model states in ``HEADROOM``
    of ``device_memory``, untiled and with each tiling (the given tile sizes, else 2048) and, checkpointed, with
    both and the checkpointed inputs offloaded (into at most ``host_memory`` bytes per rank, when given)."""
    t = result.tiling
    variants = t.variants(result.activation_checkpointing)
    lines = [
        f"longest sequence in {HEADROOM:.0%} of {_gb(device_memory)} GB per device: {_count(result.shape.params)} parameters, "
        f"micro-batch {result.micro_batch}, {result.precision}, sequence over {t.seq_shards} rank(s)"
        + (", checkpointed" if result.activation_checkpointing else ""),
        f"{'stage':<6}{'model states':>14}" + "".join(f"{name:>14}" for name in variants),
    ]
    for e in result.stages:
        budget = HEADROOM * device_memory - e.model_states - e.collectives
        cells = [
            longest_sequence(
                result.shape,
                budget,
                result.micro_batch,
                result.precision,
                result.activation_checkpointing,
                result.flash,
                v,
                host_budget=host_memory,
            )
            for v in variants.values()
        ]
        lines.append(
            f"{e.stage:<6}{_gb(e.model_states):>14}" + "".join(f"{c:>14,}" if c else f"{'none':>14}" for c in cells)
        )
        longest_offloaded = cells[-1] if "all three" in variants else 0
    if longest_offloaded:  # the last stage's: the longest; what it asks of host memory or disk is not on the device
        away = checkpointed_input_bytes(
            result.shape, longest_offloaded, result.micro_batch, result.precision, t.seq_shards
        )
        bound = f"; at most {_gb(host_memory)} GB per rank given" if host_memory else ""
        lines.append(
            f"all three: both tilings, and the checkpointed inputs in host memory or files "
            f"({_gb(away)} GB per rank at {longest_offloaded:,} tokens{bound})"
        )
    return "\n".join(lines)
