"""The hosts' switches, one process (issue 30, cases 3, 5, 9, 10): the config and the errors users see."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")


class _Arguments:
    """The TrainingArguments fields the auto filler reads."""

    def __init__(self, **overrides: Any) -> None:
        self.world_size, self.process_index = 1, 0
        self.per_device_train_batch_size, self.gradient_accumulation_steps = 2, 1
        self.max_grad_norm, self.learning_rate, self.adam_beta1, self.adam_beta2 = 1.0, 1e-3, 0.9, 0.999
        self.adam_epsilon, self.weight_decay, self.save_on_each_node = 1e-8, 0.0, False
        self.fp16 = self.fp16_full_eval = self.bf16 = self.bf16_full_eval = False
        self.__dict__.update(overrides)


def _filled(config: dict[str, Any], **arguments: Any) -> dict[str, Any]:
    from slipstream.integrations._hf_auto import AutoFiller

    filler = AutoFiller(config)
    filler.from_arguments(_Arguments(**arguments))
    filler.raise_mismatches()
    return filler.config


@pytest.mark.parametrize(("flag", "section"), [("bf16", "bf16"), ("fp16", "fp16")])
def test_a_half_precision_flag_adds_the_missing_section(flag: str, section: str) -> None:
    """--bf16 with a config without a bf16 section trained in fp32, silently; DeepSpeed trains in bf16 there."""
    config = _filled({"zero_optimization": {"stage": 2}}, **{flag: True})
    assert config[section] == {"enabled": True}
    assert _filled({"zero_optimization": {"stage": 2}}).get(section) is None  # no flag, no section


def test_a_flag_for_one_dtype_and_a_config_for_the_other_are_refused() -> None:
    with pytest.raises(ValueError, match="--bf16 asks for bf16, but the DeepSpeed config enables fp16; keep one"):
        _filled({"fp16": {"enabled": True}}, bf16=True)


def test_an_explicit_disabled_section_is_a_mismatch_as_in_deepspeed() -> None:
    with pytest.raises(ValueError, match=r"ds bf16.enabled=False vs hf bf16\|bf16_full_eval=True"):
        _filled({"bf16": {"enabled": False}}, bf16=True)


def test_a_host_that_counts_another_world_size_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.integrations._launch import check_host_world_size, host_needs_cpu_flag

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLIPSTREAM_ACCELERATOR", "cpu")
    assert host_needs_cpu_flag()
    with pytest.raises(
        ValueError, match=r"^TrainingArguments sees 1 process\(es\) but the launcher started WORLD_SIZE=2; .*--use_cpu"
    ):
        check_host_world_size("TrainingArguments", 1)
    check_host_world_size("TrainingArguments", 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not host_needs_cpu_flag()


def test_any_trainer_subclass_switches_in_one_line_and_keeps_its_own_behaviour() -> None:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from slipstream.integrations.transformers import SlipstreamTrainerMixin, slipstream_trainer

    trainer_cls, arguments_cls = slipstream_trainer(Seq2SeqTrainer, Seq2SeqTrainingArguments)
    assert issubclass(trainer_cls, Seq2SeqTrainer) and issubclass(trainer_cls, SlipstreamTrainerMixin)
    assert issubclass(arguments_cls, Seq2SeqTrainingArguments)
    assert slipstream_trainer(Seq2SeqTrainer, Seq2SeqTrainingArguments) == (
        trainer_cls,
        arguments_cls,
    )  # the same classes
    args = arguments_cls(
        output_dir="/tmp/x", deepspeed={"zero_optimization": {"stage": 2}}, predict_with_generate=True, use_cpu=True
    )
    assert args.predict_with_generate and args.slipstream_config["zero_optimization"]["stage"] == 2
    import pickle

    assert (
        pickle.loads(pickle.dumps(args)).slipstream_config == args.slipstream_config
    )  # the Trainer saves it with torch.save
    with pytest.raises(TypeError, match="is not a transformers.Trainer subclass"):
        slipstream_trainer(object, Seq2SeqTrainingArguments)


def test_a_plain_arguments_object_is_refused_by_a_switched_trainer() -> None:
    import torch
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from slipstream.integrations.transformers import slipstream_trainer

    trainer_cls, _ = slipstream_trainer(Seq2SeqTrainer, Seq2SeqTrainingArguments)
    with pytest.raises(ValueError, match="SlipstreamSeq2SeqTrainer: pass args=SlipstreamTrainingArguments"):
        trainer_cls(model=torch.nn.Linear(2, 2), args=Seq2SeqTrainingArguments(output_dir="/tmp/x", use_cpu=True))


def test_no_effect_warnings_are_said_once_and_on_rank_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank of a job reads the same file; official templates carry keys that have no effect here."""
    from slipstream.engine.config import SlipstreamConfig, compat, model
    from slipstream.utils import logging as slipstream_logging

    monkeypatch.setattr(slipstream_logging, "_rank", None)  # an earlier test may have joined a group: RANK decides here
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setattr(model, "_warned_sections", set())
    config = {
        "train_batch_size": 2,
        "tensorboard": {"enabled": False},
        "zero_optimization": {"stage": 2, "round_robin_gradients": True},
    }
    monkeypatch.setenv("RANK", "1")
    SlipstreamConfig.load(config)
    assert "no effect" not in capsys.readouterr().err  # rank 1 says nothing
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setenv("RANK", "0")
    SlipstreamConfig.load(config)
    SlipstreamConfig.load(config)
    err = capsys.readouterr().err
    assert err.count("round_robin_gradients = True has no effect") == 1, err


def test_engine_ready_says_whether_offload_is_on_and_which_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import slipstream

    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    slipstream.initialize(torch.nn.Linear(4, 4), config).close()
    err = capsys.readouterr().err
    assert "engine ready: ZeRO stage 3, fp32, optimizer AdamW, offload parameters to cpu," in err, err
    slipstream.initialize(torch.nn.Linear(4, 4), {"train_batch_size": 2}).close()
    assert "no optimizer (forward only), offload off," in capsys.readouterr().err
