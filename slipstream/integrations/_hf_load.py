"""``from_pretrained(cls, path, config)``: a ``save_pretrained`` directory loaded straight into ZeRO-3 shards.

[Note: never the whole model] The model is built under ``slipstream.zero.Init`` (each rank keeps
only its shard), an inference engine is attached, and the checkpoint's tensors are copied in one
module at a time inside ``GatheredParameters(modifier_rank=0)``: rank 0 reads the file, every rank
keeps its shard. Training later replaces the inference engine (see ``_engine.py``). Files are read
as safetensors or with ``torch.load(weights_only=True)``: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream import comm
from slipstream.integrations._config import inference_config, read_config
from slipstream.integrations._engine import attach_inference_engine
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

_SINGLE = ("model.safetensors", "pytorch_model.bin")
_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _weight_files(path: Path) -> list[Path]:
    for name in _SINGLE:
        if (path / name).is_file():
            return [path / name]
    for name in _INDEX:
        if (path / name).is_file():
            index = json.loads((path / name).read_text())
            return [path / f for f in sorted(set(index["weight_map"].values()))]
    raise FileNotFoundError(f"from_pretrained: no {', '.join(_SINGLE + _INDEX)} in {path}")


def _read(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (all shards)."""
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        state.update(_read(file))
    return state


def from_pretrained(
    cls: Any, path: str | os.PathLike[str], config: dict[str, Any] | str | os.PathLike[str], **model_kwargs: Any
) -> Any:
    """``cls.from_pretrained(path)`` with the parameters partitioned as ``config``'s ZeRO-3 says. Collective.

    Returns the model (in eval mode, as ``from_pretrained`` does) with an inference engine attached,
    ready for ``SlipstreamTrainer`` (evaluation, or training at ZeRO-3) or for ``slipstream.initialize``.
    """
    ds_config = read_config(config)
    model_config = cls.config_class.from_pretrained(path, **model_kwargs)
    if ds_config.get("zero_optimization", {}).get("stage") != 3:
        return cls.from_pretrained(path, config=model_config)
    probe = type("Probe", (), {"config": model_config})()  # the hidden size for "auto" bucket sizes
    engine_config = inference_config(ds_config, probe)
    with slipstream.zero.Init(config=engine_config):
        model = cls(model_config)
    engine = slipstream.initialize(model, engine_config, inference=True)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = read_weights(path) if rank0 else {}
    missing, seen = [], set()
    for module_name, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]  # tied: once
        seen.update(id(p) for _, p in params)
        if not params:
            continue
        with slipstream.zero.GatheredParameters([p for _, p in params], modifier_rank=0), torch.no_grad():
            if rank0:
                for name, p in params:
                    key = f"{module_name}.{name}" if module_name else name
                    if key in state:
                        p.copy_(state[key].to(p.dtype))
                    else:
                        missing.append(key)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            value = state.get(name) if rank0 else None
            flag = torch.tensor([value is not None], dtype=torch.uint8)
            if dist.is_initialized():
                comm.broadcast(flag, 0, tag=f"from_pretrained: buffer {name} present").wait()
            if flag.item():
                source = value.to(buffer.dtype) if value is not None else torch.empty_like(buffer)
                if dist.is_initialized():
                    comm.broadcast(source, 0, tag=f"from_pretrained: buffer {name}").wait()
                buffer.copy_(source)
    if missing:
        logger.warning("from_pretrained: not in %s, kept as initialised: %s", path, ", ".join(missing[:8]))
    attach_inference_engine(model, engine)
    model.eval()
    return model
