"""One initial weight sync: whatever each rank built, every parallelism starts from global rank 0's model.

The sync happens once, world-wide, before any cut (``engine/parallel/weights.py``): each rank below
builds its model from its own seed, and the assembled weights after ``initialize`` must be exactly
the model rank 0 built, under a pipeline (a tied embedding held by both ends), tensor parallelism
and expert parallelism alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.engine.config import SlipstreamConfig, mesh_sizes
from slipstream.engine.parallel.mesh import Mesh
from tests.harness import run_distributed
from tests.reference import tiny_gpt2, tiny_llama, tiny_mixtral

BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def _mixtral(seed: int) -> torch.nn.Module:
    return tiny_mixtral(seed, hidden=32, intermediate=48, vocab=64)


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "pp2_dp2_tied": (tiny_gpt2, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}),
    "tp2_dp2": (tiny_llama, {"tensor_parallel": {"autotp_size": 2}}),
    "ep2_dp4": (_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2}}),
}


def _body() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for name, (build, extra) in CASES.items():
        engine = slipstream.initialize(build(seed=rank), {**BASE, **extra})
        state = engine.consolidated_state_dict()
        if rank == 0:
            reference = build(seed=0).state_dict()
            out[name] = sorted(n for n, v in state.items() if not torch.equal(v, reference[n].float()))
            out[name + " names"] = sorted(state) == sorted(n for n, _ in build(seed=0).named_parameters())
        engine.close()
    mesh = Mesh.build(
        mesh_sizes(SlipstreamConfig.load({**BASE, "pipeline": {"stages": 2}}, world_size=None), 4), log=False
    )
    group = mesh.pair_group("pp", (0, 1))
    out["pair"] = dist.get_process_group_ranks(group) if group is not None else None
    return out


def test_every_parallelism_starts_from_rank_0s_model() -> None:
    results = run_distributed(4, _body)
    for name in CASES:
        assert results[0][name] == [], f"{name}: parameters differing from rank 0's model: {results[0][name]}"
        assert results[0][name + " names"], name
    # The pipeline's first and last stage pair up along pp, one group per dp coordinate.
    assert [r["pair"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
