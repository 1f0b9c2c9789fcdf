"""Placed pieces (utils/placement.py): what tensor, pipeline and expert parallelism hand ZeRO.

Two ranks each hold half of the rows of one weight ``w`` (a piece of a 4×4 global tensor, in its
own one-rank sharding group) and a replicated vector ``s``. Each rank's loss is its rows' part of
the global loss, so the global model's gradient is each rank's piece gradient (for ``w``) and their
mean (for ``s``): exactly what training a 4×4 model in one process gives. With a small clipping
threshold the step depends on the global norm, which must count both pieces and ``s`` once; the
checkpoint must hold each element once, ``w`` as two boxes that assemble into the global tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slipstream
import slipstream.zero
from slipstream.engine.checkpoint.reader import CheckpointReader
from slipstream.utils.placement import place
from tests.harness import run_distributed

STEPS, LR, CLIP, ROWS = 4, 0.05, 0.5, 2


def _global_init() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g), torch.randn(3, generator=g)


class _Pieces(torch.nn.Module):
    def __init__(self, w: torch.Tensor, s: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())
        self.s = torch.nn.Parameter(s.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.w.T) ** 2).sum() + 0.5 * (self.s**2).sum()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(STEPS)]


def _reference() -> tuple[list[float], torch.Tensor, torch.Tensor]:
    w, s = _global_init()
    model = _Pieces(w, s)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for x in _inputs():
        model(x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms, model.w.detach(), model.s.detach()


def _body(stage: int, save_dir: str) -> dict:
    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    w, s = _global_init()
    model = _Pieces(w[ROWS * rank : ROWS * (rank + 1)], s)
    place(model.w, (4, 4), (ROWS * rank, 0))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    groups = [{"params": [model.w], "process_group": own}, {"params": [model.s]}]
    engine = slipstream.initialize(model, config, model_parameters=groups)
    norms = []
    for x in _inputs():
        engine.backward(engine(x))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    consolidated = engine.consolidated_state_dict()
    engine.save_checkpoint(save_dir, tag="end")
    dist.barrier()
    with slipstream.zero.GatheredParameters([engine.module.w, engine.module.s]) if stage == 3 else _nothing():
        values = engine.module.w.detach().clone(), engine.module.s.detach().clone()
    engine.close()
    # Load into the other layout: each rank now holds the rows the other one saved (boxes re-cut on read).
    swapped = _Pieces(torch.zeros(ROWS, 4), torch.zeros(3))
    place(swapped.w, (4, 4), (ROWS * (1 - rank), 0))
    again = slipstream.initialize(
        swapped, config, model_parameters=[{"params": [swapped.w], "process_group": own}, {"params": [swapped.s]}]
    )
    again.load_checkpoint(save_dir, tag="end")
    reloaded = again.consolidated_state_dict()
    again.close()
    return {"norms": norms, "w": values[0], "s": values[1], "consolidated": consolidated, "reloaded": reloaded}


class _nothing:
    def __enter__(self) -> None: ...
    def __exit__(self, *args: object) -> None: ...


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_placed_pieces_train_save_and_count_once(stage: int, tmp_path: Path) -> None:
    results = run_distributed(2, _body, stage, str(tmp_path))
    norms, w, s = _reference()
    for rank, r in enumerate(results):
        assert r["norms"] == pytest.approx(norms, rel=1e-5)  # both pieces and s, each once
        torch.testing.assert_close(r["w"], w[ROWS * rank : ROWS * (rank + 1)], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["s"], s, rtol=1e-5, atol=1e-6)
    assert results[1]["consolidated"] is None
    assert list(results[0]["consolidated"]) == ["w", "s"]  # whole tensors under their own names, on rank 0
    torch.testing.assert_close(results[0]["consolidated"]["w"], w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["consolidated"]["s"], s, rtol=1e-5, atol=1e-6)
    for name in ("w", "s"):  # the swapped layout restored the same global tensors
        torch.testing.assert_close(results[0]["reloaded"][name], results[0]["consolidated"][name], rtol=0, atol=0)
    reader = CheckpointReader(tmp_path / "end")
    assert reader.manifest["parameters"]["w"]["shape"] == [4, 4]  # the global shape, not a piece's
    torch.testing.assert_close(reader.full_param("w"), w, rtol=1e-5, atol=1e-6)  # two boxes, assembled
    torch.testing.assert_close(reader.full_param("s"), s, rtol=1e-5, atol=1e-6)  # saved once
