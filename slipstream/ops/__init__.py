"""Compiled ops (C++/CUDA under ``csrc/``) with pure-PyTorch fallbacks.

``slipstream.ops.adam``: ``CPUAdam``, ``FusedAdam`` and the one-pass ``cpu_adam_step``.
``slipstream.ops.aio``: ``AsyncIO``, asynchronous file reads and writes for NVMe offload.
``slipstream.ops.builder``: the ninja builder and its on-disk cache. ``python -m
slipstream.ops.build`` builds every op ahead of time. See docs/ops.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["adam", "aio", "builder", "specs"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = importlib.import_module(f"slipstream.ops.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'slipstream.ops' has no attribute {name!r}")
