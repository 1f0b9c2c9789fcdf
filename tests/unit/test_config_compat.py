"""Configs DeepSpeed accepts are accepted (issue 15), numbers are finite (issue 20), no key is a silent no-op."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.engine.config import NO_EFFECT, STAGE3_ALIASES, SlipstreamConfig, ZeroConfig, compat, load_config

CORPUS = sorted((Path(__file__).resolve().parents[1] / "data" / "configs").rglob("*.json"))


def _error(config: dict, world_size: int | None = 1) -> str:
    with pytest.raises(slipstream.ConfigError) as info:
        SlipstreamConfig.load(config, world_size=world_size)
    return str(info.value)


# --------------------------------------------------------------------------- the corpus


def test_corpus_is_there() -> None:
    names = {p.parent.name for p in CORPUS}
    assert {"transformers", "accelerate"} <= names and len(CORPUS) >= 10


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_public_template_parses(path: Path) -> None:
    config = slipstream.load_config(path)
    assert config.zero_optimization.stage in (0, 1, 2, 3)


def test_what_accelerate_writes_parses() -> None:
    # DeepSpeedPlugin's generated config: steps_per_print is infinity, offload devices "none" with a null path.
    config = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "none", "nvme_path": None},
                "offload_param": {"device": "none", "nvme_path": None},
                "stage3_gather_16bit_weights_on_model_save": False,
            },
            "gradient_clipping": 1.0,
            "steps_per_print": math.inf,
            "bf16": {"enabled": True},
            "fp16": {"enabled": False},
        }
    )
    assert config.steps_per_print is None and config.precision == "bf16"


@pytest.mark.parametrize(("name", "alias"), [(n, a) for n, aliases in STAGE3_ALIASES.items() for a in aliases])
def test_each_alias_parses_like_its_stage3_twin(name: str, alias: str) -> None:
    value = True if ZeroConfig.model_fields[name].annotation in (bool, "bool") else 12345
    twin = load_config({"zero_optimization": {name: value}}).zero_optimization
    other = load_config({"zero_optimization": {alias: value}}).zero_optimization
    assert getattr(other, name) == getattr(twin, name) == value
    assert other.model_dump() == twin.model_dump()


def test_an_alias_and_its_twin_with_two_values_is_an_error() -> None:
    text = _error({"zero_optimization": {"stage3_max_live_parameters": 6, "max_live_parameters": 5}}, None)
    assert text.startswith(
        "zero_optimization: stage3_max_live_parameters=6 and max_live_parameters=5 are one setting"
    ), text


@pytest.mark.parametrize("key", ["sub_group_size", "reduce_bucket_size", "allgather_bucket_size"])
def test_zero_sizes_of_zero_mean_the_default(key: str) -> None:
    zero = load_config({"zero_optimization": {key: 0}}).zero_optimization
    assert getattr(zero, key) == ZeroConfig.model_fields[key].default and key not in zero.model_fields_set


@pytest.mark.parametrize(("value", "expected"), [(math.inf, None), (10.0, 10), (0, 0), (25, 25)])
def test_steps_per_print_float_or_infinity(value: float, expected: int | None) -> None:
    assert load_config({"steps_per_print": value}).steps_per_print == expected


def test_steps_per_print_fraction_is_refused() -> None:
    assert _error({"steps_per_print": 2.5}, None) == "steps_per_print: must be an integer, got 2.5"


def test_unknown_top_level_keys_are_ignored_with_one_warning(capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config({"_comment": "zero 2", "cuda_visible_devices": "0,1", "train_micro_batch_size_per_gpu": 2})
    assert set(config.ignored) == {"_comment", "cuda_visible_devices"}
    err = capsys.readouterr().err
    assert err.count("ignoring unknown top-level key") == 1 and "'_comment', 'cuda_visible_devices'" in err


def test_near_misses_and_keys_inside_sections_stay_errors() -> None:
    assert _error({"gradient_acumulation_steps": 2}, None) == (
        "gradient_acumulation_steps: unknown key; did you mean 'gradient_accumulation_steps'?"
    )
    assert _error({"zero_optimization": {"_comment": "x"}}, None).startswith("zero_optimization._comment: unknown key")


def test_parameter_offload_without_optimizer_offload_parses() -> None:
    zero = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).zero_optimization
    assert zero.offload_param is not None and zero.offload_param.device == "cpu" and zero.offload_optimizer is None


def test_node_local_storage_is_accepted_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    compat._warned.discard("checkpoint.use_node_local_storage")
    assert load_config({"checkpoint": {"use_node_local_storage": True}}).checkpoint.use_node_local_storage
    assert "checkpoint.use_node_local_storage = True has no effect" in capsys.readouterr().err


def test_bf16_wins_over_bfloat16() -> None:
    config = load_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})
    assert config.precision == "bf16"
    assert load_config({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}).precision == "fp32"


def test_load_config_is_public_and_resolves_the_triad_on_request(tmp_path: Path) -> None:
    assert slipstream.load_config is load_config
    config = slipstream.load_config(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, world_size=4
    )
    assert config.train_batch_size == 24
    (tmp_path / "ds.json").write_text('{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}')
    assert slipstream.load_config(tmp_path / "ds.json").train_batch_size == "auto"  # no world size: left as written


# --------------------------------------------------------------------------- messages


def test_auto_batch_sizes_without_a_trainer_say_so() -> None:
    text = _error({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    assert text.startswith(
        'train_batch_size: train_batch_size, train_micro_batch_size_per_gpu are "auto", which a trainer fills in'
    )
    assert "neither is given" not in text


def test_pydantic_type_names_never_appear_in_a_key_path() -> None:
    from slipstream.engine.config import format_validation_error
    from slipstream.engine.lr_schedules import SCHEDULER_PARAMS

    model = SCHEDULER_PARAMS["WarmupLR"]
    with pytest.raises(Exception) as info:
        model.model_validate({"warmup_min_lr": "low"})
    text = format_validation_error(info.value, model, prefix="scheduler.params")  # type: ignore[arg-type]
    assert text.startswith("scheduler.params.warmup_min_lr: ") and "float" not in text.split(":")[0], text
    with pytest.raises(Exception) as info:
        model.model_validate({"warmup_min_lr": [0.1, math.inf]})
    text = format_validation_error(info.value, model, prefix="scheduler.params")  # type: ignore[arg-type]
    assert text == "scheduler.params.warmup_min_lr.1: must be a finite number, got Infinity", (
        text
    )  # one line: the real problem
    text = _error({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": "half"}}}, None)
    assert text.startswith("zero_optimization.offload_optimizer.ratio: must be a number"), text


def test_aio_inside_zero_optimization_is_named_a_top_level_section() -> None:
    assert _error({"zero_optimization": {"aio": {"block_size": 1048576}}}, None).startswith(
        "zero_optimization.aio: aio is a top-level section, not a key of zero_optimization; move it out"
    )


# --------------------------------------------------------------------------- no silent no-ops


def test_every_no_effect_key_names_a_real_field() -> None:
    config = load_config(
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    )
    for path in NO_EFFECT:
        node: object = config
        *sections, key = path.split(".")
        for name in sections:
            node = getattr(node, name)
        assert key in type(node).model_fields, path  # type: ignore[attr-defined]


def test_a_no_effect_key_set_warns_once_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    compat._warned.discard("zero_optimization.round_robin_gradients")
    load_config({"zero_optimization": {"round_robin_gradients": False}})  # the default: silent
    assert "round_robin_gradients" not in capsys.readouterr().err
    for _ in range(2):
        load_config({"zero_optimization": {"round_robin_gradients": True}})
    err = capsys.readouterr().err
    assert err.count("zero_optimization.round_robin_gradients = True has no effect in slipstream") == 1, err


# --------------------------------------------------------------------------- finite numbers (issue 20, #12)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"gradient_predivide_factor": math.inf}, "gradient_predivide_factor: must be a finite number, got Infinity"),
        ({"gradient_clipping": math.nan}, "gradient_clipping: must be a finite number, got NaN"),
        ({"comms_timeout_seconds": math.inf}, "comms_timeout_seconds: must be a finite number, got Infinity"),
        ({"comms_timeout_seconds": 1e300}, "comms_timeout_seconds: must be <= 1000000000.0, got 1e+300"),
        ({"fp16": {"loss_scale": math.inf}}, "fp16.loss_scale: must be a finite number, got Infinity"),
        ({"train_batch_size": math.inf}, 'train_batch_size: must be a positive integer or "auto", got Infinity'),
    ],
)
def test_non_finite_numbers_are_config_errors(config: dict, message: str) -> None:
    assert _error({"train_micro_batch_size_per_gpu": 1, **config}) == message


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}},
            "optimizer.params.lr: must be a finite number, got Infinity",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": math.nan}}},
            "optimizer.params.lr: must be a finite number, got NaN",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_decay": math.inf}}},
            "optimizer.params.weight_decay: must be a finite number",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"eps": math.nan}}},
            "optimizer.params.eps: must be a finite number",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": math.inf}}},
            "optimizer.params.momentum: must be a finite number",
        ),
        (
            {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}},
            "scheduler.params.warmup_max_lr: must be a finite number",
        ),
        (
            {
                "optimizer": {"type": "AdamW"},
                "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": math.nan}},
            },
            "scheduler.params.cycle_max_lr: must be a finite number",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "comms_timeout_seconds": math.inf},
            "comms_timeout_seconds: must be a finite number",
        ),
    ],
)
def test_initialize_refuses_non_finite_numbers(config: dict, message: str) -> None:
    with pytest.raises(slipstream.ConfigError) as info:
        slipstream.initialize(torch.nn.Linear(4, 2), {"train_batch_size": 2, **config})
    assert str(info.value).startswith(message), str(info.value)


# --------------------------------------------------------------------------- initialize(optimizer=...) (issue 20, #11)


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    with pytest.raises(
        slipstream.ConfigError, match=r"^optimizer: the optimizer passed to initialize\(\) holds 2 tensor"
    ):
        slipstream.initialize(model, {"train_batch_size": 2}, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_an_optimizer_over_the_model_is_accepted() -> None:
    model = torch.nn.Linear(4, 2)
    engine = slipstream.initialize(
        model, {"train_batch_size": 2}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    assert engine.mesh.size("dp") == 1
    engine.close()


# --------------------------------------------------------------------------- the mesh keys


def test_triad_counts_dp_not_world() -> None:
    config = load_config(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "tensor_parallel": {"autotp_size": 2}},
        world_size=8,
    )
    assert config.train_batch_size == 16  # 2 × 2 × dp 4 (tp 2 of world 8)
    text = _error(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "pipeline": {"stages": 2},
        },
        world_size=8,
    )
    assert text.startswith(
        "train_batch_size: must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × "
        "data-parallel size (dp of world 8) = 2 × 2 × 4 = 16, got 32"
    ), text


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"tensor_parallel": {"autotp_size": 3}},
            "mesh: world size 8 does not factor as pipeline.stages 1 × data_parallel_size dp",
        ),
        ({"data_parallel_size": 2}, "data_parallel_size: 2 does not fit world size 8"),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 3}},
            "expert_parallel.autoep_size: 3 must divide dp × cp × sp × tp",
        ),
    ],
)
def test_mesh_sizes_that_do_not_fit_are_one_line_errors(config: dict, message: str) -> None:
    text = _error({"train_micro_batch_size_per_gpu": 1, **config}, world_size=8)
    assert text.startswith(message) and "\n" not in text, text


def test_pipeline_stages_auto_means_one() -> None:
    assert (
        load_config(
            {"pipeline": {"stages": "auto", "partition": "best"}, "train_micro_batch_size_per_gpu": 1}, world_size=2
        ).train_batch_size
        == 2
    )
