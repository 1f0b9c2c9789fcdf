"""Make ``tests/data/ckpt_v1_zero2_world2``: a checkpoint written by the format-1 code of main 5c4955e.

Run from the repository root: ``PYTHONPATH=. python tests/data/make_v1_checkpoint.py``. Two gloo
ranks train a tiny MLP (a LayerNorm, a persistent buffer, AdamW, WarmupLR) for two optimizer steps
at ZeRO stage 2 and save; the uninterrupted run then takes two more steps, and their losses and
final weights go into ``expected.json`` so tests/unit/test_checkpoint_compat.py can check that the
old checkpoint still loads and continues the same trajectory at another world size.

[Note: keep the fixture] Never regenerate it with newer code: its point is to be bytes that the
old writer produced.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
TARGET = HERE / "ckpt_v1_zero2_world2"
TAG = "global_step2"
SAVED_STEPS, MORE_STEPS, GLOBAL_BATCH = 2, 2, 4


class TinyMLP(torch.nn.Module):
    """Small enough for a fixture of a few KB; has a LayerNorm and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 3)
        self.register_buffer("offset", torch.linspace(-1, 1, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.out(torch.tanh(self.norm(self.inp(x)))) + self.offset
        return torch.nn.functional.cross_entropy(logits, y)


def build_model(seed: int = 0) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def config(world: int, stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
    }


def train(engine: object, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """One optimizer step per global batch; this rank's micro-batches of 1 sample; global mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in data:
        total = torch.zeros(())
        per_rank = GLOBAL_BATCH // world
        for i in range(per_rank):
            j = rank * per_rank + i
            loss = engine(x[j : j + 1], y[j : j + 1])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / GLOBAL_BATCH)
    return losses


def _body() -> dict | None:
    import slipstream

    data = batches(SAVED_STEPS + MORE_STEPS)
    engine = slipstream.initialize(build_model(), config(dist.get_world_size(), 2))
    train(engine, data[:SAVED_STEPS])
    engine.save_checkpoint(str(TARGET), tag=TAG, client_state={"note": "format v1 fixture", "step": SAVED_STEPS})
    losses = train(engine, data[SAVED_STEPS:])
    final = engine.consolidated_state_dict()
    engine.close()
    if dist.get_rank() != 0:
        return None
    return {"losses_after_resume": losses, "final_weights": {k: v.reshape(-1).tolist() for k, v in final.items()}}


def main() -> None:
    from tests.harness import run_distributed

    if TARGET.exists():
        shutil.rmtree(TARGET)
    result = run_distributed(2, _body)[0]
    (TARGET / TAG / "config.json").exists() or sys.exit("no checkpoint written")
    (HERE / "ckpt_v1_expected.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {TARGET} and ckpt_v1_expected.json")


if __name__ == "__main__":
    main()
