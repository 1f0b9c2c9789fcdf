"""A slipstream checkpoint back into DeepSpeed's universal layout, so nobody is locked in.

[Note: why universal] DeepSpeed loads its ZeRO partition files only at the world size that wrote
them; its *universal* checkpoints (``ds_to_universal``'s output: one folder of whole tensors per
parameter) load at any world size and stage with ``"checkpoint": {"load_universal": true}``. So the
export writes that layout, one parameter at a time:

    <out>/latest_universal, <out>/latest    the tag
    <out>/<tag>/zero/<name>/fp32.pt         {"param": fp32 master}, likewise exp_avg.pt, exp_avg_sq.pt
    <out>/<tag>/zero/<name>/step.pt         the optimizer step
    <out>/<tag>/zero/optimizer_state.pt     the parameter groups' hyperparameters, ds_version
    <out>/<tag>/mp_rank_00_model_states.pt  module state dict (fp32), names and shapes, tied aliases,
                                            LR scheduler, counters, client state (and the ZeRO-3 name)

Every file is a ``torch.save`` of dicts, lists, numbers and tensors only, so
``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from slipstream.engine.checkpoint.reader import CheckpointError, CheckpointReader, resolve
from slipstream.utils.pieces import ParamSlice

DEEPSPEED_VERSION = "0.19.8"  # the layout written (DeepSpeed 0.14-0.19 read it)


def export_deepspeed(checkpoint: str | Path, out: str | Path, tag: str | None = None) -> Path:
    """Write the slipstream checkpoint (``latest``, or ``tag``) as a DeepSpeed universal checkpoint under ``out``."""
    path = resolve(checkpoint, tag)
    if path is None:
        raise CheckpointError(f"no checkpoint in {checkpoint}")
    reader = CheckpointReader(path)
    out = Path(out)
    if out.resolve().is_relative_to(path.resolve()):
        raise CheckpointError(f"convert: {out} lies inside the checkpoint {path}; write the DeepSpeed copy elsewhere")
    steps = reader.manifest["global_steps"]
    ds_tag = f"global_step{steps}"
    part = out / f".part-{ds_tag}"
    shutil.rmtree(part, ignore_errors=True)
    (part / "zero").mkdir(parents=True)
    module: dict[str, torch.Tensor] = {}
    shapes: collections.OrderedDict[str, torch.Size] = collections.OrderedDict()
    step: Any = None
    for name, info in reader.manifest["parameters"].items():
        shape = tuple(info["shape"])
        whole = ParamSlice(name, shape, 0, math.prod(shape))
        module[name] = reader.read_param(whole).view(shape).clone()
        shapes[name] = torch.Size(shape)
        folder = part / "zero" / name
        folder.mkdir()
        torch.save({"param": module[name]}, folder / "fp32.pt")
        for key, (kind, value) in (reader.read_optimizer_state(whole) or {}).items():
            if kind == "slice":
                torch.save({"param": value.view(shape)}, folder / f"{key}.pt")
            elif key == "step":
                step = value[0] if kind == "tensor" else value
                torch.save(step, folder / "step.pt")
    common = reader.common()
    buffers = {name: reader.tensor(0, key) for name, key in common["buffers"].items()}
    torch.save(_optimizer_state(reader, common, step), part / "zero" / "optimizer_state.pt")
    state = _model_state(reader, common, module, buffers, shapes)
    for name in (
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
    ):  # ZeRO 0-2 and ZeRO-3 names
        torch.save(state, part / name)
    final = out / ds_tag
    if final.exists():
        shutil.rmtree(final)
    os.replace(part, final)
    for latest in ("latest_universal", "latest"):
        (out / latest).write_text(ds_tag)
    return final


def _optimizer_state(reader: CheckpointReader, common: dict[str, Any], step: Any) -> dict[str, Any]:
    """The global optimizer state: hyperparameters as ZeRO 1/2 read them, and nested as ZeRO-3 reads them (with the step)."""
    groups = [{**g, "params": [i]} for i, g in enumerate(reader.decode(0, common["optimizer_groups"]))]
    config = _config(reader)
    return {
        "param_groups": groups,
        "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups},
        "ds_version": DEEPSPEED_VERSION,
        "zero_stage": reader.manifest["zero_stage"],
        "clip_grad": float(config.get("gradient_clipping", 0.0) or 0.0),
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": 1,
    }


def _model_state(
    reader: CheckpointReader,
    common: dict[str, Any],
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    shapes: collections.OrderedDict[str, torch.Size],
) -> dict[str, Any]:
    module: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    shared = {}
    for key, source in reader.manifest["state_dict_keys"].items():
        if "param" in source:
            module[key] = params[source["param"]]
            if key != source["param"]:
                shared[key] = source["param"]
        else:
            module[key] = buffers[source["buffer"]]
    counters = reader.decode(0, common["counters"])
    client = reader.decode(0, common["client_state"])
    scheduler = None if common["lr_scheduler"] is None else reader.decode(0, common["lr_scheduler"])
    state = {
        "module": module,
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": [shapes],
        "frozen_param_shapes": None,
        "shared_params": shared,
        "frozen_param_fragments": None,
        "lr_scheduler": scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": counters["skipped_steps"],
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": _config(reader),
        "ds_version": DEEPSPEED_VERSION,
    }
    clashes = sorted(set(client) & set(state)) if isinstance(client, dict) else []
    if clashes:
        raise CheckpointError(
            f"convert: client_state key {clashes[0]!r} is one DeepSpeed's model-states file uses itself"
        )
    state.update(client if isinstance(client, dict) else {})
    return state


def _config(reader: CheckpointReader) -> dict[str, Any]:
    from slipstream.engine.checkpoint.reader import read_json

    file = reader.path / "config.json"
    config = read_json(file, str(reader.path)) if file.is_file() else {}
    return config if isinstance(config, dict) else {}
