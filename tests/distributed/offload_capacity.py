"""One rank of the NVMe capacity test (run by test_offload.py as two fresh processes).

Builds a GPT-2 under zero.Init whose fp32 optimizer state (masters + two moments, 12 bytes per
parameter) is larger than a data-size limit set on this process, trains it 3 steps with
parameters and optimizer state on NVMe, and prints a JSON line with the losses and memory.
"""

from __future__ import annotations

import gc
import json
import resource
import sys

import torch
import torch.distributed as dist

import slipstream
from tests.reference import global_batches, gpt2_loss, micro_batch, tiny_gpt2

N_LAYER, N_EMBD = 20, 512


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(nvme_path: str, cap: int) -> None:
    torch.set_num_threads(1)
    config = {
        "train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1_000_000,
            "stage3_prefetch_bucket_size": 0,
            "reduce_bucket_size": 4_000_000,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
        },
        "aio": {"queue_depth": 2},
    }
    warm = slipstream.initialize(tiny_gpt2(seed=0, n_layer=1), {**config, "zero_optimization": {"stage": 3}})
    warm.close()  # process groups, ring threads and the compiled ops exist before the limit
    del warm
    gc.collect()
    base_rss, base_data = _status("VmRSS"), _status("VmData")
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (base_data + cap, hard))
    with slipstream.zero.Init(config=config):
        model = tiny_gpt2(seed=0, n_layer=N_LAYER, n_embd=N_EMBD)
    numel = sum(p.numel() for p in model.parameters())
    engine = slipstream.initialize(model, config)
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, peak = [], 0
    for tokens in global_batches(3, 2):
        loss = gpt2_loss(engine, micro_batch(tokens, 0, rank, world, 1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        peak = max(peak, _status("VmHWM"))
    held = engine.strategy.memory_breakdown()
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    engine.close()  # hands every parameter its full value back: the whole model, above the cap
    print(
        json.dumps(
            {
                "rank": rank,
                "losses": losses,
                "params": numel,
                "optimizer_state_per_rank": 12 * numel // world,
                "cap": cap,
                "peak_rss_growth": peak - base_rss,
                "held": held,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
