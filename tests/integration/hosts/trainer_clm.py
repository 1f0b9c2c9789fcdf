"""transformers' ``examples/pytorch/language-modeling/run_clm.py``, step for step, on a local corpus.

``HfArgumentParser`` over the model, data and training arguments; ``datasets`` reading text files;
tokenize and group into blocks under ``main_process_first``; ``Trainer`` with
``compute_metrics`` / ``preprocess_logits_for_metrics``; ``train`` (resuming when asked),
``save_model``, ``log_metrics`` / ``save_metrics`` / ``save_state``, ``evaluate`` with perplexity.
``--slipstream`` is the documented one-line switch: ``Trainer`` → ``SlipstreamTrainer``,
``TrainingArguments`` → ``SlipstreamTrainingArguments`` (``--deepspeed ds_config.json`` unchanged).
Any ``Trainer`` subclass switches the same way with ``slipstream_trainer(cls)`` (``--trainer_subclass``).
"""

from __future__ import annotations

import dataclasses
import math
from itertools import chain

from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorWithFlattening,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


@dataclasses.dataclass
class ModelArguments:
    config_name: str = ""
    tokenizer_name: str = ""
    slipstream: bool = False
    trainer_subclass: str = ""  # "seq2seq": Seq2SeqTrainer through slipstream_trainer()


@dataclasses.dataclass
class DataTrainingArguments:
    train_file: str = ""
    validation_file: str = ""
    block_size: int = 16
    flatten: bool = False  # each line one document, flattened into one row per batch (DataCollatorWithFlattening)


def main(argv: list[str]) -> dict:
    model_args, _ = HfArgumentParser(ModelArguments).parse_args_into_dataclasses(
        argv, return_remaining_strings=True, look_for_args_file=False
    )
    trainer_cls, arguments_cls = Trainer, TrainingArguments
    if model_args.trainer_subclass == "seq2seq":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

        trainer_cls, arguments_cls = Seq2SeqTrainer, Seq2SeqTrainingArguments
    if model_args.slipstream:  # the one-line switch
        from slipstream.integrations.transformers import slipstream_trainer

        trainer_cls, arguments_cls = slipstream_trainer(trainer_cls, arguments_cls)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, arguments_cls))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv, look_for_args_file=False)
    set_seed(training_args.seed)

    raw_datasets = load_dataset(
        "text", data_files={"train": data_args.train_file, "validation": data_args.validation_file}
    )
    config = AutoConfig.from_pretrained(model_args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)
    model.resize_token_embeddings(len(tokenizer))

    column_names = list(raw_datasets["train"].features)
    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw_datasets.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=column_names)
    block_size = data_args.block_size

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated[list(examples.keys())[0]]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    def preprocess_logits_for_metrics(logits, labels):
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}

    collator, metrics = (
        default_data_collator,
        {"compute_metrics": compute_metrics, "preprocess_logits_for_metrics": preprocess_logits_for_metrics},
    )
    if data_args.flatten:  # padding-free SFT's batches: documents end to end, position ids restarting at each
        lm_datasets = tokenized.remove_columns([c for c in tokenized["train"].column_names if c != "input_ids"])
        collator, metrics = DataCollatorWithFlattening(), {}
    else:
        with training_args.main_process_first(desc="grouping texts together"):
            lm_datasets = tokenized.map(group_texts, batched=True)

    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=lm_datasets["train"],
        eval_dataset=lm_datasets["validation"],
        processing_class=tokenizer,
        data_collator=collator,
        **metrics,
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = train_result.metrics
    metrics["train_samples"] = len(lm_datasets["train"])
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate()
    eval_metrics["perplexity"] = math.exp(eval_metrics["eval_loss"])
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "eval_loss": eval_metrics["eval_loss"], "accuracy": eval_metrics.get("eval_accuracy")}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
