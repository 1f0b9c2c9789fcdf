"""What hosts do to a ZeRO-3 model that DeepSpeed tolerates (issue 30): finish, never an exception, never a wrong step.

- ``state_dict()`` of a partitioned model (transformers' ``save_pretrained`` fallback) and
  ``.cpu()`` / ``.to(device)`` (Lightning's teardown) on it; training continues unchanged after.
- ``offload_param`` without ``offload_optimizer`` (axolotl's ``zero3_bf16_cpuoffload_params``),
  bit for bit the run without offload, and through a checkpoint.
- A model loaded straight into shards (``from_pretrained``), then ``initialize``: the training
  engine takes the shards over without gathering the model.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import slipstream
from tests.harness import run_distributed
from tests.reference import global_batches, gpt2_loss, micro_batch, tiny_gpt2

MB = 2


def _config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _train(engine: object, batches: list[torch.Tensor]) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        loss = gpt2_loss(engine, micro_batch(batch, 0, rank, world, MB))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _host_calls_body() -> dict:
    batches = global_batches(4, MB * dist.get_world_size())
    plain = slipstream.initialize(tiny_gpt2(seed=3), _config())
    want = _train(plain, batches)
    plain.close()
    engine = slipstream.initialize(tiny_gpt2(seed=3), _config())
    got = _train(engine, batches[:2])
    state = engine.module.state_dict()  # placeholders, as DeepSpeed's: loading one fails on its shape
    partitioned = [n for n, t in state.items() if t.numel() == 0]
    engine.module.cpu()
    engine.module.to("cpu")
    engine.module.to(device="cpu")
    got += _train(engine, batches[2:])  # the moves changed nothing
    errors = {}
    for name, call in {
        "dtype": lambda: engine.module.to(torch.bfloat16),
        "detach": lambda: engine.module.transformer.wte.weight.detach() + 1,
    }.items():
        try:
            call()
            errors[name] = None
        except RuntimeError as err:
            errors[name] = str(err)
    engine.close()
    return {"want": want, "got": got, "partitioned": partitioned, "keys": len(state), "errors": errors}


def test_state_dict_and_device_moves_of_a_partitioned_model_finish_and_change_nothing() -> None:
    result = run_distributed(2, _host_calls_body)[0]
    assert result["got"] == result["want"]
    assert len(result["partitioned"]) >= result["keys"] - 1 and "transformer.wte.weight" in result["partitioned"]
    assert "to(dtype=torch.bfloat16) on a partitioned parameter" in result["errors"]["dtype"]
    assert (
        "used a partitioned parameter while its unit was not gathered" in result["errors"]["detach"]
    )  # outside state_dict


def _param_offload_body(device: str, precision: str | None, swap: str) -> dict:
    batches = global_batches(4, MB * dist.get_world_size())
    extra = {precision: {"enabled": True}} if precision else {}
    plain = slipstream.initialize(tiny_gpt2(seed=4), {**_config(), **extra})
    want = _train(plain, batches)
    want_weights = plain.consolidated_state_dict()
    plain.close()
    offload = {"offload_param": {"device": device, "nvme_path": swap}}
    engine = slipstream.initialize(tiny_gpt2(seed=4), {**_config(**offload), **extra})
    got = _train(engine, batches[:2])
    checkpoint = os.path.join(swap, "ckpt")
    engine.save_checkpoint(checkpoint, tag="t")
    got += _train(engine, batches[2:])
    weights = engine.consolidated_state_dict()
    engine.close()
    again = slipstream.initialize(tiny_gpt2(seed=9), {**_config(**offload), **extra})
    again.load_checkpoint(checkpoint, tag="t")
    resumed = _train(again, batches[2:])
    again.close()
    same = None
    if dist.get_rank() == 0:
        same = all(torch.equal(weights[k], want_weights[k]) for k in want_weights)
    return {"want": want, "got": got, "resumed": resumed, "same_weights": same}


@pytest.mark.parametrize(("device", "precision"), [("cpu", None), ("nvme", None), ("cpu", "bf16")])
def test_parameter_offload_without_optimizer_offload_is_bit_for_bit_the_run_without(
    device: str, precision: str | None
) -> None:
    result = run_distributed(
        2, _param_offload_body, device, precision, tempfile.mkdtemp(prefix="slipstream-param-offload-")
    )[0]
    assert result["got"] == result["want"] and result["same_weights"]
    assert result["resumed"] == result["want"][2:]


def _hand_over_body(path: str) -> dict:
    from transformers import GPT2LMHeadModel

    from slipstream.comm import comms_log
    from slipstream.integrations.transformers import from_pretrained

    reference = tiny_gpt2(seed=5)
    if dist.get_rank() == 0:
        reference.save_pretrained(path)
    dist.barrier()
    model = from_pretrained(GPT2LMHeadModel, path, _config())
    comms_log.next_step()
    engine = slipstream.initialize(model, _config())
    gathered = sum(r.nbytes for r in comms_log.records if r.op == "all_gather")
    batches = global_batches(3, MB * dist.get_world_size())
    losses = _train(engine, batches)
    engine.close()
    reference_engine = slipstream.initialize(reference, _config())
    want = _train(reference_engine, batches)
    reference_engine.close()
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {"losses": losses, "want": want, "gathered": gathered, "model_bytes": model_bytes}


def test_initialize_takes_the_shards_over_from_the_loading_engine_without_gathering() -> None:
    path = tempfile.mkdtemp(prefix="slipstream-handover-")
    result = run_distributed(2, _hand_over_body, path)[0]
    assert result["losses"] == result["want"]
    assert result["gathered"] < result["model_bytes"] / 2, result  # closing would have gathered every unit
