"""What every config section shares: the error type, the strict base model, ``"auto"``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from slipstream.errors import SlipstreamError

AUTO = "auto"


class ConfigError(SlipstreamError, ValueError):
    """A configuration mistake; the message names the key path, the value and the fix."""


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, values are validated on assignment.

    [Note: finite numbers] ``allow_inf_nan=False``: an ``inf`` or ``NaN`` learning rate, factor or
    timeout would pass every ``ge``/``gt`` bound pydantic checks (NaN compares false both ways) and
    training would go non-finite without a word; a key that means "off" when infinite
    (``steps_per_print``) says so with its own validator.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True, allow_inf_nan=False)


def unsupported(value: Any, default: Any, what: str) -> Any:
    """Refuse a DeepSpeed feature slipstream does not have, unless the value asks for nothing."""
    if value != default:
        raise ValueError(f"{what} is not supported by slipstream; remove the key or set it to {default!r}")
    return value


def refuse(*fields: str, allowed: Any, what: str) -> Any:
    """A field validator for a section class body: ``fields`` accept only ``allowed`` (see :func:`unsupported`)."""

    def check(cls: type, value: Any) -> Any:
        return unsupported(value, allowed, what)

    return field_validator(*fields)(check)
