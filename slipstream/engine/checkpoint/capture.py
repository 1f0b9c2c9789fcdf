"""What one rank saves: :func:`capture` turns a :class:`CheckpointTarget` into a :class:`Payload`.

It runs on the training thread at a step boundary and returns the tensors to write (live
references; see snapshot.py for background writes) and the JSON metadata. Every piece of a
parameter is recorded as (name, global shape, box, flat range inside the box); see slices.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from slipstream.engine.checkpoint.format import FORMAT_NAME, FORMAT_VERSION, encode_tree, key_part
from slipstream.engine.checkpoint.target import CheckpointTarget
from slipstream.engine.checkpoint.tiling import piece_key
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.placement import global_shape_and_box
from slipstream.version import __version__

LOADER_STATE = "training_dataloader"


@dataclasses.dataclass
class Payload:
    """One rank's part of a checkpoint: ``tensors`` go to ``rankNNNNN.safetensors``, ``meta`` to its JSON."""

    rank: int
    tensors: Any  # dict[str, Tensor] of live tensors, or a GuardedTensors for a background write
    meta: dict[str, Any]
    manifest: dict[str, Any] | None = None  # rank 0: everything of the manifest but the file list
    config: dict[str, Any] | None = None  # rank 0


def capture(
    target: CheckpointTarget, rank: int, tag: str, client_state: dict[str, Any] | None, exclude_frozen: bool = False
) -> Payload:
    """``exclude_frozen``: leave out parameters that do not require gradients (files and manifest alike)."""
    tensors: dict[str, torch.Tensor] = {}
    slices = []
    frozen = {n for n, p in target.module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    for owned in target.shards.sharded_state():
        if owned.duplicate or owned.slice.name in frozen:  # another rank saves a duplicate
            continue
        state = target.shards.slice_optimizer_state(owned)
        for lo, hi, part in owned.slice.split():  # a packed piece is stored as one slice per box
            if part is not owned.slice:
                state_part = (
                    None if state is None else {k: _cut(v, owned.slice.numel, lo, hi) for k, v in state.items()}
                )
                owned_part = dataclasses.replace(owned, slice=part, value=owned.value[lo:hi])
                slices.append(_capture_slice(owned_part, state_part, tensors))
            else:
                slices.append(_capture_slice(owned, state, tensors))
    meta: dict[str, Any] = {"rank": rank, "world_size": target.world_size, "slices": slices}
    meta["rng"] = encode_tree(target.rng.state_dict(), "rng", tensors, "RNG state")
    meta["stateful"] = {
        name: encode_tree(obj.state_dict(), f"stateful/{key_part(name)}", tensors, f"{name}.state_dict()")
        for name, obj in target.extra.items()
    }
    payload = Payload(rank, tensors, meta)
    if rank == 0:
        meta["common"] = _capture_common(target, client_state, tensors)
        payload.manifest = _manifest_body(target, tag)
        if frozen:  # the manifest lists exactly what the files hold
            manifest = payload.manifest
            manifest["parameters"] = {n: v for n, v in manifest["parameters"].items() if n not in frozen}
            keys = manifest["state_dict_keys"]
            manifest["state_dict_keys"] = {k: v for k, v in keys.items() if v.get("param") not in frozen}
        payload.config = target.config
    return payload


def _cut(value: Any, numel: int, lo: int, hi: int) -> Any:
    """Elements ``[lo, hi)`` of a per-element optimizer tensor of a slice (scalars such as ``step`` stay whole)."""
    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel:
        return value.reshape(-1)[lo:hi]
    return value


def slice_key(prefix: str, owned: OwnedSlice) -> str:
    s = owned.slice
    return piece_key(prefix, s.name, (s.offsets, s.sizes), tuple(s.shape), s.start, FORMAT_VERSION)


def _capture_slice(owned: OwnedSlice, state: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    s = owned.slice
    key = slice_key("p", owned)
    tensors[key] = owned.value if owned.value.dtype == torch.float32 else owned.value.float()
    entry: dict[str, Any] = {**s.entry(), "key": key}
    if state:
        entry["optimizer"] = opt = {}
        for name, value in state.items():
            okey = f"{slice_key('o', owned)}/{key_part(name)}"
            if torch.is_tensor(value) and value.numel() == s.numel and value.dim() > 0:
                tensors[okey] = value.detach().reshape(-1)
                opt[name] = {"slice": okey}
            elif torch.is_tensor(value):
                tensors[okey] = value.detach()
                on_param = value.device == owned.optimizer_param.device  # type: ignore[union-attr]
                opt[name] = {"tensor": okey, "on_param_device": on_param}
            else:
                opt[name] = {"value": encode_tree(value, okey, tensors, f"optimizer state {name!r} of {s.name}")}
    return entry


# fmt: off
def _capture_common(target: CheckpointTarget, client_state: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """State every rank shares (saved once, by rank 0)."""
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state is a {type(client_state).__name__}; pass a dict (or None)")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in target.optimizer.param_groups]
    scheduler = target.scheduler
    buffers = {}
    for name, buf in persistent_buffers(target.module).items():
        buffers[name] = f"b/{key_part(name)}"
        tensors[buffers[name]] = buf.detach()
    return {
        "counters": target.counters.state_dict(),
        "optimizer_groups": encode_tree(groups, "common/optimizer_groups", tensors, "optimizer.param_groups"),
        "lr_scheduler": None if scheduler is None
        else encode_tree(scheduler.state_dict(), "common/lr_scheduler", tensors, "lr_scheduler.state_dict()"),
        "loss_scaler": encode_tree(target.loss_scaler.state_dict(), "common/loss_scaler", tensors, "loss scaler"),
        "client_state": encode_tree(client_state or {}, "common/client_state", tensors, "client_state"),
        "buffers": buffers,
    }
# fmt: on


def _manifest_body(target: CheckpointTarget, tag: str) -> dict[str, Any]:
    module = target.module
    names = {id(p): n for n, p in module.named_parameters()}
    counters = target.counters.record()
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created": time.time(),
        "slipstream_version": __version__,
        "torch_version": torch.__version__,
        "world_size": target.world_size,
        "zero_stage": target.zero_stage,
        "precision": target.precision,
        "global_steps": counters.global_steps,
        "micro_steps": counters.micro_steps,
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
        **({"mesh": {str(axis): int(size) for axis, size in target.mesh.items()}} if target.mesh else {}),
        **_module_entries(module, names),
    }


def merge_spread_manifest(payload: Payload, target: CheckpointTarget, exclude_frozen: bool = False) -> None:
    """Rank 0's manifest lists every rank's parameters and their state-dict keys. Collective.

    [Note: the manifest of a spread model] Under pipeline parallelism rank 0 holds only the first
    stage, so its own module cannot describe the checkpoint: each rank sends the manifest entries of
    its module (global shapes: a tensor-parallel piece is described as its whole tensor) and rank 0
    takes the union, its own entries first. Entries of one name agree (they describe one tensor).
    Persistent buffers are rank 0's only (it alone saves buffer values); the models this serves
    (transformers' GPT-2, Llama, Mixtral) keep no persistent buffers outside the first stage.
    """
    from slipstream import comm

    module = target.module
    names = {id(p): n for n, p in module.named_parameters()}
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    body = _module_entries(module, names)
    mine = {  # buffers are rank 0's alone: it saves their values (see _capture_common)
        "parameters": {n: v for n, v in body["parameters"].items() if n not in frozen},
        "state_dict_keys": {
            k: v for k, v in body["state_dict_keys"].items() if "param" in v and v["param"] not in frozen
        },
    }
    gathered = comm.gather_objects(mine, dst=0, tag="checkpoint manifest entries")
    if payload.manifest is None or gathered is None:
        return
    for part in gathered:
        for field in ("parameters", "state_dict_keys"):
            merged = payload.manifest[field]
            for key, value in part[field].items():
                merged.setdefault(key, value)


def _module_entries(module: torch.nn.Module, names: dict[int, str]) -> dict[str, Any]:
    """The manifest's description of ``module``: parameters (global shapes), persistent buffers, state-dict keys."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {
        "parameters": {
            n: {
                "shape": list(global_shape_and_box(p)[0]),
                "dtype": str(p.dtype).removeprefix("torch."),
                "trainable": n in trainable,
            }
            for n, p in module.named_parameters()
        },
        "buffers": {
            n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
            for n, b in persistent_buffers(module).items()
        },
        "state_dict_keys": state_dict_keys(module, names),
    }


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds, by their first name."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, m in module.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set and id(buf) not in seen:
                seen.add(id(buf))
                found[f"{prefix}.{name}" if prefix else name] = buf
    return found


def state_dict_keys(module: torch.nn.Module, param_names: dict[int, str]) -> dict[str, dict[str, str]]:
    """Every key of ``module.state_dict()`` in its order, mapped to the parameter or buffer it holds.

    Tied weights appear under each of their names (as in ``state_dict()``), all pointing at the one
    name ``named_parameters()`` gives; export writes a copy under each key.
    """
    buffer_names = {id(b): n for n, b in persistent_buffers(module).items()}
    keys: dict[str, dict[str, str]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                keys[dot + name] = {"param": param_names[id(p)]}
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                keys[dot + name] = {"buffer": buffer_names[id(buf)]}
    return keys
