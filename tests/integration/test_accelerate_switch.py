"""Accelerate on Slipstream (issue 15): a DeepSpeed-style Accelerate loop trains to the single-process reference."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.reference import global_batches, gpt2_loss, tiny_gpt2, train_reference

pytest.importorskip("accelerate")

STEPS, MB, GAS = 4, 2, 2


def _loop_body(stage: int) -> list[float] | None:
    from accelerate.state import AcceleratorState, GradientState

    from slipstream.integrations.accelerate import DummyOptim, SlipstreamAccelerator, SlipstreamPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    world = dist.get_world_size()
    batches = global_batches(STEPS, MB * GAS * world)
    dataset = [row for batch in batches for row in batch]  # micro-batch (step, micro, rank) = loader batch in order
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": 0},
    }
    plugin = SlipstreamPlugin(hf_ds_config=config, gradient_accumulation_steps=GAS, gradient_clipping=1.0)
    accelerator = SlipstreamAccelerator(slipstream_plugin=plugin, cpu=True)
    model = tiny_gpt2(seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=MB, shuffle=False)
    optimizer = DummyOptim(model.parameters(), lr=1e-3, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert accelerator.unwrap_model(model) is model.module
    checkpoint = os.path.join(tempfile.gettempdir(), f"slipstream-accelerate-{os.getppid()}-{stage}")

    def train(batches_iter, steps: int) -> list[float]:
        losses, total = [], torch.zeros(())
        for i, tokens in zip(range(steps * GAS), batches_iter):
            with accelerator.accumulate(model):
                loss = gpt2_loss(model, tokens)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    assert norm is not None and torch.isfinite(norm)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
            if (i + 1) % GAS == 0:
                dist.all_reduce(total)
                losses.append(float(total) / (GAS * world))
                total = torch.zeros(())
        return losses

    items = list(loader)
    first = train(iter(items[: 2 * GAS]), 2)
    accelerator.save_state(checkpoint)
    rest = train(iter(items[2 * GAS :]), STEPS - 2)
    accelerator.load_state(checkpoint)
    assert model.global_steps == 2
    again = train(iter(items[2 * GAS :]), STEPS - 2)
    assert again == rest, (again, rest)  # resumed bit for bit
    model.close()
    return first + rest if dist.get_rank() == 0 else None


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_loop_with_dummy_optim_matches_the_reference(stage: int) -> None:
    losses = run_distributed(2, _loop_body, stage)[0]
    batches = global_batches(STEPS, MB * GAS * 2)
    ref = train_reference(tiny_gpt2(seed=0), batches, lr=1e-3, weight_decay=0.0, clip=1.0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)


def _compiled_by_dynamo_plugin() -> tuple[bool, str, float]:
    from accelerate.state import AcceleratorState, GradientState

    from slipstream.integrations.accelerate import DummyOptim, SlipstreamAccelerator, SlipstreamPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    accelerator = SlipstreamAccelerator(
        slipstream_plugin=SlipstreamPlugin(hf_ds_config=config), cpu=True, dynamo_backend="aot_eager"
    )
    model = tiny_gpt2(seed=0)
    model, _ = accelerator.prepare(model, DummyOptim(model.parameters(), lr=1e-3))
    tokens = global_batches(1, MB)[0]
    loss = gpt2_loss(model, tokens)
    accelerator.backward(loss)
    compiled, backend = model.is_compiled, model.config.compile.backend
    model.close()
    AcceleratorState._reset_state(True)
    return compiled, backend, float(loss.detach())


def test_a_dynamo_backend_compiles_the_blocks() -> None:
    """The Trainer's ``torch_compile`` reaches Accelerate as its dynamo plugin; under DeepSpeed it is dropped
    (transformers#23095), here each block is compiled with its backend."""
    compiled, backend, loss = run_distributed(1, _compiled_by_dynamo_plugin)[0]
    assert compiled and backend == "aot_eager" and loss == loss
