"""Collective error handling for loads and saves: a step that fails on one rank fails on every rank, before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from slipstream.comm.agree import agree as agree_on_every_rank
from slipstream.engine.checkpoint.validate import CheckpointError

T = TypeVar("T")


def agree(action: Callable[[], T], what: str) -> T:
    """Run ``action`` on this rank; if it fails on any rank, every rank raises the failing rank's error class (a
    :class:`CheckpointError` where it was not one of slipstream's). Collective."""
    return agree_on_every_rank(action, f"checkpoint: {what}", fallback=CheckpointError)
