"""``compile`` under every ZeRO stage and axis: the compiled run equals the eager one, one graph per block class.

Each case trains a model twice on the same ranks and batches, eagerly and with ``compile.enabled``
(CPU inductor), for three optimizer steps, and checks:

* losses per step within 1e-6 relative (measured: at most 1.2e-7);
* weights within 1e-6 of their tensor's largest (SGD at lr 0.01, so float noise moves them by
  at most ~5e-8 measured; under Adam, which moves a weight by ~lr whatever the noise of a ~0
  gradient, only the next check) and the weights' total change within 2e-3 of the eager change (a
  dropped or doubled gradient anywhere is O(1) of it);
* dynamo made graphs for the blocks, took 0 graph breaks in them, and made no graph after the
  first optimizer step (no recompiles: counted by the engine around each block call);

under ZeRO 0-3, optimizer and parameter offload, activation checkpointing, tensor (+ sequence)
parallel, Ulysses, ring / zig-zag / all-gathered K/V, a 1F1B pipeline, expert parallel (Mixtral
with its router loss), the long-context tilings, and two pairs at world 4.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import slipstream
from tests.harness import run_distributed

SEQ, VOCAB, LR = 16, 128, 0.01


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=64,
                n_head=4,
                vocab_size=VOCAB,
                n_positions=SEQ,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(
            MixtralConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                vocab_size=VOCAB,
                num_local_experts=4,
                num_experts_per_tok=2,
                bos_token_id=0,
                eos_token_id=0,
                output_router_logits=True,
                router_aux_loss_coef=0.1,
            )
        )
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _config(stage: int, extra: dict[str, Any], compiled: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "compile": {"enabled": compiled},
    }
    for key, value in extra.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def _train(
    kind: str, stage: int, extra: dict[str, Any], compiled: bool
) -> tuple[list[float], dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    engine = slipstream.initialize(_model(kind), _config(stage, extra, compiled))
    start = engine.consolidated_state_dict()
    g = torch.Generator().manual_seed(7 + engine.mesh.rank_of("dp"))
    window = engine.gradient_accumulation_steps()
    losses, counts = [], []
    for _ in range(3):
        step = []
        for _ in range(window):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            step.append(out.loss)
        losses.append(sum(float(loss.detach()) for loss in step) / window)
        counts.append(engine.parallel.compiled.on_step() if engine.parallel.compiled is not None else None)
    end = engine.consolidated_state_dict()
    engine.close()
    moved = None if end is None else {k: (end[k].float(), end[k].float() - start[k].float()) for k in end}
    return losses, moved, {"first": counts[0], "last": counts[-1]} if counts[0] is not None else None


def _both(kind: str, stage: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {"eager": _train(kind, stage, extra, False), "compiled": _train(kind, stage, extra, True)}


def _check(results: list[dict[str, Any]], adam: bool = False) -> None:
    for rank, result in enumerate(results):
        (eager_losses, eager_weights, _), (losses, weights, counts) = result["eager"], result["compiled"]
        for step, (a, b) in enumerate(zip(eager_losses, losses)):
            assert abs(a - b) <= 1e-6 * abs(a), f"rank {rank} step {step}: loss {b!r} compiled vs {a!r} eager"
        assert counts is not None and counts["first"]["graphs"] >= 1, f"rank {rank}: nothing was compiled ({counts})"
        assert counts["last"]["graph_breaks"] == 0, f"rank {rank}: graph breaks in the compiled blocks ({counts})"
        assert counts["last"]["graphs"] == counts["first"]["graphs"] and counts["last"]["recompiles"] == 0, (
            f"rank {rank}: graphs made after the first step ({counts})"
        )
        if eager_weights is None:
            continue
        for name, (w, moved) in eager_weights.items():
            cw, cmoved = weights[name]
            off = float((w - cw).abs().max())
            # Adam's update is ~lr wherever the gradient is ~0, whatever its noise: elementwise only under SGD
            assert adam or off <= 1e-6 * float(w.abs().max()) + 1e-9, f"{name}: weights differ by {off:.3g}"
            change = float(moved.norm())
            assert float((moved - cmoved).norm()) <= 2e-3 * change + 1e-9, (
                f"{name}: update differs (eager change {change:.3g})"
            )


@pytest.mark.parametrize(
    "kind,stage,extra",
    [
        ("llama", 0, {}),
        ("llama", 1, {}),
        ("llama", 2, {}),
        ("llama", 3, {"zero_optimization": {"stage3_param_persistence_threshold": 0}}),
        ("gpt2", 0, {}),
        ("gpt2", 3, {"activation_checkpointing": {"module_classes": ["GPT2Block"]}}),
        ("llama", 3, {"activation_checkpointing": {"module_classes": ["LlamaDecoderLayer"]}}),
        (
            "llama",
            2,
            {
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
            },
        ),
        (
            "llama",
            3,
            {
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            },
        ),
        ("llama", 1, {"tensor_parallel": {"autotp_size": 2}}),
        ("gpt2", 3, {"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}),
        ("llama", 0, {"sequence_parallel_size": 2}),
        ("llama", 3, {"context_parallel": {"size": 2, "method": "ring"}}),
        ("gpt2", 1, {"context_parallel": {"size": 2, "method": "zigzag"}}),
        ("llama", 2, {"context_parallel": {"size": 2, "method": "allgather_kv"}}),
        ("llama", 1, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}),
        ("mixtral", 1, {"expert_parallel": {"enabled": True, "autoep_size": 2}}),
        ("mixtral", 3, {}),
        (
            "llama",
            3,
            {
                "long_context": {
                    "tiled_mlp": {"enabled": True, "tile_tokens": 10},
                    "tiled_logits": {"enabled": True, "tile_tokens": 7},
                }
            },
        ),
    ],
    ids=lambda v: v if isinstance(v, (str, int)) else "-".join(f"{k}" for k in v) or "dp",
)
def test_compiled_equals_eager(kind: str, stage: int, extra: dict[str, Any]) -> None:
    _check(run_distributed(2, _both, kind, stage, extra), adam="optimizer" in extra)


@pytest.mark.parametrize(
    "extra",
    [
        {"tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
        {"sequence_parallel_size": 2, "context_parallel": {"size": 2, "method": "ring"}},
        {"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}},
    ],
    ids=["tp-pp", "ulysses-ring", "ulysses-tp"],
)
def test_compiled_equals_eager_in_pairs(extra: dict[str, Any]) -> None:
    _check(run_distributed(4, _both, "llama", 1, extra))


def _tp_with_dropout() -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ))
    with pytest.raises(slipstream.ConfigError) as err:
        slipstream.initialize(model, _config(1, {"tensor_parallel": {"autotp_size": 2}}, True))
    return str(err.value)


def test_tensor_parallel_with_dropout_is_refused() -> None:
    message = run_distributed(2, _tp_with_dropout)[0]
    assert message.startswith("compile: tensor parallelism with dropout (") and "= 0.1)" in message, message


def _compiled_autograd_run(stage: int, by_config: bool) -> dict[str, Any]:
    """The same three steps with the backward eager and under compiled autograd, fresh engines in one process group:
    the user's own ``_enable`` around ``engine.backward``, or ``compile.compiled_autograd`` (``by_config``)."""
    import torch._dynamo.compiled_autograd as compiled_autograd
    from torch._dynamo.utils import counters

    found: dict[str, Any] = {}
    for traced in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 0,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
        }
        if traced and by_config:
            config["compile"] = {"enabled": True, "backend": "eager", "compiled_autograd": True}
        engine = slipstream.initialize(model, config)
        generator = torch.Generator().manual_seed(torch.distributed.get_rank())
        losses = []
        counters.clear()
        compiled_autograd.reset()  # its graphs cached by an earlier test in this worker would count no capture
        for _ in range(3):
            loss = engine(torch.randn(4, 8, generator=generator)).square().mean()
            if traced and not by_config:
                with compiled_autograd._enable(torch.compile(backend="eager")):
                    engine.backward(loss)
            else:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        found[str(traced)] = {
            "losses": losses,
            "weights": [p.detach().clone() for p in engine.module.parameters()],
            "captures": counters["compiled_autograd"]["captures"],
            "counts": dataclasses.asdict(engine.parallel.compiled.counts) if traced and by_config else None,
        }
        engine.close()
    return found


def _check_compiled_autograd(results: list[dict[str, Any]]) -> None:
    """Same losses and weights, bit for bit, on every rank, and the traced backward really was compiled."""
    for rank, found in enumerate(results):
        eager, traced = found["False"], found["True"]
        assert traced["captures"] > 0 and eager["captures"] == 0, rank
        if traced["counts"] is not None:  # by config: the backward's graphs are the engine's to count
            # the blocks' forward is one graph (one Linear class); compiled autograd's come on top, none after step 1,
            # and no break: each arrival is one opaque op ([Note: an arrival is one opaque op under compiled autograd])
            counts = traced["counts"]
            assert counts["graphs"] > 1 and counts["graph_breaks"] == 0 and counts["recompiles"] == 0, counts
        assert traced["losses"] == eager["losses"], rank
        for a, b in zip(traced["weights"], eager["weights"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_compiled_autograd_trains_as_the_eager_backward(stage: int) -> None:
    """Compiled autograd composes with every stage: stages 0-2's gradient hooks move to Python, which it traces
    ([Note: compiled autograd traces Python hooks] in zero/arrivals.py), ZeRO-3's are per unit."""
    _check_compiled_autograd(run_distributed(2, _compiled_autograd_run, stage, False))


@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_autograd_by_config(stage: int) -> None:
    """``compile.compiled_autograd``: the engine runs every backward under compiled autograd, counted, unbroken."""
    _check_compiled_autograd(run_distributed(2, _compiled_autograd_run, stage, True))


def test_compiled_autograd_config_mistakes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(slipstream.ConfigError, match=r"^compile.compiled_autograd: set compile.enabled too"):
        slipstream.initialize(model, {**config, "compile": {"compiled_autograd": True}})
