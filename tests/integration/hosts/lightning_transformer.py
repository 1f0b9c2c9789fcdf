"""Lightning's ``examples/pytorch/basics/transformer.py``, on a local corpus instead of WikiText-2.

The stock example: ``LightningTransformer`` around ``lightning.pytorch.demos.Transformer``,
``nll_loss`` in ``training_step``, SGD in ``configure_optimizers``, a ``DataLoader`` over the
dataset and ``L.Trainer(...).fit``. The one-line switch is ``strategy="slipstream_stage_3"`` (after
``import slipstream.integrations.lightning``); ``--precision bf16-mixed`` maps into the config as
Lightning's DeepSpeed strategy maps it. ``fit`` returns after Lightning's own teardown (which moves
the module to the CPU), so a clean return is the example's exit 0.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, Dataset


class LocalText(Dataset):
    """WikiText2's interface (``vocab_size``, ``(input, target)`` blocks) over sequences that follow a learnable rule."""

    def __init__(self, blocks: int = 64, block_size: int = 16, vocab_size: int = 50) -> None:
        generator = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab_size, (blocks, 1), generator=generator)
        self.data = (starts + 7 * torch.arange(block_size + 1)) % vocab_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, :-1], self.data[index, 1:]


class LightningTransformer(L.LightningModule):
    def __init__(self, vocab_size: int = 33278) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
        self.losses: list[torch.Tensor] = []

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        output = self(inputs, target)
        loss = F.nll_loss(output.float(), target.view(-1))
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def main(argv: list[str]) -> dict | None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.strategy.startswith("slipstream"):
        import slipstream.integrations.lightning  # noqa: F401 - the switch registers the strategy names

    L.seed_everything(42)
    dataset = LocalText()
    dataloader = DataLoader(dataset, batch_size=2)
    model = LightningTransformer(vocab_size=dataset.vocab_size)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model=model, train_dataloaders=dataloader)
    losses = torch.stack(model.losses)
    dist.all_reduce(losses)
    return {"losses": [float(x) / dist.get_world_size() for x in losses]}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
