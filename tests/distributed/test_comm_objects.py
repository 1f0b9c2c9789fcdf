"""Python objects between ranks on the recorded path (comm/collectives.py, [Note: objects on the recorded path]):
every rank gets what the torch.distributed object collectives would give, and the comms log names each transfer."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.harness import run_distributed


def _body() -> dict[str, Any]:
    from slipstream import comm

    rank = dist.get_rank()
    comm.comms_log.records.clear()
    # sizes that differ per rank (padding to the largest), a tensor inside, an exception text
    mine = {"rank": rank, "text": "x" * (10 + 100 * rank), "tensor": torch.arange(rank + 1.0)}
    every = comm.all_gather_objects(mine, tag="test objects")
    gathered = comm.gather_objects(("piece", rank, torch.full((rank + 2,), float(rank))), dst=0, tag="test gather")
    verdict = comm.broadcast_object({"from": rank, "ok": True} if rank == 1 else None, src=1, tag="test verdict")
    tags = [r.tag for r in comm.comms_log.records]
    return {"every": every, "gathered": gathered, "verdict": verdict, "tags": tags}


def test_objects_cross_ranks_on_the_recorded_path() -> None:
    results = run_distributed(3, _body)
    for rank, result in enumerate(results):
        assert [e["rank"] for e in result["every"]] == [0, 1, 2]
        assert [len(e["text"]) for e in result["every"]] == [10, 110, 210]
        assert all(torch.equal(e["tensor"], torch.arange(r + 1.0)) for r, e in enumerate(result["every"]))
        assert result["verdict"] == {"from": 1, "ok": True}
        if rank == 0:
            assert [(p[0], p[1]) for p in result["gathered"]] == [("piece", 0), ("piece", 1), ("piece", 2)]
            assert all(torch.equal(p[2], torch.full((r + 2,), float(r))) for r, p in enumerate(result["gathered"]))
        else:
            assert result["gathered"] is None
        assert result["tags"] == [
            "test objects (sizes)",
            "test objects",
            "test gather (sizes)",
            "test gather",
            "test verdict (size)",
            "test verdict",
        ]
