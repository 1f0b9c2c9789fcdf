"""A tiny GPT-2 trained under ``slipstream run`` with injected faults (not a test module).

The goodput tests and ``benchmarks/bench_goodput.py`` start it. ``--faults`` lists faults as
``KIND@STEP:RANK`` (comma-separated); the i-th fires in the i-th attempt, so a job with
``--max_restarts`` takes every fault once, at global step STEP on rank RANK:

* ``kill``: SIGKILL after the step's optimizer step (a dead rank);
* ``stop``: SIGSTOP before the step's forward (a hang: the process is alive and silent);
* ``diverge``: one extra broadcast before the step's forward (a rank-dependent code path);
* ``skipuser``: with ``--user_allreduce 1`` (every rank all-reduces a metric with its own
  ``dist.all_reduce`` after each step), this rank skips that call in step STEP.

Writes ``events.jsonl`` (one line per attempt from rank 0, one per fault from the faulty rank)
and rank 0's final fp32 weights (``final.pt``). The data come from the engine's own loader, so the
order after a restart is the loader's resumed position, as in a real run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import slipstream

STARTED = time.time()


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2
    )  # dropout on: the RNG must resume too
    return GPT2LMHeadModel(config)


def token_data(samples: int = 4096, length: int = 16) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randint(0, 96, (samples, length), generator=generator))


def parse_faults(text: str) -> list[tuple[str, int, int]]:
    faults = []
    for item in filter(None, text.split(",")):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        faults.append((kind, int(step), int(rank)))
    return faults


def record(out: Path, **event: object) -> None:
    with open(out / "events.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps(event) + "\n")
        file.flush()
        os.fsync(file.fileno())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--faults", default="")
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--interval", type=int, default=0, help="disk checkpoint every N steps")
    parser.add_argument("--in_memory", type=int, default=0, help="in-memory snapshot every N steps")
    parser.add_argument("--comms_timeout", type=float, default=30.0)
    parser.add_argument("--zero_stage", type=int, default=1)
    parser.add_argument(
        "--user_allreduce", type=int, default=0, help="the script's own dist.all_reduce after each step"
    )
    args = parser.parse_args()
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = parse_faults(args.faults)
    fault = faults[attempt] if attempt < len(faults) else None

    config: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
        "comms_timeout_seconds": args.comms_timeout,
        "steps_per_print": 0,
    }
    if args.save_dir:
        config["checkpoint"] = {
            "save_dir": args.save_dir,
            "interval": args.interval,
            "auto_resume": True,
            "in_memory_interval": args.in_memory,
        }
    torch.set_num_threads(1)
    engine = slipstream.initialize(tiny_gpt2(), config, training_data=token_data())
    rank = dist.get_rank()
    if rank == 0:
        record(
            out,
            event="attempt",
            attempt=attempt,
            started=STARTED,
            ready=time.time(),
            start_step=engine.global_steps,
            resumed_from=engine.resumed_from,
            resume_s=engine.checkpoints.resume_s,
        )
    first_step_done = False
    while engine.global_steps < args.steps:
        for (tokens,) in engine.training_dataloader:
            step = engine.global_steps
            mine = fault is not None and fault[1] == step and fault[2] == rank
            if mine and fault[0] == "stop":
                record(out, event="fault", kind="stop", step=step, rank=rank, at=time.time())
                os.kill(os.getpid(), signal.SIGSTOP)
            if mine and fault[0] == "diverge":
                record(out, event="fault", kind="diverge", step=step, rank=rank, at=time.time())
                slipstream.comm.broadcast(torch.zeros(16), src=rank, tag="injected").wait()
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            if args.user_allreduce and not (mine and fault[0] == "skipuser"):
                metric = loss.detach().reshape(1).repeat(4)
                dist.all_reduce(metric)  # the user's own collective, outside slipstream
            if rank == 0 and not first_step_done:
                first_step_done = True
                record(out, event="first_step", attempt=attempt, step=engine.global_steps, at=time.time())
            if mine and fault[0] == "kill":
                record(out, event="fault", kind="kill", step=step, rank=rank, at=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps >= args.steps:
                break
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(state, out / "final.pt")
        record(out, event="done", attempt=attempt, at=time.time(), steps=engine.global_steps)
    engine.close()


if __name__ == "__main__":
    main()
