"""TRL's quick-start scripts for ``SFTTrainer`` and ``DPOTrainer`` (with an explicit reference model), on local data.

As TRL's docs write them: a ``datasets`` dataset (``text`` for SFT; ``prompt`` / ``chosen`` /
``rejected`` for DPO), a config object (``SFTConfig`` / ``DPOConfig``), the trainer built with the
model, its tokenizer as ``processing_class`` and (DPO) a frozen reference model, then ``train()``
and ``save_model()``. ``--slipstream`` is the documented one-line switch:
``SFTTrainer, SFTConfig = slipstream_trainer(SFTTrainer, SFTConfig)`` (likewise DPO), with
``deepspeed=`` naming the config as it does for DeepSpeed.
"""

from __future__ import annotations

import argparse
import copy

from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["sft", "dpo"], required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--config_name", required=True)
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--slipstream", action="store_true")
    parser.add_argument(
        "--padding_free", action="store_true", help="SFT: documents flattened into one row (DataCollatorWithFlattening)"
    )
    parser.add_argument("--packing", action="store_true", help="SFT: documents packed into max_length rows")
    args = parser.parse_args(argv)
    if args.trainer == "sft":
        from trl import SFTConfig as Config
        from trl import SFTTrainer as Trainer
    else:
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer
    if args.slipstream:  # the one-line switch
        from slipstream.integrations.transformers import slipstream_trainer

        Trainer, Config = slipstream_trainer(Trainer, Config)

    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config_name))
    dataset = load_dataset("json", data_files=args.data, split="train")
    common = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=2,
        max_steps=6,
        logging_steps=1,
        learning_rate=5e-3,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not args.slipstream,
        deepspeed=args.deepspeed,
        seed=0,
        data_seed=0,
        bf16=False,  # TRL defaults to bf16; fp32 keeps the comparison with the plain run exact
    )
    if args.trainer == "sft":
        # padding-free without packing does not cut rows (TRL refuses a max_length then): the corpus lines are short
        config = Config(
            **common,
            max_length=None if args.padding_free and not args.packing else 32,
            padding_free=args.padding_free,
            packing=args.packing,
        )
        trainer = Trainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    else:
        reference = copy.deepcopy(model).eval()
        config = Config(**common, max_length=32, beta=0.1)
        trainer = Trainer(
            model=model, ref_model=reference, args=config, train_dataset=dataset, processing_class=tokenizer
        )
    trainer.train()
    trainer.save_model()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
