"""A small training job that the launcher tests start with ``slipstream run`` (not a test module).

Writes each rank's losses (by step) and rank 0's final consolidated weights to ``--out``, and on
request misbehaves: SIGKILLs one rank once (fault tolerance) or makes one rank skip a
collective (desync guard).
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


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


def dataset(size: int = 512) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 8, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--interval", type=int, default=0)
    parser.add_argument("--comms_timeout", type=float, default=None)
    parser.add_argument("--kill_rank", type=int, default=-1)
    parser.add_argument("--kill_after_step", type=int, default=-1)
    parser.add_argument("--skip_rank", type=int, default=-1)
    parser.add_argument("--skip_step", type=int, default=-1)
    parser.add_argument("--own_process_group", action="store_true", help="create the group before initialize()")
    args = parser.parse_args()
    if args.own_process_group:
        dist.init_process_group("gloo")  # torch's default 30-minute timeout, until initialize() re-times it

    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }
    if args.save_dir:
        config["checkpoint"] = {"save_dir": args.save_dir, "interval": args.interval, "auto_resume": True}
    if args.comms_timeout:
        config["comms_timeout_seconds"] = args.comms_timeout
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = slipstream.initialize(Regression(), config, training_data=dataset())
    rank = dist.get_rank()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    out = Path(args.out)
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLIPSTREAM_TEST_MARK",
    )
    (out / f"env_rank{rank}.json").write_text(json.dumps({key: os.environ.get(key) for key in keys}))
    losses: dict[int, float] = {}
    while engine.global_steps < args.steps:
        for x, y in engine.training_dataloader:
            step = engine.global_steps
            if rank == args.skip_rank and step == args.skip_step:
                (out / "skipped_at").write_text(repr(time.time()))
                time.sleep(300)  # this rank skips the step's collectives: the others must not wait forever
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[step] = loss.item()
            (out / f"losses_rank{rank}_attempt{attempt}.json").write_text(json.dumps(losses))
            if rank == args.kill_rank and engine.global_steps == args.kill_after_step and attempt == "0":
                (out / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps >= args.steps:
                break
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(state, out / "final.pt")
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
