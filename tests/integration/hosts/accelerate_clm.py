"""Accelerate's ``examples/by_feature/deepspeed_with_config_support.py``, step for step, on a local corpus.

The flow is the stock example's: an ``Accelerator`` with the accumulation steps, ``datasets``
reading text files, tokenize and group into blocks under ``main_process_first``, ``DummyOptim`` /
``DummyScheduler`` chosen by reading ``accelerator.state.deepspeed_plugin.deepspeed_config``, one
``prepare`` call, ``accumulate`` / ``backward`` / ``step`` loop, perplexity through
``gather_for_metrics``, ``save_state`` of the best epoch, ``load_state`` of it and the check that
its perplexity is the best one, then ``unwrap_model(...).save_pretrained(state_dict=
accelerator.get_state_dict(model))`` on every rank. ``--slipstream`` is the documented one-line
switch (the import of ``Accelerator``, ``DummyOptim`` and ``DummyScheduler`` from Slipstream; the DeepSpeed config comes from
``ACCELERATE_DEEPSPEED_CONFIG_FILE`` as ``accelerate launch`` sets it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from itertools import chain

import torch
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("train_file", "validation_file", "config_name", "tokenizer_name", "output_dir"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slipstream", action="store_true")
    return parser.parse_args(argv)


def evaluate(model, eval_dataloader, accelerator, batch_size: int):
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(batch_size)))
    eval_loss = torch.mean(torch.cat(losses))
    return math.exp(eval_loss), eval_loss


def main(argv: list[str]) -> dict:
    args = parse(argv)
    if args.slipstream:  # the one-line switch (the stock example imports the dummies from accelerate.utils)
        from slipstream.integrations.accelerate import DummyOptim, DummyScheduler
        from slipstream.integrations.accelerate import SlipstreamAccelerator as Accelerator
    else:  # accelerate.utils exports the dummies only where deepspeed is installed; this is where they live
        from accelerate import Accelerator
        from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)

    extension = "text"
    data_files = {"train": args.train_file, "validation": args.validation_file}
    raw_datasets = load_dataset(extension, data_files=data_files, keep_linebreaks=True)
    config = AutoConfig.from_pretrained(args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)
    model.resize_token_embeddings(len(tokenizer))

    column_names = raw_datasets["train"].column_names
    with accelerator.main_process_first():
        tokenized = raw_datasets.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=column_names)
    block_size = args.block_size

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]
    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    plugin = accelerator.state.deepspeed_plugin
    optimizer_cls = torch.optim.AdamW if plugin is None or "optimizer" not in plugin.deepspeed_config else DummyOptim
    optimizer = optimizer_cls(grouped, lr=args.learning_rate)

    steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    if plugin is None or "scheduler" not in plugin.deepspeed_config:
        lr_scheduler = get_scheduler(
            args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps,
            num_training_steps=args.max_train_steps,
        )
    else:
        lr_scheduler = DummyScheduler(
            optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=args.num_warmup_steps
        )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    completed_steps, best_metric, best_checkpoint, losses, perplexities = 0, None, None, [], []
    for _epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    completed_steps += 1
            losses.append(accelerator.reduce(loss.detach().clone(), reduction="mean").item())
            if completed_steps >= args.max_train_steps:
                break
        perplexity, eval_loss = evaluate(model, eval_dataloader, accelerator, args.per_device_eval_batch_size)
        perplexities.append(perplexity)
        if best_metric is None or best_metric > perplexity:
            best_metric = perplexity
            best_checkpoint = os.path.join(args.output_dir, "best_checkpoint")
            accelerator.save_state(best_checkpoint)

    accelerator.wait_for_everyone()  # not in the stock example: plain Accelerate's save_state returns on rank 0 before its files are complete
    accelerator.load_state(best_checkpoint)
    perplexity, eval_loss = evaluate(model, eval_dataloader, accelerator, args.per_device_eval_batch_size)
    if perplexity != best_metric:
        raise AssertionError(
            f"Best metric {best_metric} does not match the metric {perplexity} of the loaded best model."
        )

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"perplexity": perplexity, "eval_loss": eval_loss.item()}, f)
    accelerator.wait_for_everyone()
    return {"losses": losses, "perplexities": perplexities, "best": best_metric}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
