"""A one-rank NVMe-offload run that ends abruptly: ``kill`` (SIGKILL mid-run) or ``exit`` (no close)."""

from __future__ import annotations

import os
import signal
import sys

import slipstream
from tests.reference import global_batches, gpt2_loss, tiny_gpt2


def main(root: str, mode: str) -> None:
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": root}},
    }
    engine = slipstream.initialize(tiny_gpt2(seed=0), config)
    for tokens in global_batches(2, 2):
        engine.backward(gpt2_loss(engine, tokens))
        engine.step()
    print("trained", flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)  # no engine.close(): the atexit hook removes the swap files


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
