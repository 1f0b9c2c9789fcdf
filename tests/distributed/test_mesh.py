"""The mesh at 4 ranks: groups and coordinates are exactly the rank grid (no training)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.engine.config import ALL_AXES, SlipstreamConfig, mesh_sizes
from slipstream.engine.data import DistributedDataLoader
from slipstream.engine.parallel import mesh as mesh_module
from slipstream.engine.parallel.mesh import Mesh
from tests.harness import run_distributed

# config -> every axis's groups (a partition of the ranks); rank = (((pp·dp + dp)·cp + cp)·sp + sp)·tp + tp (tp innermost)
GRIDS = {
    "tp2_dp2": (
        {"tensor_parallel": {"autotp_size": 2}},
        {
            "tp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "pp": [[0], [1], [2], [3]],
            "sp": [[0], [1], [2], [3]],
            "cp": [[0], [1], [2], [3]],
            "ep": [[0], [1], [2], [3]],
            "dense": [[0, 2], [1, 3]],
        },
    ),
    "pp2_dp2": (
        {"pipeline": {"stages": 2}},
        {
            "pp": [[0, 2], [1, 3]],
            "dp": [[0, 1], [2, 3]],
            "tp": [[0], [1], [2], [3]],
            "sp": [[0], [1], [2], [3]],
            "cp": [[0], [1], [2], [3]],
            "ep": [[0], [1], [2], [3]],
            "dense": [[0, 1], [2, 3]],
        },
    ),
    "sp2_dp2": (
        {"sequence_parallel_size": 2},
        {
            "sp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "tp": [[0], [1], [2], [3]],
            "pp": [[0], [1], [2], [3]],
            "cp": [[0], [1], [2], [3]],
            "ep": [[0], [1], [2], [3]],
            "dense": [[0, 1, 2, 3]],
        },
    ),
    "dp4": (
        {},
        {
            "dp": [[0, 1, 2, 3]],
            "tp": [[0], [1], [2], [3]],
            "pp": [[0], [1], [2], [3]],
            "sp": [[0], [1], [2], [3]],
            "cp": [[0], [1], [2], [3]],
            "ep": [[0], [1], [2], [3]],
            "dense": [[0, 1, 2, 3]],
        },
    ),
}


def _grid_body(extra: dict) -> dict:
    rank = dist.get_rank()
    config = SlipstreamConfig.load({"train_micro_batch_size_per_gpu": 1, **extra}, world_size=None)
    mesh = Mesh.build(mesh_sizes(config, dist.get_world_size()))
    seen: dict[str, list[int]] = {}
    for axis in (*ALL_AXES, "dense"):
        group = mesh.dense_group if axis == "dense" else mesh.group(axis)
        ranks = dist.get_process_group_ranks(group)
        assert ranks == list(mesh.ranks(*(("dp", "cp", "sp") if axis == "dense" else (axis,)))), axis
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)  # the group really connects exactly these ranks
        assert total.item() == sum(ranks), (axis, ranks, total)
        seen[axis] = ranks
        if axis != "dense":
            assert mesh.rank_of(axis) == ranks.index(rank) and mesh.size(axis) == len(ranks), axis
    return seen


@pytest.mark.parametrize("name", list(GRIDS))
def test_groups_and_coordinates_are_the_rank_grid(name: str) -> None:
    extra, expected = GRIDS[name]
    per_rank = run_distributed(4, _grid_body, extra)
    for rank, seen in enumerate(per_rank):
        mine = {axis: next(g for g in groups if rank in g) for axis, groups in expected.items()}
        assert seen == mine, (rank, seen)


def _non_factoring_body() -> str:
    with pytest.raises(slipstream.ConfigError) as info:
        slipstream.initialize(
            torch.nn.Linear(2, 2),
            {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "tensor_parallel": {"autotp_size": 3},
            },
        )
    return str(info.value)


def test_non_factoring_world_is_a_one_line_config_error() -> None:
    message = run_distributed(4, _non_factoring_body)[0]
    assert "\n" not in message
    assert message.startswith(
        "mesh: world size 4 does not factor as pipeline.stages 1 × data_parallel_size dp × "
        "context_parallel.size 1 × sequence_parallel_size 1 × tensor_parallel.autotp_size 3"
    ), message


def _unsupported_body(extra: dict) -> str:
    with pytest.raises(slipstream.ConfigError) as info:
        slipstream.initialize(
            torch.nn.Linear(2, 2),
            {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra},
        )
    return str(info.value)


@pytest.mark.parametrize(
    ("extra", "key", "why"),
    [
        (
            {"sequence_parallel_size": 2, "context_parallel": {"size": 2, "method": "zigzag"}},
            "context_parallel.method: 'zigzag' with sequence_parallel_size 2",
            "not contiguous after Ulysses' all-to-all",
        )
    ],
)
def test_combinations_that_cannot_work_are_refused_saying_why(extra: dict, key: str, why: str) -> None:
    message = run_distributed(4, _unsupported_body, extra)[0]
    assert message.startswith(key) and why in message, message


def _engine_body() -> dict:
    data = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    engine = slipstream.initialize(
        torch.nn.Linear(2, 1),
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        training_data=data,
    )
    loader = engine.training_dataloader
    result = {
        "dp": engine.mesh.size("dp"),
        "dp_rank": engine.mesh.rank_of("dp"),
        "replicas": loader.sampler.num_replicas,
        "sampler_rank": loader.sampler.rank,
        "tp_group_ranks": dist.get_process_group_ranks(engine.mesh.group("tp")),
    }
    engine.close()
    return result


def test_engine_mesh_and_loader_follow_dp() -> None:
    for rank, result in enumerate(run_distributed(4, _engine_body)):
        assert result == {"dp": 4, "dp_rank": rank, "replicas": 4, "sampler_rank": rank, "tp_group_ranks": [rank]}


def _shared_batches_body() -> list[list[float]]:
    config = SlipstreamConfig.load(
        {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}}, world_size=None
    )
    mesh = Mesh.build(mesh_sizes(config, dist.get_world_size()), log=False)
    data = torch.arange(8, dtype=torch.float32)
    loader = DistributedDataLoader(data, 2, mesh.rank_of("dp"), mesh.size("dp"))
    return [batch.tolist() for batch in loader]


def test_ranks_sharing_a_dp_coordinate_read_the_same_batches() -> None:
    batches = run_distributed(4, _shared_batches_body)  # tp 2 × dp 2: ranks 0,1 are dp 0; ranks 2,3 are dp 1
    assert batches[0] == batches[1] and batches[2] == batches[3]
    assert sorted(sum(batches[0] + batches[2], [])) == list(range(8))  # dp halves cover the data once


def _cheap_body() -> int:
    before = len(mesh_module._groups)
    mesh = Mesh.build(
        mesh_sizes(SlipstreamConfig.load({"train_micro_batch_size_per_gpu": 1}, world_size=None), 4), log=False
    )
    assert mesh.dense_group is dist.group.WORLD and mesh.group("dp") is dist.group.WORLD
    return len(mesh_module._groups) - before


def test_a_data_parallel_mesh_creates_no_process_group() -> None:
    assert run_distributed(4, _cheap_body) == [0, 0, 0, 0]  # arithmetic only: no group, no collective
