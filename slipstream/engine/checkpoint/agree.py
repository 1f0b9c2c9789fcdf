"""Collective error handling for loads: a step that fails on one rank fails on every rank, before anything changes."""

from __future__ import annotations

from typing import Any

from slipstream.comm import all_gather_objects


def agree(action: Any, what: str) -> Any:
    """Run ``action`` on this rank; if it fails on any rank, raise on every rank (no rank left waiting). Collective."""
    error = None
    try:
        result = action()
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        error, result = err, None
    errors = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    if len(errors) > 1:
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        if failed and error is None:
            raise RuntimeError(f"checkpoint: {what} failed on rank(s) {sorted(failed)}: {next(iter(failed.values()))}")
    if error is not None:
        raise error
    return result
