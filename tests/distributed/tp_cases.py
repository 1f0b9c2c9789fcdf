"""Models, configs and the training loop the tensor-parallel tests share (bodies run on every rank)."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from tests.reference import SEQ, VOCAB, Trajectory

LR = 1e-3


def llama(seed: int = 0, n_layer: int = 4, hidden: int = 64, vocab: int = VOCAB, kv_heads: int = 2) -> torch.nn.Module:
    """The acceptance Llama: h 64, 4 heads, 2 KV heads, 4 layers, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=SEQ * 2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def gpt2(seed: int = 0) -> torch.nn.Module:
    """The acceptance GPT-2: n_embd 64, 4 heads, 4 layers, tied head, dropout 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ * 2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class MLPBlock(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc_in = torch.nn.Linear(hidden, 4 * hidden)
        self.fc_out = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(self.norm(x))))


class HeadNormBlock(MLPBlock):
    """A replicated parameter inside the sharded region: a LayerNorm over each 16-wide group of fc_in's output
    (as Qwen3's per-head q_norm): at tp 2 each rank normalizes only its groups, so its gradient is partial."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.head_norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(self.norm(x))
        h = self.head_norm(h.view(*h.shape[:-1], -1, 16)).flatten(-2)
        return x + self.fc_out(torch.nn.functional.gelu(h))


class TinyMLPLM(torch.nn.Module):
    """A custom model (no Hugging Face plan, names the inference would not guess): blocks of MLPs."""

    def __init__(self, seed: int = 0, hidden: int = 32, n_layer: int = 3, block: type = MLPBlock) -> None:
        torch.manual_seed(seed)
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.blocks = torch.nn.ModuleList(block(hidden) for _ in range(n_layer))
        self.out = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.out(x)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss)


MLP_PARTITION = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.fc_in\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.fc_out\.weight$"], "partition_type": "row"},
    ],
}


def llama_odd_vocab(seed: int = 0) -> torch.nn.Module:
    """A vocabulary of 257 (prime): cut 129 + 128 rows at tp 2, the logits padded for the gather."""
    return llama(seed, n_layer=2, vocab=VOCAB + 1)


def llama_one_kv_head(seed: int = 0) -> torch.nn.Module:
    """4 query heads, 1 KV head: at tp 2 each rank keeps the KV head whole (its gradient summed over tp)."""
    return llama(seed, n_layer=2, kv_heads=1)


def mlp_head_norm(seed: int = 0) -> torch.nn.Module:
    return TinyMLPLM(seed, block=HeadNormBlock)


BUILDERS = {
    "llama": llama,
    "gpt2": gpt2,
    "mlp": TinyMLPLM,
    "mlp-headnorm": mlp_head_norm,
    "llama-v257": llama_odd_vocab,
    "llama-kv1": llama_one_kv_head,
}


def config(micro: int, dp: int, tp: int = 2, stage: int = 0, gas: int = 1, **extra: Any) -> dict[str, Any]:
    tensor = {"autotp_size": tp, **extra.pop("tensor", {})}
    return {
        "train_batch_size": micro * dp * gas,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})},
        "gradient_clipping": extra.pop("clip", 0.0),
        "tensor_parallel": tensor,
        **extra,
    }


def train(engine: Any, batches: list[torch.Tensor], record: Any = None) -> Trajectory:
    """This rank's dp share of every global batch; losses averaged over the world (tp ranks agree)."""
    dp, dp_rank, gas = engine.mesh.size("dp"), engine.mesh.rank_of("dp"), engine.gradient_accumulation_steps()
    losses, norms = [], []
    for step, tokens in enumerate(batches):
        mb = tokens.shape[0] // (dp * gas)
        total = torch.zeros(())
        for micro in range(gas):  # micro-batch `micro` of every dp rank, then the next: the reference's order
            start = (micro * dp + dp_rank) * mb
            part = tokens[start : start + mb]
            loss = engine(input_ids=part, labels=part).loss
            engine.backward(loss)
            if record is not None and micro == 0:
                record(step)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (dist.get_world_size() * gas))
        norms.append(float(engine.get_global_grad_norm()))
    state = engine.consolidated_state_dict()
    return Trajectory(losses, state or {}, norms)


def reference(
    model: torch.nn.Module, batches: list[torch.Tensor], dtype: torch.dtype = torch.float32, clip: float = 0.0
) -> Trajectory:
    """``train_reference`` with this file's optimizer settings."""
    from tests.reference import train_reference

    return train_reference(model, batches, lr=LR, weight_decay=0.0, clip=clip, dtype=dtype)
