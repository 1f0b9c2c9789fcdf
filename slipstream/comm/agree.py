"""One rank's failure becomes every rank's, as the same error: ``agree(action, what)``. Collective.

[Note: agree before acting] A step that can fail on some ranks only (reading a file, converting a
checkpoint, planning a save) must not leave the others to carry on into a collective the failed
rank never joins: they would wait until the timeout. Each rank runs the action, the ranks exchange
one small verdict, and if any failed, all raise, before anything is applied. The failing rank
re-raises its own exception; every other rank raises the same class (see
``slipstream.errors.same_kind``) with a message that names the failed rank and its error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from slipstream.comm.abort import mark_raised_on_every_rank
from slipstream.comm.collectives import all_gather_objects
from slipstream.errors import SlipstreamError, error_kind, same_kind

T = TypeVar("T")


def agree(action: Callable[[], T], what: str, fallback: type[SlipstreamError] = SlipstreamError) -> T:
    """``action()`` on this rank; if it raised on any rank, raise on every rank. Collective over the world."""
    error: Exception | None = None
    result = None
    try:
        result = action()
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        error = err
    verdicts = all_gather_objects(None if error is None else (error_kind(error), f"{type(error).__name__}: {error}"))
    if error is not None:
        raise mark_raised_on_every_rank(error)
    failed = {rank: verdict for rank, verdict in enumerate(verdicts) if verdict is not None}
    if failed:
        first = min(failed)
        kind, text = failed[first]
        raise mark_raised_on_every_rank(same_kind(kind, f"{what} failed on rank(s) {sorted(failed)}: {text}", fallback))
    return result  # type: ignore[return-value]
