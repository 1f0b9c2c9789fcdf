"""Build (and hand over) the Slipstream engine behind a host's model.

[Note: one engine per model] Evaluation before training, or a model loaded straight into ZeRO-3
shards, gets an *inference* engine (no optimizer). When training starts, the training engine is
built over the same model and ``initialize`` takes the shards over from the inference engine
(``Engine.close(for_new_engine=True)``): the whole model is never gathered. ``_inference_engines`` keeps each
model's inference engine alive until then (the engine layer only remembers it weakly).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import slipstream
from slipstream.engine.engine import engine_of

_inference_engines: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def attach_inference_engine(model: torch.nn.Module, engine: Any) -> None:
    _inference_engines[model] = engine


def inference_engine(model: torch.nn.Module) -> Any:
    """The inference engine attached to ``model``, if any (and still open: ``initialize`` may have taken the model over)."""
    engine = _inference_engines.get(model)
    if engine is not None and engine_of(model) is not engine:
        del _inference_engines[model]
        return None
    return engine


def build_inference_engine(model: torch.nn.Module, config: dict[str, Any]) -> Any:
    """An engine without an optimizer for evaluation; reused until training replaces it."""
    engine = _inference_engines.get(model)
    if engine is None:
        engine = slipstream.initialize(model, config, inference=True)
        _inference_engines[model] = engine
    return engine


def build_training_engine(
    model: torch.nn.Module,
    config: dict[str, Any],
    optimizer: Any = None,
    lr_scheduler: Any = None,
    model_parameters: Any = None,
) -> Any:
    """``slipstream.initialize``, which takes the model over from its inference engine (collective)."""
    _inference_engines.pop(model, None)
    return slipstream.initialize(
        model, config, optimizer=optimizer, lr_scheduler=lr_scheduler, model_parameters=model_parameters
    )
