"""Pipeline parallelism on unchanged models, against one process training the same global batch.

Every schedule at p 2, 1F1B at p 4, p 2 × dp 2 at ZeRO 1-3 and p 2 × tp 2 reproduce the reference
(losses 1e-5 relative per step; weights 1e-5, GPT-2's 5e-5/1e-4 as in test_tensor_parallel: Adam
amplifies rounding on near-zero gradients). Activations cross each boundary exactly
2·m·b·s·h·4 bytes per step; ZeRO-3 gathers each unit once per step, not once per micro-batch;
measured bubbles of sleeping stages match the schedule's prediction; checkpoints move pp 2 → 1 → 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import (
    Trajectory,
    assert_close_trajectory,
    train_lm_reference,
    train_reference,
    train_step_on_global_batch,
)

SEQ, B, VOCAB, LR, STEPS, HIDDEN = 16, 2, 128, 1e-3, 3, 64
GPT2_WEIGHTS = {"atol": 5e-5, "rtol": 1e-4}
LLAMA_WEIGHTS = {"atol": 1e-5, "rtol": 1e-5}


def _gpt2(layers: int = 4) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=HIDDEN,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _llama(layers: int = 4) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


BUILD = {"gpt2": _gpt2, "llama": _llama}


def _batches(rows: int, steps: int = STEPS, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(steps)]


def _config(
    pp: int, schedule: str, m: int, v: int = 1, stage: int = 0, pipeline_partition: str = "parameters", **extra: Any
) -> dict[str, Any]:
    return {
        "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v, "partition": pipeline_partition},
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": m,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        **extra,
    }


def _train(engine: Any, batches: list[torch.Tensor]) -> list[float]:
    """The user's loop: every micro-batch through engine/backward/step; the step's mean loss over the world."""
    return [train_step_on_global_batch(engine, tokens, B) for tokens in batches]


def _run_case(model: str, pp: int, schedule: str, m: int, v: int = 1, stage: int = 0, **extra: Any) -> dict[str, Any]:
    engine = slipstream.initialize(BUILD[model](), _config(pp, schedule, m, v, stage, **extra))
    ranges = engine.pipeline.ranges
    assert (
        ranges[0].start == 0
        and all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        and all(len(r) for r in ranges)
    )
    dp = engine.mesh.size("dp")
    losses = _train(engine, _batches(m * B * dp))
    records = comms_log.last  # the last step's traffic
    result = {
        "losses": losses,
        "state": engine.consolidated_state_dict(),
        "p2p": sum(r.nbytes for r in records if r.op == "p2p"),
        "gathers": sum(1 for r in records if r.op == "all_gather" and r.tag.startswith("ZeRO-3 unit")),
        "scatters": sum(1 for r in records if r.op == "reduce_scatter" and r.tag.startswith("ZeRO-3 gradients")),
        "units": len(getattr(engine.strategy, "units", ())),
        "bucket_bytes": sum(
            r.nbytes for r in records if r.op == "reduce_scatter" and r.tag.startswith("gradient bucket")
        ),
        "stage_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad),
        "bubble": engine.pipeline.last_report.timing.bubble,
        "in_flight": engine.pipeline.last_report.timing.in_flight,
        "monitor": dict(engine.monitor.last),
    }
    engine.close()
    return result


def _cases_body(cases: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {name: _run_case(**kwargs) for name, kwargs in cases}


WORLD2 = [
    ("gpt2-afab", {"model": "gpt2", "pp": 2, "schedule": "afab", "m": 4}),
    ("gpt2-1f1b", {"model": "gpt2", "pp": 2, "schedule": "1f1b", "m": 4, "steps_per_print": 1}),
    ("gpt2-zb1p", {"model": "gpt2", "pp": 2, "schedule": "zb1p", "m": 4}),
    ("gpt2-zbv", {"model": "gpt2", "pp": 2, "schedule": "zbv", "m": 8, "v": 2}),
    ("llama-interleaved", {"model": "llama", "pp": 2, "schedule": "interleaved_1f1b", "m": 4, "v": 2}),
    ("llama-zb1p-v2", {"model": "llama", "pp": 2, "schedule": "zb1p", "m": 4, "v": 2}),
    ("llama-zbv", {"model": "llama", "pp": 2, "schedule": "zbv", "m": 4, "v": 2}),
    ("gpt2-profile", {"model": "gpt2", "pp": 2, "schedule": "1f1b", "m": 4, "pipeline_partition": "profile"}),
    ("llama-dualpipev", {"model": "llama", "pp": 2, "schedule": "dualpipev", "m": 4, "v": 2}),
    ("llama-bf16", {"model": "llama", "pp": 2, "schedule": "zb1p", "m": 4, "bf16": {"enabled": True}}),
    # issue 27 case 11: a tied embedding's gradient summed over both ends when the strategy moves bf16 grads out of .grad
    ("gpt2-bf16", {"model": "gpt2", "pp": 2, "schedule": "1f1b", "m": 4, "bf16": {"enabled": True}}),
    ("gpt2-bf16-zb1p", {"model": "gpt2", "pp": 2, "schedule": "zb1p", "m": 4, "bf16": {"enabled": True}}),
    (
        "llama-1f1b-ac",
        {
            "model": "llama",
            "pp": 2,
            "schedule": "1f1b",
            "m": 4,
            "activation_checkpointing": {"module_classes": ["LlamaDecoderLayer"]},
        },
    ),
]
WORLD4 = [
    ("gpt2-dp2-zero1", {"model": "gpt2", "pp": 2, "schedule": "1f1b", "m": 4, "stage": 1}),
    ("gpt2-dp2-zero2", {"model": "gpt2", "pp": 2, "schedule": "zb1p", "m": 4, "stage": 2}),
    ("gpt2-dp2-zero3", {"model": "gpt2", "pp": 2, "schedule": "1f1b", "m": 4, "stage": 3}),
    ("llama-p4-1f1b", {"model": "llama", "pp": 4, "schedule": "1f1b", "m": 4}),
    (
        "llama-tp2",
        {"model": "llama", "pp": 2, "schedule": "1f1b", "m": 4, "stage": 1, "tensor_parallel": {"autotp_size": 2}},
    ),
]


def _check(result: dict[str, Any], model: str, rows: int) -> None:
    ref_losses, ref_state = train_lm_reference(BUILD[model](), _batches(rows), LR)
    for ours, theirs in zip(result["losses"], ref_losses, strict=True):
        assert abs(ours - theirs) <= 1e-5 * theirs, (result["losses"], ref_losses)
    state = result["state"]
    assert set(state) == set(ref_state)
    assert_weights_close(state, ref_state, **(GPT2_WEIGHTS if model == "gpt2" else LLAMA_WEIGHTS))


def test_every_schedule_at_p2_matches_one_process() -> None:
    ranks = run_distributed(2, _cases_body, WORLD2)
    results = ranks[0]
    for name, kwargs in WORLD2:
        if "bf16" in kwargs:  # against fp32 master weights and bf16 compute in one process (tests/reference.py)
            low = train_reference(BUILD[kwargs["model"]](), _batches(kwargs["m"] * B), LR, dtype=torch.bfloat16)
            ours = Trajectory(results[name]["losses"], {k: v.float() for k, v in results[name]["state"].items()}, [])
            assert_close_trajectory(ours, low, loss_rtol=1e-3, param_rel_norm=2e-2)
            continue
        _check(results[name], kwargs["model"], kwargs["m"] * B)
    # Activations: per boundary per step, each micro-batch's b·s·h fp32 forward and its gradient back.
    per_boundary = 2 * 4 * B * SEQ * HIDDEN * 4
    assert sum(r["gpt2-1f1b"]["p2p"] for r in ranks) == per_boundary
    assert ranks[0]["gpt2-1f1b"]["p2p"] == ranks[1]["gpt2-1f1b"]["p2p"] == per_boundary // 2
    assert sum(r["llama-zbv"]["p2p"] for r in ranks) == 2 * per_boundary  # V: stages 1 and 2 share rank 1
    # Activations held for their backward, counted by the executor: AFAB all m, 1F1B min(p - s, m).
    assert [r["gpt2-afab"]["in_flight"] for r in ranks] == [{0: 4}, {1: 4}]
    assert [r["gpt2-1f1b"]["in_flight"] for r in ranks] == [{0: 2}, {1: 1}]
    monitor = results["gpt2-1f1b"]["monitor"]
    assert 0.0 < monitor["pipeline_bubble_predicted"] < 1.0 and monitor["pipeline_bubble"] >= 0.0


def test_pipeline_composes_with_zero_and_tensor_parallel() -> None:
    run_ranks = run_distributed(4, _cases_body, WORLD4)
    results = run_ranks[0]
    for name, kwargs in WORLD4:
        dp = 4 // kwargs["pp"] // kwargs.get("tensor_parallel", {}).get("autotp_size", 1)
        _check(results[name], kwargs["model"], kwargs["m"] * B * dp)
    assert [r["llama-p4-1f1b"]["in_flight"] for r in run_ranks] == [{s: min(4 - s, 4)} for s in range(4)]
    # ZeRO-1/2 under a pipeline: this stage's gradients reduce-scattered once per step (Ψ_stage), not m times.
    for name in ("gpt2-dp2-zero1", "gpt2-dp2-zero2"):
        for r in run_ranks:
            assert r[name]["bucket_bytes"] == r[name]["stage_bytes"] > 0, (
                name,
                r[name]["bucket_bytes"],
                r[name]["stage_bytes"],
            )
    zero3 = results["gpt2-dp2-zero3"]
    # ZeRO-3 under a pipeline: each unit gathered and reduce-scattered once per step, not once per micro-batch.
    assert zero3["units"] > 0 and zero3["gathers"] == zero3["units"]
    assert 0 < zero3["scatters"] <= zero3["units"]


# --------------------------------------------------------------------------- bubble on a logical clock
# [Note: no wall clock in tests] The idle time a rank measures depends on the machine's load, so the
# test replays what the executor actually ran: each rank's compute actions in execution order,
# gathered from the real distributed step and fed to the simulator with unit costs (a logical
# clock: every pass costs its counted work, every wait is a dependency on another rank's pass).
# An executor that reorders, repeats or drops a pass changes this bubble or deadlocks the replay.
# Wall-clock bubbles against the prediction are measured in benchmarks/bench_pipeline.py.
def _bubble_body(schedule: str, m: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)], _Mean())
    engine = slipstream.initialize(model, _config(2, schedule, m))
    batch = torch.randn(B, 8)
    engine.train_batch(iter([batch] * m))
    timing = engine.pipeline.last_report.timing
    executed = [None, None]
    dist.all_gather_object(executed, list(timing.executed))
    result = {"executed": executed, "schedule": engine.pipeline.schedule, "in_flight": timing.in_flight}
    engine.close()
    return result


class _Mean(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean()


@pytest.mark.parametrize("schedule,m", [("1f1b", 4), ("afab", 4), ("zb1p", 4)])
def test_executed_order_replays_to_the_predicted_bubble(schedule: str, m: int) -> None:
    """The passes each rank ran, replayed on a logical clock, idle exactly as the schedule predicts."""
    import dataclasses

    from slipstream.engine.parallel.pipeline.simulate import predicted_bubble as closed_bubble
    from slipstream.engine.parallel.pipeline.simulate import simulate

    for result in run_distributed(2, _bubble_body, schedule, m):
        planned = result["schedule"]
        ran = dataclasses.replace(planned, compute=tuple(tuple(actions) for actions in result["executed"]))
        assert sorted(map(str, ran.compute[0] + ran.compute[1])) == sorted(
            map(str, planned.compute[0] + planned.compute[1])
        )
        replayed, predicted = simulate(ran), closed_bubble(planned)
        assert replayed.bubble() == pytest.approx(predicted, abs=1e-12)
        if schedule in ("1f1b", "afab"):
            assert predicted == pytest.approx((2 - 1) / m)
        expected_in_flight = m if schedule == "afab" else None
        if expected_in_flight is not None:
            assert max(result["in_flight"].values()) == expected_in_flight


# --------------------------------------------------------------------------- the user's loop and DeepSpeed's calls
def _loop_body() -> dict[str, Any]:
    engine = slipstream.initialize(_gpt2(), _config(2, "1f1b", 4))
    batches = _batches(4 * B, steps=2)
    tokens = batches[0]
    first = engine(input_ids=tokens[:B], labels=tokens[:B]).loss
    engine.backward(first)
    try:
        first.item()
        early = ""
    except RuntimeError as err:
        early = str(err)
    engine.step()
    losses = [first]
    for i in range(1, 4):
        losses.append(engine(input_ids=tokens[i * B : (i + 1) * B], labels=tokens[i * B : (i + 1) * B]))
        engine.backward(losses[-1])
        engine.step()
    step1 = sum(loss.item() for loss in losses) / 4
    micro = [{"input_ids": t, "labels": t} for t in batches[1].split(B)]
    step2 = float(engine.train_batch(iter(micro)))
    evaluated = float(engine.eval_batch(iter(micro)))
    engine.close()
    return {"early": early, "step1": step1, "step2": step2, "eval": evaluated}


def _dp_body() -> tuple[float, float]:
    """train_batch/eval_batch without a pipeline: dp 2, two micro-batches per rank."""
    engine = slipstream.initialize(_gpt2(), {**_config(1, "1f1b", 2), "pipeline": {}})
    d = dist.get_rank()
    tokens = _batches(4 * B, steps=1)[0]
    micro = [
        {
            "input_ids": tokens[(i * 2 + d) * B : (i * 2 + d + 1) * B],
            "labels": tokens[(i * 2 + d) * B : (i * 2 + d + 1) * B],
        }
        for i in range(2)
    ]
    trained = float(engine.train_batch(iter(micro)))
    evaluated = float(engine.eval_batch(iter(micro)))
    engine.close()
    return trained, evaluated


def _reference_then_eval(steps: int) -> tuple[list[float], float]:
    """The reference's losses over ``steps`` batches, then its loss on the last batch after training on it."""
    model, batches = _gpt2(), _batches(4 * B, steps=2)[:steps]
    losses, _ = train_lm_reference(model, batches, LR, bounds=False)
    with torch.no_grad():
        return losses, float(model(input_ids=batches[-1], labels=batches[-1]).loss)


def test_user_loop_train_batch_and_eval_batch() -> None:
    ref_losses, ref_eval = _reference_then_eval(2)
    for result in run_distributed(2, _loop_body):  # every rank sees every loss
        assert "computed when the accumulation window's last engine.backward()" in result["early"]
        assert result["step1"] == pytest.approx(ref_losses[0], rel=1e-5)
        assert result["step2"] == pytest.approx(ref_losses[1], rel=1e-5)
        assert result["eval"] == pytest.approx(ref_eval, rel=1e-5)
    ref_losses, ref_eval = _reference_then_eval(1)
    for trained, evaluated in run_distributed(2, _dp_body):
        assert trained == pytest.approx(ref_losses[0], rel=1e-5)
        assert evaluated == pytest.approx(ref_eval, rel=1e-5)


# --------------------------------------------------------------------------- checkpoints pp 2 -> 1 -> 2
CKPT = _batches(4 * B, steps=6, seed=9)


def _ckpt_pp2(save_dir: str | None, load_dir: str | None) -> list[float]:
    engine = slipstream.initialize(_gpt2(), _config(2, "1f1b", 4, stage=1))
    if load_dir:
        engine.load_checkpoint(load_dir, tag="pp1")
        return _train(engine, CKPT[4:])
    losses = _train(engine, CKPT[:2])
    engine.save_checkpoint(save_dir, tag="pp2")
    return losses + _train(engine, CKPT[2:])


def _ckpt_pp1(load_dir: str, save_dir: str) -> list[float]:
    engine = slipstream.initialize(_gpt2(), {**_config(1, "1f1b", 4), "pipeline": {}})
    engine.load_checkpoint(load_dir, tag="pp2")
    losses = _train(engine, CKPT[2:4])
    engine.save_checkpoint(save_dir, tag="pp1")
    return losses + _train(engine, CKPT[4:])


def test_checkpoint_pp2_to_pp1_and_back(tmp_path: Path) -> None:
    """GPT-2 (embedding tied across the pipeline's ends) at pp 2 ZeRO-1 → one process → pp 2."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    uninterrupted = run_distributed(2, _ckpt_pp2, first, None)[0]
    resumed_pp1 = run_distributed(1, _ckpt_pp1, first, second)[0]
    resumed_pp2 = run_distributed(2, _ckpt_pp2, None, second)[0]
    for ours, theirs in ((resumed_pp1, uninterrupted[2:]), (resumed_pp2, uninterrupted[4:])):
        for a, b in zip(ours, theirs, strict=True):
            assert abs(a - b) <= 1e-5 * b, (ours, theirs)


# --------------------------------------------------------------------------- mistakes
def _mistakes_body() -> list[str]:
    messages = []
    for model, config in (
        (_llama(), _config(2, "1f1b", 1)),
        (_llama(), _config(2, "dualpipev", 3, v=2)),
        (_llama(layers=2), _config(2, "zbv", 4, v=2)),  # 4 stages, 2 blocks
        (
            torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]),
            {**_config(2, "1f1b", 4), "pipeline": {"stages": 2, "partition": "profile"}},
        ),
    ):
        try:
            slipstream.initialize(model, config)
            messages.append("")
        except slipstream.ConfigError as err:
            messages.append(str(err))
    return messages


def test_mistakes_name_the_key() -> None:
    messages = run_distributed(2, _mistakes_body)[0]
    assert messages[0].startswith(
        "gradient_accumulation_steps: 1 micro-batches cannot fill a 1f1b pipeline of 2 stages"
    )
    assert messages[1].startswith("gradient_accumulation_steps: dualpipev needs at least 2 × pipeline.stages = 4")
    assert messages[2].startswith(
        "pipeline.virtual_stages: 2 ranks × 2 virtual stages = 4 stages need at least 4 blocks"
    )  # issue 27 case 18
    assert messages[3].startswith('pipeline.partition: "profile" times the model on synthetic token ids')


def _scale_wrt_gas_body(scale_wrt_gas: bool) -> dict[str, Any]:
    """pp 2, 2 micro-batches, SGD: ``engine.backward(loss, scale_wrt_gas=...)``; the step's gradient norm and weights."""
    from tests.reference import tiny_gpt2

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 2},
    }
    engine = slipstream.initialize(tiny_gpt2(n_layer=2), config)
    norms = []
    for tokens in _scale_batches():
        for micro in tokens.split(2):
            engine.backward(engine(input_ids=micro, labels=micro).loss, scale_wrt_gas=scale_wrt_gas)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    state = engine.consolidated_state_dict()
    engine.close()
    return {"norms": norms, "state": state}


def _scale_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(2)]


def test_pipeline_honours_scale_wrt_gas_false() -> None:
    """scale_wrt_gas=False (the HF Trainer's num_items_in_batch style): each micro-batch's loss is not divided by the
    window, exactly as without a pipeline. Was ignored: gradients 1/gas too small, silently."""
    from tests.reference import tiny_gpt2

    for scale_wrt_gas, divisor in ((False, 1.0), (True, 2.0)):
        model = tiny_gpt2(n_layer=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        norms = []
        for tokens in _scale_batches():
            for micro in tokens.split(2):
                (model(input_ids=micro, labels=micro).loss / divisor).backward()
            norms.append(
                float(
                    torch.linalg.vector_norm(
                        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
                    )
                )
            )
            optimizer.step()
            optimizer.zero_grad()
        ours = run_distributed(2, _scale_wrt_gas_body, scale_wrt_gas)[0]
        assert ours["norms"] == pytest.approx(norms, rel=1e-4), (scale_wrt_gas, ours["norms"], norms)
        assert_weights_close(
            ours["state"],
            {n: p.detach() for n, p in model.named_parameters()},
            rtol=1e-5,
            atol=1e-6,
            label=f"scale_wrt_gas={scale_wrt_gas}",
        )
