"""Tiny real models, deterministic data and the plain-PyTorch reference trajectory tests compare to."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from tests.noise import AdamW, NoiseShadows, assert_weights_close, float64_twin, twin_grads, with_bounds

VOCAB = 256
SEQ = 16


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 64) -> torch.nn.Module:
    """A randomly initialised GPT-2 (transformers) small enough to train in milliseconds."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ * 2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def global_batches(steps: int, batch: int, seed: int = 1234) -> list[torch.Tensor]:
    """Sequences that follow ``x[i+1] = (5 x[i] + 3) mod VOCAB`` from a random start: learnable, so losses fall."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch, SEQ, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=generator)
        for i in range(1, SEQ):
            tokens[:, i] = (5 * tokens[:, i - 1] + 3) % VOCAB
        batches.append(tokens)
    return batches


def noisy_batches(steps: int, batch: int, seed: int = 1234, noise: float = 0.3) -> list[torch.Tensor]:
    """``global_batches``' sequences with each token replaced by a random one with probability ``noise``: the loss
    settles near the noise's entropy (~2.9 nats) instead of memorising to ~0, so a relative loss comparison over
    hundreds of steps measures the training, not the last digits of a memorised batch."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
        follow = torch.rand(batch, SEQ, generator=generator) >= noise
        for i in range(1, SEQ):
            tokens[:, i] = torch.where(follow[:, i], (5 * tokens[:, i - 1] + 3) % VOCAB, tokens[:, i])
        batches.append(tokens)
    return batches


def micro_batch(global_batch: torch.Tensor, micro: int, rank: int, world: int, mb: int) -> torch.Tensor:
    """The slice of a global batch that ``rank`` trains on in accumulation step ``micro``."""
    start = (micro * world + rank) * mb
    return global_batch[start : start + mb]


def gpt2_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


@dataclasses.dataclass
class Trajectory:
    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: list[float]


def train_reference(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    clip: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> Trajectory:
    """Single process, full global batch, ``torch.optim.AdamW`` with fp32 master weights when ``dtype`` is low."""
    model = model.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params] if dtype != torch.float32 else params
    optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, fused=True)
    # float32 only: the noise allowance of each weight (tests/noise.py); low precision compares in norm instead
    twin = float64_twin(model) if dtype == torch.float32 else None
    shadows = NoiseShadows(model.named_parameters(), AdamW(lr, weight_decay=weight_decay)) if twin is not None else None
    losses, norms = [], []
    for tokens in batches:
        loss = gpt2_loss(model, tokens)
        loss.backward()
        if masters is not params:
            for m, p in zip(masters, params):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grads = [m.grad for m in masters if m.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if shadows is not None:  # float32: masters are the parameters; the gradients as they are before clipping
            exact = twin_grads(twin, model, lambda m, tokens=tokens: gpt2_loss(m, tokens))
            coef = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
            shadows.observe({n: p.grad for n, p in model.named_parameters()}, exact, coef)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        optimizer.step()
        optimizer.zero_grad()
        if masters is not params:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    names = {id(p): n for n, p in model.named_parameters()}
    master_of = dict(zip((id(p) for p in params), masters))
    final = {names[id(p)]: master_of.get(id(p), p).detach().float().clone() for p in model.parameters()}
    return Trajectory(losses, with_bounds(final, shadows) if shadows is not None else final, norms)


def train_engine(engine: Any, batches: list[torch.Tensor]) -> Trajectory:
    """Train with the engine on this rank's share of each global batch; losses are global means."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gas, mb = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses, norms = [], []
    for tokens in batches:
        total = torch.zeros(())
        for micro in range(gas):
            loss = gpt2_loss(engine, micro_batch(tokens, micro, rank, world, mb))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (gas * world))
        norms.append(engine.get_global_grad_norm())
    state = engine.consolidated_state_dict()
    return Trajectory(losses, state or {}, norms)


def assert_weights_match(state: dict[str, torch.Tensor], reference: torch.nn.Module, rtol: float, atol: float) -> None:
    """Every parameter of ``reference`` equals ``state[name]`` (a consolidated state dict) within the tolerances."""
    assert_weights_close(state, {name: value for name, value in reference.named_parameters()}, rtol=rtol, atol=atol)


def assert_close_trajectory(
    ours: Trajectory,
    ref: Trajectory,
    loss_rtol: float,
    param_atol: float = 0.0,
    param_rtol: float = 0.0,
    param_rel_norm: float | None = None,
) -> None:
    """Per-step losses within ``loss_rtol``; final weights element-wise (atol/rtol) or in relative L2 norm."""
    for step, (a, b) in enumerate(zip(ours.losses, ref.losses, strict=True)):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: loss {a!r} vs reference {b!r} (rtol {loss_rtol})"
    assert ours.params.keys() == ref.params.keys()
    if param_rel_norm is not None:
        diff = torch.sqrt(sum((ours.params[k] - ref.params[k]).pow(2).sum() for k in ref.params))
        norm = torch.sqrt(sum(ref.params[k].pow(2).sum() for k in ref.params))
        assert diff <= param_rel_norm * norm, (
            f"weights differ by {float(diff / norm):.2e} relative (limit {param_rel_norm})"
        )
        return
    assert_weights_close(ours.params, ref.params, rtol=param_rtol, atol=param_atol)


def tiny_llama(seed: int = 0, n_layer: int = 2, hidden: int = 64) -> torch.nn.Module:
    """A randomly initialised Llama-style model (RMSNorm, rotary, gated MLP, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ * 2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def train_lm_reference(
    model: torch.nn.Module, batches: list[torch.Tensor], lr: float, bounds: bool = True, micro_batches: int = 1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: ``model(input_ids=t, labels=t).loss`` on each whole batch, AdamW without weight decay or clipping;
    the weights carry their noise allowance (compare with ``tests.noise.assert_weights_close``); ``bounds=False``
    skips the float64 twin that measures it, for callers that compare losses only. ``micro_batches``: the batch's
    rows cut into that many equal micro-batches and their losses averaged, as data parallel averages its ranks'
    (for a loss that is not a mean over rows, such as an MoE's balancing loss over each micro-batch)."""

    def step_loss(m: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        chunks = tokens.chunk(micro_batches)
        return sum(m(input_ids=c, labels=c).loss for c in chunks) / len(chunks)  # type: ignore[return-value]

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    twin, shadows = (float64_twin(model), NoiseShadows(model.named_parameters(), AdamW(lr))) if bounds else (None, None)
    losses = []
    for tokens in batches:
        loss = step_loss(model, tokens)
        loss.backward()
        if shadows is not None:
            exact = twin_grads(twin, model, lambda m, tokens=tokens: step_loss(m, tokens))
            shadows.observe({n: p.grad for n, p in model.named_parameters()}, exact)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, with_bounds(final, shadows) if shadows is not None else final


def train_lm_engine(engine: Any, batches: list[torch.Tensor], micro: int, index: int) -> list[float]:
    """Each rank trains on rows ``[index·micro, (index+1)·micro)`` of every batch; the world-mean loss per step."""
    losses = []
    for tokens in batches:
        mine = tokens[index * micro : (index + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def tiny_mixtral(
    seed: int = 0, hidden: int = 64, intermediate: int = 96, vocab: int = 128, positions: int = 16, layers: int = 2
) -> torch.nn.Module:
    """A randomly initialised Mixtral (4 experts, top-2, GQA 4/2 heads, sdpa attention), two layers by default."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=vocab,
        max_position_embeddings=positions,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config)


def train_step_on_global_batch(engine: Any, tokens: torch.Tensor, micro: int) -> float:
    """One optimizer step over ``tokens`` (the global batch): dp rank ``d``'s micro-batch ``i`` is rows
    ``(i·dp + d)·micro …`` (as a sampler would hand them out); the step's mean loss over the world
    (a pipeline's deferred losses are read after the window's last backward)."""
    dp, d, m = engine.mesh.size("dp"), engine.mesh.rank_of("dp"), engine.gradient_accumulation_steps()
    window = []
    for i in range(m):
        mine = tokens[(i * dp + d) * micro : (i * dp + d + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        window.append(loss)
    total = torch.tensor(sum(float(loss.item()) for loss in window) / m)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()
