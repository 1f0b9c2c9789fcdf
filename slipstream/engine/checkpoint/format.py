"""The on-disk format: file names, the streaming safetensors writer, and JSON trees with tensors.

[Note: layout] A checkpoint is a directory ``<save_dir>/<tag>/``::

    manifest.json           written last; versions, world size, stage, the mesh's axis sizes,
                            parameter shapes and dtypes, the model's state_dict keys, and every
                            file's size and CRC-32
    config.json             the engine's config
    rank00000.json          this rank's slices (parameter name, flat start, length), the optimizer
    rank00000.safetensors   state for them, RNG states, loader position; rank 0 also the shared state

and ``<save_dir>/latest`` holds the newest tag. Tensors are only ever read back through
safetensors and metadata through JSON, so loading never unpickles anything.

The safetensors files are written by hand (an 8-byte header length, a JSON header, the raw bytes)
so the bytes stream from the tensors to the file without an in-memory copy and with the GIL
released during writes and checksums: an asynchronous save then costs the training thread almost
nothing. They are read with the official ``safetensors`` package.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

FORMAT_NAME = "slipstream-checkpoint"
FORMAT_VERSION = 2  # 2: slices may carry a box; tree keys escape '/' and '%'. Version 1 still loads.
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
CONFIG = "config.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
CHUNK = 16 * 2**20  # bytes per write/checksum call: large enough to release the GIL for long stretches

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def rank_stem(rank: int) -> str:
    return f"rank{rank:05d}"


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def naming_file(path: Path, err: OSError) -> OSError:
    """``err`` with the file being written in its message (a bare ENOSPC from ``write`` names none)."""
    if err.filename:
        return err
    named = OSError(err.errno, f"{err.strerror or err} while writing the checkpoint file", str(path))
    return named


def write_bytes_durably(path: Path, data: bytes) -> dict[str, int]:
    """Write ``data`` to ``path``, fsync it; return its size and CRC-32 for the manifest."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise naming_file(path, err) from None
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def write_json_durably(path: Path, obj: Any) -> dict[str, int]:
    return write_bytes_durably(path, json.dumps(obj, indent=1, sort_keys=False).encode())


def write_safetensors(
    path: Path, tensors: Any, metadata: dict[str, str] | None = None, checksum: bool = True
) -> dict[str, int]:
    """Write ``tensors`` (a dict, or a :class:`GuardedTensors`) as a safetensors file, fsync it; return size and CRC-32.

    ``checksum=False`` records the size only (in-memory snapshots: RAM needs no media check, and the
    CRC pass was a third of a snapshot's cost); readers then check the size alone."""
    from slipstream.engine.checkpoint.snapshot import reading

    header = safetensors_header([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()], metadata)
    crc, size = zlib.crc32(header), len(header)
    try:
        with open(path, "wb") as f:
            f.write(header)
            for name in tensors:
                with reading(tensors, name) as t:
                    for block in _byte_blocks(t):
                        f.write(block)  # file writes and zlib.crc32 of large buffers release the GIL
                        if checksum:
                            crc = zlib.crc32(block, crc)
                        size += len(block)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise naming_file(path, err) from None
    return {"bytes": size, "crc32": crc} if checksum else {"bytes": size}


def safetensors_header(
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """What precedes a safetensors file's data: the header length (8 bytes, little-endian) and the JSON header,
    padded so the data starts 8-byte aligned; ``layout`` is (key, dtype, shape) per tensor, in file order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in _DTYPE_CODES:
            raise TypeError(f"checkpoint: tensor {name!r} has dtype {dtype}, which safetensors cannot hold")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def _byte_blocks(t: torch.Tensor) -> Any:
    if t.numel() == 0:
        return
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(raw)
    for begin in range(0, len(view), CHUNK):
        yield view[begin : begin + CHUNK]


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


# --------------------------------------------------------------------------- JSON trees with tensors


def key_part(name: str | int) -> str:
    """One component of a tensor key, escaped so that distinct paths give distinct keys.

    [Note: injective keys] Keys join path components with '/'. A dict key holding '/' (or '%')
    is escaped, and an integer key gets a '%i' prefix that no escaped string can produce, so
    ``{"a/b": x}`` and ``{"a": {"b": y}}`` (or ``{1: x}`` and ``{"1": y}``) never share a key.
    """
    if isinstance(name, int) and not isinstance(name, bool):
        return f"%i{name}"
    return name.replace("%", "%25").replace("/", "%2F")


def encode_tree(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """A JSON-able copy of ``obj``; tensors go into ``tensors`` under ``prefix``-based keys.

    Holds dicts, lists, tuples, str/int/float/bool/None and tensors (what ``state_dict()`` methods
    return). Anything else would need pickle: a ``TypeError`` names where it is. Non-finite floats
    are kept (JSON's NaN/Infinity, which Python's json reads back).
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        key = prefix
        tensors[key] = obj.detach()
        return {"__tensor__": key}
    if isinstance(obj, (list, tuple)):
        items = [encode_tree(v, f"{prefix}/{i}", tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        markers = ("__tensor__", "__tuple__", "__items__")
        if all(isinstance(k, str) for k in obj) and not any(m in obj for m in markers):
            return {k: encode_tree(v, f"{prefix}/{key_part(k)}", tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            return {
                "__items__": [
                    [k, encode_tree(v, f"{prefix}/{key_part(k)}", tensors, f"{where}[{k!r}]")] for k, v in obj.items()
                ]
            }
        bad = next(k for k in obj if not isinstance(k, (str, int)) or isinstance(k, bool))
        raise TypeError(
            f"checkpoint: {where} has the key {bad!r} ({type(bad).__name__}); checkpoint dicts take str or int keys only"
        )
    import numpy

    if isinstance(obj, numpy.generic):
        return obj.item()
    raise TypeError(
        f"checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which cannot be saved without "
        "pickle; use dicts, lists, numbers, strings and tensors"
    )


def decode_tree(obj: Any, tensors: Any) -> Any:
    """Invert :func:`encode_tree`; ``tensors`` maps keys to tensors (a dict or a lazy reader)."""
    if isinstance(obj, list):
        return [decode_tree(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj and len(obj) == 1:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj and len(obj) == 1:
            return tuple(decode_tree(v, tensors) for v in obj["__tuple__"])
        if "__items__" in obj and len(obj) == 1:
            return {k: decode_tree(v, tensors) for k, v in obj["__items__"]}
        return {k: decode_tree(v, tensors) for k, v in obj.items()}
    return obj
