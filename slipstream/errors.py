"""The library's error family: every error slipstream raises on purpose derives from :class:`SlipstreamError`.

[Note: one family] A user who wraps a training loop in ``except slipstream.SlipstreamError`` catches
every mistake slipstream reports (config, usage, checkpoint, collective, launch) and nothing from
their own code. Each member also derives from the builtin a caller would have caught before
(``ValueError`` for bad input, ``RuntimeError`` for a call that cannot be served), so existing
``except ValueError`` / ``except RuntimeError`` code keeps working. Standard library only: the
launcher imports this without torch.
"""

from __future__ import annotations


class SlipstreamError(Exception):
    """Base of every error slipstream raises on purpose; the message says what to change."""


class UsageError(SlipstreamError, RuntimeError):
    """An engine call made out of order, or one this engine cannot serve (training an engine built without an
    optimizer, a pipeline loss read before its schedule ran, ZeRO-3 parameters used outside their unit)."""


def error_kind(error: BaseException) -> str:
    """The name another rank resolves with :func:`same_kind` (``module.QualName``)."""
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def same_kind(kind: str, message: str, fallback: type[SlipstreamError]) -> SlipstreamError:
    """An error of the class named ``kind`` if it is one of the family, else ``fallback``; never imports or unpickles.

    [Note: the same error on every rank] When one rank's step fails and the others learn of it
    through a collective (a checkpoint load, a conversion, an agreement), each rank should raise what
    the failing rank raised, so ``except CheckpointError`` works the same everywhere. Only classes
    already defined (subclasses of :class:`SlipstreamError`) are candidates; a foreign error (an
    ``OSError`` on the failing rank) arrives as ``fallback`` with its name in the message.
    """
    pending: list[type[SlipstreamError]] = [SlipstreamError]
    while pending:
        candidate = pending.pop()
        if f"{candidate.__module__}.{candidate.__qualname__}" == kind:
            try:
                return candidate(message)
            except Exception:  # noqa: BLE001 - a class with another constructor: fall back
                break
        pending.extend(candidate.__subclasses__())
    return fallback(message)
