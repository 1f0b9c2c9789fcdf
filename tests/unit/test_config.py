"""Config parsing: DeepSpeed's keys, the batch triad, and errors that name the key path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.engine.config import ConfigError, SlipstreamConfig


def _error(config: dict, world_size: int = 1) -> str:
    with pytest.raises(slipstream.ConfigError) as info:
        SlipstreamConfig.load(config, world_size=world_size)
    return str(info.value)


def test_config_error_is_a_value_error_and_public() -> None:
    assert issubclass(slipstream.ConfigError, ValueError)
    assert slipstream.ConfigError is ConfigError


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"train_batch_size": 8, "zero_optimizaton": {"stage": 1}},
            "zero_optimizaton: unknown key; did you mean 'zero_optimization'?",
        ),
        (
            {"train_batch_size": 8, "zero_optimization": {"stgae": 1}},
            "zero_optimization.stgae: unknown key; did you mean 'stage'?",
        ),
        ({"train_batch_size": 8, "fp16": {"enabeld": True}}, "fp16.enabeld: unknown key; did you mean 'enabled'?"),
        (
            {"train_batch_size": 8, "zero_optimization": {"stage": 7}},
            "zero_optimization.stage: must be 0, 1, 2 or 3, got 7",
        ),
        ({"train_batch_size": "eight"}, 'train_batch_size: must be a positive integer or "auto", got "eight"'),
        ({"train_batch_size": 0}, 'train_batch_size: must be a positive integer or "auto", got 0'),
        ({"train_batch_size": 8, "gradient_clipping": "high"}, 'gradient_clipping: must be a number, got "high"'),
        ({"train_batch_size": 8, "gradient_clipping": -1}, "gradient_clipping: must be >= 0.0, got -1"),
        (
            {"train_batch_size": 8, "zero_optimization": {"overlap_comm": "sometimes"}},
            'zero_optimization.overlap_comm: must be true or false, got "sometimes"',
        ),
        (
            {"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device: must be 'none', 'cpu' or 'nvme', got \"gpu\"",
        ),
        ({"train_batch_size": 8, "zero_optimization": "3"}, 'zero_optimization: must be an object, got "3"'),
        (
            {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "config: fp16.enabled and bf16.enabled are both true; choose one",
        ),
        ({"train_batch_size": 8, "amp": {"enabled": True}}, "amp: NVIDIA apex AMP is not supported"),
        (
            {"train_batch_size": 8, "zero_optimization": {"zero_quantized_weights": True}},
            "zero_optimization.zero_quantized_weights: needs stage 3",
        ),
        (
            {"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
            "zero_optimization.zero_quantized_nontrainable_weights: ZeRO++ INT8 storage of frozen weights is not supported",
        ),
        (
            {"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 0}},
            "zero_optimization.mics_shard_size: 0 ranks per shard group",
        ),
        (
            {"train_batch_size": 8, "optimizer": {"type": "Adam"}, "scheduler": {"params": {}}},
            "scheduler.type: is required",
        ),
        ({"train_batch_size": 8, "steps_per_print": "auto"}, 'steps_per_print: "auto" cannot be resolved here'),
    ],
)
def test_mistakes_name_the_key_path(config: dict, message: str) -> None:
    text = _error(config)
    assert text.startswith(message) or message in text, text


def test_several_mistakes_are_all_reported() -> None:
    text = _error({"train_batch_size": 8, "zero_optimization": {"stage": 9, "reduce_bucket_size": "big"}})
    assert "zero_optimization.stage: must be 0, 1, 2 or 3, got 9" in text
    assert 'zero_optimization.reduce_bucket_size: must be an integer, got "big"' in text


@pytest.mark.parametrize(
    ("config", "world", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
        ({"train_batch_size": 16}, 4, (16, 4, 1)),
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"},
            2,
            (16, 2, 4),
        ),
        (
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            2,
            (8, 2, 2),
        ),
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            4,
            (16, 2, 2),
        ),
    ],
)
def test_batch_triad_is_derived(config: dict, world: int, expected: tuple[int, int, int]) -> None:
    cfg = SlipstreamConfig.load(config, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_derived_and_auto_values_are_logged(capsys: pytest.CaptureFixture[str]) -> None:
    SlipstreamConfig.load(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"},
        world_size=2,
    )
    err = capsys.readouterr().err
    assert "derived train_batch_size=4, gradient_accumulation_steps=1" in err
    assert 'gradient_clipping is "auto"; resolved to 1.0' in err


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
            2,
            "train_batch_size: must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size = 2 × 3 × 2 = 12, got 16",
        ),
        ({"train_batch_size": 10}, 4, "train_batch_size: 10 is not divisible by the data-parallel world size 4"),
        (
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4},
            2,
            "train_batch_size: 12 is not divisible by train_micro_batch_size_per_gpu × world size = 8",
        ),
        (
            {"gradient_accumulation_steps": 4},
            1,
            "train_batch_size: set train_batch_size or train_micro_batch_size_per_gpu",
        ),
    ],
)
def test_inconsistent_triad_is_refused(config: dict, world: int, message: str) -> None:
    assert _error(config, world).startswith(message)


def test_reads_json_and_hjson_with_comments(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True}}))
    (tmp_path / "ds.hjson").write_text(
        "{\n  # a comment\n  train_batch_size: 8\n  zero_optimization: {stage: 0}  // another\n}\n"
    )
    assert SlipstreamConfig.load(tmp_path / "ds.json").precision == "bf16"
    assert SlipstreamConfig.load(str(tmp_path / "ds.hjson")).zero_optimization.stage == 0


def test_bad_files_are_config_errors(tmp_path: Path) -> None:
    assert "does not exist" in _error(str(tmp_path / "missing.json"))  # type: ignore[arg-type]
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,,}')
    assert "is not valid JSON/HJSON" in _error(str(tmp_path / "broken.json"))  # type: ignore[arg-type]
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "must hold an object" in _error(str(tmp_path / "list.json"))  # type: ignore[arg-type]


def test_deepspeed_defaults_and_aliases() -> None:
    cfg = SlipstreamConfig.load(
        {
            "train_batch_size": 8,
            "bfloat16": {"enabled": True},
            "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True},
        }
    )
    assert cfg.gradient_clipping == 1.0  # DeepSpeed clips at 1.0 when unset
    assert cfg.precision == "bf16"
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.hysteresis == 2 and cfg.fp16.loss_scale_window == 1000


def test_deepspeed_only_sections_are_accepted_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = SlipstreamConfig.load(
        {"train_batch_size": 8, "autotuning": {"enabled": True}, "zero_allow_untested_optimizer": True}
    )
    assert set(cfg.ignored) == {"autotuning", "zero_allow_untested_optimizer"}
    assert "'autotuning' is accepted for DeepSpeed compatibility but has no effect" in capsys.readouterr().err


def test_loading_a_parsed_config_round_trips() -> None:
    first = SlipstreamConfig.load(
        {"train_batch_size": 8, "fp16": {"enabled": True}, "flops_profiler": {}}, world_size=2
    )
    again = SlipstreamConfig.load(first, world_size=2)
    assert again.model_dump() == first.model_dump() and again.ignored == first.ignored


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def test_initialize_without_an_optimizer_builds_an_engine_that_only_runs_forward() -> None:
    """As DeepSpeed allows (TRL's reference models, evaluation-only runs): forward works, training says why not."""
    model = _model()
    engine = slipstream.initialize(model, {"train_batch_size": 2})
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model(x))
    loss = engine(x).sum()
    with pytest.raises(RuntimeError, match=r"no optimizer .*add an \"optimizer\" section"):
        engine.backward(loss)
    with pytest.raises(RuntimeError, match="no optimizer"):
        engine.step()
    engine.close()


def test_a_schedule_without_an_optimizer_is_refused() -> None:
    config = {"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}
    with pytest.raises(slipstream.ConfigError, match=r"^scheduler: a schedule needs an optimizer"):
        slipstream.initialize(_model(), config)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type: 'Lamb' is not available; use Adam, AdamW or SGD"),
        (
            {"optimizer": {"type": "Adamw"}, "zero_optimization": {"stage": 3, "stage3_unit_modules": ["GPT2Block"]}},
            "zero_optimization.stage3_unit_modules: no module of class GPT2Block in the model",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr: must be > 0.0, got -1"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas: must be"),
        ({"optimizer": {"type": "sgd", "params": {"momentum": 0.9}}}, "optimizer.params.lr: is required"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "lr_decay": 1}}},
            "optimizer.params.lr_decay: unknown key",
        ),
        (
            {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "Cosine"}},
            "scheduler.type: 'Cosine' is not available",
        ),
        (
            {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_stepz": 5}}},
            "scheduler.params.warmup_num_stepz: unknown key; did you mean 'warmup_num_steps'?",
        ),
        (
            {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer.device: offload needs ZeRO stage 1, 2 or 3",
        ),
    ],
)
def test_initialize_reports_config_mistakes(config: dict, message: str) -> None:
    with pytest.raises(slipstream.ConfigError) as info:
        slipstream.initialize(_model(), {"train_batch_size": 2, **config})
    assert str(info.value).startswith(message), str(info.value)


def test_optimizer_in_config_and_argument_is_ambiguous() -> None:
    model = _model()
    with pytest.raises(slipstream.ConfigError, match="given both in the config and as initialize"):
        slipstream.initialize(
            model,
            {"train_batch_size": 2, "optimizer": {"type": "Adam"}},
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        )


@pytest.mark.parametrize("name", ["ds.yaml", "ds.json"])
def test_a_yaml_config_is_named_as_yaml(tmp_path: Path, name: str) -> None:
    """HJSON would read YAML's nested mappings as strings ("optimizer: must be an object, got 'type: AdamW'")."""
    (tmp_path / name).write_text("# DeepSpeed config\noptimizer:\n  type: AdamW\n  params:\n    lr: 0.001\n")
    message = _error(str(tmp_path / name))  # type: ignore[arg-type]
    assert name in message and "not YAML: convert it to JSON" in message
