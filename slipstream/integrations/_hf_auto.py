"""Fill a DeepSpeed config's ``"auto"`` values from ``TrainingArguments``, as Hugging Face does.

[Note: same values, same errors] The Trainer's DeepSpeed integration fills ``"auto"`` in two
passes — from the arguments when they are created, then from the model and the step count when
training starts — and collects every explicit value that disagrees with an argument into one
``ValueError``. Users' configs were written against that behaviour, so it is kept key for key.
"""

from __future__ import annotations

from typing import Any

from slipstream.integrations._config import apply_mixed_precision, fill_hidden_size_autos, get, node
from slipstream.integrations._mesh import data_parallel_layout


class AutoFiller:
    """One config dict being filled; ``mismatches`` lists explicit values that disagree with the arguments."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def fill_match(self, key: str, hf_value: Any, hf_name: str | None = None, must_match: bool = True) -> None:
        parent, last = node(self.config, key)
        if parent is None:
            return
        if parent.get(last) == "auto":
            parent[last] = hf_value
            return
        value = parent.get(last)
        if must_match and value is not None and value != hf_value:
            self.mismatches.append(f"- ds {key}={value} vs hf {hf_name}={hf_value}")

    def fill_only(self, key: str, hf_value: Any) -> None:
        self.fill_match(key, hf_value, must_match=False)

    def from_arguments(self, args: Any, auto_find_batch_size: bool = False) -> None:
        """The first pass, when the arguments are created.

        ``train_batch_size`` counts data-parallel ranks: under sequence, context, tensor or pipeline
        parallelism several processes share one micro-batch (``_mesh.py``), so it is
        dp × micro × accumulation, with dp = world / (pp · cp · sp · tp), as the engine checks it.
        """
        dp = data_parallel_layout(self.config, args.world_size, args.process_index).size
        train_batch_size = dp * args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.fill_match(
            "train_micro_batch_size_per_gpu",
            args.per_device_train_batch_size,
            "per_device_train_batch_size",
            not auto_find_batch_size,
        )
        self.fill_match("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
        self.fill_match("train_batch_size", train_batch_size, "train_batch_size (calculated)", not auto_find_batch_size)
        self.fill_match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
        self.fill_match("optimizer.params.lr", args.learning_rate, "learning_rate")
        self.fill_match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
        self.fill_match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        self.fill_match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
        self.fill_only("scheduler.params.warmup_min_lr", 0)
        self.fill_match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
        if args.save_on_each_node:
            self.config.setdefault("checkpoint", {})["use_node_local_storage"] = True
        # --bf16 / --fp16 with a config that has no such section trains in that dtype, as under DeepSpeed
        # (Accelerate's DeepSpeed plugin adds the section); it used to train in fp32, silently.
        apply_mixed_precision(
            self.config, "bf16" if args.bf16 else "fp16" if args.fp16 else "no", "--bf16" if args.bf16 else "--fp16"
        )
        self.fill_match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
        self.fill_match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")

    def at_training_start(self, args: Any, model: Any, num_training_steps: int) -> None:
        """The second pass: bucket sizes from the model's hidden size, the schedule's step counts; then the mismatches."""
        fill_hidden_size_autos(self.config, model)
        self.fill_match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        # Hugging Face keeps an auto-filled warmup positive (DeepSpeed rejects 0 warmup steps).
        self.fill_match(
            "scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps"
        )
        self.raise_mismatches()

    def raise_mismatches(self) -> None:
        if self.mismatches:
            raise ValueError(
                "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
                + "\n".join(self.mismatches)
                + "\nThe easiest method is to set these DeepSpeed config values to 'auto'."
            )

    def is_zero3(self) -> bool:
        return get(self.config, "zero_optimization.stage") == 3
