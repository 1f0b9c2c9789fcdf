"""The model zoo: tiny models built from configs (random init, fixed seed), one builder per architecture.

Every builder returns a model whose forward takes ``input_ids`` and ``labels`` and returns an output
with ``.loss`` (transformers' convention), dropout off, so a run is deterministic. Sizes are the
smallest that keep each architecture's features (windows shorter than the sequence, soft-capping,
ALiBi, MLA, shared experts, tied embeddings): hidden 32, 4 layers (2 + 2 for encoder-decoders, so a
V pipeline of 4 stages fits the decoders), 4 heads, vocabulary 64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ = 64, 32, 16
WINDOW = 4  # sliding windows shorter than SEQ, so they bite


def _hf(config_name: str, model_name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**kwargs)
        return getattr(transformers, model_name)(config)

    return build


_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
)


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def _causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
        x = x + torch.tanh(self.linear(x))
        return x if x0 is None else x + 0.5 * x0


class _BlockLM(torch.nn.Module):
    """Embedding, four small blocks, a head; subclasses decide how the blocks are called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([_Block() for _ in range(4)])
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def hidden(self, x0: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Output:
        return _Output(_causal_loss(self.head(self.hidden(self.embed(input_ids))), labels))


class PlainLM(_BlockLM):
    """Custom: the blocks once, in order (what a pipeline cut expects)."""

    def hidden(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = layer(x)
        return x


class ValueResidualLM(_BlockLM):
    """Custom: every block also reads the embedding output (``x = block(x, x0)``)."""

    def hidden(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = layer(x, x0)
        return x


class LoopedLM(_BlockLM):
    """Custom: the block list runs twice per forward (looped depth, ALBERT-style sharing)."""

    def hidden(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x


class _KeywordBlock(torch.nn.Module):
    """A pre-norm MLP block that takes an extra keyword tensor (a per-position gate computed once by the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up, self.down = torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))) * gate


class SkippingKeywordLM(_BlockLM):
    """Custom: blocks called with an extra keyword tensor (``gate``, from positions), and the forward skips block 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([_KeywordBlock() for _ in range(4)])

    def hidden(self, x0: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x0.shape[1], device=x0.device, dtype=x0.dtype)
        gate = (1.0 + positions / x0.shape[1])[None, :, None]  # [1, s, 1]: read per position by every block
        x = x0
        for i, layer in enumerate(self.layers):
            if i != 1:
                x = layer(x, gate=gate)
        return x


class EncoderLM(torch.nn.Module):
    """Custom: an LM on ``nn.TransformerEncoder`` with a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        layer = torch.nn.TransformerEncoderLayer(HIDDEN, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Output:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        return _Output(_causal_loss(self.head(self.encoder(self.embed(input_ids), mask=mask, is_causal=True)), labels))


ZOO: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", **_DECODER),
    "mistral-window": _hf("MistralConfig", "MistralForCausalLM", **_DECODER, sliding_window=WINDOW),
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
    "qwen3": _hf("Qwen3Config", "Qwen3ForCausalLM", **_DECODER, head_dim=8),
    "gemma2": _hf(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        **_DECODER,
        head_dim=8,
        sliding_window=WINDOW,
        query_pre_attn_scalar=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
    ),
    "phi3": _hf("Phi3Config", "Phi3ForCausalLM", **_DECODER, pad_token_id=0),
    "gpt2": _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=4,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "gpt-neox": _hf(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
    "opt": _hf(
        "OPTConfig",
        "OPTForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_dim=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=HIDDEN,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
    ),
    "falcon": _hf(
        "FalconConfig",
        "FalconForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        new_decoder_architecture=True,
        num_kv_heads=2,
    ),
    "bloom-alibi": _hf(
        "BloomConfig",
        "BloomForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        n_layer=4,
        n_head=4,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
    "bert-mlm": _hf(
        "BertConfig",
        "BertForMaskedLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "bart": _hf(
        "BartConfig",
        "BartForConditionalGeneration",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    ),
    "t5": _hf(
        "T5Config",
        "T5ForConditionalGeneration",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
    "mixtral": _hf("MixtralConfig", "MixtralForCausalLM", **_DECODER, num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe": _hf(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        **_DECODER,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
    "deepseek-v3": _hf(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
        attention_dropout=0.0,
    ),
    "gemma3": _hf(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        **_DECODER,
        head_dim=8,
        sliding_window=WINDOW,
        query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "starcoder2": _hf(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        **_DECODER,
        sliding_window=WINDOW,
        residual_dropout=0.0,
        embedding_dropout=0.0,
    ),
    "olmo2": _hf("Olmo2Config", "Olmo2ForCausalLM", **_DECODER),
    "stablelm": _hf("StableLmConfig", "StableLmForCausalLM", **_DECODER, qk_layernorm=True, hidden_dropout=0.0),
    "gpt-bigcode": _hf(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=4,
        n_head=4,
        n_positions=64,
        multi_query=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "gpt-j": _hf(
        "GPTJConfig",
        "GPTJForCausalLM",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=4,
        n_head=4,
        n_positions=64,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "modernbert-mlm": _hf(
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        global_attn_every_n_layers=2,
        local_attention=WINDOW,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        attention_dropout=0.0,
        embedding_dropout=0.0,
        mlp_dropout=0.0,
    ),
    "torch-encoder": EncoderLM,
    "value-residual": ValueResidualLM,
    "looped": LoopedLM,
    "skip-keyword": SkippingKeywordLM,
}
MOE = ("mixtral", "qwen2-moe", "deepseek-v3")
