"""The plain-DDP twin of examples/train_gpt2.py (same model, data, optimizer, printing).

    torchrun --nproc_per_node 2 benchmarks/ddp_gpt2.py [--steps 30]

bench_startup.py launches both and compares their time to the first loss.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt2 import MODELS, SEQ, VOCAB, PatternTokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--print-every", type=int, default=5)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            **MODELS[args.model],
        )
    )
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    dataset = PatternTokens(100_000)
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, world, rank, seed=0))
    batches = iter(loader)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.print_every == 0 or step == args.steps:
            loss = loss.detach()
            dist.all_reduce(loss)
            if rank == 0:
                tokens = args.print_every * 4 * world * SEQ
                print(
                    f"step {step:4d} | loss {float(loss) / world:.4f} | {tokens / (time.perf_counter() - start):8.0f} tokens/s",
                    flush=True,
                )
            start = time.perf_counter()
    dist.barrier()  # without it gloo's teardown can hang when one rank leaves first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
