"""Optimizer (and ZeRO-3 parameter) offload to CPU memory and NVMe trains exactly like no offload."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import slipstream
from tests.harness import run_distributed
from tests.reference import (
    assert_close_trajectory,
    global_batches,
    tiny_gpt2,
    tiny_llama,
    train_engine,
    train_reference,
)

STEPS = 12
MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def _offload(device: str, path: str | None) -> dict:
    return {"device": device, **({"nvme_path": path} if device == "nvme" else {})}


def _config(world: int, stage: int, gas: int, optimizer: str, param: str, path: str | None, **zero: object) -> dict:
    zero_cfg: dict = {"stage": stage, "offload_optimizer": _offload(optimizer, path), **zero}
    if param != "none":
        zero_cfg["offload_param"] = _offload(param, path)
    if stage == 3:
        zero_cfg.setdefault("stage3_param_persistence_threshold", 0)
    return {
        "train_batch_size": 2 * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero_cfg,
    }


def _parity_body(
    stage: int,
    optimizer: str,
    param: str = "none",
    path: str | None = None,
    gas: int = 1,
    precision: str = "fp32",
    model: str = "gpt2",
    **zero: object,
) -> list[float]:
    world = dist.get_world_size()
    config = _config(world, stage, gas, optimizer, param, path, **zero)
    if precision != "fp32":
        config[precision] = {"enabled": True}
    build = MODELS[model]
    engine = slipstream.initialize(build(seed=dist.get_rank()), config)
    assert type(engine.optimizer).__name__ == "OffloadAdam"
    if path is not None:  # this rank's swap files: nvme_path/<job-id>/rank<r>/
        (job,) = os.listdir(path)
        files = os.listdir(os.path.join(path, job, f"rank{dist.get_rank()}"))
        assert any(f.startswith("optimizer_") for f in files) and (
            param != "nvme" or any(f.startswith("param_") for f in files)
        )
    batches = global_batches(STEPS, config["train_batch_size"])
    ours = train_engine(engine, batches)
    engine.close()
    dist.barrier()  # every rank closed
    if path is not None:
        assert not any(os.scandir(path)), f"swap files left behind: {os.listdir(path)}"
    if dist.get_rank() == 0:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        ref = train_reference(build(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0, dtype=dtype)
        if precision == "fp32":  # the bounds of test_zero_partitioned / test_zero3
            assert_close_trajectory(ours, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
        else:
            assert_close_trajectory(ours, ref, loss_rtol=1e-3, param_rel_norm=2e-2)
        assert ours.losses[-1] < ours.losses[0] - 0.3
    return ours.losses


@pytest.mark.parametrize(
    ("stage", "device", "gas", "precision"),
    [(1, "cpu", 2, "fp32"), (2, "cpu", 1, "fp32"), (2, "cpu", 2, "bf16"), (2, "nvme", 1, "bf16")],
)
def test_stage12_optimizer_offload_matches_reference(
    stage: int, device: str, gas: int, precision: str, tmp_path: os.PathLike[str]
) -> None:
    path = str(tmp_path) if device == "nvme" else None
    results = run_distributed(
        2, _parity_body, stage, device, path=path, gas=gas, precision=precision, sub_group_size=30_000
    )
    assert results[0] == results[1]


@pytest.mark.parametrize(
    ("optimizer", "param", "gas", "precision"), [("cpu", "cpu", 2, "fp32"), ("cpu", "none", 1, "bf16")]
)
def test_stage3_cpu_offload_matches_reference(optimizer: str, param: str, gas: int, precision: str) -> None:
    results = run_distributed(2, _parity_body, 3, optimizer, param, gas=gas, precision=precision, model="llama")
    assert results[0] == results[1]


@pytest.mark.parametrize(("gas", "precision"), [(2, "fp32"), (1, "bf16")])
def test_stage3_nvme_offload_matches_reference(gas: int, precision: str, tmp_path: os.PathLike[str]) -> None:
    # Small sub-groups and prefetch: several swap files, read-ahead and write-behind all exercised.
    results = run_distributed(
        2,
        _parity_body,
        3,
        "nvme",
        "nvme",
        str(tmp_path),
        gas=gas,
        precision=precision,
        sub_group_size=20_000,
        stage3_prefetch_bucket_size=100_000,
        stage3_param_persistence_threshold=1000,  # biases stay gathered
    )
    assert results[0] == results[1]


def test_nvme_offload_trains_a_model_whose_optimizer_state_exceeds_the_memory_cap(tmp_path: os.PathLike[str]) -> None:
    """Fresh processes (peak RSS must not include earlier tests) under RLIMIT_DATA = now + cap."""
    import json
    import socket
    import subprocess
    import sys

    cap = 320 * 2**20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": root,
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-m", "tests.distributed.offload_capacity", str(tmp_path), str(cap)]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for r in results:
        assert r["optimizer_state_per_rank"] > cap, r  # the state could not be held in memory
        assert r["peak_rss_growth"] < cap, r
        assert 5.0 < r["losses"][0] < 6.0 and all(5.0 < x < 7.0 for x in r["losses"]), r  # ln(256) ≈ 5.55 at init
    assert not any(os.scandir(tmp_path)), "swap files left behind"


# ---------------------------------------------------------------- faults and configuration errors
def _error_body(case: str, root: str) -> str:
    from unittest import mock

    from slipstream.engine.zero.offload import swap_dir

    world = dist.get_world_size()
    nvme = {"device": "nvme", "nvme_path": root}
    zero: dict = {
        "stage0": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
        "param_stage2": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "param_nvme_no_path": {"stage": 3, "offload_param": {"device": "nvme"}},
        "no_path": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
        "unwritable": {"stage": 2, "offload_optimizer": {**nvme, "nvme_path": os.path.join(root, "a_file", "swap")}},
        "full": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme},
        "sgd": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }[case]
    optimizer = {"type": "SGD", "params": {"lr": 0.1}} if case == "sgd" else {"type": "AdamW", "params": {}}
    config = {"train_batch_size": 2 * world, "optimizer": optimizer, "zero_optimization": zero}
    usage = (
        mock.patch.object(swap_dir.shutil, "disk_usage", return_value=mock.Mock(free=4096))
        if case == "full"
        else mock.MagicMock()
    )
    with usage, pytest.raises(slipstream.ConfigError) as err:
        slipstream.initialize(tiny_gpt2(seed=0), config)
    return str(err.value)


def test_offload_configuration_errors_name_the_key_and_path(tmp_path: os.PathLike[str]) -> None:
    root = str(tmp_path)
    with open(os.path.join(root, "a_file"), "w") as f:
        f.write("not a directory")
    expected = {
        "stage0": "offload_optimizer.device: offload needs ZeRO stage 1, 2 or 3",
        "param_stage2": "offload_param.device: parameter offload needs stage 3",
        "param_nvme_no_path": "offload_param.nvme_path: required",  # parameter offload alone is allowed (issue 30)
        "no_path": "offload_optimizer.nvme_path: required",
        "unwritable": f"offload_optimizer.nvme_path: cannot create swap files under '{root}/a_file/swap'",
        "full": f"nvme_path: '{root}' has 0.00 GiB free",
        "sgd": "must be Adam or AdamW",
    }
    for case, message in expected.items():
        for text in run_distributed(2, _error_body, case, root):
            assert message in text, (case, text)
    assert sorted(os.listdir(root)) == ["a_file"], "a failed initialize left swap directories behind"


def _train_after_crash_body(root: str) -> list[str]:
    config = _config(dist.get_world_size(), 2, 1, "nvme", "none", root)
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    mine = os.listdir(root)
    train_engine(engine, global_batches(2, config["train_batch_size"]))
    engine.close()
    return mine


def test_killed_run_leaves_nothing_that_breaks_the_next_one_and_exit_cleans_up(tmp_path: os.PathLike[str]) -> None:
    import socket
    import subprocess
    import sys

    root = str(tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for mode in ("exit", "kill"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": repo,
        }
        done = subprocess.run(
            [sys.executable, "-m", "tests.distributed.offload_exit", root, mode],
            env=env,
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert "trained" in done.stdout, done.stderr[-3000:]
        left = os.listdir(root)
        if mode == "exit":
            assert left == [], f"exit without engine.close() left {left}"
        else:
            assert done.returncode == -9 and len(left) == 1, (done.returncode, left)  # the killed run's job directory
            stale = left[0]
    seen = run_distributed(2, _train_after_crash_body, root)
    assert stale not in seen[0], "the stale job directory was not removed at start"
    assert os.listdir(root) == []


def _groups_body(stage: int, how: str) -> None:
    """Param groups (no decay on biases and norms) and a user optimizer: offload matches no offload."""
    world = dist.get_world_size()
    results = []
    for offload in ("none", "cpu"):
        model = tiny_gpt2(seed=0)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]
        zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
        if offload != "none":
            zero["offload_optimizer"] = {"device": offload}
        config: dict = {
            "train_batch_size": 2 * world,
            "gradient_clipping": 1.0,
            "zero_optimization": zero,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        }
        if how == "instance":
            del config["scheduler"]
            engine = slipstream.initialize(
                model, config, optimizer=torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.05)
            )
        else:
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.05}}
            engine = slipstream.initialize(model, config, model_parameters=groups)
        results.append(train_engine(engine, global_batches(6, config["train_batch_size"])))
        engine.close()
    if dist.get_rank() == 0:
        assert_close_trajectory(
            results[1], results[0], loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4
        )  # CPU Adam: ulps


@pytest.mark.parametrize(("stage", "how"), [(2, "config"), (3, "instance")])
def test_offload_keeps_param_groups_schedules_and_user_optimizers(stage: int, how: str) -> None:
    run_distributed(2, _groups_body, stage, how)


def _frozen_body(path: str) -> None:
    world = dist.get_world_size()
    config = _config(world, 3, 1, "nvme", "nvme", path)
    config["bf16"] = {"enabled": True}
    model = tiny_gpt2(seed=0)
    frozen = dict(model.transformer.h[0].ln_1.named_parameters())  # a unit only partly frozen
    for p in frozen.values():
        p.requires_grad_(False)
    before = {f"transformer.h.0.ln_1.{n}": p.detach().to(torch.bfloat16).float().clone() for n, p in frozen.items()}
    engine = slipstream.initialize(model, config)
    train_engine(engine, global_batches(3, config["train_batch_size"]))
    weights = engine.consolidated_state_dict()
    engine.close()
    if dist.get_rank() == 0:
        for name, value in before.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=f"frozen {name} changed")


def test_stage3_nvme_offload_leaves_frozen_parameters_untouched(tmp_path: os.PathLike[str]) -> None:
    # bf16 parameters are published from a staging buffer per sub-group; frozen pieces in it must
    # carry their (unchanged) values, not whatever the buffer held.
    run_distributed(2, _frozen_body, str(tmp_path))
