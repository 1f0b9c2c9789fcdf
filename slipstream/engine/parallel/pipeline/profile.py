"""``pipeline.partition: "profile"``: balance stages by measured block times, not parameter counts.

Parameter counts misjudge compute: an embedding holds many parameters and costs a lookup, an LM
head holds as many and costs a large matrix product (and the loss after it). Before the cut, while
every rank still holds the whole model, the model runs a few forward and backward passes on a
synthetic micro-batch of the configured size (random token ids, sequence as long as the model's
positions allow, up to 512) with timers on each block and on the modules before and after the
blocks, forward and backward. The pipeline ranks average their timings (one all-reduce), so every
rank cuts the same stages.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.anatomy import Blocks

RUNS, WARMUP, MAX_SEQ = 4, 1, 512


def synthetic_batch(model: torch.nn.Module, micro_batch: int) -> dict[str, torch.Tensor]:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(vocab, int) or not isinstance(positions, int):
        raise ConfigError(
            'pipeline.partition: "profile" times the model on synthetic token ids, so it needs a transformers model '
            '(a config with vocab_size and max_position_embeddings); use "parameters", "uniform" or "type:<regex>"'
        )
    device = next(model.parameters()).device
    ids = torch.randint(
        0, vocab, (micro_batch, min(positions, MAX_SEQ)), generator=torch.Generator().manual_seed(0)
    ).to(device)
    return {"input_ids": ids, "labels": ids}  # the loss too: the last stage computes it


def block_times(
    model: torch.nn.Module,
    blocks: Blocks,
    prologue: list[str],
    epilogue: list[str],
    micro_batch: int,
    group: dist.ProcessGroup | None,
) -> list[float]:
    """Each block's forward + backward time, the prologue's added to the first and the epilogue's to the last (averaged over ``group``).

    What no timed module covers (gradient accumulation, the loss after the head, masks and positions)
    is measured as the rest of the model's forward and backward and spread in proportion. Gradients
    are dropped afterwards: the model is left as it was.
    """
    batch = synthetic_batch(model, micro_batch)
    timed = {name: model.get_submodule(name) for name in [*blocks.names, *prologue, *epilogue]}
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    started: dict[str, float] = {}

    def begin(name: str) -> None:
        started[name] = time.perf_counter()

    def end(name: str) -> None:
        if name in started:
            seconds[name].append(time.perf_counter() - started.pop(name))

    handles = []
    for name, module in timed.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: begin(name)))
        handles.append(module.register_forward_hook(lambda m, a, o, name=name: end(name)))
        handles.append(module.register_full_backward_pre_hook(lambda m, g, name=name: begin("~" + name)))
        handles.append(module.register_full_backward_hook(lambda m, gi, go, name=name: end("~" + name)))
        seconds["~" + name] = []
    whole: list[float] = []
    try:
        for run in range(WARMUP + RUNS):
            if run == WARMUP:
                for values in seconds.values():
                    values.clear()
                whole.clear()
            start = time.perf_counter()
            loss = getattr(model(**batch), "loss", None)
            if loss is not None:
                loss.backward()
            whole.append(time.perf_counter() - start)
    finally:
        for handle in handles:
            handle.remove()
        for param in model.parameters():
            param.grad = None
    # The fastest of the runs: other processes (the other ranks timing their copy on the same
    # machine) only ever add time, so the minimum is the most repeatable figure.
    fastest = {name: min(values) if values else 0.0 for name, values in seconds.items()}
    cost = {name: fastest[name] + fastest["~" + name] for name in timed}
    weights = torch.tensor([cost[name] for name in blocks.names], dtype=torch.float64)
    weights[0] += sum(cost[name] for name in prologue)
    weights[-1] += sum(cost[name] for name in epilogue)
    # The rest (gradient accumulation into every parameter, the loss, masks): spread in proportion,
    # since most of it follows the modules' own work. Putting it all on the last stage overweights it.
    outer = [
        n for n in timed if not any(n != m and n.startswith(m + ".") for m in timed)
    ]  # nested modules counted once
    rest = max(0.0, min(whole) - sum(cost[name] for name in outer))
    weights *= 1.0 + rest / max(float(weights.sum()), 1e-12)
    comm.all_reduce(weights, group=group, tag="pipeline partition profile").wait()
    return [float(w) for w in weights / dist.get_world_size(group)]


def describe(weights: list[float], ranges: list[range]) -> str:
    return ", ".join(f"{sum(weights[i] for i in r) * 1e3:.1f} ms" for r in ranges)
