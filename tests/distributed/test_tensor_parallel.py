"""Tensor parallel (and Megatron sequence parallel) trains unchanged models like one process.

Every case trains against ``train_reference`` on the same global batches: losses per step within
1e-5 relative, final weights within 5e-5 absolute / 1e-4 relative (test_zero_groups' limits: Adam
turns the rounding of a gradient near zero into an update of up to lr·g/(|g|+eps), so one element
in ~16k drifts ~2e-5 in 10 steps even where the gradients agree to 1e-7; bf16: the tolerance of
test_data_parallel). Plan
coverage, exact local parameter counts, collective counts and bytes, and the saved activation
bytes of the norms are pinned in the same runs (one pool per world size, to keep CPU time low).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.comm import comms_log
from slipstream.engine.parallel.tensor.layers import ShardedLinear, VocabEmbedding, VocabHead
from tests.distributed.tp_cases import BUILDERS, MLP_PARTITION, config, reference, train
from tests.harness import run_distributed
from tests.reference import SEQ, assert_close_trajectory, global_batches

STEPS = 10
MICRO = 4
HIDDEN = 64
PARAM_ATOL, PARAM_RTOL = 5e-5, 1e-4


def _plan_of(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    return {n: (m.style, m.parts) for n, m in model.named_modules() if isinstance(m, ShardedLinear)}


def _local_count_matches(model: torch.nn.Module, sharded_names: set[str], t: int, build: Any) -> tuple[int, int]:
    """Σ local numel vs Σ sharded/t + replicated, both from the unsharded model's shapes."""
    full = dict(build(0).named_parameters())
    expected = sum(p.numel() // t if n in sharded_names else p.numel() for n, p in full.items())
    return sum(p.numel() for p in model.parameters()), expected


def _tp_traffic(records: list[Any]) -> dict[str, Any]:
    mine = [r for r in records if r.tag.startswith(("tp ", "sp "))]
    return {
        "ops": sorted((r.op, r.nbytes, r.tag) for r in mine),
        "moved": sum(r.moved for r in mine if "replicated" not in r.tag),  # activations (not the norms' gradients)
        "block_moved": sum(
            r.moved
            for r in mine
            if "region end" not in r.tag
            and "split" not in r.tag
            and "logits" not in r.tag
            and "replicated" not in r.tag
        ),
    }


class _NormSaved:
    """Bytes autograd saves while the blocks' norm modules run (saved-tensor hooks)."""

    def __init__(self, norms: list[torch.nn.Module]) -> None:
        self.inside = 0
        self.bytes = 0
        self.weights = {id(p) for norm in norms for p in norm.parameters()}  # saved too, but not activations
        for norm in norms:
            norm.register_forward_pre_hook(lambda m, a: setattr(self, "inside", self.inside + 1))
            norm.register_forward_hook(lambda m, a, o: setattr(self, "inside", self.inside - 1))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.inside and id(t) not in self.weights:
            self.bytes += t.numel() * t.element_size()
        return t


def _case(name: str, model_name: str, stage: int = 0, micro: int = MICRO, **extra: Any) -> dict[str, Any]:
    dp = dist.get_world_size() // 2
    model = BUILDERS[model_name](seed=dist.get_rank())  # rank 0's weights win
    if model_name.startswith("mlp"):
        extra.setdefault("tensor", {})["partition_config"] = MLP_PARTITION
    engine = slipstream.initialize(model, config(micro, dp, stage=stage, **extra))
    batches = global_batches(STEPS, MICRO * dp)
    traffic: dict[str, Any] = {}
    saved = _NormSaved([m for n, m in engine.module.named_modules() if n.endswith("input_layernorm")])

    def record(step: int) -> None:
        if step == 0:
            traffic.update(_tp_traffic(comms_log.records))

    comms_log.records.clear()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        ours = train(engine, batches[:1], record)
    saved_bytes = saved.bytes
    rest = train(engine, batches[1:])
    ours.losses += rest.losses
    ours.grad_norms += rest.grad_norms
    ours.params = rest.params
    result = {
        "name": name,
        "losses": ours.losses,
        "norms": ours.grad_norms,
        "state": ours.params if dist.get_rank() == 0 else None,
        "plan": _plan_of(engine.module),
        "traffic": traffic,
        "norm_saved": saved_bytes,
        "vocab": [n for n, m in engine.module.named_modules() if isinstance(m, (VocabEmbedding, VocabHead))],
        "local_numel": sum(p.numel() for p in engine.module.parameters()),
    }
    engine.close()
    return result


def _world2_body() -> list[dict[str, Any]]:
    return [
        _case("llama", "llama"),
        _case("llama-sp", "llama", tensor={"sequence_parallel": True}),
        _case("gpt2", "gpt2"),
        _case("mlp", "mlp"),
        _case("mlp-headnorm", "mlp-headnorm"),
        _case("llama-bf16", "llama", bf16={"enabled": True}),
        _case("llama-fp16", "llama", fp16={"enabled": True}),
        _case("llama-v257", "llama-v257"),
        _case("llama-kv1", "llama-kv1"),
        _case(
            "llama-sp-ac",
            "llama",
            tensor={"sequence_parallel": True},
            activation_checkpointing={"module_classes": ["LlamaDecoderLayer"]},
        ),
    ]


def _reference(
    model_name: str, batches: list[torch.Tensor], dtype: torch.dtype = torch.float32, clip: float = 0.0
) -> Any:
    return reference(BUILDERS[model_name](seed=0), batches, dtype, clip)


def test_tensor_parallel_world2_parity_plan_and_traffic() -> None:
    results = {r["name"]: r for r in run_distributed(2, _world2_body)[0]}
    batches = global_batches(STEPS, MICRO)
    refs = {
        name: _reference(name, batches) for name in ("llama", "gpt2", "mlp", "llama-v257", "llama-kv1", "mlp-headnorm")
    }
    for name, model_name in (
        ("llama", "llama"),
        ("llama-sp", "llama"),
        ("gpt2", "gpt2"),
        ("mlp", "mlp"),
        ("llama-sp-ac", "llama"),
        ("llama-v257", "llama-v257"),
        ("llama-kv1", "llama-kv1"),
        ("mlp-headnorm", "mlp-headnorm"),
    ):
        assert_close_trajectory(
            _as_trajectory(results[name]),
            refs[model_name],
            loss_rtol=1e-5,
            param_atol=PARAM_ATOL,
            param_rtol=PARAM_RTOL,
        )
        assert results[name]["losses"][-1] < results[name]["losses"][0] - 0.1
    for name, dtype in (("llama-bf16", torch.bfloat16), ("llama-fp16", torch.float16)):
        low = _reference("llama", batches, dtype)
        assert_close_trajectory(_as_trajectory(results[name]), low, loss_rtol=1e-3, param_rel_norm=2e-2)

    # 2. plan coverage: Llama 5 column + 2 row per block; GPT-2 packed c_attn, column c_fc, two rows.
    llama_plan = results["llama"]["plan"]
    for i in range(4):
        block = {n.split(".", 3)[3]: v for n, v in llama_plan.items() if n.startswith(f"model.layers.{i}.")}
        assert block == {
            "self_attn.q_proj": ("column", 1),
            "self_attn.k_proj": ("column", 1),
            "self_attn.v_proj": ("column", 1),
            "self_attn.o_proj": ("row", 1),
            "mlp.gate_proj": ("column", 1),
            "mlp.up_proj": ("column", 1),
            "mlp.down_proj": ("row", 1),
        }
    gpt2_plan = results["gpt2"]["plan"]
    for i in range(4):
        block = {n.split(".", 3)[3]: v for n, v in gpt2_plan.items() if n.startswith(f"transformer.h.{i}.")}
        assert block == {
            "attn.c_attn": ("column", 3),
            "attn.c_proj": ("row", 1),
            "mlp.c_fc": ("column", 1),
            "mlp.c_proj": ("row", 1),
        }
    assert set(results["mlp"]["plan"]) == {f"blocks.{i}.{leaf}" for i in range(3) for leaf in ("fc_in", "fc_out")}
    assert results["llama"]["vocab"] == ["model.embed_tokens", "lm_head"]
    assert results["gpt2"]["vocab"] == ["transformer.wte", "lm_head"]
    kv1 = {n.split(".", 3)[3]: v for n, v in results["llama-kv1"]["plan"].items() if n.startswith("model.layers.0.")}
    assert kv1["self_attn.k_proj"] == kv1["self_attn.v_proj"] == ("kv", 1) and kv1["self_attn.q_proj"] == ("column", 1)
    assert results["llama-v257"]["vocab"] == ["model.embed_tokens", "lm_head"]  # 257 rows: 129 + 128
    # local parameter count = sharded / t + replicated, exactly (shapes of the unsharded model)
    full = {name: dict(BUILDERS[name](seed=0).named_parameters()) for name in ("llama", "gpt2", "mlp")}
    odd = dict(BUILDERS["llama-v257"](seed=0).named_parameters())  # rank 0 holds 129 of the 257 vocabulary rows
    assert results["llama-v257"]["local_numel"] == sum(
        129 * p.shape[1]
        if n in ("model.embed_tokens.weight", "lm_head.weight")
        else p.numel() // 2
        if n.endswith("proj.weight")
        else p.numel()
        for n, p in odd.items()
    )
    cut = {
        "llama": lambda n: n.endswith("proj.weight") or n in ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": lambda n: (
            n.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "c_proj.weight"))
            or n == "transformer.wte.weight"
        ),
        "mlp": lambda n: n.endswith(("fc_in.weight", "fc_in.bias", "fc_out.weight")),
    }
    for name, params in full.items():
        expected = sum(p.numel() // 2 if cut[name](n) else p.numel() for n, p in params.items())
        assert results[name]["local_numel"] == expected, (name, results[name]["local_numel"], expected)

    # 3. traffic per micro-batch forward + backward (Llama, b 4, s 16, h 64, 4 blocks, vocab 256)
    bsh = MICRO * SEQ * HIDDEN * 4
    ops = results["llama"]["traffic"]["ops"]
    reduces = [o for o in ops if o[0] == "all_reduce"]
    assert len(reduces) == 4 * 4 + 2 and all(nbytes == bsh for _, nbytes, _ in reduces)  # + embedding fwd, head bwd
    assert [o[:2] for o in ops if o[0] == "all_gather"] == [("all_gather", MICRO * SEQ * 256 * 4)]  # gathered logits
    tp_moved, sp_moved = results["llama"]["traffic"]["block_moved"], results["llama-sp"]["traffic"]["block_moved"]
    assert tp_moved == 2 * (4 * 4 + 2) * bsh and sp_moved == tp_moved  # ratio 1.00 (blocks, embedding, head)
    # in all: sequence parallel adds its region edges, one all-gather of b·s·h each way (see docs/tensor_parallel.md)
    assert results["llama-sp"]["traffic"]["moved"] == results["llama"]["traffic"]["moved"] + 2 * bsh
    sp_ops = results["llama-sp"]["traffic"]["ops"]
    counted = collections.Counter((op, tag) for op, nbytes, tag in sp_ops if nbytes == bsh)
    assert counted == {  # per block 2 gathers + 2 reduce-scatters each way; + the region edges and embedding/head terms
        ("all_gather", "sp gather"): 8,
        ("reduce_scatter", "sp gather (backward)"): 8,
        ("reduce_scatter", "sp reduce-scatter"): 8,
        ("all_gather", "sp reduce-scatter (backward)"): 8,
        ("all_gather", "sp split (backward)"): 1,
        ("all_gather", "sp gather (region end)"): 1,
        ("all_reduce", "tp reduce"): 1,
        ("all_reduce", "tp copy (backward)"): 1,
    }, counted
    # saved activation bytes of the norms' inputs fall by exactly t
    assert (
        results["llama"]["norm_saved"] > 0 and results["llama"]["norm_saved"] == 2 * results["llama-sp"]["norm_saved"]
    )


def _as_trajectory(result: dict[str, Any]) -> Any:
    from tests.reference import Trajectory

    return Trajectory(result["losses"], result["state"], [])


def _world4_body() -> list[dict[str, Any]]:
    return [
        _case("zero1", "llama", stage=1),
        _case("zero3-clip", "llama", stage=3, clip=0.5),
        _case(
            "zero2-offload-gas2",
            "llama",
            stage=2,
            zero={"offload_optimizer": {"device": "cpu"}},
            micro=MICRO // 2,
            gas=2,
        ),
        _case("zero3-sp-kv1", "llama-kv1", stage=3, tensor={"sequence_parallel": True}),
    ]


def test_tensor_parallel_with_zero_over_dp() -> None:
    """tp 2 × dp 2 at ZeRO 1, 2 with CPU optimizer offload and 2 accumulation steps, and 3 (3 with clipping: the global norm counts every element once, over the world)."""
    zero1, zero3, zero2_offload, zero3_sp_kv1 = run_distributed(4, _world4_body)[0]
    batches = global_batches(STEPS, 2 * MICRO)
    ref = _reference("llama", batches)
    for result in (zero1, zero2_offload):
        assert_close_trajectory(
            _as_trajectory(result), ref, loss_rtol=1e-5, param_atol=PARAM_ATOL, param_rtol=PARAM_RTOL
        )
    kv1 = _reference("llama-kv1", batches)  # ZeRO-3 over dp with sequence parallel and replicated KV heads
    assert_close_trajectory(
        _as_trajectory(zero3_sp_kv1), kv1, loss_rtol=1e-5, param_atol=PARAM_ATOL, param_rtol=PARAM_RTOL
    )
    clipped = _reference("llama", batches, clip=0.5)
    assert_close_trajectory(
        _as_trajectory(zero3), clipped, loss_rtol=1e-5, param_atol=PARAM_ATOL, param_rtol=PARAM_RTOL
    )
    for ours, theirs in zip(zero3["norms"] + zero1["norms"], clipped.grad_norms + ref.grad_norms):
        assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
    assert max(clipped.grad_norms) > 0.5  # the clipping did bite


# --------------------------------------------------------------------------- checkpoints across tp degrees

CKPT_STEPS = 9  # A: 3 steps, save, 6 more; B (tp 1) resumes at 3, saves at 6; C (tp 2) resumes at 6


def _ckpt_engine(model: str, tp: int, stage: int) -> Any:
    dp = dist.get_world_size() // tp
    micro = 2 * MICRO // dp  # the same global batch of 8 at every layout
    return slipstream.initialize(BUILDERS[model](seed=7 + dist.get_rank()), config(micro, dp, tp=tp, stage=stage))


def _ckpt_a(model: str, stage: int, save_dir: str) -> list[float]:
    engine = _ckpt_engine(model, 2, stage)
    batches = global_batches(CKPT_STEPS, 2 * MICRO)
    losses = train(engine, batches[:3]).losses
    engine.save_checkpoint(save_dir, tag="tp2")
    losses += train(engine, batches[3:]).losses
    engine.close()
    return losses


def _ckpt_b(model: str, load_dir: str, save_dir: str) -> list[float]:
    engine = _ckpt_engine(model, 1, 0)
    engine.load_checkpoint(load_dir, tag="tp2")
    batches = global_batches(CKPT_STEPS, 2 * MICRO)
    losses = train(engine, batches[3:6]).losses
    engine.save_checkpoint(save_dir, tag="tp1")
    losses += train(engine, batches[6:]).losses
    engine.close()
    return losses


def _ckpt_c(model: str, stage: int, load_dir: str) -> list[float]:
    engine = _ckpt_engine(model, 2, stage)
    engine.load_checkpoint(load_dir, tag="tp1")
    losses = train(engine, global_batches(CKPT_STEPS, 2 * MICRO)[6:]).losses
    engine.close()
    return losses


@pytest.mark.parametrize(("model", "stage"), [("llama", 3), ("gpt2", 1)])
def test_checkpoint_tp2_dp2_to_tp1_stage0_and_back(model: str, stage: int, tmp_path: Path) -> None:
    """Llama at ZeRO-3; GPT-2 at ZeRO-1, whose packed c_attn pieces are saved and loaded one box per part."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    uninterrupted = run_distributed(4, _ckpt_a, model, stage, first)[0]
    resumed_tp1 = run_distributed(1, _ckpt_b, model, first, second)[0]
    resumed_tp2 = run_distributed(4, _ckpt_c, model, stage, second)[0]
    ref = reference(BUILDERS[model](seed=7), global_batches(CKPT_STEPS, 2 * MICRO)).losses
    for ours, theirs in ((uninterrupted, ref), (resumed_tp1, uninterrupted[3:]), (resumed_tp2, uninterrupted[6:])):
        for a, b in zip(ours, theirs, strict=True):
            assert abs(a - b) <= 1e-5 * b, (ours, theirs)


# --------------------------------------------------------------------------- mistakes fail initialize, naming the key or block

WRONG_GPT2_PLAN = {  # c_attn without "shape": [3, -1] is cut across Q|K|V instead of per part: runs, computes garbage
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.c_attn\.weight$", r".*\.c_fc\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.c_proj\.weight$"], "partition_type": "row"},
    ],
}


SILENTLY_WRONG_GPT2_PLAN = {  # c_fc cut as if it packed two parts: shapes all fit, the numbers do not
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1]},
        {"patterns": [r".*\.c_fc\.weight$"], "partition_type": "column", "shape": [2, -1]},
        {"patterns": [r".*\.c_proj\.weight$"], "partition_type": "row"},
    ],
}


def _error_of(model: torch.nn.Module, cfg: dict[str, Any]) -> str:
    try:
        slipstream.initialize(model, cfg).close()
    except slipstream.ConfigError as err:
        return str(err)
    return "no error"


def _errors_body() -> dict[str, str]:
    from tests.distributed.tp_cases import llama

    right = {
        **WRONG_GPT2_PLAN,
        "layer_specs": [
            *WRONG_GPT2_PLAN["layer_specs"][1:],
            {"patterns": [r".*\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1]},
            {"patterns": [r".*\.c_fc\.weight$"], "partition_type": "column"},
        ],
    }
    return {
        "wrong plan": _error_of(BUILDERS["gpt2"](), config(MICRO, 1, tensor={"partition_config": WRONG_GPT2_PLAN})),
        "silently wrong plan": _error_of(
            BUILDERS["gpt2"](), config(MICRO, 1, tensor={"partition_config": SILENTLY_WRONG_GPT2_PLAN})
        ),
        "right plan": _error_of(BUILDERS["gpt2"](), config(MICRO, 1, tensor={"partition_config": right})),
        "kv heads": _error_of(_three_kv_heads_llama(), config(MICRO, 1)),
        "sp without tp": _error_of(llama(), config(MICRO, 2, tp=1, tensor={"sequence_parallel": True})),
        "partition type": _error_of(
            llama(),
            config(
                MICRO,
                1,
                tensor={"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}},
            ),
        ),
    }


def _three_kv_heads_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=96,
            intermediate_size=128,
            num_attention_heads=6,
            num_key_value_heads=3,
            vocab_size=256,
        )
    )


def test_config_mistakes_fail_initialize_naming_the_key_or_block() -> None:
    errors = run_distributed(2, _errors_body)[0]
    assert errors["wrong plan"].startswith("tensor_parallel: the sharded block transformer.h.0 does not reproduce"), (
        errors["wrong plan"]
    )
    assert "transformer.h.0.attn.c_attn: column [partition_config.layer_specs[0]]" in errors["wrong plan"]
    silent = errors["silently wrong plan"]
    assert (
        silent.startswith("tensor_parallel: the sharded block transformer.h.0 does not reproduce the unsharded one")
        and "outputs differ by" in silent
    ), silent
    assert "transformer.h.0.mlp.c_fc: column (packed 2) [partition_config.layer_specs[1]]" in silent
    assert errors["right plan"] == "no error"  # the same plan with shape [3, -1] passes the self-check
    assert errors["kv heads"].startswith(
        "tensor_parallel.autotp_size: model.layers.0.self_attn.k_proj holds 3 heads, which neither divide by 2 nor divide 2"
    ), errors["kv heads"]
    assert errors["sp without tp"].startswith("tensor_parallel.sequence_parallel: needs tensor_parallel.autotp_size"), (
        errors["sp without tp"]
    )
    assert errors["partition type"].startswith(
        "tensor_parallel.partition_config.layer_specs[0].partition_type: must be row, column or skip"
    ), errors["partition type"]


# --------------------------------------------------------------------------- dropout randomness


def _rng_body() -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from slipstream.engine.parallel.rng import ShardedRegionRng

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # different default streams per rank: initialize must align them over tp
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=256,
            n_positions=32,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
        )
    )
    engine = slipstream.initialize(model, config(MICRO, 1))
    tokens = global_batches(2, MICRO)
    finals: list[torch.Tensor] = []  # the last norm's output: through replicated dropout (embeddings, residuals)
    engine.module.transformer.ln_f.register_forward_hook(lambda m, a, out: finals.append(out.detach().clone()))
    for batch in tokens:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    engine.close()
    region = ShardedRegionRng(rank)
    start = torch.get_rng_state()
    region.enter()
    inside = torch.rand(4)
    region.leave()
    after = torch.rand(4)
    torch.set_rng_state(start)  # what recomputation under activation checkpointing does
    region.enter()
    again = torch.rand(4)
    region.leave()
    return {"finals": finals, "inside": inside, "after": after, "again": again}


def test_dropout_rng_alike_in_replicated_regions_independent_in_sharded_ones() -> None:
    r0, r1 = run_distributed(2, _rng_body)
    for a, b in zip(
        r0["finals"], r1["finals"], strict=True
    ):  # replicated regions drew the same masks (ranks were seeded apart)
        assert torch.equal(a, b)
    assert not torch.equal(r0["inside"], r1["inside"])  # a sharded region: independent per tp rank
    assert torch.equal(r0["after"], r1["after"])  # back on the replicated stream, still alike
    assert torch.equal(r0["again"], r0["inside"]) and torch.equal(r1["again"], r1["inside"])  # recompute-safe


def _user_optimizer_body(stage: int) -> list[float]:
    """An optimizer instance built on the uncut model (as hosts build theirs) must step the shards the cut put in place."""
    from tests.reference import global_batches, tiny_llama, train_lm_engine

    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine = slipstream.initialize(model, config, optimizer=optimizer)
    losses = train_lm_engine(engine, global_batches(3, 4), micro=4, index=0)
    engine.close()
    return losses


@pytest.mark.parametrize("stage", [0, 3])
def test_an_optimizer_built_before_the_cut_trains_the_shards(stage: int) -> None:
    from tests.reference import global_batches, tiny_llama, train_lm_reference

    want, _ = train_lm_reference(tiny_llama(seed=0), global_batches(3, 4), lr=1e-2, bounds=False)
    for got in run_distributed(2, _user_optimizer_body, stage):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
