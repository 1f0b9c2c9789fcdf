"""Dropout under the parallelisms that cut the model or the sequence: every slice draws its own masks.

Each rank is seeded alike (``torch.manual_seed(0)``, as a user's script does). In one process every
block and every sequence position draws fresh masks; a pipeline stage or a Ulysses shard that
started from the same generator state as its neighbour would repeat the neighbour's masks
([Note: one stream per slice] in ``parallel/rng.py``). World 2, GPT-2 with ``resid_pdrop`` 0.5.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import slipstream
from tests.harness import run_distributed

SEQ, VOCAB, B = 16, 128, 2


def _gpt2(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # alike on every rank: only the engine's re-seeding can tell their streams apart
    config = GPT2Config(
        n_layer=layers,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.5,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def _first_masks(model: torch.nn.Module, engine: Any, micro_batches: int) -> dict[int, torch.Tensor]:
    """Each local block's first MLP-dropout mask (where its output is zero) in one training step."""
    masks: dict[int, torch.Tensor] = {}

    def record(index: int) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> None:
            if module.training:  # the first-batch twin check runs the model in eval mode first: no masks there
                masks.setdefault(index, (out == 0).flatten())

        return hook

    for index, block in enumerate(model.transformer.h):
        if hasattr(block, "mlp"):  # not another stage's block
            block.mlp.dropout.register_forward_hook(record(index))
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (B, SEQ), generator=g) for _ in range(micro_batches)]
    engine.train_batch(iter([{"input_ids": t, "labels": t} for t in tokens]))
    return masks


def _gathered(mask: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(mask) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mask)
    return out


def _body() -> dict[str, Any]:
    common = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
    }
    # Pipeline: stage 0 holds blocks 0-1, stage 1 blocks 2-3; compare the first local block of each.
    model = _gpt2(4)
    engine = slipstream.initialize(
        model, {**common, "pipeline": {"stages": 2, "schedule": "1f1b"}, "gradient_accumulation_steps": 2}
    )
    masks = _first_masks(model, engine, 2)
    first_local = masks[min(masks)]
    stages = _gathered(first_local)
    # Ulysses: each rank holds half of every sequence; compare block 0's masks of the two halves.
    model = _gpt2(2)
    engine = slipstream.initialize(model, {**common, "sequence_parallel_size": 2, "gradient_accumulation_steps": 1})
    shards = _gathered(_first_masks(model, engine, 1)[0])
    return {
        "stage_blocks": sorted(masks),
        "stages_equal": bool(torch.equal(stages[0], stages[1])),
        "shards_equal": bool(torch.equal(shards[0], shards[1])),
        "rate": float(first_local.float().mean()),
    }


def test_pipeline_stages_and_sequence_shards_draw_their_own_dropout_masks() -> None:
    results = run_distributed(2, _body)
    assert [r["stage_blocks"] for r in results] == [[0, 1], [2, 3]]
    for r in results:
        assert not r["stages_equal"], "pipeline stage 1 repeats stage 0's dropout masks"
        assert not r["shards_equal"], "Ulysses shard 1 repeats shard 0's dropout masks"
        assert 0.35 < r["rate"] < 0.65  # dropout still drops about p = 0.5
