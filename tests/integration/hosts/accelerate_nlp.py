"""Accelerate's ``examples/complete_nlp_example.py``, step for step, on local sentence pairs instead of GLUE MRPC.

The stock flow: ``Accelerator(cpu=..., mixed_precision=..., project_dir=...)``, a BERT sequence
classifier, ``AdamW`` and ``get_linear_schedule_with_warmup`` built by the script, one ``prepare``
call, a loop that divides the loss by the accumulation steps and steps every few batches,
``save_state`` per epoch (``epoch_N``), ``--resume_from_checkpoint`` with ``skip_first_batches``,
and accuracy from ``gather_for_metrics`` predictions. ``--slipstream`` is the one-line switch
(``Accelerator`` from Slipstream; the DeepSpeed config from ``ACCELERATE_DEEPSPEED_CONFIG_FILE``).
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate.utils import set_seed
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from tests.integration.hosts.fixtures import WORDS


def pairs(count: int, seed: int) -> list[tuple[str, str, int]]:
    """MRPC's shape: two sentences and whether the second continues the first's rule (label 1) or not."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        start, label = (
            int(torch.randint(len(WORDS), (), generator=generator)),
            int(torch.randint(2, (), generator=generator)),
        )
        step = 7 if label else 3
        first = [WORDS[(start + 7 * k) % len(WORDS)] for k in range(6)]
        second = [WORDS[(start + 42 + step * k) % len(WORDS)] for k in range(6)]
        rows.append((" ".join(first), " ".join(second), label))
    return rows


def get_dataloaders(accelerator, tokenizer, batch_size: int):
    def collate(rows):
        encoded = tokenizer([r[0] for r in rows], [r[1] for r in rows], padding="longest", return_tensors="pt")
        encoded["labels"] = torch.tensor([r[2] for r in rows])
        return encoded

    train = DataLoader(pairs(64, 1), shuffle=True, collate_fn=collate, batch_size=batch_size)
    evaluation = DataLoader(pairs(16, 2), shuffle=False, collate_fn=collate, batch_size=batch_size)
    return train, evaluation


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--checkpointing_steps", default="epoch")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--slipstream", action="store_true")
    parser.add_argument("--schedule_once", action="store_true")
    args = parser.parse_args(argv)
    if args.slipstream:  # the one-line switch
        from slipstream.integrations.accelerate import SlipstreamAccelerator as Accelerator
    else:
        from accelerate import Accelerator
    # DeepSpeed's semantics, which the switch keeps: the schedule steps once per optimizer step. Plain Accelerate steps
    # it once per *process* per step unless told step_scheduler_with_optimizer=False (only the plain run passes it).
    once = {"step_scheduler_with_optimizer": False} if args.schedule_once else {}
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision, project_dir=args.output_dir, **once)
    lr, num_epochs, seed, batch_size = 2e-3, args.num_epochs, 42, 4
    gradient_accumulation_steps = max(1, batch_size // 16)  # the example's MAX_GPU_BATCH_SIZE rule: 1 here
    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, tokenizer, batch_size)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            num_labels=2,
        )
    )
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=2,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        starting_epoch = int(os.path.basename(args.resume_from_checkpoint).replace("epoch_", "")) + 1

    losses, accuracies = [], []
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        active_dataloader = train_dataloader
        if resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        for step, batch in enumerate(active_dataloader):
            outputs = model(**batch)
            loss = outputs.loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(outputs.loss.detach(), reduction="mean").item())
        if args.checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
            accelerator.wait_for_everyone()

        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1), batch["labels"]))
            correct += int((predictions == references).sum())
            total += references.numel()
        accuracies.append(correct / total)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total}")
    return {"losses": losses, "accuracies": accuracies}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
