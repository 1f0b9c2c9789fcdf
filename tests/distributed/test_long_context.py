"""``long_context``'s tilings under the sequence modes, ZeRO and tensor parallel: the tiled run equals the untiled one.

Each case trains the same model twice on 2 ranks, untiled and tiled (tiles far shorter than the
micro-batch, so every step crosses tiles, rows and shards), with SGD: the first step's update of
each weight is the learning rate times its gradient, so comparing those updates compares the
gradients. Losses per step within 1e-5 relative (measured: at most 1e-7 in fp32). First-step
updates within 1e-3 of their tensor's largest (measured: at most 3e-5, in the norms' weights, whose
gradients sum over every token; a dropped tile, a wrong shift or a gradient counted twice is
O(1e-2) or more). Later steps' updates are not compared elementwise: each starts from weights that
already differ by that noise, and it grows; their losses are compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slipstream
from tests.harness import run_distributed

SEQ, VOCAB, STEPS, LR = 48, 160, 2, 0.5


def _llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(dtype)


def _gpt_neox() -> torch.nn.Module:
    """Another shape of block: a quarter of each head rotated, attention and MLP side by side on one residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        rotary_pct=0.25,
        use_parallel_residual=True,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return GPTNeoXForCausalLM(config)


def _mixtral() -> torch.nn.Module:
    """Experts in every block (never tiled: only the logits are) and the router's auxiliary loss in the loss."""
    from tests.reference import tiny_mixtral

    model = tiny_mixtral(vocab=VOCAB, positions=SEQ)
    model.config.output_router_logits, model.router_aux_loss_coef = True, 0.02  # the coefficient is copied at init
    return model


# builder, block class, whether its MLPs are tiled (experts never are; a model of experts only is refused)
MODELS = {
    "llama": (_llama, "LlamaDecoderLayer", True),
    "gpt_neox": (_gpt_neox, "GPTNeoXLayer", True),
    "mixtral": (_mixtral, "MixtralDecoderLayer", False),
}


def _config(
    mode: str,
    stage: int,
    batch: int,
    tiled: bool,
    bf16: bool = False,
    offload: str | None = None,
    block: str = "LlamaDecoderLayer",
    tile_mlp: bool = True,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if mode == "ulysses":
        cfg["sequence_parallel_size"] = 2
    elif mode in ("ring", "zigzag"):
        cfg["context_parallel"] = {"size": 2, "method": mode}
    elif mode == "tp":
        cfg["tensor_parallel"] = {"autotp_size": 2}
    elif mode == "pp":  # a 1F1B window of two micro-batches of half the rows
        cfg.update(pipeline={"stages": 2}, train_micro_batch_size_per_gpu=batch // 2, gradient_accumulation_steps=2)
    if offload is not None:  # every block checkpointed, its inputs waiting in files
        cfg["activation_checkpointing"] = {"module_classes": [block], "offload_path": offload}
    if tiled:
        cfg["long_context"] = {"tiled_logits": {"enabled": True, "tile_tokens": 7}}
        if tile_mlp:
            cfg["long_context"]["tiled_mlp"] = {"enabled": True, "tile_tokens": 10}
    return cfg


def _train(
    mode: str, stage: int, batch: int, tiled: bool, bf16: bool, offload: str | None = None, arch: str = "llama"
) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    build, block, tile_mlp = MODELS[arch]
    model = build()
    if offload is not None:  # this test's inputs are small: every one of them goes to a file
        from slipstream import checkpointing
        from slipstream.saved_tensor_offload import FileOffload

        checkpointing._offloads[offload] = FileOffload(offload, min_bytes=0)
    engine = slipstream.initialize(model, _config(mode, stage, batch, tiled, bf16, offload, block, tile_mlp))
    start = engine.consolidated_state_dict()
    tiles = engine.parallel.tiling.logits if tiled and engine.parallel.tiling is not None else None
    counted = tiles.tiled_losses if tiles is not None else 0  # the twin check's forward at initialize may count one
    g = torch.Generator().manual_seed(11)
    losses, deferred, first = [], False, {}
    for step in range(STEPS):
        if step == 1:  # the first step's update: its gradient, times the learning rate
            first = engine.consolidated_state_dict()
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :5] = -100  # some tokens unlabelled: the count the mean divides by is the labelled ones
        if mode == "pp":
            window = []
            for rows in (slice(0, batch // 2), slice(batch // 2, batch)):
                out = engine(input_ids=ids[rows], labels=labels[rows])
                engine.backward(out.loss)
                engine.step()
                window.append(out.loss)
            losses.append(sum(float(loss) for loss in window) / 2)
            if tiles is not None:  # the last stage computed both micro-batches' losses over tiles; the first none
                last = engine.mesh.rank_of("pp") == engine.mesh.size("pp") - 1
                deferred = tiles.tiled_losses - counted == (2 * (step + 1) if last else 0)
            continue
        out = engine(input_ids=ids, labels=labels)
        deferred = deferred or type(out.__dict__.get("logits")).__name__ == "DeferredLogits"
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    if tiles is not None:  # nothing, the engine's first-batch check included, computed the logits whole
        deferred = deferred and tiles.whole_logits == 0
    if tiled and tile_mlp:  # and the MLP of every block this rank runs was found and tiled
        deferred = deferred and len(engine.parallel.tiling.mlp.names) == (
            1 if mode == "pp" else 2
        )  # pp: a block a stage
    engine.close()
    if offload is not None:
        from slipstream import checkpointing

        checkpointing.configure(offload_path=None)
        files = checkpointing._offloads.pop(offload)
        deferred = deferred and next(files._names) > 0 and not list(files.directory.glob("*.bin"))  # written, then gone
    return losses, {k: (first[k].float() - start[k].float()) for k in first} if first else {}, deferred


def _both(
    mode: str, stage: int, batch: int, bf16: bool, offload: str | None = None, arch: str = "llama"
) -> dict[str, Any]:
    plain = _train(mode, stage, batch, False, bf16, arch=arch)
    where = None if offload is None else f"{offload}/rank{torch.distributed.get_rank()}"
    tiled = _train(mode, stage, batch, True, bf16, where, arch)
    return {"plain": plain, "tiled": tiled}


def _compare(result: dict[str, Any], loss_rtol: float, update_rtol: float) -> None:
    (plain_losses, plain_updates, _), (tiled_losses, tiled_updates, deferred) = result["plain"], result["tiled"]
    assert deferred, (
        "the tiled run computed its logits whole, in the loss or before it (or, with offload, wrote no file or left one "
        "behind)"
    )
    for step, (a, b) in enumerate(zip(plain_losses, tiled_losses)):
        assert abs(a - b) <= loss_rtol * abs(a), f"step {step}: loss {b!r} tiled vs {a!r} untiled"
    for name, a in plain_updates.items():
        b = tiled_updates[name]
        scale = float(a.abs().max())
        off = float((a - b).abs().max())
        assert off <= update_rtol * scale + 1e-12, f"{name}: update off by {off:.3g} (its scale {scale:.3g})"


@pytest.mark.parametrize(
    "mode,stage,batch",
    [
        ("ulysses", 0, 1),
        ("ulysses", 3, 4),
        ("ring", 0, 4),
        ("zigzag", 3, 1),
        ("tp", 0, 2),
        ("tp", 3, 1),
        ("dp", 3, 2),
        ("pp", 1, 2),
        ("pp", 3, 2),
    ],
)
def test_tiled_logits_and_mlp_equal_the_untiled_run(mode: str, stage: int, batch: int) -> None:
    results = run_distributed(2, _both, mode, stage, batch, False)
    _compare(results[0], 1e-5, 1e-3)
    assert all(r["tiled"][2] for r in results), (
        "a rank's loss was not tiled (under pp: the last stage's, every micro-batch)"
    )


def test_tiled_in_bf16_follows_the_untiled_bf16_run() -> None:
    results = run_distributed(2, _both, "ulysses", 0, 2, True)
    # bf16: the tiles' GEMMs round their own partial sums (8 bits of mantissa; measured 6e-3 of the updates' scale);
    # measured 8e-6 of the loss. A dropped tile of the loss moves it by 12% here; one tile's MLP output zeroed is refused
    # by the first-batch twin check before training
    _compare(results[0], 2e-2, 1e-1)


@pytest.mark.parametrize(
    "arch,mode", [("llama", "ulysses"), ("gpt_neox", "ulysses"), ("gpt_neox", "zigzag"), ("mixtral", "ulysses")]
)
def test_all_three_with_the_checkpointed_inputs_in_files(tmp_path: Any, arch: str, mode: str) -> None:
    """Tiled logits, tiled MLP and checkpointed blocks whose inputs wait in files, ZeRO-3: the untiled run's result."""
    results = run_distributed(2, _both, mode, 3, 2, False, str(tmp_path), arch)
    _compare(results[0], 1e-5, 1e-3)


def _pipeline_run(schedule: str, tiled: bool) -> tuple[list[float], int | None]:
    from tests.reference import tiny_gpt2

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "pipeline": {"stages": 2, "schedule": schedule, "virtual_stages": 2},
    }
    if tiled:
        cfg["long_context"] = {"tiled_logits": {"enabled": True, "tile_tokens": 5}}
    engine = slipstream.initialize(tiny_gpt2(seed=0, n_layer=4), cfg)  # the head is tied to the embeddings
    counted = engine.parallel.tiling.logits.tiled_losses if tiled else 0
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (8, 16), generator=g)
        window = []
        for m in range(4):
            out = engine(input_ids=ids[2 * m : 2 * m + 2], labels=ids[2 * m : 2 * m + 2])
            engine.backward(out.loss)
            engine.step()
            window.append(out.loss)
        losses.append(sum(float(loss) for loss in window) / 4)
    tiles = engine.parallel.tiling.logits.tiled_losses - counted if tiled else None
    engine.close()
    return losses, tiles


def _pipeline_both(schedule: str) -> dict[str, Any]:
    return {"plain": _pipeline_run(schedule, False), "tiled": _pipeline_run(schedule, True)}


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "dualpipev"])
def test_tiled_logits_on_the_last_stage_of_any_schedule(schedule: str) -> None:
    # Interleaved 1F1B puts the last (virtual) stage on rank 1, DualPipeV's V shape on rank 0.
    results = run_distributed(2, _pipeline_both, schedule)
    for a, b in zip(results[0]["plain"][0], results[0]["tiled"][0], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (results[0]["plain"][0], results[0]["tiled"][0])
    counts = sorted(r["tiled"][1] for r in results)
    assert counts == [0, 4 * STEPS], counts  # every micro-batch's loss tiled, on the one rank holding the last stage
    last = 0 if schedule == "dualpipev" else 1
    assert results[last]["tiled"][1] == 4 * STEPS, [r["tiled"][1] for r in results]
