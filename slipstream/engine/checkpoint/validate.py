"""Type checks of a checkpoint's JSON files, so a damaged field is one line, never a traceback.

[Note: trust nothing read back] A manifest or rank file can be truncated, edited or written by a
buggy tool. Every field the reader uses is checked here once, right after parsing, and a bad one
is a :class:`CheckpointError` naming the file, the field, the value and what was expected; a
checkpoint with such a file is simply not complete, so a sibling is found by the fallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slipstream.errors import SlipstreamError


class CheckpointError(SlipstreamError, ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model; the message says which file or parameter."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nat(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _shape(v: Any) -> bool:
    return isinstance(v, list) and all(_nat(d) for d in v)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain_name(v: Any) -> bool:
    return isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v and "\0" not in v


def _fail(path: Path, file: str, field: str, value: Any, expected: str) -> CheckpointError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return CheckpointError(
        f"checkpoint {path}: {file} field {field} is {shown}, expected {expected} "
        "(the file is damaged or was not written by slipstream; load another checkpoint)"
    )


def _check(path: Path, file: str, obj: dict[str, Any], specs: dict[str, tuple[Any, str]], where: str = "") -> None:
    for key, (test, expected) in specs.items():
        if key not in obj or not test(obj[key]):
            raise _fail(path, file, f"{where}{key}", obj.get(key, "<missing>"), expected)


METADATA_CRC_ONLY = "crc32 of metadata files"  # the manifest's "checksum" when the tensor files have none (snapshots)

_MANIFEST = {
    "version": (_nat, "a non-negative integer"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "global_steps": (_nat, "a non-negative integer"),
    "micro_steps": (_nat, "a non-negative integer"),
    "zero_stage": (_nat, "a non-negative integer"),
    "precision": (lambda v: isinstance(v, str), "a string"),
    "created": (_num, "a number"),
    "parameters": (lambda v: isinstance(v, dict), "an object"),
    "buffers": (lambda v: isinstance(v, dict), "an object"),
    "state_dict_keys": (lambda v: isinstance(v, dict), "an object"),
    "files": (lambda v: isinstance(v, dict), "an object"),
}


def check_manifest(path: Path, m: dict[str, Any], file: str) -> None:
    _check(path, file, m, _MANIFEST)
    mesh = m.get("mesh")  # optional: checkpoints written before it was recorded have none
    if mesh is not None and not (
        isinstance(mesh, dict) and all(isinstance(k, str) and _is_int(v) and v >= 1 for k, v in mesh.items())
    ):
        raise _fail(path, file, "mesh", mesh, "an object of axis sizes (positive integers)")
    for name, info in m["parameters"].items():
        if not isinstance(info, dict) or not _shape(info.get("shape")):
            raise _fail(
                path,
                file,
                f"parameters[{name!r}].shape",
                info.get("shape") if isinstance(info, dict) else info,
                "a list of sizes",
            )
    for name, info in m["buffers"].items():
        if not isinstance(info, dict) or not _shape(info.get("shape")):
            raise _fail(path, file, f"buffers[{name!r}].shape", info, "a list of sizes")
    for key, source in m["state_dict_keys"].items():
        ok = (
            isinstance(source, dict)
            and len(source) == 1
            and (
                isinstance(source.get("param"), str)
                and source["param"] in m["parameters"]
                or isinstance(source.get("buffer"), str)
                and source["buffer"] in m["buffers"]
            )
        )
        if not ok:
            raise _fail(
                path, file, f"state_dict_keys[{key!r}]", source, "{'param': NAME} or {'buffer': NAME} of a listed one"
            )
    for name, record in m["files"].items():
        if not _plain_name(name):
            raise _fail(path, file, "files", name, "plain file names inside the checkpoint directory")
        if not isinstance(record, dict):
            raise _fail(path, file, f"files[{name!r}]", record, "an object with bytes and crc32")
        specs = {"bytes": (_nat, "a non-negative integer"), "crc32": (_nat, "a non-negative integer")}
        if m.get("checksum") == METADATA_CRC_ONLY and name.endswith(".safetensors"):  # an in-memory snapshot's tensors
            del specs["crc32"]
        _check(path, file, record, specs, f"files[{name!r}].")


_SLICE = {
    "name": (lambda v: isinstance(v, str), "a string"),
    "shape": (_shape, "a list of sizes"),
    "start": (_nat, "a non-negative integer"),
    "numel": (_nat, "a non-negative integer"),
    "key": (lambda v: isinstance(v, str), "a string"),
}


def check_rank_meta(path: Path, meta: Any, file: str, rank: int) -> None:
    if not isinstance(meta, dict):
        raise _fail(path, file, "(the whole file)", meta, "a JSON object")
    _check(
        path,
        file,
        meta,
        {
            "slices": (lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v), "a list of objects"),
            "stateful": (lambda v: isinstance(v, dict), "an object"),
            "rng": (lambda v: isinstance(v, dict), "an object"),
        },
    )
    for i, entry in enumerate(meta["slices"]):
        _check(path, file, entry, _SLICE, f"slices[{i}].")
        box = entry.get("box")
        if box is not None and not (isinstance(box, dict) and _shape(box.get("offsets")) and _shape(box.get("sizes"))):
            raise _fail(path, file, f"slices[{i}].box", box, "{'offsets': [...], 'sizes': [...]}")
        if "optimizer" in entry and not (
            isinstance(entry["optimizer"], dict)
            and all(isinstance(r, dict) and len(r) >= 1 for r in entry["optimizer"].values())
        ):
            raise _fail(path, file, f"slices[{i}].optimizer", entry["optimizer"], "an object of records")
    if rank == 0:
        common = meta.get("common")
        if not isinstance(common, dict):
            raise _fail(path, file, "common", common, "an object")
        _check(
            path,
            file,
            common,
            {
                "counters": (lambda v: isinstance(v, dict), "an object"),
                "buffers": (
                    lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v.values()),
                    "an object of tensor keys",
                ),
                "client_state": (lambda v: isinstance(v, (dict, list)), "an encoded dict"),
                "optimizer_groups": (lambda v: isinstance(v, list), "a list of groups"),
                "loss_scaler": (lambda v: isinstance(v, dict), "an object"),
                "lr_scheduler": (lambda v: v is None or isinstance(v, dict), "an object or null"),
            },
            "common.",
        )
