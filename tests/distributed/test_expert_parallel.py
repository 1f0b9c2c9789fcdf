"""Expert parallelism on an unchanged Mixtral: dropless all-to-all dispatch, against one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import tiny_mixtral, train_lm_engine, train_lm_reference

SEQ, MICRO, STEPS, VOCAB, LR = 16, 2, 6, 128, 1e-3


def _mixtral() -> torch.nn.Module:
    return tiny_mixtral(vocab=VOCAB, positions=SEQ)


def _qwen_moe() -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
        decoder_sparse_step=1,
    )
    return Qwen2MoeForCausalLM(config)


BUILDERS = {"mixtral": _mixtral, "qwen2-moe": _qwen_moe}


def _batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g) for _ in range(STEPS)]


def _reference(world: int, name: str = "mixtral") -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_lm_reference(BUILDERS[name](), _batches(world), LR)


def _config(stage: int, ep: int = 2) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "expert_parallel": {"enabled": ep > 1, "autoep_size": ep},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1,
    }


def _train(stage: int, name: str = "mixtral") -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = slipstream.initialize(BUILDERS[name](), _config(stage))
    experts = engine.module.model.layers[0].mlp.experts
    local = {n: p.numel() for n, p in experts.named_parameters()}
    comms_log.keep_history = 2
    losses = train_lm_engine(engine, _batches(world), MICRO, rank)
    records = comms_log.history[-1]
    dispatch = sum(r.nbytes for r in records if r.tag == "expert dispatch")
    combine = sum(r.nbytes for r in records if r.tag == "expert combine")
    # choices of the last step routed to experts held by the other rank, over both layers
    remote = sum(
        int(layer.mlp.experts.tokens_per_expert.sum())
        - int(layer.mlp.experts.tokens_per_expert[experts.first : experts.first + 2].sum())
        for layer in engine.module.model.layers
    )
    comms_log.keep_history = 0
    comms_log.history.clear()
    monitored = dict(engine.monitor.last or {})  # rank 0: the last step's metrics
    moments = sum(engine.optimizer.state[p]["exp_avg"].numel() for p in experts.parameters()) if stage == 0 else None
    state = engine.consolidated_state_dict()
    engine.close()
    return {
        "losses": losses,
        "state": state,
        "local": local,
        "dispatch": dispatch,
        "combine": combine,
        "remote": remote,
        "monitored": monitored,
        "moments": moments,
    }


def _body() -> dict[str, Any]:
    return {0: _train(0), 2: _train(2), "qwen2-moe": _train(0, "qwen2-moe")}


def test_expert_parallel_matches_one_process() -> None:
    results = run_distributed(2, _body)
    losses, params = _reference(2)
    for stage in (0, 2):
        ours = results[0][stage]
        assert ours["losses"] == pytest.approx(losses, rel=1e-5), stage
        assert_weights_close(ours["state"], params, rtol=1e-4, atol=1e-5, label=f"stage {stage}")
        # each rank holds half of every expert tensor (experts 0-1 or 2-3), and so half of their optimizer state
        assert ours["local"] == {"gate_up_proj": 4 * 2 * 96 * 64 // 2, "down_proj": 4 * 64 * 96 // 2}
        if stage == 0:
            assert ours["moments"] == sum(ours["local"].values())
        # the monitor reports each layer's per-expert choices for the step: micro-batch × seq × top-2 of them
        for layer in (0, 1):
            counts = [ours["monitored"][f"expert_tokens/layer{layer}/expert{e}"] for e in range(4)]
            assert sum(counts) == MICRO * SEQ * 2, counts
            assert ours["monitored"][f"expert_balance/layer{layer}"] == max(counts) / (sum(counts) / 4)
    qwen_losses, qwen_params = _reference(2, "qwen2-moe")  # shared expert and its gate stay dense
    assert results[0]["qwen2-moe"]["losses"] == pytest.approx(qwen_losses, rel=1e-5)
    for name, value in qwen_params.items():
        torch.testing.assert_close(
            results[0]["qwen2-moe"]["state"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"qwen {name}: {m}"
        )
    # Traffic of the last step: dispatch = Σ(choices routed to the other rank's experts) × h × 4 bytes exactly;
    # combine sends back what arrived, i.e. the other rank's dispatch.
    for stage in (0, 2):
        a, b = results[0][stage], results[1][stage]
        assert a["remote"] > 0 and b["remote"] > 0
        assert a["dispatch"] == a["remote"] * 64 * 4 and b["dispatch"] == b["remote"] * 64 * 4
        assert a["combine"] == b["dispatch"] and b["combine"] == a["dispatch"]


def _world4_body() -> dict[str, Any]:
    return _train(3)


def test_expert_parallel_ep2_dp4_zero3() -> None:
    """4 ranks, ep 2: each expert on two ranks (its expert-data-parallel group), ZeRO-3 over that group."""
    ours = run_distributed(4, _world4_body)[0]
    losses, params = _reference(4)
    assert ours["losses"] == pytest.approx(losses, rel=1e-5)
    assert_weights_close(ours["state"], params, rtol=1e-4, atol=1e-5)


def _ckpt_run(ep: int, load: str | None, save: str, first: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = MICRO * 2 // world  # the same global batch at 1 and 2 ranks
    engine = slipstream.initialize(
        _mixtral(), {**_config(2 if ep > 1 else 0, ep), "train_micro_batch_size_per_gpu": micro}
    )
    if load is not None:
        engine.load_checkpoint(load, tag="t")
    losses = train_lm_engine(engine, _batches(2)[first : first + 2], micro, rank)
    engine.save_checkpoint(save, tag="t")
    engine.close()
    return losses


def test_checkpoint_ep2_to_ep1_and_back(tmp_path: Any) -> None:
    """Experts are saved under their global indices: an ep 2 checkpoint resumes in one process and back."""
    a, b, c = (str(tmp_path / x) for x in "abc")
    losses, _ = _reference(2)
    first = run_distributed(2, _ckpt_run, 2, None, a, 0)[0]
    middle = run_distributed(1, _ckpt_run, 1, a, b, 2)[0]
    last = run_distributed(2, _ckpt_run, 2, b, c, 4)[0]
    assert first + middle + last == pytest.approx(losses, rel=1e-5)


def _errors_body() -> dict[str, str]:
    found = {}
    mixtral = _mixtral()
    for key, model, config, kwargs in (
        ("plain", torch.nn.Linear(4, 4), _config(0), {}),
        (
            "prebuilt-optimizer",
            mixtral,
            {**_config(0), "optimizer": None},
            {"optimizer": torch.optim.AdamW(mixtral.parameters())},
        ),
    ):
        try:
            slipstream.initialize(model, config, **kwargs)
        except slipstream.ConfigError as err:
            found[key] = str(err)
    return found


def test_expert_parallel_mistakes_are_one_line_errors_naming_the_key() -> None:
    found = run_distributed(2, _errors_body)[0]
    assert found["plain"].startswith("expert_parallel.autoep_size: no experts module found"), found
    assert found["prebuilt-optimizer"].startswith(
        "expert_parallel.autoep_size: an optimizer built before initialize()"
    ), found


class _Custom(torch.nn.Module):
    """A custom model around slipstream.moe.MoE (DeepSpeed's classic layer's interface).

    The aux loss is computed (and checked) but weighted 0: it is a product of per-batch means, so
    the mean of two half-batches' values is not the whole batch's, unlike the cross-entropy.
    """

    def __init__(self) -> None:
        super().__init__()
        from slipstream.moe import MoE

        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.moe = MoE(hidden_size=32, expert=mlp, num_experts=4, ep_size=2, k=2)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, aux, counts = self.moe(self.embed(input_ids))
        assert counts.shape == (4,) and int(counts.sum()) == input_ids.numel() * 2
        logits = self.head(out)
        return (
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))
            + 0.0 * aux
        )


def _custom_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _Custom()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for tokens in _batches(2):
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _custom_body() -> dict[str, Any]:
    rank = dist.get_rank()
    engine = slipstream.initialize(_Custom(), _config(1))
    names = [n for n, _ in engine.module.named_parameters() if ".experts." in n]
    losses = []
    for tokens in _batches(2):
        mine = tokens[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(mine)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / 2)
    state = engine.consolidated_state_dict()
    engine.close()
    return {"names": names, "losses": losses, "state": state}


def test_moe_layer_for_custom_models_keeps_global_expert_names() -> None:
    results = run_distributed(2, _custom_body)
    assert all(n.startswith("moe.experts.0.") or n.startswith("moe.experts.1.") for n in results[0]["names"])
    assert all(n.startswith("moe.experts.2.") or n.startswith("moe.experts.3.") for n in results[1]["names"])
    losses, params = _custom_reference()
    assert set(results[0]["state"]) == set(params)  # every expert under its global name, on rank 0
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5)
    assert_weights_close(results[0]["state"], params, rtol=1e-4, atol=1e-5)


def _skipped_step_body(precision: str, stage: int, stages: int) -> list[tuple[float, bool]]:
    """A non-finite loss (NaN activations on rank 0, or on the whole first stage) skips the step everywhere;
    the next step is normal."""
    config = {**_config(stage), precision: {"enabled": True}, "comms_timeout_seconds": 60}
    if stages > 1:
        config.update(pipeline={"stages": stages}, gradient_accumulation_steps=stages)
    engine = slipstream.initialize(_mixtral(), config)
    state = {"poison": False}

    def poison(module: torch.nn.Module, args: Any, output: torch.Tensor) -> Any:
        return output * float("nan") if state["poison"] and (dist.get_rank() == 0 or stages > 1) else None

    for name, module in engine.module.named_modules():  # under a pipeline only the first stage embeds
        if name.endswith("embed_tokens"):
            module.register_forward_hook(poison)
    tokens = _batches(1)[0]
    seen = []
    for step in range(3):
        state["poison"] = step == 1
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        seen.append((float(loss), engine.was_step_applied()))
    engine.close()
    return seen


@pytest.mark.parametrize("precision,stage,stages", [("bf16", 0, 1), ("fp16", 2, 1), ("bf16", 1, 2), ("fp16", 3, 2)])
def test_a_skipped_step_is_followed_by_a_normal_step_on_every_rank(precision: str, stage: int, stages: int) -> None:
    """Issue 47 case 3, directly (NaN activations on rank 0) and under pp 2 × ep 2 (on the first stage): there
    the NaN reaches the last stage, whose routers then send every token to one rank's experts, and the
    other rank waited in its backward all-to-all ([Note: a rank no token reached]) before the fix."""
    world = 2 * stages
    results = run_distributed(world, _skipped_step_body, precision, stage, stages, timeout=240)
    for seen in results:
        assert [applied for _, applied in seen] == [True, False, True]
        assert all(loss == loss for loss, _ in (seen[0], seen[2]))  # finite steps around the skipped one
    last = results[world - 2 :]  # the last stage's ranks read the losses
    assert last[0][2][0] == pytest.approx(last[1][2][0], rel=1e-6)


def _collapse(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A router that picks experts 0 and 1 for every token: ep rank 1's experts receive nothing."""
    logits, scores, index = output
    return logits, scores, torch.stack([torch.zeros_like(index[:, 0]), torch.ones_like(index[:, 1])], dim=-1)


def _collapsed_mixtral() -> torch.nn.Module:
    model = _mixtral()
    model.model.layers[0].mlp.gate.register_forward_hook(_collapse)
    return model


def _collapsed_body() -> dict[int, Any]:
    results = {}
    for stage in (0, 3):
        engine = slipstream.initialize(_collapsed_mixtral(), {**_config(stage), "comms_timeout_seconds": 60})
        losses = train_lm_engine(engine, _batches(2)[:3], MICRO, dist.get_rank())
        results[stage] = {"losses": losses, "state": engine.consolidated_state_dict()}
        engine.close()
    return results


def test_a_rank_whose_experts_no_token_reaches_trains_like_one_process() -> None:
    """[Note: a rank no token reached]: before, that rank skipped the reverse exchanges and the other waited
    in its backward all-to-all until the timeout."""
    results = run_distributed(2, _collapsed_body, timeout=240)
    losses, params = train_lm_reference(_collapsed_mixtral(), _batches(2)[:3], LR)
    for stage in (0, 3):
        assert results[0][stage]["losses"] == pytest.approx(losses, rel=1e-5), stage
        assert_weights_close(results[0][stage]["state"], params, rtol=1e-4, atol=1e-5)
