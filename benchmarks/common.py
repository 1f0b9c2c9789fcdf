"""The standard workloads of BENCHMARKS.md, shared by every benchmark script."""

from __future__ import annotations

import os
import resource
import socket
import statistics
import time
from collections.abc import Callable

import torch

VOCAB, SEQ, MICRO_BATCH = 8192, 128, 4
MODELS = {"gpt2-small": dict(n_layer=4, n_embd=256, n_head=4), "gpt2-large": dict(n_layer=8, n_embd=512, n_head=8)}


def build_gpt2(name: str = "gpt2-small", seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        **MODELS[name],
    )
    return GPT2LMHeadModel(config)


def random_batches(n: int, batch: int = MICRO_BATCH, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=generator) for _ in range(n)]


def time_steps(step: Callable[[torch.Tensor], None], batches: list[torch.Tensor], warmup: int) -> list[float]:
    """Seconds per step after ``warmup`` untimed steps (a barrier keeps ranks aligned per step)."""
    import torch.distributed as dist

    times = []
    for i, batch in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_rank_results(out: str, times: list[float], extra: dict | None = None) -> None:
    """Gather every rank's peak RSS (and ``extra``); rank 0 writes ``{"times", "rss", "extra"}`` as JSON to ``out``. Collective."""
    import json

    import torch.distributed as dist

    all_rss = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(all_rss, torch.tensor([peak_rss_mb()]))
    extras: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(extras, extra)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "rss": [float(r) for r in all_rss], "extra": extras}, f)
    dist.barrier()


def current_rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def lm_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip: float = 1.0
) -> Callable[[torch.Tensor], None]:
    """The plain PyTorch step a peer (DDP, FSDP2) takes on a causal LM: loss on ``batch`` as labels, backward, clip, step."""

    def step(batch: torch.Tensor) -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()

    return step


def wrap_peer(kind: str, model: torch.nn.Module, blocks: torch.nn.ModuleList) -> torch.nn.Module:
    """The PyTorch peers: ``ddp`` (DistributedDataParallel) or ``fsdp2`` (``fully_shard`` on each block, then the root)."""
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def summarize(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    return f"{name:<34} median {statistics.median(ms):7.1f} ms  (min {ms[0]:.1f}, max {ms[-1]:.1f}, n={len(ms)})"


def spawn_ranks(worker: Callable[..., None], *args: object, world: int = 2) -> list[dict]:
    """Run ``worker(rank, *args, port, out)`` on ``world`` fresh processes; each rank may write JSON to
    ``f"{out}.{rank}"``. Returns what the ranks wrote, in rank order (ranks that wrote nothing left out)."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(worker, args=(*args, free_port(), out), nprocs=world, start_method="spawn")
        found = []
        for rank in range(world):
            path = f"{out}.{rank}"
            if os.path.exists(path):
                with open(path) as f:
                    found.append(json.load(f))
        return found


def alternate_on_off(
    worker: Callable[..., None], modes: list[str], rounds: int, *args: object
) -> dict[tuple[str, bool], list[dict]]:
    """Fresh 2-rank jobs ``worker(rank, mode, on, *args, port, out)`` for every mode with a feature on, then off,
    round after round (A B A B ...); what rank 0 wrote, by ``(mode, on)``."""
    found: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(rounds):
        for mode in modes:
            for on in (True, False):
                found.setdefault((mode, on), []).extend(spawn_ranks(worker, mode, on, *args))
    return found
