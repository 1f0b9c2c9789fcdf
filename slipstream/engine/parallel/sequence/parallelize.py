"""Ulysses or ring attention for an unchanged model: the kernel registered, the engine's input sharder, the twin check."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.attention import route_attention
from slipstream.engine.parallel.context import AllGatherKVAttention, Layout, RingAttention
from slipstream.engine.parallel.expert import ExpertPlan
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.pipeline import Pipeline
from slipstream.engine.parallel.sequence.blockwise import BlockwiseSharder, position_mixers
from slipstream.engine.parallel.sequence.first_batch import first_batch_check
from slipstream.engine.parallel.sequence.inputs import SequenceSharder
from slipstream.engine.parallel.sequence.options import SequenceOptions
from slipstream.engine.parallel.sequence.ulysses import ATTENTION_NAME, UlyssesAttention
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)


def parallelize_attention(
    model: torch.nn.Module,
    mesh: Mesh,
    options: SequenceOptions | None,
    pipeline: Pipeline | None = None,
    experts: ExpertPlan | None = None,
) -> SequenceSharder | BlockwiseSharder | None:
    """Ulysses over ``mesh.group("sp")`` or ring attention over ``mesh.group("cp")``; None when neither is on.

    The sharder switches the model to the registered kernel for each step and shards each batch on
    the sequence; the numerical twin check (parallel/twin/) runs unless ``twin_check`` is false and
    refuses a model the kernel does not reproduce (:class:`ConfigError` naming the key); under a
    ``pipeline`` (whose stages hold only part of the model) it compares one schedule with another;
    ``experts``' gradients are averaged over their own group there (parallel/twin/whole_sequence.py, [Note: which ranks to average]).
    """
    if options is None:
        return None
    if options.blockwise:
        return _blockwise(model, mesh, options, options.refusal)
    if options.ulysses > 1 and options.context > 1:  # USP: see ulysses.py, [Note: Ulysses × ring]
        method = options.method
        kernel = UlyssesAttention(mesh.group("sp"), _context_attention(mesh, method, zigzag=False))
        previous = route_attention(model, ATTENTION_NAME, kernel, "sequence_parallel_size")
        log_rank0(
            logger,
            "Ulysses %d × %s context parallel %d: attention %r replaced in each step; batches sharded on the sequence",
            options.ulysses,
            method,
            options.context,
            previous,
        )
        sharder = SequenceSharder(mesh.group("cp", "sp"), routing=(model, ATTENTION_NAME, previous, kernel))
        mode = f"Ulysses ({options.ulysses}) × {method} context parallel ({options.context})"
    elif options.ulysses > 1:
        group = mesh.group("sp")
        ulysses = UlyssesAttention(group)
        kernel: object = ulysses
        previous = route_attention(model, ATTENTION_NAME, ulysses, "sequence_parallel_size")
        ulysses.use_own(
            previous
        )  # a function the user registered runs on whole sequences ([Note: the model's own attention function])
        log_rank0(
            logger,
            "sequence parallel (Ulysses) %d: attention %r replaced in each step; batches sharded on the sequence",
            options.ulysses,
            previous,
        )
        sharder = SequenceSharder(group, routing=(model, ATTENTION_NAME, previous, kernel))
        mode = f"Ulysses sequence parallel ({options.ulysses})"
    else:
        method = options.method
        kernel = _context_attention(mesh, method, zigzag=method in ("zigzag", "zigzag_ring"))
        layout = kernel.layout
        previous = route_attention(model, f"slipstream_{method}", kernel, "context_parallel.size")
        log_rank0(
            logger,
            "context parallel (%s) %d: attention %r replaced in each step; batches sharded on the sequence",
            method,
            layout.size,
            previous,
        )
        sharder = SequenceSharder(
            mesh.group("cp"), "context_parallel.size", layout, routing=(model, f"slipstream_{method}", previous, kernel)
        )
        mode = f"context parallel ({method}, {layout.size})"
    if options.twin_check:
        from slipstream.engine.parallel.twin.whole_sequence import check_sequence_pipeline_twin, check_sequence_twin

        averaging = {id(p): experts.group for p in experts.params} if experts is not None else None
        try:
            if pipeline is not None:
                check_sequence_pipeline_twin(pipeline, sharder, mode, averaging)
            else:
                check_sequence_twin(model, sharder, mode, averaging)
        except ConfigError as refusal:
            sharder.close()
            alone = pipeline is None and experts is None and all(mesh.size(axis) == 1 for axis in ("tp", "pp", "ep"))
            if not alone:
                raise
            sharder = _blockwise(
                model, mesh, options, str(refusal)
            )  # the kernel does not reproduce it: blockwise.py's note
            log_rank0(
                logger,
                "%s; the model trains blockwise instead (attention whole on every rank)",
                refusal,
                level=logging.WARNING,
            )
            return sharder
        except BaseException:
            sharder.close()
            raise
        # and again on the first training batch (first_batch.py's note)
        staged = pipeline
        run: Callable[[dict[str, Any], str], None] = (
            (lambda batch, what: check_sequence_twin(model, sharder, mode, averaging, batch, what))
            if staged is None
            else (lambda batch, what: check_sequence_pipeline_twin(staged, sharder, mode, averaging, batch, what))
        )
        sharder.first_batch = first_batch_check(staged.model if staged is not None else model, sharder, run)
    return sharder


def _blockwise(model: torch.nn.Module, mesh: Mesh, options: SequenceOptions, refusal: str) -> BlockwiseSharder:
    """The blocks on sequence shards, the rest of the model whole ([Note: blockwise sequence parallel]), if its twin
    check passes; else ``refusal`` (what the kernels' route said) as the ConfigError."""
    from slipstream.engine.parallel.twin.harness import quiet_model, synthetic_batches
    from slipstream.engine.parallel.twin.whole_sequence import check_sequence_twin

    axes = tuple(axis for axis, size in (("cp", options.context), ("sp", options.ulysses)) if size > 1)
    key = "sequence_parallel_size" if options.ulysses > 1 else "context_parallel.size"
    blocks = find_blocks(model)
    batches = synthetic_batches(model, 1, divisor=options.ulysses * options.context)
    if blocks is None or batches is None or not isinstance(batches[0], dict):
        raise ConfigError(refusal)
    with quiet_model(model):
        mixers, calls = position_mixers(model, blocks, batches[0])
    if not calls:
        raise ConfigError(refusal)
    sharder = BlockwiseSharder(model, blocks, mesh.group(*axes), key, mixers, calls)
    size = sharder.size
    mode = f"blockwise sequence parallel ({size})"
    try:
        check_sequence_twin(model, sharder, mode, None, batches[0])
    except ConfigError as err:
        sharder.close()
        log_rank0(logger, "%s: %s", mode, err)
        raise ConfigError(refusal) from None
    except BaseException:
        sharder.close()
        raise
    log_rank0(
        logger,
        "%s: %s runs its blocks on 1/%d of the sequence each (attention %s whole on every rank; embeddings, "
        "head and loss whole): its attention does not go through a Slipstream kernel",
        mode,
        type(model).__name__,
        size,
        ", ".join(repr(m or "the whole block") for m in mixers) or "(none found)",
    )
    return sharder


def _context_attention(mesh: Mesh, method: str, zigzag: bool) -> AllGatherKVAttention | RingAttention:
    """Context parallel's attention over ``mesh.group("cp")``: all-gathered K/V, or the ring."""
    layout = Layout(mesh.size("cp"), zigzag=zigzag)
    return (
        AllGatherKVAttention(mesh.group("cp"), layout)
        if method == "allgather_kv"
        else RingAttention(mesh.group("cp"), layout)
    )
