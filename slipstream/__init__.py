"""Slipstream: wrap an unchanged PyTorch model and a DeepSpeed-style config into a training engine.

Public names are resolved lazily (PEP 562) so ``import slipstream`` stays cheap and the
launcher (``slipstream run --help``) never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slipstream.version import __version__

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from slipstream.comm.distributed import init_distributed
    from slipstream.engine.config import ConfigError, SlipstreamConfig, load_config
    from slipstream.engine.engine import Engine
    from slipstream.engine.initialize import initialize
    from slipstream.errors import SlipstreamError, UsageError
    from slipstream.estimator import estimate

_LAZY = {
    "initialize": ("slipstream.engine.initialize", "initialize"),
    "Engine": ("slipstream.engine.engine", "Engine"),
    "SlipstreamConfig": ("slipstream.engine.config", "SlipstreamConfig"),
    "ConfigError": ("slipstream.engine.config", "ConfigError"),
    "load_config": ("slipstream.engine.config", "load_config"),
    "init_distributed": ("slipstream.comm.distributed", "init_distributed"),
    "estimate": ("slipstream.estimator", "estimate"),
    "SlipstreamError": ("slipstream.errors", "SlipstreamError"),
    "UsageError": ("slipstream.errors", "UsageError"),
}
_LAZY_MODULES = {"accelerator", "checkpointing", "comm", "ops", "zero"}

__all__ = ["__version__", *_LAZY, *sorted(_LAZY_MODULES)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"slipstream.{name}")
    else:
        raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
