"""torch DCP checkpoints: FSDP2 -> Slipstream and back, at another world size, and refusals."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.engine.checkpoint.formats.dcp import load_dcp, save_dcp
from slipstream.engine.checkpoint.validate import CheckpointError
from slipstream.utils.pieces import flat_boxes
from tests.harness import run_distributed

VOCAB, HIDDEN, MB, SEQ = 29, 12, 2, 8
LR, WD = 1e-2, 0.01


class Tiny(torch.nn.Module):
    """Odd widths, so ZeRO's flat ranges start and end inside rows and FSDP2's dim-0 chunks are uneven."""

    def __init__(self, mlp: int = 21) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, mlp), torch.nn.GELU(), torch.nn.Linear(mlp, HIDDEN))
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return torch.nn.functional.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of step ``step`` (2 micro-batches of MB rows)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (2 * MB, SEQ), generator=g)
    return x, (3 * x + 1) % VOCAB


def _mine(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    return x[rows], y[rows]


def _mean(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.manual_seed(seed)
    model = Tiny()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def _fsdp2_train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*_mine(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
    return losses


def _fsdp2_save(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str, titan: bool = False) -> None:
    """``get_state_dict`` + ``dcp.save``; ``titan``: torchtitan's layout (model keys at the top, optimizer flattened)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=titan))
    dcp.save(
        {**model_sd, "optimizer": optim_sd} if titan else {"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path
    )


def _fsdp2_load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _engine(stage: int, seed: int = 7, scheduler: dict | None = None, **model: int) -> object:
    torch.manual_seed(seed)
    config = {
        **({"scheduler": scheduler} if scheduler else {}),
        "train_batch_size": MB * dist.get_world_size() * (2 // dist.get_world_size()),
        "train_micro_batch_size_per_gpu": MB * (2 // dist.get_world_size()),
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 200},
    }
    return slipstream.initialize(Tiny(**model), config)


def _engine_train(engine: object, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(*_mine(step))
        engine.backward(loss)
        engine.step()
        losses.append(_mean(loss))
    return losses


def _read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole (for comparisons)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=path)
    return state


def _assert_close_losses(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


def _fsdp2_reference(tmp: str) -> dict[str, list[float]]:
    """FSDP2 trains 6 steps, saving after 2 and 4: its losses are what every other run must reproduce."""
    d = Path(tmp)
    model, opt = _fsdp2(seed=0)
    _fsdp2_train(model, opt, range(2))
    _fsdp2_save(model, opt, str(d / "fsdp2-2"))
    _fsdp2_save(model, opt, str(d / "titan-2"), titan=True)
    after = _fsdp2_train(model, opt, range(2, 4))
    _fsdp2_save(model, opt, str(d / "fsdp2-4"))
    return {"after": after, "later": _fsdp2_train(model, opt, range(4, 6))}


def _round_trip_body(stage: int, tmp: str) -> None:
    d = Path(tmp)
    reference = _fsdp2_reference(tmp)
    fsdp2_losses, fsdp2_later = reference["after"], reference["later"]

    # (a) Slipstream (other initial weights) loads FSDP2's checkpoint and continues identically.
    engine = _engine(stage)
    path, client_state = engine.load_checkpoint(d / "fsdp2-2")  # the public path: a DCP directory is recognised
    assert (path, client_state) == (str(d / "fsdp2-2"), {})
    _assert_close_losses(_engine_train(engine, range(2, 4)), fsdp2_losses)
    engine.save_dcp(d / "ours-4")
    theirs, ours = _read_all(str(d / "fsdp2-4")), _read_all(str(d / "ours-4"))
    for key, value in theirs.items():  # weights and Adam moments after the same 4 steps
        assert key in ours, key
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
    ours_later = _engine_train(engine, range(4, 6))
    engine.close()

    # (b) FSDP2 (other initial weights) loads Slipstream's checkpoint and continues identically.
    model, opt = _fsdp2(seed=3)
    _fsdp2_load(model, opt, str(d / "ours-4"))
    back = _fsdp2_train(model, opt, range(4, 6))
    _assert_close_losses(back, ours_later)
    _assert_close_losses(back, fsdp2_later)


def _other_world_body(tmp: str, expected: list[float]) -> None:
    """One rank loads what two ranks wrote (torchtitan's layout) and continues with the same losses."""
    engine = _engine(stage=1)
    load_dcp(engine.checkpoint_target(), Path(tmp) / "titan-2")
    _assert_close_losses(_engine_train(engine, range(2, 4)), expected)
    save_dcp(engine.checkpoint_target(), Path(tmp) / "one-rank-4")
    engine.close()
    # Slipstream's own extras come back too: counters and the LR schedule.
    schedule = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": LR, "warmup_type": "linear"}}
    engines = [_engine(stage=2, scheduler=schedule) for _ in range(2)]
    _engine_train(engines[0], range(3))
    save_dcp(engines[0].checkpoint_target(), Path(tmp) / "scheduled")
    load_dcp(engines[1].checkpoint_target(), Path(tmp) / "scheduled")
    assert engines[1].global_steps == 3 and engines[1].get_lr() == engines[0].get_lr() != [LR]
    assert engines[1].lr_scheduler.state_dict() == engines[0].lr_scheduler.state_dict()
    _assert_close_losses(_engine_train(engines[1], range(3, 5)), _engine_train(engines[0], range(3, 5)))
    for engine in engines:
        engine.close()


def _reload_body(tmp: str, expected: list[float]) -> None:
    """Two ranks (ZeRO-3) load what one rank saved, and carry on like the original FSDP2 run."""
    engine = _engine(stage=3)
    target = engine.checkpoint_target()
    load_dcp(target, Path(tmp) / "one-rank-4")
    assert engine.global_steps == 2  # counted since the FSDP2 checkpoint, which holds no Slipstream counters
    _assert_close_losses(_engine_train(engine, range(4, 6)), expected)
    engine.close()


def _refusal_body(tmp: str) -> None:
    engine = _engine(stage=3, mlp=22)
    target = engine.checkpoint_target()
    snapshot = [o.value.clone() for o in target.shards.sharded_state()]
    with pytest.raises(
        CheckpointError, match=r"parameter 'blocks\.0\.0\.weight' has shape \[21, 12\] in the checkpoint but \[22, 12\]"
    ):
        load_dcp(target, Path(tmp) / "fsdp2-2")
    for value, o in zip(snapshot, target.shards.sharded_state()):
        assert torch.equal(value, o.value)
    with pytest.raises(CheckpointError, match="no DCP checkpoint here"):
        load_dcp(target, Path(tmp) / "nowhere")
    engine.close()


@pytest.mark.parametrize("stage", [3, 1])
def test_fsdp2_to_slipstream_and_back(stage: int, tmp_path: Path) -> None:
    run_distributed(2, _round_trip_body, stage, str(tmp_path))


def test_other_world_size_and_refusals(tmp_path: Path) -> None:
    reference = run_distributed(2, _fsdp2_reference, str(tmp_path))[0]
    run_distributed(1, _other_world_body, str(tmp_path), reference["after"])
    run_distributed(2, _reload_body, str(tmp_path), reference["later"])
    run_distributed(2, _refusal_body, str(tmp_path))


def test_flat_boxes_tile_the_range() -> None:
    shape = (3, 4, 5)
    full = torch.arange(60).view(shape)
    for start, end in [(0, 60), (7, 8), (3, 58), (20, 40), (19, 41), (0, 1), (59, 60)]:
        got = torch.cat(
            [full[tuple(slice(o, o + s) for o, s in zip(*box))].reshape(-1) for box in flat_boxes(shape, start, end)]
        )
        assert torch.equal(got, torch.arange(start, end)), (start, end)
    assert flat_boxes((), 0, 1) == [((), ())]
