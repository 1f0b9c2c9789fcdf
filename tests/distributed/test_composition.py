"""The axes compose: every pair ``initialize`` accepts trains a tiny Mixtral to the one-process reference.

World 4, ZeRO-1 and ZeRO-3, fp32, dropout 0, 3 steps on the same global batches as one process (``train_lm_reference``):
expert parallel folded onto tensor parallel's ranks, onto Ulysses' and ring attention's, expert
parallel inside pipeline stages, Ulysses / ring attention inside pipeline stages, and Ulysses × ring
(and × all-gathered K/V) over one sequence split four ways. Losses within
1e-5 relative, weights 1e-4 relative / 5e-5 absolute (Adam turns a last-bit difference in a near-zero gradient into a step of up to lr).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import slipstream
from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import tiny_mixtral, train_lm_reference, train_step_on_global_batch

SEQ, MICRO, STEPS, VOCAB, LR = 16, 2, 3, 128, 1e-3


def _mixtral() -> torch.nn.Module:
    return tiny_mixtral(vocab=VOCAB, positions=SEQ)


EP2 = {"expert_parallel": {"enabled": True, "autoep_size": 2}}
PAIRS: dict[str, dict[str, Any]] = {
    "ep2_tp2": {**EP2, "tensor_parallel": {"autotp_size": 2}},
    "ep2_sp2": {**EP2, "sequence_parallel_size": 2},
    "ep2_cp2": {**EP2, "context_parallel": {"size": 2}},
    "ep2_pp2": {**EP2, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
    "sp2_pp2": {"sequence_parallel_size": 2, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
    "cp2_pp2": {"context_parallel": {"size": 2}, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
    "sp2_cp2": {"sequence_parallel_size": 2, "context_parallel": {"size": 2}},  # USP: Ulysses × ring
    "sp2_cp2_allgather": {"sequence_parallel_size": 2, "context_parallel": {"size": 2, "method": "allgather_kv"}},
    # Megatron sequence parallelism inside tensor parallelism (norm and dropout activations cut along the sequence)
    "tpsp2_pp2": {
        "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True},
        "pipeline": {"stages": 2},
        "gradient_accumulation_steps": 2,
    },
    "tpsp2_cp2": {"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}, "context_parallel": {"size": 2}},
    # experts on the tp ranks, which hold sequence shards: each token reaches its expert once
    "ep2_tpsp2": {**EP2, "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}},
}


def _batches(dp: int, accumulation: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (MICRO * dp * accumulation, SEQ), generator=g) for _ in range(STEPS)]


def _config(extra: dict[str, Any], stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1,
        **extra,
    }


def _train(extra: dict[str, Any], stage: int = 1, build: Callable[[], torch.nn.Module] | None = None) -> dict[str, Any]:
    engine = slipstream.initialize((build or _mixtral)(), _config(extra, stage))
    dp, m = engine.mesh.size("dp"), engine.gradient_accumulation_steps()
    losses = [train_step_on_global_batch(engine, tokens, MICRO) for tokens in _batches(dp, m)]
    traffic = {k: v for k, v in engine.monitor.last.items() if k.startswith("comms_MB")}  # the last step's, by axis
    state = engine.consolidated_state_dict()
    engine.close()
    return {"losses": losses, "state": state, "dp": dp, "m": m, "traffic": traffic}


def _body(stage: int) -> dict[str, Any]:
    return {name: _train(extra, stage) for name, extra in PAIRS.items()}


# The axes whose groups each pair's own collectives cross (the step record's comms_MB/<axis>; "tp+ep" where the
# two axes' groups are the same ranks).
AXES_USED = {
    "ep2_tp2": {"ep", "tp"},
    "ep2_sp2": {"ep", "sp"},
    "ep2_cp2": {"ep", "cp"},
    "ep2_pp2": {"ep", "pp"},
    "sp2_pp2": {"sp", "pp"},
    "cp2_pp2": {"cp", "pp"},
    "sp2_cp2": {"sp", "cp"},
    "sp2_cp2_allgather": {"sp", "cp"},
    "tpsp2_pp2": {"tp", "pp"},
    "tpsp2_cp2": {"tp", "cp"},
    "ep2_tpsp2": {"ep", "tp"},
}


@pytest.mark.parametrize("stage", [1, 3])
def test_pairs_match_one_process(stage: int) -> None:
    results = run_distributed(4, _body, stage)[0]
    for name, ours in results.items():
        by_axis = {k.partition("/")[2]: v for k, v in ours["traffic"].items() if "/" in k}
        assert AXES_USED[name] <= {axis for label in by_axis for axis in label.split("+")}, (name, by_axis)
        assert sum(by_axis.values()) == pytest.approx(ours["traffic"]["comms_MB"], rel=1e-9), name
        losses, params = train_lm_reference(_mixtral(), _batches(ours["dp"], ours["m"]), LR)
        assert ours["losses"] == pytest.approx(losses, rel=1e-5), name
        assert_weights_close(ours["state"], params, rtol=1e-4, atol=5e-5, label=name)


def _routed_mixtral() -> torch.nn.Module:
    """Mixtral trained with its load-balancing loss (coefficient 0.02), as MoE models are trained."""
    model = _mixtral()
    model.config.output_router_logits, model.router_aux_loss_coef = True, 0.02
    return model


ROUTED = {
    "ep2_sp2": PAIRS["ep2_sp2"],
    "ep2_cp2": PAIRS["ep2_cp2"],
    "ep2_zigzag2": {**EP2, "context_parallel": {"size": 2, "method": "zigzag"}},
    "ep2_tpsp2": PAIRS["ep2_tpsp2"],
}


def _routed_body() -> dict[str, Any]:
    results = {}
    for stage in (1, 3):
        for name, extra in ROUTED.items():
            engine = slipstream.initialize(_routed_mixtral(), _config(extra, stage))
            losses = [
                train_step_on_global_batch(engine, tokens, MICRO) for tokens in _batches(engine.mesh.size("dp"), 1)
            ]
            results[f"{name}/zero{stage}"] = {
                "losses": losses,
                "state": engine.consolidated_state_dict(),
                "dp": engine.mesh.size("dp"),
            }
            engine.close()
    return results


def test_the_router_loss_under_expert_with_sequence_and_context_parallel_matches_one_process() -> None:
    """Issue 47: the balancing loss over the whole micro-batch (sequence/router.py's note) with ep × Ulysses / ring /
    zig-zag / tp+sp × dp at ZeRO 1 and 3; before, the twin check refused it."""
    results = run_distributed(4, _routed_body)[0]
    for name, ours in results.items():
        # data parallel averages its ranks' balancing losses, each over its own micro-batch (as DDP would)
        losses, params = train_lm_reference(_routed_mixtral(), _batches(ours["dp"], 1), LR, micro_batches=ours["dp"])
        assert ours["losses"] == pytest.approx(losses, rel=1e-5), name
        assert_weights_close(ours["state"], params, rtol=1e-4, atol=5e-5, label=name)


def _routed_deep_mixtral() -> torch.nn.Module:
    """Four layers with the balancing loss: a V schedule's 4 stages on 2 pipeline ranks need one block each."""
    model = tiny_mixtral(vocab=VOCAB, positions=SEQ, layers=4)
    model.config.output_router_logits, model.router_aux_loss_coef = True, 0.02
    return model


# DeepSeek-V3's layout at world 4: pp 2 × ep 2 over dp 2, every stage's router logits carried to the last
# (pipeline/carry.py), under 1F1B, the zero-bubble V (split backward, two stages per rank) and DualPipeV.
ROUTED_PIPELINES = {
    "pp2_ep2_1f1b/zero3": ({**EP2, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}, 3),
    "pp2_ep2_zbv/zero1": ({**EP2, "pipeline": {"stages": 2, "schedule": "zbv"}, "gradient_accumulation_steps": 2}, 1),
}  # at ZeRO-1, 1F1B and DualPipeV: the DeepSeek recipes at world 8 below


def _routed_pipeline_body() -> dict[str, Any]:
    results = {}
    for name, (extra, stage) in ROUTED_PIPELINES.items():
        engine = slipstream.initialize(_routed_deep_mixtral(), _config(extra, stage))
        dp, m = engine.mesh.size("dp"), engine.gradient_accumulation_steps()
        losses = [train_step_on_global_batch(engine, tokens, MICRO) for tokens in _batches(dp, m)[:2]]
        results[name] = {"losses": losses, "state": engine.consolidated_state_dict(), "dp": dp, "m": m}
        engine.close()
    return results


def test_the_router_loss_under_pipeline_and_expert_parallel_matches_one_process() -> None:
    """Issue 47: pp × ep × dp with the balancing loss of every layer, on 1F1B and ZB-V; before, the pipeline's twin
    check refused it (the last stage saw only its own layers' router logits)."""
    results = run_distributed(4, _routed_pipeline_body)[0]
    for name, ours in results.items():
        # each micro-batch's balancing loss over its own tokens, averaged over the window and dp (as DDP would)
        count = ours["dp"] * ours["m"]
        losses, params = train_lm_reference(
            _routed_deep_mixtral(), _batches(ours["dp"], ours["m"])[:2], LR, micro_batches=count
        )
        assert ours["losses"] == pytest.approx(losses, rel=1e-5), name
        assert_weights_close(ours["state"], params, rtol=1e-4, atol=5e-5, label=name)


def _refused_body(extra: dict[str, Any]) -> str:
    with pytest.raises(slipstream.ConfigError) as err:
        slipstream.initialize(_mixtral(), _config(extra, 1))
    return str(err.value)


def test_megatron_sequence_parallel_with_fewer_expert_ranks_than_tp_is_refused() -> None:
    """ep 2 inside tp 4: ranks holding the same experts would each hold part of their gradient; refused, saying why."""
    extra = {**EP2, "tensor_parallel": {"autotp_size": 4, "sequence_parallel": True}}
    for message in run_distributed(4, _refused_body, extra):
        assert message.startswith(
            "tensor_parallel.sequence_parallel: expert_parallel.autoep_size 2 is not a multiple of"
        ), message


RECIPES: dict[str, dict[str, Any]] = {
    # Llama 3: tensor × context × pipeline (× data, 1 here: 8 processes are the CI budget's most)
    "llama3_tp2_cp2_pp2": {
        "tensor_parallel": {"autotp_size": 2},
        "context_parallel": {"size": 2},
        "pipeline": {"stages": 2},
        "gradient_accumulation_steps": 2,
    },
    # DeepSeek-V3: pipeline × expert × ZeRO-1 data parallel
    "deepseek_pp2_ep2_dp4": {**EP2, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
    # USP with tensor parallel and data parallel: Ulysses × ring × tp × dp... at 8: Ulysses 2 × ring 2 × dp 2
    "usp_sp2_cp2_dp2": {"sequence_parallel_size": 2, "context_parallel": {"size": 2}},
}


# DeepSeek-V3 trains with its balancing loss: its recipe's model has it on (every stage's router logits reach the
# last stage: pipeline/carry.py), on 1F1B and on DualPipeV (four layers: two stages per pipeline rank).
ROUTED_RECIPES: dict[str, tuple[dict[str, Any], Callable[[], torch.nn.Module]]] = {
    "deepseek_pp2_ep2_dp4": (RECIPES["deepseek_pp2_ep2_dp4"], _routed_mixtral),
    "deepseek_dualpipev_pp2_ep2_dp4": (
        {**EP2, "pipeline": {"stages": 2, "schedule": "dualpipev"}, "gradient_accumulation_steps": 4},
        _routed_deep_mixtral,
    ),
}


def _recipes_body() -> dict[str, Any]:
    results = {name: _train(extra) for name, extra in RECIPES.items() if name not in ROUTED_RECIPES}
    return {**results, **{name: _train(extra, build=build) for name, (extra, build) in ROUTED_RECIPES.items()}}


def test_recipes_at_world_8_match_one_process() -> None:
    results = run_distributed(8, _recipes_body)[0]
    assert set(results) == set(RECIPES) | set(ROUTED_RECIPES)
    for name, ours in results.items():
        build = ROUTED_RECIPES[name][1] if name in ROUTED_RECIPES else _mixtral
        # a balancing loss is each micro-batch's own: the reference averages them as the window and dp do
        count = ours["dp"] * ours["m"] if name in ROUTED_RECIPES else 1
        losses, params = train_lm_reference(build(), _batches(ours["dp"], ours["m"]), LR, micro_batches=count)
        assert ours["losses"] == pytest.approx(losses, rel=1e-5), name
        assert_weights_close(ours["state"], params, rtol=1e-4, atol=5e-5, label=name)


GLOBAL_ROWS = 8  # every mesh below trains on the same global batches of 8 sequences


def _global_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=g) for _ in range(6)]


def _resume_run(
    extra: dict[str, Any],
    accumulation: int,
    micro: int,
    steps: range,
    load: str | None,
    save: str,
    build: Callable[[], torch.nn.Module] = _mixtral,
) -> list[float]:
    """Train ``steps`` of the global batches on this mesh (resuming from ``load``), save to ``save``."""
    config = {**_config(extra, 1), "gradient_accumulation_steps": accumulation, "train_micro_batch_size_per_gpu": micro}
    engine = slipstream.initialize(build(), config)
    assert engine.mesh.size("dp") * accumulation * micro == GLOBAL_ROWS
    if load is not None:
        engine.load_checkpoint(load, tag="t")
    losses = [train_step_on_global_batch(engine, _global_batches()[k], micro) for k in steps]
    engine.save_checkpoint(save, tag="t")
    engine.close()
    return losses


def test_a_deepseek_like_checkpoint_resumes_in_one_process_and_under_tensor_parallel(tmp_path: Any) -> None:
    """pp 2 × ep 2 × dp 2 → one process → tp 2 × dp 2, with the balancing loss on: the trajectory continues as if
    never interrupted. Every mesh cuts the global batch into the same four micro-batches of two rows (a balancing
    loss is each micro-batch's own), so one process accumulates four."""
    a, b, c = (str(tmp_path / x) for x in "abc")
    reference, _ = train_lm_reference(_routed_mixtral(), _global_batches(), LR, bounds=False, micro_batches=4)
    first = run_distributed(
        4, _resume_run, {**EP2, "pipeline": {"stages": 2}}, 2, 2, range(0, 2), None, a, _routed_mixtral
    )[0]
    middle = run_distributed(1, _resume_run, {}, 4, 2, range(2, 4), a, b, _routed_mixtral)[0]
    last = run_distributed(
        4, _resume_run, {"tensor_parallel": {"autotp_size": 2}}, 2, 2, range(4, 6), b, c, _routed_mixtral
    )[0]
    assert first + middle + last == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("method", ["ring", "zigzag", "allgather_kv"])
def test_a_llama3_like_checkpoint_resumes_under_pipeline_and_data_parallel(method: str, tmp_path: Any) -> None:
    """tp 2 × cp 2 × pp 2 → pp 2 × dp 4 (world 8 both), every context method: the trajectory continues as if never
    interrupted."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    reference, _ = train_lm_reference(_mixtral(), _global_batches()[:4], LR, bounds=False)
    llama3 = {
        "tensor_parallel": {"autotp_size": 2},
        "context_parallel": {"size": 2, "method": method},
        "pipeline": {"stages": 2},
    }
    first = run_distributed(8, _resume_run, llama3, 2, 4, range(0, 2), None, a)[0]
    last = run_distributed(8, _resume_run, {"pipeline": {"stages": 2}}, 2, 1, range(2, 4), a, b)[0]
    assert first + last == pytest.approx(reference, rel=1e-5)
