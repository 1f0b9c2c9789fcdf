"""Rank-aware logging: every line says which rank wrote it.

Kept free of torch imports so the launcher can use it and still start instantly.
"""

from __future__ import annotations

import logging
import os
import sys

_rank: int | None = None


def set_rank(rank: int) -> None:
    """Record this process's global rank (called by ``init_distributed``)."""
    global _rank
    _rank = rank


def current_rank() -> int:
    if _rank is not None:
        return _rank
    # A malformed RANK must not break a log line: init_distributed refuses it with an error that names it.
    value = os.environ.get("RANK", "0").strip()
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 10 else 0


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (pytest and notebooks replace it after import)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return True


def get_logger(name: str = "slipstream") -> logging.Logger:
    """The package logger (``[slipstream rank N] message``); level from ``SLIPSTREAM_LOG_LEVEL``."""
    root = logging.getLogger("slipstream")
    if not root.handlers:
        handler = _StderrHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[slipstream rank %(rank)s] %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SLIPSTREAM_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name) if name.startswith("slipstream") else root.getChild(name)


def log_rank0(logger: logging.Logger, msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log on rank 0 only, for messages every rank would repeat identically."""
    if current_rank() == 0:
        logger.log(level, msg, *args)
