"""A rank whose step raises makes its peers stop at once with its error; every wait ends by the timeout.

(slipstream/comm/abort.py, [Note: fail together, at once]; collectives.Work.wait's explicit limit.)
Before: under a pipeline, a model error on stage 1 in step 0 left stage 0 in its gradient receive past
``comms_timeout_seconds`` (gloo's receives took no timeout at all), and the report said nothing of the error.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import CollectiveError, p2p
from slipstream.comm.abort import abort_for
from tests.harness import run_distributed
from tests.reference import tiny_gpt2

FAILING = 1


def _boom(*_: Any) -> None:
    raise ValueError("the model failed on this rank's data")


def _failing_step_body(extra: dict[str, Any], accumulation: int) -> dict[str, str]:
    """Two steps; on rank FAILING the last block raises in step 0. What each rank raised."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "comms_timeout_seconds": 120,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }
    engine = slipstream.initialize(tiny_gpt2(n_layer=4), config)
    if dist.get_rank() == FAILING:
        engine.module.transformer.h[3].register_forward_hook(_boom)
    try:
        for _ in range(2):
            for _ in range(accumulation):
                tokens = torch.randint(0, 256, (2, 16))
                engine.backward(engine(input_ids=tokens, labels=tokens).loss)
                engine.step()
    except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
        return {"kind": type(err).__name__, "message": str(err)}
    return {"kind": "none", "message": ""}


def _check(results: list[dict[str, str]]) -> None:
    assert results[FAILING]["kind"] == "ValueError", results[FAILING]
    peer = results[1 - FAILING]
    assert peer["kind"] == "CollectiveError", peer
    # stopped by the failed rank's abort (a timeout would say "timed out" and name no error)
    assert f"because another rank failed first — rank {FAILING}:" in peer["message"], peer["message"]
    assert "ValueError: the model failed on this rank's data" in peer["message"], peer["message"]


def test_a_model_error_in_one_pipeline_stage_stops_the_other_stage_with_that_error() -> None:
    _check(run_distributed(2, _failing_step_body, {"pipeline": {"stages": 2}}, 2, timeout=100))


def test_a_model_error_on_one_data_parallel_rank_stops_its_peer_in_the_gradient_reduction() -> None:
    _check(run_distributed(2, _failing_step_body, {"zero_optimization": {"stage": 2}}, 1, timeout=100))


def _unanswered_receive_body() -> str:
    """Rank 0 waits for a message rank 1 never sends; the wait must end by the 3 s limit, as a CollectiveError."""
    slipstream.init_distributed(timeout=3.0)
    try:
        if dist.get_rank() == 0:
            try:
                p2p.recv(torch.zeros(4), 1, channel=7).wait()
            except CollectiveError as err:
                return str(err)
            return "received"
        time.sleep(6)  # silent past rank 0's limit
        return "silent"
    finally:
        abort_for(RuntimeError("test over"), "test")  # the timed-out pair is closed: the harness starts a fresh pool


def test_a_pipeline_receive_ends_by_the_timeout_naming_itself() -> None:
    message = run_distributed(2, _unanswered_receive_body, timeout=60)[0]
    assert message.startswith("rank 0/2: p2p_recv") and "timed out" in message, message
