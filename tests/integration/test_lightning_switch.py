"""Lightning on Slipstream (issue 15): Trainer(strategy="slipstream_stage_2") trains to the reference and resumes."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.reference import global_batches, gpt2_loss, micro_batch, tiny_gpt2, train_reference

pytest.importorskip("lightning")

MB, STEPS_PER_EPOCH = 2, 2


def _body(strategy: str, epochs: int, save_to: str | None = None, resume_from: str | None = None) -> list[float] | None:
    import lightning.pytorch as pl

    import slipstream.integrations.lightning  # noqa: F401 - registers the strategy names

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(STEPS_PER_EPOCH, MB * world)
    mine = [micro_batch(b, 0, rank, world, MB) for b in batches]
    losses: list[torch.Tensor] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2(seed=0)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = gpt2_loss(self.model, batch)
            losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(mine, batch_size=None)
    trainer.fit(Module(), loader, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    stacked = torch.stack(losses) if losses else torch.zeros(0)
    dist.all_reduce(stacked)
    return [float(x) / world for x in stacked] if rank == 0 else None


def test_lightning_stage2_trains_to_the_reference_and_resumes() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="slipstream-lightning-"), "epoch0.ckpt")
    full = run_distributed(2, _body, "slipstream_stage_2", 2)[0]
    batches = global_batches(STEPS_PER_EPOCH, MB * 2)
    ref = train_reference(tiny_gpt2(seed=0), batches * 2, lr=1e-3, weight_decay=0.0, clip=1.0)
    torch.testing.assert_close(torch.tensor(full), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    first = run_distributed(2, _body, "slipstream_stage_2", 1, path)[0]
    assert first == full[:STEPS_PER_EPOCH]
    resumed = run_distributed(2, _body, "slipstream_stage_2", 2, None, path)[0]
    assert resumed == full[STEPS_PER_EPOCH:], (resumed, full)
