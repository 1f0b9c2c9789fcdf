"""Hugging Face Trainer on Slipstream (issue 15): SlipstreamTrainer with transformers' ZeRO-2/ZeRO-3 "auto"
templates trains to the single-process reference, resumes bit for bit, saves loadable full weights."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.reference import VOCAB, global_batches, tiny_gpt2

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

CONFIGS = Path(__file__).parent / "configs"
MB, PER_RANK, LR = 2, 10, 1e-3  # 5 micro-batches per rank and epoch


def _dataset(n: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row, "labels": row} for row in global_batches(1, n, seed=seed)[0]]


def _arguments(config_path: Path, out: Path, gas: int, epochs: int, save_steps: int | None) -> object:
    from transformers import HfArgumentParser

    from slipstream.integrations.transformers import SlipstreamTrainingArguments

    argv = [
        "--output_dir",
        str(out),
        "--deepspeed",
        str(config_path),
        "--per_device_train_batch_size",
        str(MB),
        "--per_device_eval_batch_size",
        str(MB),
        "--gradient_accumulation_steps",
        str(gas),
        "--learning_rate",
        str(LR),
        "--num_train_epochs",
        str(epochs),
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--use_cpu",
        "true",
        "--seed",
        "0",
        "--disable_tqdm",
        "true",
        "--save_strategy",
        "steps" if save_steps else "no",
        "--save_steps",
        str(save_steps or 500),
        "--dataloader_num_workers",
        "0",
    ]
    (args,) = HfArgumentParser(SlipstreamTrainingArguments).parse_args_into_dataclasses(argv)
    return args


def _config_file(template: str, stage: int, out: Path) -> Path:
    config = json.loads((CONFIGS / f"hf_ds_config_{template}.json").read_text())
    config["zero_optimization"]["stage"] = stage
    if stage == 0:  # offload moves partitioned optimizer state: there is none at stage 0
        config["zero_optimization"].pop("offload_optimizer")
    path = out / f"ds_config_rank{dist.get_rank()}.json"
    path.write_text(json.dumps(config))
    return path


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _train_body(
    template: str,
    stage: int,
    gas: int,
    epochs: int = 1,
    save_steps: int | None = None,
    resume: str | None = None,
    out: str | None = None,
) -> dict:
    from slipstream.integrations.transformers import SlipstreamTrainer

    _reset_accelerate()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(out or tempfile.mkdtemp(prefix="slipstream-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    args = _arguments(_config_file(template, stage, root), root / "run", gas, epochs, save_steps)
    seen: list[torch.Tensor] = []

    def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
        seen.append(batch["input_ids"].clone())
        return batch

    trainer = SlipstreamTrainer(
        model=tiny_gpt2(seed=0), args=args, train_dataset=_dataset(PER_RANK * world), data_collator=collate
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    all_seen: list[list[torch.Tensor]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(all_seen, seen)
    result = {"losses": losses, "steps": trainer.state.global_step, "seen": all_seen, "out": str(root)}
    if resume is None and save_steps is not None:
        trainer.save_model(str(root / "final"))
        result["weights"] = trainer.model_wrapped.consolidated_state_dict()
    trainer.accelerator.free_memory()
    return result if rank == 0 else {}


def _warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR (log warmup) with the templates' auto values: 1 warmup step, raised to 2.

    Optimizer step ``s`` runs at the schedule's iteration ``s - 1`` (the construction sets iteration -1).
    """
    it = step - 1
    return LR * (0.0 if it < 0 else math.log(it + 1) / math.log(2) if it < 2 else 1.0)


def _reference_losses(seen: list[list[torch.Tensor]], gas: int, epochs: int) -> list[float]:
    """Plain single-process AdamW + clip 1.0 on the global batches the ranks consumed, window by window."""
    per_epoch = len(seen[0]) // epochs
    windows = [min(gas, per_epoch - start) for start in range(0, per_epoch, gas)] * epochs
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses, cursor = [], 0
    for step, size in enumerate(windows):
        tokens = torch.cat([seen[r][i] for i in range(cursor, cursor + size) for r in range(len(seen))])
        cursor += size
        for group in optimizer.param_groups:
            group["lr"] = _warmup_lr(step)
        # The Trainer normalises by the label count of the whole window (num_items_in_batch), as here.
        loss = model(input_ids=tokens, labels=tokens, num_items_in_batch=tokens.numel()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(("template", "stage"), [("zero2", 0), ("zero2", 1), ("zero2", 2), ("zero3", 3)])
@pytest.mark.parametrize("gas", [1, 2])
def test_trainer_losses_match_the_single_process_reference(template: str, stage: int, gas: int) -> None:
    result = run_distributed(2, _train_body, template, stage, gas)[0]
    assert result["steps"] == math.ceil(PER_RANK / MB / gas)  # 5 micro-batches, gas 2 -> 3 optimizer steps per epoch
    ref = _reference_losses(result["seen"], gas, epochs=1)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)


def _saved_model_body(saved: str, template: str) -> dict:
    from transformers import GPT2LMHeadModel

    import slipstream
    from slipstream.integrations.transformers import SlipstreamTrainer, from_pretrained

    _reset_accelerate()
    root = Path(tempfile.mkdtemp(prefix="slipstream-hf-eval-"))
    config_path = _config_file(template, 3, root)
    model = from_pretrained(GPT2LMHeadModel, saved, str(config_path))
    loaded = {}
    for name, p in model.named_parameters():
        with slipstream.zero.GatheredParameters([p]):
            loaded[name] = p.detach().clone()
    args = _arguments(config_path, root / "run", 1, 1, None)
    trainer = SlipstreamTrainer(model=model, args=args, eval_dataset=_dataset(8, seed=99))
    metrics = trainer.evaluate()  # before train(), on a model partitioned at load
    trainer.accelerator.free_memory()
    return {"loaded": loaded, "eval_loss": metrics["eval_loss"]} if dist.get_rank() == 0 else {}


def test_stage3_resume_is_bit_for_bit_and_save_model_loads_with_from_pretrained() -> None:
    out = tempfile.mkdtemp(prefix="slipstream-hf-stage3-")
    full = run_distributed(2, _train_body, "zero3", 3, 2, 2, 2, None, out)[0]
    assert full["steps"] == 6  # 2 epochs of 3 optimizer steps
    checkpoint = os.path.join(out, "run", "checkpoint-4")  # inside epoch 2
    resumed = run_distributed(2, _train_body, "zero3", 3, 2, 2, 2, checkpoint, out)[0]
    # log_history comes back with the checkpoint's first 4 entries; the last 2 are trained again.
    assert len(resumed["losses"]) == 6 and resumed["steps"] == 6
    assert resumed["losses"][4:] == full["losses"][4:], (resumed["losses"], full["losses"])
    assert len(resumed["seen"][0]) == 3  # only the 3 micro-batches after the checkpoint were drawn

    saved = os.path.join(out, "final")
    assert os.path.isfile(os.path.join(saved, "model.safetensors")) and os.path.isfile(
        os.path.join(saved, "config.json")
    )
    result = run_distributed(2, _saved_model_body, saved, "zero3")[0]
    for name, value in full["weights"].items():
        torch.testing.assert_close(result["loaded"][name], value, rtol=0, atol=0, msg=name)
    from transformers import GPT2LMHeadModel

    plain = GPT2LMHeadModel.from_pretrained(saved).eval()
    tokens = torch.stack([d["input_ids"] for d in _dataset(8, seed=99)])
    with torch.no_grad():  # the Trainer's evaluation normalises by each batch's label count, as here
        losses = [plain(input_ids=t, labels=t, num_items_in_batch=t.numel()).loss for t in tokens.split(MB)]
    torch.testing.assert_close(result["eval_loss"], float(torch.stack(losses).mean()), rtol=1e-5, atol=0)
    assert plain.config.vocab_size == VOCAB
