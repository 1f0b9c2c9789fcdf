"""Finding, validating and reading checkpoints, at whatever world size or stage they were written.

[Note: resharding on read] Every rank file lists the slices it holds as (parameter, flat start,
length). The reader indexes them by parameter; asking for any range of a parameter copies the
overlapping parts of the saved slices (``safe_open(...).get_slice`` reads just those bytes). A
strategy of another stage or world size simply asks for the ranges it owns now.
"""

from __future__ import annotations

import bisect
import glob
import json
import math
import struct
import warnings
from pathlib import Path
from typing import Any

import torch

from slipstream.engine.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    READABLE_VERSIONS,
    TMP_PREFIX,
    TRASH_PREFIX,
    decode_tree,
    file_crc32,
    rank_stem,
)
from slipstream.engine.checkpoint.tags import TagError, check_load_tag, tag_problem
from slipstream.engine.checkpoint.tiling import LayoutError, assemble, check_keys, check_tiling, entry_box
from slipstream.engine.checkpoint.validate import CheckpointError, check_manifest, check_rank_meta
from slipstream.utils.pieces import ParamSlice, is_whole
from slipstream.utils.placement import global_shape_and_box

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "check_coverage",
    "check_files",
    "complete_checkpoints",
    "latest_tag",
    "resolve",
]


def _looks_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object."""
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= size - 8 and head[8:9] == b"{"


def _looks_pickled(path: Path) -> bool:
    """torch.save's zip or a raw pickle stream, and *not* a safetensors file.

    [Note: the sniff] A safetensors file starts with its header length: its low byte is 0x80 for
    one header length in 32, exactly a pickle's first byte. So a file is taken for a pickle only
    when it does not parse as the start of a safetensors file.
    """
    with open(path, "rb") as f:
        head = f.read(9)
    if _looks_safetensors(head, path.stat().st_size):
        return False
    return head[:2] == b"PK" or head[:1] == b"\x80"


def _pickle_refusal(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is a torch.save/pickle file, not a slipstream checkpoint; slipstream never unpickles checkpoint files "
        "(unpickling runs arbitrary code). Load it yourself with torch.load(..., weights_only=True) and "
        "engine.module.load_state_dict(), then save_checkpoint() to get a slipstream checkpoint"
    )


def read_json(path: Path, where: str) -> Any:
    """A JSON file, or a :class:`CheckpointError` naming it (unreadable, not UTF-8, not JSON)."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"checkpoint {where}: {path.name} is not UTF-8 text (byte {err.start}); the file is damaged"
        ) from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {where}: {path.name} is corrupt ({err})") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {where}: {path.name} cannot be read ({err.strerror})") from None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, or a :class:`CheckpointError` saying what is wrong."""
    if path.is_file():
        if _looks_pickled(path):
            raise _pickle_refusal(path)
        raise CheckpointError(f"{path} is a file; a slipstream checkpoint is a directory holding {MANIFEST}")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise _pickle_refusal(path / pickles[0])
        raise CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing (the save did not finish)")
    manifest = read_json(manifest_path, str(path))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a slipstream checkpoint manifest")
    version = manifest.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}; this slipstream reads up to {FORMAT_VERSION} (upgrade slipstream)"
        )
    check_manifest(path, manifest, MANIFEST)
    if manifest["version"] not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} has format version {manifest['version']}; readable: {READABLE_VERSIONS}"
        )
    return manifest


def check_files(path: Path, manifest: dict[str, Any], checksums: bool) -> None:
    """Every file of the manifest exists with its recorded size (and CRC-32 when ``checksums``)."""
    for name, record in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {size} bytes, {MANIFEST} says {record['bytes']} (truncated or corrupt)"
            )
        if checksums and "crc32" in record and file_crc32(file) != record["crc32"]:  # a snapshot's tensors have none
            raise CheckpointError(f"checkpoint {path}: {name} fails its CRC-32 check (corrupt)")


def check_coverage(where: str, parameters: dict[str, Any], slices: list[dict[str, Any]]) -> None:
    """Every element of every parameter is saved exactly once by the ranks' ``slices`` (no overlap, no gap)."""
    saved: dict[str, int] = {}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for entry in slices:
        saved[entry["name"]] = saved.get(entry["name"], 0) + entry["numel"]
        by_name.setdefault(entry["name"], []).append(entry)
    for name, info in parameters.items():
        numel = math.prod(info["shape"])
        if saved.get(name, 0) != numel:
            raise CheckpointError(
                f"checkpoint {where}: parameter {name!r} has {saved.get(name, 0)} of its {numel} elements saved "
                "(the sharding strategy's sharded_state() does not cover it exactly)"
            )
        entries = by_name.get(name, [])
        if any(tuple(e.get("shape", info["shape"])) != tuple(info["shape"]) for e in entries):
            raise CheckpointError(
                f"checkpoint {where}: a slice of parameter {name!r} records another shape than {MANIFEST}"
            )
        if all("start" in e for e in entries):
            try:
                check_tiling(name, tuple(info["shape"]), entries)
            except LayoutError as err:
                raise CheckpointError(f"checkpoint {where}: {err} (the rank files are damaged)") from None
    unknown = sorted(set(by_name) - set(parameters))
    if unknown:
        raise CheckpointError(
            f"checkpoint {where}: slices of {unknown[0]!r}, which {MANIFEST} does not list (the rank files are damaged)"
        )


def is_complete(path: Path) -> dict[str, Any] | None:
    """The manifest if ``path`` is a complete checkpoint (all files present, right sizes), else None."""
    try:
        manifest = read_manifest(path)
        check_files(path, manifest, checksums=False)
        return manifest
    except CheckpointError:
        return None


def complete_checkpoints(save_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Complete checkpoints under ``save_dir``, oldest first (by global step, then creation time)."""
    if not save_dir.is_dir():
        return []
    found = []
    for child in save_dir.iterdir():
        if child.is_dir() and not child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            manifest = is_complete(child)
            if manifest is not None:
                found.append((child, manifest))
    found.sort(key=lambda item: (item[1].get("global_steps", 0), item[1].get("created", 0.0)))
    return found


def read_latest(save_dir: Path) -> tuple[str | None, str]:
    """The tag ``latest`` names and, when it names none usable, why (empty when there is no ``latest``)."""
    file = save_dir / LATEST
    if not file.is_file():
        return None, ""
    try:
        tag = file.read_bytes().decode("utf-8").strip()
    except (UnicodeDecodeError, OSError) as err:
        return None, f"{file} cannot be read as text ({err})"
    problem = tag_problem(tag)
    if problem is not None:
        return None, f"{file} holds {tag[:60]!r}, which {problem}; it must hold one checkpoint directory name"
    return tag, ""


def latest_tag(save_dir: Path) -> str | None:
    return read_latest(save_dir)[0]


def stand_in(save_dir: Path, tag: str) -> Path | None:
    """Where a crash between the two renames of a re-save left ``tag``: the committed ``.tmp-<tag>``, else its trash copy."""
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    if is_complete(tmp) is not None:
        return tmp
    if latest_tag(save_dir) != tag:
        return None
    trash = sorted(
        (
            p
            for p in save_dir.glob(f"{TRASH_PREFIX}{glob.escape(tag)}-*")
            if p.name.rpartition("-")[0] == f"{TRASH_PREFIX}{tag}"
        ),
        reverse=True,
    )
    return next((p for p in trash if is_complete(p) is not None), None)


def resolve(load_dir: str | Path, tag: str | None, checksums: bool = True) -> Path | None:
    """The checkpoint directory to load: ``tag``, else ``latest``, else (with a warning) the newest complete one.

    Falling back, candidates are checked newest first, with their checksums when ``checksums``.

    ``load_dir`` may also be a checkpoint directory itself. None when there is no checkpoint at all.
    """
    load_dir = Path(load_dir)
    if tag is not None:
        try:
            return load_dir / check_load_tag(tag, "checkpoint")
        except TagError as err:
            raise CheckpointError(str(err)) from None
    if (load_dir / MANIFEST).is_file():
        return load_dir
    if load_dir.is_file():
        raise (
            _pickle_refusal(load_dir)
            if _looks_pickled(load_dir)
            else CheckpointError(f"{load_dir} is not a checkpoint directory")
        )
    pointed, reason = read_latest(load_dir)
    if pointed is not None:
        candidate = load_dir / pointed
        if not candidate.exists():
            candidate = stand_in(load_dir, pointed) or candidate
        try:
            check_files(candidate, read_manifest(candidate), checksums=False)
            return candidate
        except CheckpointError as err:
            reason = str(err)
    newest = next(
        (path for path, manifest in reversed(complete_checkpoints(load_dir)) if _verifies(path, manifest, checksums)),
        None,
    )
    if newest is None:
        if pointed is not None or reason:
            raise CheckpointError(
                f"{load_dir}/{LATEST} points to {pointed!r}, which cannot be loaded ({reason}), and no other complete checkpoint exists"
            )
        return None
    if pointed is not None or reason:
        warnings.warn(
            f"checkpoint: {LATEST} points to {pointed!r}, which cannot be loaded ({reason}); loading the newest complete one, "
            f"{newest.name!r}",
            stacklevel=3,
        )
    else:
        warnings.warn(
            f"checkpoint: {load_dir} has no {LATEST} file; loading the newest complete checkpoint, {newest.name!r}",
            stacklevel=3,
        )
    return newest


def _verifies(path: Path, manifest: dict[str, Any], checksums: bool) -> bool:
    try:
        check_files(path, manifest, checksums)
        return True
    except CheckpointError:
        return False


class CheckpointReader:
    """One validated checkpoint: its manifest, rank metadata and tensors, readable by slice."""

    def __init__(self, path: str | Path, verify_checksums: bool = True) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        check_files(self.path, self.manifest, checksums=False)
        self.verify_checksums = verify_checksums
        self.world_size = self.manifest["world_size"]
        for rank in range(self.world_size):
            for suffix in (".json", ".safetensors"):
                if f"{rank_stem(rank)}{suffix}" not in self.manifest["files"]:
                    raise CheckpointError(
                        f"checkpoint {self.path}: {MANIFEST} lists no {rank_stem(rank)}{suffix} (world size {self.world_size})"
                    )
        self._meta: dict[int, dict[str, Any]] = {}
        self._full: tuple[str, torch.Tensor] | None = None  # the last parameter assembled from boxes
        self._files: dict[int, Any] = {}
        self._verified: set[str] = set()
        # parameter -> sorted starts and their (start, numel, rank, entry)
        self._index: dict[str, list[tuple[int, int, int, dict[str, Any]]]] = {}
        for rank in range(self.world_size):
            for entry in self.rank_meta(rank)["slices"]:
                wrong = check_keys(entry, self.manifest["version"])
                if wrong is not None:
                    raise CheckpointError(
                        f"checkpoint {self.path}: {rank_stem(rank)}.json: a slice of {entry['name']!r} has {wrong} (the file is damaged)"
                    )
                self._index.setdefault(entry["name"], []).append((entry["start"], entry["numel"], rank, entry))
        check_coverage(
            str(self.path), self.manifest["parameters"], [e[3] for entries in self._index.values() for e in entries]
        )
        for entries in self._index.values():
            entries.sort(key=lambda e: e[0])
        self._starts = {name: [e[0] for e in entries] for name, entries in self._index.items()}

    # ------------------------------------------------------------------ files
    def _verify(self, name: str) -> None:
        if name in self._verified:
            return
        record = self.manifest["files"].get(name)
        if record is None:
            raise CheckpointError(f"checkpoint {self.path}: {name} is not listed in {MANIFEST}")
        file = self.path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {self.path} is incomplete: {name} is missing (listed in {MANIFEST})")
        if (
            (self.verify_checksums or name.endswith(".json"))
            and "crc32" in record
            and file_crc32(file) != record["crc32"]
        ):
            raise CheckpointError(f"checkpoint {self.path}: {name} fails its CRC-32 check (corrupt)")
        self._verified.add(name)

    def rank_meta(self, rank: int) -> dict[str, Any]:
        if rank not in self._meta:
            name = f"{rank_stem(rank)}.json"
            self._verify(name)
            meta = read_json(self.path / name, str(self.path))
            check_rank_meta(self.path, meta, name, rank)
            self._meta[rank] = meta
        return self._meta[rank]

    def _open(self, rank: int) -> Any:
        handle = self._files.get(rank)
        if handle is None:
            from safetensors import SafetensorError, safe_open

            name = f"{rank_stem(rank)}.safetensors"
            self._verify(name)
            if _looks_pickled(self.path / name):
                raise _pickle_refusal(self.path / name)
            try:
                handle = self._files[rank] = safe_open(str(self.path / name), framework="pt")
            except SafetensorError as err:
                raise CheckpointError(
                    f"checkpoint {self.path}: {name} is not a valid safetensors file ({err})"
                ) from None
        return handle

    def tensor(self, rank: int, key: Any) -> torch.Tensor:
        handle = self._open(rank)
        if not isinstance(key, str) or key not in handle.keys():
            raise CheckpointError(
                f"checkpoint {self.path}: {rank_stem(rank)}.safetensors holds no tensor {key!r} (the files are damaged)"
            )
        return handle.get_tensor(key)

    def _piece(self, rank: int, key: Any, numel: int) -> Any:
        """The saved 1-D tensor ``key`` as a lazy slice, after checking it has the ``numel`` its entry says."""
        handle = self._open(rank)
        if not isinstance(key, str) or key not in handle.keys():
            raise CheckpointError(
                f"checkpoint {self.path}: {rank_stem(rank)}.safetensors holds no tensor {key!r} (the files are damaged)"
            )
        piece = handle.get_slice(key)
        shape = piece.get_shape()
        if list(shape) != [numel]:
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {key!r} of {rank_stem(rank)}.safetensors has shape {list(shape)}, its slice "
                f"entry says {numel} elements (the files are damaged)"
            )
        return piece

    def decode(self, rank: int, tree: Any) -> Any:
        try:
            return decode_tree(tree, _LazyTensors(self, rank))
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(
                f"checkpoint {self.path}: {rank_stem(rank)}.json holds a malformed saved tree ({type(err).__name__}: {err}); "
                "the file is damaged"
            ) from None

    def common(self) -> dict[str, Any]:
        return self.rank_meta(0)["common"]

    # ------------------------------------------------------------------ model
    def check_model(self, module: torch.nn.Module, strict: bool = True, model_names: set[str] | None = None) -> None:
        """Every parameter of ``module`` is in the checkpoint with the same shape (and none extra when ``strict``).

        ``model_names``: every parameter name of a model spread over ranks (pipeline stages), of which
        ``module`` holds a part; a saved name is unexpected only when the whole model lacks it.
        """
        saved = self.manifest["parameters"]
        ours = dict(module.named_parameters())
        for name, p in ours.items():
            shape = global_shape_and_box(p)[0]  # a tensor/expert-parallel piece is compared as its whole tensor
            if name in saved and tuple(saved[name]["shape"]) != shape:
                raise CheckpointError(
                    f"checkpoint {self.path}: parameter {name!r} has shape {tuple(saved[name]['shape'])} in the checkpoint "
                    f"but {shape} in the model (a different model or model config?)"
                )
        missing = [n for n in ours if n not in saved]
        unexpected = [n for n in saved if n not in (model_names if model_names is not None else ours)]
        # Saved with exclude_frozen_parameters=True: a non-strict load keeps the model's own frozen values.
        frozen_only = bool(missing) and all(not ours[n].requires_grad for n in missing)
        if not strict:
            missing = [n for n in missing if ours[n].requires_grad]
        if missing or (strict and unexpected):
            parts = []
            if missing:
                hint = " (frozen parameters left out by exclude_frozen_parameters=True: load with load_module_strict=False)"
                parts.append(
                    f"missing from the checkpoint: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                    + (hint if frozen_only else "")
                )
            if strict and unexpected:
                parts.append(f"not in the model: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
            raise CheckpointError(
                f"checkpoint {self.path} does not fit the model ({self.manifest.get('module_class')} was saved): "
                + "; ".join(parts)
            )

    def _overlaps(self, s: ParamSlice) -> list[tuple[int, int, int, dict[str, Any]]]:
        entries = self._index.get(s.name)
        if entries is None and s.numel == 0:
            return []  # a zero-element parameter: strategies may save no slice of it
        if entries is None:
            raise CheckpointError(f"checkpoint {self.path}: no rank file holds parameter {s.name!r}")
        first = max(bisect.bisect_right(self._starts[s.name], s.start) - 1, 0)
        found, end = [], s.start + s.numel
        for entry in entries[first:]:
            if entry[0] >= end:
                break
            if entry[0] + entry[1] > s.start:
                found.append(entry)
        return found

    def _assemble(
        self, s: ParamSlice, key_of: Any, dtype: torch.dtype | None = None, what: str = "weights"
    ) -> torch.Tensor:
        """``s`` of the tensor ``what`` (the weights or one optimizer state) whose saved keys ``key_of(entry)`` gives."""
        end = s.start + s.numel
        if s.numel == 0:
            return torch.empty(0, dtype=dtype or torch.float32)
        boxed = not s.whole or any(not is_whole(entry_box(e[3], s.shape), s.shape) for e in self._index.get(s.name, []))
        if boxed:
            return self._from_boxes(s, key_of, dtype, what)
        overlaps = self._overlaps(s)
        if (
            len(overlaps) == 1 and overlaps[0][0] == s.start and overlaps[0][1] == s.numel
        ):  # saved as asked: no re-slicing
            piece = self._piece(overlaps[0][2], key_of(overlaps[0][3]), s.numel)[:]
            return piece if dtype is None or piece.dtype == dtype else piece.to(dtype)
        out: torch.Tensor | None = None
        covered = 0
        for start, numel, rank, entry in overlaps:
            lo, hi = max(start, s.start), min(start + numel, end)
            piece = self._piece(rank, key_of(entry), numel)[lo - start : hi - start]
            if out is None:
                out = torch.empty(s.numel, dtype=dtype or piece.dtype)
            out[lo - s.start : hi - s.start] = piece
            covered += hi - lo
        if out is None or covered != s.numel:
            raise CheckpointError(
                f"checkpoint {self.path}: elements {s.start}..{end} of parameter {s.name!r} are not all saved "
                f"({covered} of {s.numel} found; a rank file is missing or does not match {MANIFEST})"
            )
        return out

    def _from_boxes(self, s: ParamSlice, key_of: Any, dtype: torch.dtype | None, what: str) -> torch.Tensor:
        """Assemble the whole parameter from its boxes (kept until another one is asked for), then cut ``s`` out."""
        cache_key = f"{s.name}\0{what}"
        if self._full is None or self._full[0] != cache_key:
            self._full = None  # free the previous parameter first: memory stays bounded by the largest one
            entries = self._index.get(s.name)
            if entries is None:
                raise CheckpointError(f"checkpoint {self.path}: no rank file holds parameter {s.name!r}")

            def reader_of(rank: int, entry: dict[str, Any]) -> Any:
                return lambda lo, hi: self._piece(rank, key_of(entry), entry["numel"])[lo:hi]

            pieces = [(entry, reader_of(rank, entry)) for _, _, rank, entry in entries]
            self._full = (cache_key, assemble(tuple(s.shape), pieces, dtype or torch.float32))
        return s.cut(self._full[1])

    def read_param(self, s: ParamSlice) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened fp32 parameter, from whichever slices hold them."""
        if s.parts is not None:  # a packed piece: its boxes one after another
            return torch.cat([self.read_param(part) for _, _, part in s.split()]) if s.numel else torch.zeros(0)
        return self._assemble(s, lambda entry: entry["key"], torch.float32)

    def full_param(self, name: str) -> torch.Tensor:
        shape = tuple(self.manifest["parameters"][name]["shape"])
        return self.read_param(ParamSlice(name, shape, 0, math.prod(shape))).view(shape)

    def read_optimizer_state(self, s: ParamSlice) -> dict[str, tuple[str, Any]] | None:
        """The optimizer state of this slice: key -> ("slice", tensor) | ("tensor", (tensor, on_param_device)) | ("value", v)."""
        if s.parts is not None:  # a packed piece: per-element state joined box after box, the rest from the first
            found = [self.read_optimizer_state(part) for _, _, part in s.split()]
            if not found or any(f is None for f in found):
                if any(f is not None for f in found):
                    raise CheckpointError(
                        f"checkpoint {self.path}: parameter {s.name!r} has optimizer state for only some of its slices"
                    )
                return None
            first = found[0]
            assert first is not None
            return {
                k: ("slice", torch.cat([f[k][1] for f in found])) if kind == "slice" else (kind, v)  # type: ignore[index]
                for k, (kind, v) in first.items()
            }
        overlaps = self._overlaps(s)
        with_state = [e for e in overlaps if "optimizer" in e[3]]
        if not with_state:
            return None
        if len(with_state) != len(overlaps):
            raise CheckpointError(
                f"checkpoint {self.path}: parameter {s.name!r} has optimizer state for only some of its slices"
            )
        first_rank, first = with_state[0][2], with_state[0][3]
        state: dict[str, tuple[str, Any]] = {}
        for key, record in first["optimizer"].items():
            if "slice" in record:
                state[key] = ("slice", self._assemble(s, _state_key(key, self.path), what=f"optimizer state {key}"))
            elif "tensor" in record:
                state[key] = ("tensor", (self.tensor(first_rank, record["tensor"]), record["on_param_device"]))
            else:
                state[key] = ("value", self.decode(first_rank, record["value"]))
        return state


def _state_key(key: str, path: Path) -> Any:
    def of(entry: dict[str, Any]) -> Any:
        record = entry.get("optimizer", {}).get(key)
        if not isinstance(record, dict) or "slice" not in record:
            raise CheckpointError(
                f"checkpoint {path}: a slice of {entry['name']!r} has no optimizer state {key!r} (the files are damaged)"
            )
        return record["slice"]

    return of


class _LazyTensors:
    """``decode_tree``'s tensor lookup: reads each tensor from the rank's file when the tree needs it."""

    def __init__(self, reader: CheckpointReader, rank: int) -> None:
        self.reader, self.rank = reader, rank

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.reader.tensor(self.rank, key)
