"""Activations measured rather than modelled: one forward and backward of the model on fake tensors, counted.

[Note: activations measured on fake tensors] The estimator's activation formula (Korthikanti et al.,
``estimator.py``) counts what a textbook transformer layer keeps: 34 bytes per token per hidden unit
at 16 bits. A real implementation keeps what its code keeps. GPT-2's tanh GELU, written as five
elementwise operations, saves four intermediates of the MLP's width; a rotary embedding saves its
sines and cosines; an unfused loss keeps a log-softmax. On the gpt2-large workload of
``bench_zero.py`` (fp32, 512 tokens) the formula says 184 MiB at the step's peak; the model holds
290, measured with ``LiveTensorMeter`` on real tensors.

This module runs the model once on ``FakeTensorMode``'s tensors: every operator is dispatched as on
the real device (so attention takes the kernel the device would, flash attention's logsumexp rather
than the math path's probabilities, as a meta-device run would not) but no byte is allocated and no
arithmetic done, so any size runs in well under a second. ``LiveTensorMeter`` counts the storages
alive after every operator, forward and backward; each parameter's gradient is dropped as it
arrives, since the engine keeps gradients in its own buffers (the model states' share). The loop
keeps only the loss, as ``loss = model(...).loss`` does. Measured on gpt2-large: 290 MiB, the real
run's figure to the byte.

It needs torch, so it lives beside the torch-free estimator: ``slipstream estimate --measure`` and
the benchmarks import it. A model that cannot run on fake tensors (it reads a value back to the
host, as a data-dependent router may) raises :class:`MeasureError` naming the operation, and the
caller falls back to the formula.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from slipstream.engine.monitor.memory import LiveTensorMeter
from slipstream.engine.parallel.calls import loss_of

__all__ = ["MeasureError", "causal_lm_inputs", "measure_activations", "stage3_gathered_params"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MeasureError(RuntimeError):
    """The model could not run on fake tensors; the message names why."""


def causal_lm_inputs(micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A causal LM's training call: token ids and the same ids as labels (made inside the fake mode)."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _loss_of(output: Any) -> torch.Tensor:
    try:
        return loss_of(output)  # the engine's own reading of a model's output (engine/parallel/calls.py)
    except TypeError:
        raise MeasureError(
            f"the model returned {type(output).__name__}, with no scalar loss to run the backward from"
        ) from None


def measure_activations(
    model: torch.nn.Module, seq_len: int, micro_batch: int, precision: str = "fp32", make_inputs: Any = causal_lm_inputs
) -> int:
    """Peak bytes of activations (and the loss's tensors) one micro-batch holds through forward and backward.

    The model's floating-point parameters take ``precision``'s dtype, as the engine runs the forward;
    ``make_inputs(micro_batch, seq_len)`` gives the call's keyword arguments (a causal LM's by
    default). See [Note: activations measured on fake tensors].
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = _DTYPES[precision]

    def fake(t: torch.Tensor, grad: bool) -> torch.Tensor:
        made = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
        return made.requires_grad_(grad)

    def drop(p: torch.Tensor) -> None:
        p.grad = None

    meter = LiveTensorMeter()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            state = {name: fake(p, p.requires_grad) for name, p in model.named_parameters()}
            for p in state.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(drop)
            state.update({name: fake(b, False) for name, b in model.named_buffers()})
            inputs = make_inputs(micro_batch, seq_len)
            with meter:
                loss = _loss_of(functional_call(model, state, (), inputs))  # the output dies here: only the loss kept
                loss.backward()
    except MeasureError:
        raise
    except Exception as error:  # noqa: BLE001 - any operator fake tensors cannot run: say which and fall back
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise MeasureError(
            f"{type(model).__name__} cannot run on fake tensors: {type(error).__name__}: {first}"
        ) from error
    return int(sum(meter.peak.values()))


def stage3_gathered_params(model: torch.nn.Module) -> int:
    """Parameters a stage-3 rank holds whole at its peak beyond its shard: the root unit (a tied head's embedding
    is used again in the backward), the running block and the one prefetched, and one block's gradients packed
    for its reduce-scatter; the units as ``stage3/units.py`` cuts them."""
    from slipstream.engine.zero.stage3.units import find_units

    units = find_units(model, None, 0)
    root = sum(u.numel for u in units if u.kind == "root")
    largest = max((u.numel for u in units if u.kind == "block"), default=0)
    return root + 3 * largest


def measure_config(config: dict[str, Any], seq_len: int, micro_batch: int, precision: str) -> tuple[int, int]:
    """(activation bytes, stage-3 gathered parameters) of the transformers causal LM a ``config.json`` describes,
    built on the meta device (no weights are made): ``slipstream estimate --measure``."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise MeasureError("--measure builds the model with transformers, which is not installed") from None
    fields = {k: v for k, v in config.items() if k not in ("params", "num_parameters")}
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise MeasureError("--measure needs the config's 'model_type' (a transformers config.json) to build the model")
    try:
        built = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(built)
    except (ValueError, KeyError, TypeError) as error:
        raise MeasureError(f"transformers cannot build a causal LM of model_type {model_type!r}: {error}") from None
    return measure_activations(model, seq_len, micro_batch, precision), stage3_gathered_params(model)
