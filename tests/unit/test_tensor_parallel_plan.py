"""The tensor-parallel plan without a process group: config validation and the three plan sources."""

from __future__ import annotations

import pytest
import torch

from slipstream import ConfigError
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.tensor.plan import build_plan, is_linear_like, validate_partition_config
from tests.distributed.tp_cases import MLP_PARTITION, TinyMLPLM, gpt2, llama


def _leaves(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    blocks = find_blocks(model)
    assert blocks is not None
    return {
        f"{b}.{n}": m
        for b, block in zip(blocks.names, blocks.modules)
        for n, m in block.named_modules()
        if n and is_linear_like(m)
    }


def test_deepspeed_partition_configs_are_accepted() -> None:
    validate_partition_config(
        {
            "use_default_specs": False,
            "strict_mode": True,
            "tp_size": 2,
            "embedding_partition_dim": 1,
            "lm_head_patterns": ["lm_head"],
            "layer_specs": [
                {
                    "patterns": [r".*\.query_key_value\.weight$"],
                    "partition_type": "COLUMN",
                    "shape": [3, -1],
                    "partition_dim": 0,
                },
                {"patterns": [r".*\.dense\.weight$"], "partition_type": "row", "model_types": ["gpt_neox"]},
                {"patterns": [r".*\.q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
                {"patterns": [r".*\.gate_up\.weight$"], "gather_output": False},
            ],
        }
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"layer_spec": []}, "tensor_parallel.partition_config: unknown key 'layer_spec'"),
        ({"layer_specs": {}}, "tensor_parallel.partition_config.layer_specs: must be a list"),
        (
            {"layer_specs": [{"patterns": ["("]}]},
            "tensor_parallel.partition_config.layer_specs[0].patterns: '(' is not a regular expression",
        ),
        (
            {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]},
            "tensor_parallel.partition_config.layer_specs[0].partition_type: must be row, column or skip",
        ),
        (
            {"layer_specs": [{"patterns": ["x"], "shape": [[64, 32, 32], -1]}]},
            "packed parts of unequal sizes are not supported yet",
        ),
        (
            {"layer_specs": [{"patterns": ["x"], "colour": 1}]},
            "tensor_parallel.partition_config.layer_specs[0]: unknown key 'colour'",
        ),
    ],
)
def test_partition_config_mistakes_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_partition_config(section)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_plan_sources() -> None:
    model = llama(n_layer=2)  # base_model_tp_plan: q/k/v/gate/up column, o/down row
    leaves = _leaves(model)
    entries = build_plan(model, leaves, list(leaves), None)
    assert len(entries) == 2 * 7
    plan = {
        e.name.split(".", 3)[3]: (e.style, e.parts, e.source.split("[")[0])
        for e in entries
        if e.name.startswith("model.layers.0.")
    }
    assert plan == {
        "self_attn.q_proj": ("column", 1, "base_model_tp_plan"),
        "self_attn.k_proj": ("column", 1, "base_model_tp_plan"),
        "self_attn.v_proj": ("column", 1, "base_model_tp_plan"),
        "self_attn.o_proj": ("row", 1, "base_model_tp_plan"),
        "mlp.gate_proj": ("column", 1, "base_model_tp_plan"),
        "mlp.up_proj": ("column", 1, "base_model_tp_plan"),
        "mlp.down_proj": ("row", 1, "base_model_tp_plan"),
    }
    model = gpt2()  # no tp_plan: inferred in execution order, c_attn packed Q|K|V
    leaves = _leaves(model)
    order = [
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.0.mlp.c_proj",
    ]
    plan = {
        e.name: (e.style, e.parts, e.source)
        for e in build_plan(model, leaves, order, None)
        if e.name.startswith("transformer.h.0.")
    }
    assert plan == {
        order[0]: ("column", 3, "inferred"),
        order[1]: ("row", 1, "inferred"),
        order[2]: ("column", 1, "inferred"),
        order[3]: ("row", 1, "inferred"),
    }
    model = TinyMLPLM()  # the config's layer_specs; strict_mode refuses a leaf no spec covers
    leaves = _leaves(model)
    assert {e.style for e in build_plan(model, leaves, list(leaves), MLP_PARTITION)} == {"column", "row"}
    strict = {"use_default_specs": False, "strict_mode": True, "layer_specs": MLP_PARTITION["layer_specs"][:1]}
    with pytest.raises(
        ConfigError, match=r"strict_mode: 3 linear layer\(s\) match no layer spec \(first: blocks.0.fc_out\)"
    ):
        build_plan(model, leaves, list(leaves), strict)


def test_a_gathered_pair_in_the_models_plan_is_kept() -> None:
    """transformers' colwise_gather_output / rowwise_split_input (Phi-3's packed qkv_proj, sliced by the global
    head count) mark the pair gathered: the attention between them sees whole heads."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = transformers.Phi3ForCausalLM(config)
    leaves = _leaves(model)
    plan = {
        e.name.rpartition(".")[2]: (e.style, e.gathered)
        for e in build_plan(model, leaves, list(leaves), None)
        if ".0." in e.name
    }
    assert plan == {
        "qkv_proj": ("column", True),
        "o_proj": ("row", True),
        "gate_up_proj": ("column", True),
        "down_proj": ("row", True),
    }


def test_inference_follows_the_data_flow_across_sibling_modules() -> None:
    """BERT spreads its attention over ``attention.self`` (Q, K, V) and ``attention.output`` (the output projection),
    and its MLP over two sibling modules: grouped by parent module, V would be the attention's row and the MLP
    unsharded; traced through the probe's autograd graph, each group ends at the first leaf reading its outputs."""
    from transformers import BertConfig, BertForMaskedLM

    from slipstream.engine.parallel.tensor.probe import leaf_inputs

    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    blocks = find_blocks(model)
    assert blocks is not None
    leaves = _leaves(model)
    inputs = leaf_inputs(model, blocks.modules, leaves)
    prefix = "bert.encoder.layer.0."
    plan = {
        e.name[len(prefix) :]: e.style
        for e in build_plan(model, leaves, list(leaves), None, lambda: inputs)
        if e.name.startswith(prefix)
    }
    assert plan == {
        "attention.self.query": "column",
        "attention.self.key": "column",
        "attention.self.value": "column",
        "attention.output.dense": "row",
        "intermediate.dense": "column",
        "output.dense": "row",
    }
    assert inputs[prefix + "attention.output.dense"] == {
        prefix + f"attention.self.{n}" for n in ("query", "key", "value")
    }
    assert inputs[prefix + "attention.self.query"] == set()  # the block's input, traced no further
