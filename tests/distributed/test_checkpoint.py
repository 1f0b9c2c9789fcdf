"""Checkpoints resume exactly, at another world size or stage, refuse bad input and export plain weights."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.engine.checkpoint.reader import CheckpointError
from tests.harness import run_distributed
from tests.reference import SEQ, global_batches, gpt2_loss, tiny_gpt2, train_engine

STEPS, SAVE_AT = 10, 5


class _Tokens(torch.utils.data.Dataset):
    """Learnable sequences, each tagged with its index so tests can see which samples were read."""

    def __init__(self, n: int) -> None:
        self.tokens = global_batches(1, n, seed=99)[0]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "idx": torch.tensor(i)}


def _config(world: int, stage: int, gas: int, mb: int = 2, **checkpoint: object) -> dict:
    return {
        "train_batch_size": mb * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3, "warmup_type": "linear"},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 20_000},
        "checkpoint": checkpoint,
    }


def _shared_dir() -> str:
    """A temporary directory every rank agrees on (rank 0 creates it)."""
    holder = [tempfile.mkdtemp(prefix="slipstream-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


def _with_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():  # makes every step consume each rank's RNG: resume must restore it
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    return model


class _Trainer:
    """Runs optimizer steps from the engine's own data loader, recording local losses and sample ids."""

    def __init__(self, engine: object) -> None:
        self.engine, self.batches = engine, iter(engine.training_dataloader)
        self.losses: list[float] = []
        self.seen: list[int] = []

    def next_batch(self) -> dict:
        try:
            return next(self.batches)
        except StopIteration:  # the next epoch
            self.batches = iter(self.engine.training_dataloader)
            return next(self.batches)

    def run(self, steps: int) -> None:
        engine = self.engine
        for _ in range(steps):
            for _ in range(engine.gradient_accumulation_steps()):
                batch = self.next_batch()
                loss = gpt2_loss(engine, batch["input_ids"])
                engine.backward(loss)
                engine.step()
                self.losses.append(loss.item())
                self.seen.extend(batch["idx"].tolist())


# ---------------------------------------------------------------- 1. exact resume


def _with_offload(config: dict, offload: str, swap: str) -> dict:
    """``offload`` "cpu": optimizer state in CPU memory; "nvme": optimizer state and (stage 3) parameters
    in swap files under ``swap``, in several sub-groups with a persistent unit, so every path is exercised."""
    zero = config["zero_optimization"]
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": swap}, sub_group_size=20_000)
        if zero["stage"] == 3:
            zero.update(offload_param={"device": "nvme", "nvme_path": swap}, stage3_param_persistence_threshold=1000)
    return config


def _exact_resume_body(stage: int, gas: int, precision: str, async_save: bool, offload: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    directory = _shared_dir()
    extra = {precision: {"enabled": True}} if precision != "fp32" else {}
    config = {
        **_with_offload(_config(world, stage, gas, **{"async": async_save}), offload, os.path.join(directory, "swap")),
        **extra,
    }
    data = _Tokens(26 * gas)  # 6.5 optimizer steps per epoch: the epoch ends mid-window, after the save
    torch.manual_seed(rank)
    engine = slipstream.initialize(_with_dropout(tiny_gpt2(seed=0)), config, training_data=data)
    assert (type(engine.optimizer).__name__ == "OffloadAdam") == (offload != "none")
    full = _Trainer(engine)
    full.run(SAVE_AT)
    full_scale_at_save = engine.loss_scale()
    engine.save_checkpoint(directory, client_state={"note": "mid-run", "losses": torch.tensor(full.losses)})
    full.run(STEPS - SAVE_AT)  # with async, training goes on while the snapshot is written
    engine.close()

    torch.manual_seed(1000 + rank)  # different RNG and weights: everything must come from the checkpoint
    engine = slipstream.initialize(_with_dropout(tiny_gpt2(seed=3)), config, training_data=data)
    path, client = engine.load_checkpoint(directory)
    assert path is not None and path.endswith(f"global_step{SAVE_AT}")
    assert client["note"] == "mid-run"
    if rank == 0:  # client_state is saved once, from rank 0 (as DeepSpeed does)
        assert torch.equal(client["losses"], torch.tensor(full.losses[: SAVE_AT * gas]))
    assert (engine.global_steps, engine.micro_steps) == (SAVE_AT, SAVE_AT * gas)
    scale = engine.loss_scale()
    resumed = _Trainer(engine)
    resumed.run(STEPS - SAVE_AT)
    final = engine.consolidated_state_dict()
    engine.close()
    if precision == "fp16":
        assert scale == full_scale_at_save  # the dynamic loss scaler's state came back too
    tail = full.losses[SAVE_AT * gas :]
    assert resumed.losses == tail, f"stage {stage}: resumed losses {resumed.losses} != uninterrupted {tail}"  # bitwise
    assert resumed.seen == full.seen[SAVE_AT * gas * 2 :], "the resumed loader read different samples"
    first_epoch: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(first_epoch, full.seen[: 13 * gas])
    if rank == 0:
        assert sorted(i for ids in first_epoch for i in ids) == list(range(26 * gas))  # each sample once per epoch
        assert final is not None
        shutil.rmtree(directory)


@pytest.mark.parametrize(
    ("stage", "gas", "precision", "async_save", "offload"),
    [
        (0, 2, "fp32", False, "none"),
        (1, 2, "fp32", False, "none"),
        (2, 2, "fp32", True, "none"),
        (3, 2, "fp32", False, "none"),
        (3, 1, "fp32", True, "none"),
        (2, 1, "bf16", False, "none"),
        (1, 2, "fp16", True, "none"),
        (2, 2, "fp32", True, "cpu"),
        (3, 1, "bf16", False, "nvme"),
    ],
)
def test_exact_resume(stage: int, gas: int, precision: str, async_save: bool, offload: str) -> None:
    run_distributed(2, _exact_resume_body, stage, gas, precision, async_save, offload)


def _cross_offload_body(directory: str, saved_with: str, loaded_with: str) -> dict:
    world = dist.get_world_size()
    swap = os.path.join(directory, "swap")
    batches = global_batches(STEPS, 2 * 2 * world)
    engine = slipstream.initialize(tiny_gpt2(seed=0), _with_offload(_config(world, 3, gas=2), saved_with, swap))
    train_engine(engine, batches[:SAVE_AT])
    engine.save_checkpoint(directory)
    uninterrupted = train_engine(engine, batches[SAVE_AT:]).losses
    engine.close()
    engine = slipstream.initialize(tiny_gpt2(seed=4), _with_offload(_config(world, 3, gas=2), loaded_with, swap))
    assert (type(engine.optimizer).__name__ == "OffloadAdam") == (loaded_with != "none")
    engine.load_checkpoint(directory)
    resumed = train_engine(engine, batches[SAVE_AT:]).losses
    engine.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


@pytest.mark.parametrize(("saved_with", "loaded_with"), [("nvme", "none"), ("none", "cpu")])
def test_offload_checkpoint_loads_without_offload_and_back(saved_with: str, loaded_with: str, tmp_path: Path) -> None:
    """The checkpoint format does not depend on offload: the CPU Adam and torch's differ only in rounding."""
    result = run_distributed(2, _cross_offload_body, str(tmp_path / "ckpt"), saved_with, loaded_with)[0]
    torch.testing.assert_close(result["resumed"], result["uninterrupted"], rtol=1e-5, atol=0)


# ---------------------------------------------------------------- 2. reshard


def _save_sharded_body(directory: str, stage: int) -> list[float]:
    world = dist.get_world_size()
    engine = slipstream.initialize(tiny_gpt2(seed=0), _config(world, stage, gas=8 // (2 * world)))
    losses = train_engine(engine, global_batches(STEPS, 8)[:SAVE_AT]).losses
    engine.save_checkpoint(directory)
    engine.close()
    return losses


def _resume_at_new_size_body(directory: str, stage: int) -> dict:
    world = dist.get_world_size()
    config = _config(world, stage, gas=8 // (2 * world))
    batches = global_batches(STEPS, 8)
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    uninterrupted = train_engine(engine, batches).losses
    engine.close()
    engine = slipstream.initialize(tiny_gpt2(seed=4), config)
    engine.load_checkpoint(directory)
    resumed = train_engine(engine, batches[SAVE_AT:]).losses
    engine.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def test_reshard_stage3_world4_to_stage2_world2_and_stage0_world1(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(4, _save_sharded_body, directory, 3)[0]
    for world, stage in ((2, 2), (1, 0)):
        result = run_distributed(world, _resume_at_new_size_body, directory, stage)[0]
        full = result["uninterrupted"]
        torch.testing.assert_close(saved, full[:SAVE_AT], rtol=1e-5, atol=0)  # the same run before the save
        torch.testing.assert_close(result["resumed"], full[SAVE_AT:], rtol=1e-5, atol=0)


# ---------------------------------------------------------------- retention, interval, auto-resume


def _interval_body(directory: str) -> dict:
    world = dist.get_world_size()
    config = _config(
        world, 1, gas=1, save_dir=directory, interval=3, keep_last_n=2, auto_resume=True, **{"async": True}
    )
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    assert engine.resumed_from is None
    train_engine(engine, global_batches(STEPS, 2 * world))
    engine.close()  # waits for the background save of step 9
    kept = sorted(p for p in os.listdir(directory) if not p.startswith("."))
    engine = slipstream.initialize(tiny_gpt2(seed=1), config)
    resumed = (engine.resumed_from, engine.global_steps)
    engine.close()
    return {"kept": kept, "resumed": resumed, "latest": Path(directory, "latest").read_text()}


def test_interval_saves_keep_last_n_and_auto_resume(tmp_path: Path) -> None:
    result = run_distributed(2, _interval_body, str(tmp_path / "run"))[0]
    assert result["kept"] == ["global_step6", "global_step9", "latest"]
    assert result["latest"] == "global_step9"
    assert result["resumed"][0].endswith("global_step9") and result["resumed"][1] == 9


# ---------------------------------------------------------------- 4. bad input


def _bad_input_body(directory: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = slipstream.initialize(tiny_gpt2(seed=0), _config(world, 2, gas=1))
    train_engine(engine, global_batches(2, 2 * world))
    good = Path(engine.save_checkpoint(directory, tag="good"))
    root = Path(directory)
    variants = {
        "truncated": lambda d: _truncate(d / "rank00001.safetensors"),
        "missing": lambda d: (d / "rank00001.safetensors").unlink(),
        "flipped": lambda d: _flip_byte(d / "rank00001.safetensors"),
        "no_manifest": lambda d: (d / "manifest.json").unlink(),
    }
    if rank == 0:
        for name, damage in variants.items():
            shutil.copytree(good, root / name)
            damage(root / name)
        pickled = root / "deepspeed_style" / "global_step2"
        pickled.mkdir(parents=True)
        torch.save({"module": {}}, pickled / "mp_rank_00_model_states.pt")
    dist.barrier()
    messages = {}
    # rank 0 captures client_state (TypeError); every other rank raises slipstream's CheckpointError naming it
    with pytest.raises(TypeError if rank == 0 else CheckpointError) as err:
        engine.save_checkpoint(directory, tag="bad_client", client_state={"fn": len})
    messages["client_state"] = str(err.value)
    for name in [*variants, "deepspeed_style/global_step2"]:
        with pytest.raises(CheckpointError) as err:  # on every rank, whichever rank found the damage
            engine.load_checkpoint(directory, tag=name)
        messages[name] = str(err.value)
    engine.close()
    # latest names a damaged checkpoint: fall back to the newest complete one, with a warning
    if rank == 0:
        Path(directory, "latest").write_text("truncated")
    dist.barrier()
    engine = slipstream.initialize(tiny_gpt2(seed=0), _config(world, 2, gas=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _ = engine.load_checkpoint(directory)
    engine.close()
    messages["fallback"] = (path, [str(w.message) for w in caught])
    # the wrong model: a shape mismatch names the parameter
    engine = slipstream.initialize(tiny_gpt2(seed=0, n_embd=32), _config(world, 2, gas=1))
    with pytest.raises((CheckpointError, RuntimeError)) as err:
        engine.load_checkpoint(directory, tag="good")
    messages["wrong_model"] = str(err.value)
    engine.close()
    return messages


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bad_input_is_refused_with_a_precise_message(tmp_path: Path) -> None:
    messages = run_distributed(2, _bad_input_body, str(tmp_path / "bad"))
    for m in messages:  # every rank refuses (the ranks that read a healthy file name the one that did not)
        assert "rank00001.safetensors has" in m["truncated"] and "truncated" in m["truncated"]
        assert "rank00001.safetensors is missing" in m["missing"]
        assert "client_state['fn'] is a builtins.builtin_function_or_method" in m["client_state"]
        assert "manifest.json is missing" in m["no_manifest"]
        assert (
            "holds no weights" in m["deepspeed_style/global_step2"]
            and "mp_rank_00_model_states.pt" in m["deepspeed_style/global_step2"]
        )
        assert "'transformer.wte.weight' has shape (256, 64) in the checkpoint but (256, 32)" in m["wrong_model"]
        path, caught = m["fallback"]
        assert path.endswith("good") and any("latest points to 'truncated'" in w for w in caught)
    assert "rank00001.safetensors fails its CRC-32 check" in messages[1]["flipped"]  # the rank that read it
    assert "CRC-32" in messages[0]["flipped"]


# ---------------------------------------------------------------- 6. export


def _export_body(directory: str) -> dict:
    world = dist.get_world_size()
    engine = slipstream.initialize(tiny_gpt2(seed=0), _config(world, 3, gas=1))
    train_engine(engine, global_batches(3, 2 * world))
    engine.save_checkpoint(directory)
    tokens = global_batches(1, 2, seed=7)[0]
    with torch.no_grad():
        logits = engine(input_ids=tokens).logits
    engine.close()
    return {"logits": logits, "tokens": tokens}


def test_export_loads_into_plain_gpt2_with_the_same_logits(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from slipstream.cli import main

    directory, out = tmp_path / "ckpt", tmp_path / "model.safetensors"
    result = run_distributed(2, _export_body, str(directory))[0]
    assert main(["checkpoint", "export", str(directory), str(out)]) == 0  # offline: files only, one process
    state = load_file(out)
    model = tiny_gpt2(seed=5)
    assert set(state) == set(model.state_dict())
    assert "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(input_ids=result["tokens"]).logits
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)
    assert logits.shape == (2, SEQ, 256)
