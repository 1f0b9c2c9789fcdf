"""A tiny single-process engine and tools to damage its checkpoints consistently (CRCs kept valid)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import slipstream


class Tiny(torch.nn.Module):
    def __init__(self, empty: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 2)
        if empty:
            self.nothing = torch.nn.Parameter(torch.zeros(0, 3))
        self.register_buffer("shift", torch.tensor([0.5, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x))) + self.shift
        if hasattr(self, "nothing"):
            out = out + self.nothing.sum()
        return out.pow(2).mean()


def config(stage: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        **extra,
    }


def engine(seed: int = 0, stage: int = 1, empty: bool = False, **extra: Any) -> Any:
    torch.manual_seed(seed)
    return slipstream.initialize(Tiny(empty), config(stage, **extra))


def train(eng: Any, steps: int = 2, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = eng(torch.randn(2, 4, generator=g).to(eng.module.a.weight.dtype))
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def snapshot(eng: Any) -> dict[str, Any]:
    """Everything a load may change, copied: weights, optimizer state and groups, counters, scheduler, scaler."""
    state = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    state.update({f"buf:{n}": b.clone() for n, b in eng.module.named_buffers()})
    opt = eng.optimizer.state_dict()
    state["opt"] = {
        k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()} for k, v in opt["state"].items()
    }
    state["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    state["counters"] = (eng.global_steps, eng.micro_steps, eng.global_samples, eng.skipped_steps)
    state["sched"] = eng.lr_scheduler.state_dict() if eng.lr_scheduler is not None else None
    state["scaler"] = eng.loss_scaler.state_dict()
    return state


def same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def rewrite_json(ckpt: Path, name: str, edit: Any) -> None:
    """Apply ``edit`` to a JSON file of the checkpoint and record its new size and CRC-32 in the manifest."""
    path = ckpt / name
    data = edit(json.loads(path.read_text()))
    raw = json.dumps(data).encode()
    path.write_bytes(raw)
    if name != "manifest.json":
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"][name] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))


def rewrite_tensor(ckpt: Path, rank: int, key: str, value: torch.Tensor) -> None:
    """Replace one tensor of a rank's safetensors file, keeping every record consistent."""
    from safetensors.torch import load_file

    from slipstream.engine.checkpoint.format import write_safetensors

    stem = f"rank{rank:05d}"
    tensors = {k: v.clone() for k, v in load_file(ckpt / f"{stem}.safetensors").items()}  # not the mmap we overwrite
    tensors[key] = value
    record = write_safetensors(ckpt / f"{stem}.safetensors", tensors)

    def edit(meta: dict) -> dict:
        meta["tensor_file"] = record
        return meta

    rewrite_json(ckpt, f"{stem}.json", edit)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][f"{stem}.safetensors"] = record
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def eng() -> Any:
    """One trained engine per test module (import this fixture by name)."""
    e = engine()
    train(e)
    yield e
    e.close()
