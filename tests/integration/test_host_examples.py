"""Each host's stock example, with its documented one-line switch, exits cleanly at ZeRO-2 and ZeRO-3 (issue 30).

The scripts in ``hosts/`` follow the stock examples call for call (transformers' ``run_clm.py``,
Accelerate's ``deepspeed_with_config_support.py`` and ``complete_nlp_example.py``, Lightning's
``basics/transformer.py``, TRL's ``SFTTrainer`` and ``DPOTrainer`` with a reference model) on local
data. Each runs to its end — saving, evaluating, tearing down — on 2 ranks of the shared pool,
plain and switched; the switched losses match the host's plain run (DDP on the same global batch).
One run per host also goes through ``slipstream run`` as a user launches it, for the exit status.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.harness import run_distributed

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5
LR = 5e-3


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.integration.hosts.fixtures import write_corpus, write_gpt2_config, write_tokenizer

    root = tmp_path_factory.mktemp("host-data")
    files = write_corpus(root)
    files["tokenizer"] = write_tokenizer(root / "tokenizer")
    files["config"] = write_gpt2_config(root / "gpt2")
    files["root"] = str(root)
    return files


def ds_config(path: Path, stage: int, **extra: Any) -> str:
    """A DeepSpeed config as the hosts' docs write them; clipping off, as in the plain runs (DeepSpeed's default clips at 1)."""
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    config = {k: v for k, v in config.items() if v is not None}
    path.write_text(json.dumps(config))
    return str(path)


def _run_host(module: str, argv: list[str], env: dict[str, str]) -> Any:
    """On every rank of the pool: the example's ``main(argv)`` with ``env`` set, as its launch would set it."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = dict(os.environ)  # hosts edit the environment too (Lightning's DDP set-up): the next host gets the pool's
    os.environ.update(env)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    try:
        result = importlib.import_module(f"tests.integration.hosts.{module}").main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    dist.barrier()
    return result if dist.get_rank() == 0 else None


def run_host(module: str, argv: list[str], env: dict[str, str] | None = None) -> Any:
    return run_distributed(2, _run_host, module, argv, env or {})[0]


def launch(script: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``slipstream run --nproc_per_node 2`` as a user types it; the exit status is the point."""
    command = [
        sys.executable,
        "-m",
        "slipstream.cli",
        "run",
        "--nproc_per_node",
        "2",
        str(REPO / "tests/integration/hosts" / script),
        *argv,
    ]
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=600, cwd=REPO)


def assert_losses_match(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and got, (got, want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: {a} vs {b} (plain)\n{got}\n{want}"


# ---------------------------------------------------------------------- Accelerate: deepspeed_with_config_support.py
def _accelerate_clm_argv(data: dict[str, str], out: Path) -> list[str]:
    return [
        "--train_file",
        data["train.txt"],
        "--validation_file",
        data["validation.txt"],
        "--config_name",
        data["config"],
        "--tokenizer_name",
        data["tokenizer"],
        "--output_dir",
        str(out),
        "--num_train_epochs",
        "2",
        "--learning_rate",
        str(LR),
        "--lr_scheduler_type",
        "constant",
    ]


def _accelerate_clm_config(path: Path, stage: int) -> str:
    """The example's DeepSpeed path: optimizer and schedule from the config (DummyOptim, DummyScheduler).

    DeepSpeed's schedules apply their lr one step later than transformers' (engine.step advances
    them after the update), so both runs hold the lr constant: WarmupLR from lr to lr here, the
    plain run's "constant" schedule there.
    """
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": LR, "warmup_max_lr": LR, "warmup_num_steps": "auto"}}
    return ds_config(path, stage, scheduler=schedule)


@pytest.fixture(scope="module")
def accelerate_clm_plain(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("accelerate-clm-plain")
    return run_host("accelerate_clm", _accelerate_clm_argv(data, out), {"ACCELERATE_USE_CPU": "1"})


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed_example_finishes_and_matches_plain(
    stage: int, data: dict[str, str], accelerate_clm_plain: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    config = _accelerate_clm_config(tmp_path / "ds.json", stage)
    out = tmp_path / "out"
    got = run_host(
        "accelerate_clm",
        [*_accelerate_clm_argv(data, out), "--slipstream"],
        {"ACCELERATE_DEEPSPEED_CONFIG_FILE": config},
    )
    assert_losses_match(got["losses"], accelerate_clm_plain["losses"])
    assert got["best"] == pytest.approx(accelerate_clm_plain["best"], rel=1e-5)
    saved = AutoModelForCausalLM.from_pretrained(out)  # rank 0's get_state_dict: the whole model, loadable
    assert all(p.numel() > 0 for p in saved.parameters())


# ---------------------------------------------------------------------- Accelerate: complete_nlp_example.py
@pytest.fixture(scope="module")
def accelerate_nlp_plain(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("accelerate-nlp-plain")
    argv = ["--tokenizer_name", data["tokenizer"], "--output_dir", str(out), "--schedule_once"]
    plain = run_host("accelerate_nlp", argv)
    plain["resumed"] = run_host("accelerate_nlp", [*argv, "--resume_from_checkpoint", str(out / "epoch_0")])
    return plain


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_nlp_example_finishes_resumes_and_matches_plain(
    stage: int, data: dict[str, str], accelerate_nlp_plain: dict[str, Any], tmp_path: Path
) -> None:
    """The script's own AdamW and schedule (no optimizer in the config); epoch 1 again from epoch_0's save_state."""
    env = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": ds_config(tmp_path / "ds.json", stage, optimizer=None)}
    argv = ["--tokenizer_name", data["tokenizer"], "--output_dir", str(tmp_path / "out"), "--slipstream"]
    got = run_host("accelerate_nlp", argv, env)
    assert_losses_match(got["losses"], accelerate_nlp_plain["losses"])
    assert got["accuracies"] == accelerate_nlp_plain["accuracies"]
    again = run_host("accelerate_nlp", [*argv, "--resume_from_checkpoint", str(tmp_path / "out" / "epoch_0")], env)
    assert_losses_match(again["losses"], accelerate_nlp_plain["resumed"]["losses"])  # resumes as the plain run resumes


# ---------------------------------------------------------------------- transformers: run_clm.py
def _trainer_clm_argv(data: dict[str, str], out: Path) -> list[str]:
    return [
        "--train_file",
        data["train.txt"],
        "--validation_file",
        data["validation.txt"],
        "--config_name",
        data["config"],
        "--tokenizer_name",
        data["tokenizer"],
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "2",
        "--num_train_epochs",
        "1",
        "--logging_steps",
        "1",
        "--learning_rate",
        "5e-3",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--use_cpu",
        "--disable_tqdm",
        "true",
    ]


@pytest.fixture(scope="module")
def trainer_clm_plain(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_host("trainer_clm", _trainer_clm_argv(data, tmp_path_factory.mktemp("trainer-clm-plain")))


@pytest.mark.parametrize("stage", [2, 3])
def test_run_clm_finishes_and_matches_plain(
    stage: int, data: dict[str, str], trainer_clm_plain: dict[str, Any], tmp_path: Path
) -> None:
    config = ds_config(tmp_path / "ds.json", stage, gradient_clipping="auto")  # --max_grad_norm fills it
    got = run_host("trainer_clm", [*_trainer_clm_argv(data, tmp_path / "out"), "--slipstream", "--deepspeed", config])
    assert_losses_match(got["losses"], trainer_clm_plain["losses"])
    assert got["eval_loss"] == pytest.approx(trainer_clm_plain["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("mesh", ["ulysses", "zigzag"])
def test_run_clm_with_flattened_documents_under_sequence_modes_matches_one_process(
    mesh: str, data: dict[str, str], tmp_path: Path
) -> None:
    """``SlipstreamTrainer`` given ``DataCollatorWithFlattening``'s rows (documents end to end, position ids
    restarting, lengths that do not divide by 2) outside TRL: the logged losses and the evaluation loss of the
    same Trainer in one process."""
    flat = ["--flatten", "true", "--max_steps", "6"]
    plain = run_distributed(1, _one_process, "trainer_clm", [*_trainer_clm_argv(data, tmp_path / "plain"), *flat])[0]
    config = ds_config(tmp_path / "ds.json", 1, gradient_clipping="auto", **_sequence_mode(mesh))
    got = run_host(
        "trainer_clm", [*_trainer_clm_argv(data, tmp_path / "out"), *flat, "--slipstream", "--deepspeed", config]
    )
    assert_losses_match(got["losses"], plain["losses"])
    assert got["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)


# ---------------------------------------------------------------------- Lightning: basics/transformer.py
@pytest.fixture(scope="module")
def lightning_plain() -> dict[str, Any]:
    pytest.importorskip("lightning")
    return run_host("lightning_transformer", ["--strategy", "ddp"])


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_transformer_example_finishes_and_matches_plain(stage: int, lightning_plain: dict[str, Any]) -> None:
    got = run_host("lightning_transformer", ["--strategy", f"slipstream_stage_{stage}"])
    assert_losses_match(got["losses"], lightning_plain["losses"])


@pytest.mark.parametrize(
    ("flag", "section"), [("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("32-true", None)]
)  # (16-mixed is bf16 on CPU)
def test_lightning_precision_flag_maps_into_the_config(flag: str, section: str | None) -> None:
    """As Lightning's DeepSpeed strategy: Trainer(precision=...) turns on the config's section (the engine casts)."""
    import lightning as L

    from slipstream.integrations.lightning import SlipstreamStrategy

    strategy = SlipstreamStrategy(config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=flag, logger=False)
    config = trainer.strategy._config(trainer, training=False)
    if section is None:
        assert "bf16" not in config and "fp16" not in config
    else:
        assert config[section] == {"enabled": True}


def test_lightning_precision_flag_contradicting_the_config_is_refused() -> None:
    import lightning as L

    from slipstream.integrations.lightning import SlipstreamStrategy

    strategy = SlipstreamStrategy(
        config={"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
    )
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", logger=False)
    with pytest.raises(
        ValueError, match=r"Trainer\(precision=...\) asks for bf16, but the DeepSpeed config enables fp16"
    ):
        trainer.strategy._config(trainer, training=False)


# ---------------------------------------------------------------------- TRL: SFTTrainer, DPOTrainer with a reference model
def _trl_argv(trainer: str, data: dict[str, str], out: Path) -> list[str]:
    return [
        "--trainer",
        trainer,
        "--data",
        data["train.jsonl" if trainer == "sft" else "pairs.jsonl"],
        "--config_name",
        data["config"],
        "--tokenizer_name",
        data["tokenizer"],
        "--output_dir",
        str(out),
    ]


@pytest.fixture(scope="module")
def trl_plain(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    pytest.importorskip("trl")
    return {
        t: run_host("trl_trainers", _trl_argv(t, data, tmp_path_factory.mktemp(f"trl-{t}"))) for t in ("sft", "dpo")
    }


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
@pytest.mark.parametrize("stage", [2, 3])
def test_trl_trainer_finishes_and_matches_plain(
    trainer: str, stage: int, data: dict[str, str], trl_plain: dict[str, Any], tmp_path: Path
) -> None:
    config = ds_config(tmp_path / "ds.json", stage, gradient_clipping="auto")
    got = run_host("trl_trainers", [*_trl_argv(trainer, data, tmp_path / "out"), "--slipstream", "--deepspeed", config])
    assert_losses_match(got["losses"], trl_plain[trainer]["losses"])


def _one_process(module: str, argv: list[str]) -> Any:
    """The host's ``main(argv)`` in a process of its own (world 1): the plain run on the whole global batch."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return importlib.import_module(f"tests.integration.hosts.{module}").main(argv)


def _sequence_mode(mesh: str) -> dict[str, Any]:
    return {"sequence_parallel_size": 2} if mesh == "ulysses" else {"context_parallel": {"size": 2, "method": "zigzag"}}


@pytest.mark.parametrize("batches", ["padding_free", "packing"])
@pytest.mark.parametrize("mesh", ["ulysses", "zigzag"])
def test_trl_sft_with_packed_documents_under_sequence_modes_matches_one_process(
    batches: str, mesh: str, data: dict[str, str], tmp_path: Path
) -> None:
    """TRL's padding-free and packed SFT batches (documents in one row, position ids restarting) under Ulysses and
    zig-zag on 2 ranks (dp 1: both read every batch) log the losses of the same SFTTrainer in one process."""
    pytest.importorskip("trl")
    argv = [*_trl_argv("sft", data, tmp_path / "plain"), f"--{batches}"]
    plain = run_distributed(1, _one_process, "trl_trainers", argv)[0]
    config = ds_config(tmp_path / "ds.json", 1, gradient_clipping="auto", **_sequence_mode(mesh))
    got = run_host(
        "trl_trainers",
        [*_trl_argv("sft", data, tmp_path / "out"), f"--{batches}", "--slipstream", "--deepspeed", config],
    )
    assert_losses_match(got["losses"], plain["losses"])


# ---------------------------------------------------------------------- as a user launches it
def test_accelerate_example_at_zero3_exits_0_under_slipstream_run(data: dict[str, str], tmp_path: Path) -> None:
    """The run that used to train, save on rank 0 and then exit 1 (get_state_dict was None on rank 1)."""
    env = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": _accelerate_clm_config(tmp_path / "ds.json", 3)}
    argv = [*_accelerate_clm_argv(data, tmp_path / "out"), "--num_train_epochs", "1", "--slipstream"]
    done = launch("accelerate_clm.py", argv, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "all_results.json").is_file()
