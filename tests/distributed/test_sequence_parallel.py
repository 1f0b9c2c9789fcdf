"""Ulysses sequence parallelism on unchanged Hugging Face models, against one process on whole sequences.

The engine shards each batch on the sequence (shift, then shard), attention runs on whole
sequences for a share of the heads (one all-to-all of Q|K|V and one of the output per layer), and
the loss the user sees is the whole sequence's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slipstream
from slipstream.comm import comms_log
from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import train_lm_engine, train_lm_reference

SEQ, BATCH, STEPS, VOCAB, LR = 64, 2, 6, 128, 1e-3


def _llama(kv_heads: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
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
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


BUILDERS = {"llama": _llama, "llama-kv1": lambda: _llama(kv_heads=1), "gpt2": _gpt2}


def _batches(batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(STEPS)]


def _reference(name: str, batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_lm_reference(BUILDERS[name](), _batches(batch), LR)


def _config(u: int, dp: int, stage: int, tp: int = 1) -> dict[str, Any]:
    return {
        "tensor_parallel": {"autotp_size": tp},
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
        "sequence_parallel_size": u,
        "data_parallel_size": dp,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _train(name: str, u: int, dp: int, stage: int, tp: int = 1) -> dict[str, Any]:
    model = BUILDERS[name]()
    engine = slipstream.initialize(model, _config(u, dp, stage, tp))
    assert model.config._attn_implementation == "sdpa"  # switched to Ulysses only inside the engine's steps
    dp_rank = engine.mesh.rank_of("dp")
    comms_log.keep_history = 2
    # ranks of one sequence group share a micro-batch; each reports its group's whole-sequence loss
    losses = train_lm_engine(engine, _batches(BATCH * dp), BATCH, dp_rank)
    a2a = [(r.nbytes, r.tag) for r in comms_log.history[-1] if r.op == "all_to_all"]
    comms_log.keep_history = 0
    comms_log.history.clear()
    state = engine.consolidated_state_dict()
    engine.close()
    assert model.config._attn_implementation == "sdpa"  # the model's own attention back
    return {"losses": losses, "state": state, "a2a": a2a}


def _world2_body() -> dict[str, Any]:
    return {name: _train(name, 2, 1, 0) for name in ("llama", "llama-kv1", "gpt2")}


def _assert_matches(result: dict[str, Any], name: str, batch: int) -> None:
    losses, params = _reference(name, batch)
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    assert_weights_close(result["state"], params, rtol=1e-4, atol=1e-5, label=f"{name}")


def test_ulysses_matches_one_process_and_counts_its_all_to_alls() -> None:
    results = run_distributed(2, _world2_body)
    for name in ("llama", "llama-kv1", "gpt2"):
        _assert_matches(results[0][name], name, BATCH)
    # Per layer and micro-batch: Q|K|V and output all-to-alls forward, their inverses backward; each
    # rank's send buffer holds b·(H + 2·Hkv')·(s/u)·d and b·H·(s/u)·d fp32 elements (Hkv' = max(Hkv, u)), of which
    # (u−1)/u = 1/2 leaves the rank (what is logged).
    b, s_local, d, heads, layers = BATCH, SEQ // 2, 16, 4, 2
    for name, kv in (("llama", 2), ("llama-kv1", 2), ("gpt2", 4)):
        qkv, out = b * (heads + 2 * kv) * s_local * d * 4 // 2, b * heads * s_local * d * 4 // 2
        a2a = results[0][name]["a2a"]
        assert len(a2a) == 4 * layers, a2a
        assert sorted(n for n, _ in a2a) == sorted([qkv, out, out, qkv] * layers), a2a


def _world4_body() -> dict[str, Any]:
    return {"zero3": _train("llama", 2, 2, 3), "tp2": _train("llama", 2, 1, 1, tp=2)}


def test_ulysses_with_zero3_over_dp_and_with_tensor_parallel() -> None:
    """u 2 × dp 2 at ZeRO-3; u 2 × tp 2 at ZeRO-1 (tp's 2 local heads split over u, its 1 local KV head repeated)."""
    results = run_distributed(4, _world4_body)[0]
    _assert_matches(results["zero3"], "llama", 2 * BATCH)
    _assert_matches(results["tp2"], "llama", BATCH)


def _errors_body() -> dict[str, str]:
    found = {}
    # Odd lengths and padded batches train now (tests/distributed/test_batch_structure.py).
    from transformers import GPT2Config, GPT2LMHeadModel

    three_heads = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=48, n_head=3, vocab_size=VOCAB, n_positions=SEQ))
    try:
        slipstream.initialize(three_heads, _config(2, 1, 0))
    except slipstream.ConfigError as err:
        found["heads"] = str(err)
    try:
        slipstream.initialize(torch.nn.Linear(4, 4), _config(2, 1, 0))
    except slipstream.ConfigError as err:
        found["plain"] = str(err)
    return found


def test_ulysses_mistakes_are_one_line_errors_naming_the_key() -> None:
    found = run_distributed(2, _errors_body)[0]
    assert "sequence_parallel_size" in found["heads"] and "3 attention heads" in found["heads"]
    assert found["plain"].startswith("sequence_parallel_size: 2 needs a Hugging Face model"), found["plain"]
