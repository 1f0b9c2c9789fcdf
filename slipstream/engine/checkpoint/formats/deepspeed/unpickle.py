"""Reading DeepSpeed's ``*.pt`` pickles without executing anything they name.

[Note: an allow-list, by name] DeepSpeed saves with ``torch.save``: a pickle, which may name any
callable to run at load time. Its files are read with ``torch.load(weights_only=True)``, whose
unpickler accepts tensors, containers and numbers, plus the globals it is told about. DeepSpeed
itself is not installed here, so the few DeepSpeed classes its checkpoints hold are allowed *by
their qualified name* and rebuilt as inert stand-ins: a :class:`DeepSpeedRecord` keeps the object's
attributes as data (a loss scaler's ``cur_scale``...), an enum member becomes its value. Any other
global is refused in one line naming it, before anything of the file is used.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.engine.checkpoint.validate import CheckpointError


class DeepSpeedRecord:
    """An object of a DeepSpeed class, reduced to its attributes (``vars(record)``); nothing of it runs."""

    ds_class = "deepspeed"

    def __repr__(self) -> str:
        return f"<{self.ds_class} {vars(self)!r}>"


def _record_class(qualified: str) -> type[DeepSpeedRecord]:
    return type(qualified.rsplit(".", 1)[-1], (DeepSpeedRecord,), {"ds_class": qualified, "__module__": __name__})


def _enum_value(value: Any) -> Any:
    """An enum member pickled as ``Enum(value)``: its value (ZeRO stage 2 reads as 2)."""
    return value


# Classes DeepSpeed 0.14-0.19 writes into its checkpoints (model states, optimizer states, universal files).
RECORD_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",  # param_slice_mappings: (numel, start) of each share
    "argparse.Namespace",  # Megatron-DeepSpeed's args in client state
)
ENUM_CLASSES = ("deepspeed.runtime.zero.config.ZeroStageEnum",)
_STANDINS: list[tuple[Any, str]] = [(_record_class(name), name) for name in RECORD_CLASSES]
_STANDINS += [(_enum_value, name) for name in ENUM_CLASSES]
ALLOWED = tuple(name for _, name in _STANDINS)

_UNSUPPORTED = re.compile(r"GLOBAL (\S+)")


def load_pickle(path: Path) -> Any:
    """The object in the ``torch.save`` file ``path``, tensors on CPU; a :class:`CheckpointError` for anything unsafe.

    Refused: a global outside torch's tensor rebuilders, plain containers and :data:`ALLOWED`
    (named in the message, never imported or called), and a file that is not a torch pickle.
    """
    try:
        with torch.serialization.safe_globals(_STANDINS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=_zip(path))
    except pickle.UnpicklingError as err:
        text = str(err)
        found = _UNSUPPORTED.search(text)
        detail = next(
            (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("WeightsUnpickler error")),
            text,
        )
        what = (
            f"the global {found.group(1)}"
            if found
            else f"something outside tensors and plain data ({detail.splitlines()[0]})"
        )
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} names {what}, which is not on slipstream's allow-list of DeepSpeed "
            f"checkpoint classes ({', '.join(ALLOWED)}); it was not unpickled (unpickling runs arbitrary code)"
        ) from None
    except (RuntimeError, EOFError, OSError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None


def _zip(path: Path) -> bool:
    """torch.save's zip format can be memory-mapped (tensors are read when used); the legacy format cannot."""
    with open(path, "rb") as f:
        return f.read(2) == b"PK"


def attributes(obj: Any) -> dict[str, Any]:
    """A stand-in's attributes (an empty dict for anything else)."""
    return dict(vars(obj)) if isinstance(obj, DeepSpeedRecord) else {}
