"""Issue 14 on 2 ranks: a tp 2 or ep 2 checkpoint records its mesh, ``inspect`` names its boxes, and no lock file is left."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import slipstream
from tests.distributed.tp_cases import MLP_PARTITION, TinyMLPLM, config
from tests.harness import run_distributed
from tests.reference import tiny_mixtral


def _engine(kind: str) -> Any:
    if kind == "tp":
        return slipstream.initialize(
            TinyMLPLM(hidden=16, n_layer=2),
            config(micro=2, dp=1, tp=2, stage=1, tensor={"partition_config": MLP_PARTITION}),
        )
    settings = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    return slipstream.initialize(tiny_mixtral(hidden=32, intermediate=32, vocab=64, positions=8), settings)


def _body(kind: str, directory: str) -> dict[str, Any]:
    engine = _engine(kind)
    tokens = torch.randint(
        0, 64, (engine.train_micro_batch_size_per_gpu(), 8), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    path = Path(engine.save_checkpoint(directory, tag="t"))
    engine.close()
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    from slipstream.engine.checkpoint.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argparse.Namespace(checkpoint_command="inspect", dir=directory, tag=None, verify=True)) == 0
    return {
        "mesh": json.loads((path / "manifest.json").read_text())["mesh"],
        "entries": sorted(p.name for p in Path(directory).iterdir()),
        "inspect": out.getvalue(),
    }


@pytest.mark.parametrize(
    ("kind", "mesh", "shown", "boxes"),
    [
        (
            "tp",
            {"pp": 1, "dp": 1, "cp": 1, "sp": 1, "tp": 2, "ep": 1},
            "pp 1 × dp 1 × cp 1 × sp 1 × tp 2, ep 1",
            "tensor-parallel blocks, tp 2",
        ),
        (
            "ep",
            {"pp": 1, "dp": 2, "cp": 1, "sp": 1, "tp": 1, "ep": 2},
            "pp 1 × dp 2 × cp 1 × sp 1 × tp 1, ep 2",
            "expert-parallel slices, ep 2",
        ),
    ],
    ids=["tp2", "ep2"],
)
def test_the_mesh_is_recorded_and_inspected(
    tmp_path: Path, kind: str, mesh: dict[str, int], shown: str, boxes: str
) -> None:
    found = run_distributed(2, _body, kind, str(tmp_path / kind))[0]
    assert found["mesh"] == mesh
    assert found["entries"] == ["latest", "t"]  # no .lock-t, no .tmp-t
    assert f"mesh            {shown}\n" in found["inspect"]
    assert f"in boxes ({boxes})\n" in found["inspect"], found["inspect"]
