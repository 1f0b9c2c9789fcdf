"""The checkpoint formats, one module (or package) each, and the one table ``load_checkpoint`` dispatches on.

| format | found by | loaded by | written by |
|---|---|---|---|
| ``dcp`` (torch.distributed.checkpoint: FSDP2's, torchtitan's) | ``<dir>/<tag>/.metadata`` | ``dcp.load_dcp`` | ``dcp.save_dcp`` (``engine.save_dcp``) |
| ``deepspeed`` (ZeRO 0-3, universal) | ``deepspeed.source.locate`` | converted per node to native (``deepspeed.staging``), then native's load | ``deepspeed.export`` (``slipstream checkpoint export --format deepspeed``) |
| ``native`` (``save_checkpoint``'s) | ``native.detect`` (``latest`` or the tag) | ``native.load`` | the manager (``capture``, ``writer``) |
| ``hf`` (weights only, not a training state) | not loaded as a checkpoint | ``from_pretrained`` | ``hf.parallel_save`` (``save_16bit_model``), ``hf.export`` (offline) |

The table is tried in order; the first format whose ``detect`` finds something is the format.
Format modules never import each other (``tests/unit/test_architecture.py``): where one format
needs another (a DeepSpeed checkpoint is loaded as the native one it converts to), this module
composes them. ``dcp`` costs ~0.9 s of torch imports, so every format is imported only when used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.engine.checkpoint.target import CheckpointTarget
from slipstream.engine.checkpoint.validate import CheckpointError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

DCP_METADATA = ".metadata"  # the file that marks a torch.distributed.checkpoint directory


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What ``load_checkpoint`` asked for, handed to the format that loads it."""

    target: CheckpointTarget
    strict: bool = True
    optimizer: bool = True
    scheduler: bool = True
    module_only: bool = False
    verify_checksums: bool = False

    def options(self) -> dict[str, Any]:
        return {
            "strict": self.strict,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "module_only": self.module_only,
        }


Loaded = tuple[str, dict[str, Any]]  # the path loaded, the client state


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[str | Path, str | None, bool], Path | None]  # (load_dir, tag, verify_checksums) -> found
    load: Callable[[LoadRequest, Path], Loaded]


def _detect_dcp(load_dir: str | Path, tag: str | None, verify_checksums: bool) -> Path | None:
    found = Path(load_dir) / (tag or "")
    return found if (found / DCP_METADATA).is_file() else None


def _load_dcp(request: LoadRequest, path: Path) -> Loaded:
    from slipstream.engine.checkpoint.formats.dcp import load_dcp

    load_dcp(request.target, path, optimizer=request.optimizer and not request.module_only)
    logger.info("loaded DCP checkpoint %s", path)
    return str(path), {}


def _detect_deepspeed(load_dir: str | Path, tag: str | None, verify_checksums: bool) -> Path | None:
    from slipstream.engine.checkpoint.formats.deepspeed.source import locate

    return locate(load_dir, tag)


def _load_deepspeed(request: LoadRequest, path: Path) -> Loaded:
    from slipstream.engine.checkpoint.formats.deepspeed.staging import staged

    with staged(path) as converted:
        try:
            _, client_state = _load_native(request, converted)
        except (CheckpointError, RuntimeError) as err:  # name the user's checkpoint, not the temporary copy
            raise type(err)(str(err).replace(str(converted), f"{path} (DeepSpeed)")) from None
    logger.info("loaded DeepSpeed checkpoint %s", path)
    return str(path), client_state


def _detect_native(load_dir: str | Path, tag: str | None, verify_checksums: bool) -> Path | None:
    from slipstream.engine.checkpoint.formats import native

    return native.detect(load_dir, tag, verify_checksums)


def _load_native(request: LoadRequest, path: Path) -> Loaded:
    from slipstream.engine.checkpoint.formats import native

    return native.load(request.target, path, request.options(), request.verify_checksums)


FORMATS = (
    Format("dcp", _detect_dcp, _load_dcp),
    Format("deepspeed", _detect_deepspeed, _load_deepspeed),
    Format("native", _detect_native, _load_native),
)


def detect(load_dir: str | Path, tag: str | None, verify_checksums: bool) -> tuple[Format, Path] | None:
    """The first format of the table that finds a checkpoint at ``load_dir`` (``latest``, or ``tag``), and its path."""
    for candidate in FORMATS:
        found = candidate.detect(load_dir, tag, verify_checksums)
        if found is not None:
            return candidate, found
    return None
