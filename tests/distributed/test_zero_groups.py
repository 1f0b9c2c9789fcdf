"""ZeRO over a process group per parameter group: two groups sharded over different ranks still train
exactly like one process on the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slipstream
from tests.harness import run_distributed
from tests.reference import Trajectory, assert_close_trajectory, global_batches, gpt2_loss, tiny_gpt2, train_reference

STEPS = 12
MB = 2


def _groups(model: torch.nn.Module, pair: dist.ProcessGroup) -> list[dict]:
    # Matrices sharded over this rank's pair ({0,1} or {2,3}); vectors over all four ranks (the default).
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "process_group": pair},
        {"params": [p for p in model.parameters() if p.dim() < 2]},
    ]


def _group_sizes(strategy: object) -> list[int]:
    """The sizes of the process groups the strategy shards (stage 0: averages) parameters over."""
    if hasattr(strategy, "parts"):  # stages 1 and 2
        return sorted(part.world for part in strategy.parts)
    if hasattr(strategy, "groups"):  # stage 3
        return sorted(g.lanes.world for g in strategy.groups)
    return sorted({dist.get_world_size(b.group) for b in strategy.reducer.buckets})


def _per_group_body(stage: int, offload: str, save_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # on every rank, as torch requires
    pair = pairs[rank // 2]
    config = {
        "train_batch_size": MB * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0},
    }
    if offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": offload}
    model = tiny_gpt2(seed=rank)  # rank 0's weights win
    engine = slipstream.initialize(model, config, model_parameters=_groups(model, pair))
    # Ranks 0 and 2 see micro-batch X, ranks 1 and 3 micro-batch Y: the mean over a pair and over all
    # four ranks are then both the gradient of X ∪ Y, the batch the reference trains on.
    batches = global_batches(STEPS, 2 * MB)
    losses, norms = [], []
    for tokens in batches:
        loss = gpt2_loss(engine, tokens[(rank % 2) * MB : (rank % 2 + 1) * MB])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        norms.append(engine.get_global_grad_norm())
    sizes = _group_sizes(engine.strategy)
    state = engine.consolidated_state_dict()
    engine.save_checkpoint(save_dir, tag="end")  # each element saved once, although the pairs hold replicas
    engine.close()
    again = tiny_gpt2(seed=7)
    resumed = slipstream.initialize(again, config, model_parameters=_groups(again, pair))
    resumed.load_checkpoint(save_dir, tag="end")
    reloaded = resumed.consolidated_state_dict()
    resumed.close()
    if rank == 0:
        ref = train_reference(tiny_gpt2(seed=0), batches, lr=1e-3, weight_decay=0.01, clip=1.0)
        ours = Trajectory(losses, state, norms)
        assert_close_trajectory(ours, ref, loss_rtol=1e-5, param_atol=5e-5, param_rtol=1e-4)
        for a, b in zip(ours.grad_norms, ref.grad_norms):  # every parameter counted once, across groups
            assert abs(a - b) <= 1e-4 * b, (a, b)
        assert ours.losses[-1] < ours.losses[0] - 0.3
        for name, value in state.items():
            assert torch.equal(reloaded[name], value), name
    else:
        assert state is None and reloaded is None
    return {"losses": losses, "sizes": sizes}


@pytest.mark.parametrize(
    ("stage", "offload"), [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu")]
)
def test_parameter_groups_sharded_over_different_process_groups(stage: int, offload: str, tmp_path: Path) -> None:
    results = run_distributed(4, _per_group_body, stage, offload, str(tmp_path))
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert all(r["sizes"] == [2, 4] for r in results)  # the matrices really were sharded over a pair
