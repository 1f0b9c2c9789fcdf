"""Train a small GPT-2 with slipstream's ZeRO-2 sharding on generated data.

    slipstream run --nproc_per_node 2 examples/train_gpt2.py [--config examples/configs/zero2.json] [--steps 30]

Prints, from rank 0: loss, tokens/s, model TFLOP/s per rank (and MFU when the config names the
device's peak) and the peak memory of every rank; in a terminal with tqdm installed, as a progress
bar. examples/configs/monitor.json adds activation checkpointing and TensorBoard/CSV logs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import slipstream

MODELS = {  # the standard workloads of benchmarks/ (see BENCHMARKS.md)
    "gpt2-small": dict(n_layer=4, n_embd=256, n_head=4),
    "gpt2-large": dict(n_layer=8, n_embd=512, n_head=8),
}
VOCAB, SEQ = 8192, 128


class PatternTokens(torch.utils.data.Dataset):
    """Sequences where each token determines the next (x -> 7x + 11 mod V): random-looking, learnable."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, VOCAB, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        tokens = torch.empty(SEQ, dtype=torch.long)
        tokens[0] = self.starts[index]
        for i in range(1, SEQ):
            tokens[i] = (7 * tokens[i - 1] + 11) % VOCAB
        return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # ZeRO-2 by default: optimizer state and gradients sharded over the ranks (zero0.json: plain data parallel).
    parser.add_argument("--config", default=str(Path(__file__).parent / "configs" / "zero2.json"))
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--print-every", type=int, default=5)
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines"),
        default="auto",
        help="auto: a tqdm progress bar in a terminal, lines otherwise",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
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
    # GPT2LMHeadModel's class name maps to no transformers loss type; naming it keeps transformers from
    # warning on the first forward (the loss is the same causal-LM loss either way).
    model.loss_type = "ForCausalLM"
    engine = slipstream.initialize(model, args.config, training_data=PatternTokens(100_000))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{args.model}: {n_params / 1e6:.2f}M parameters, {world} rank(s), config {args.config}", flush=True)

    tokens_per_step = engine.train_batch_size() * SEQ
    batches = iter(engine.training_dataloader)
    bar = _progress_bar(args.progress, args.steps) if rank == 0 else None
    window_start, window_steps = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        loss_sum = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(batches)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        window_steps += 1
        if step % args.print_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)
            elapsed = time.perf_counter() - window_start
            peak = torch.tensor([engine.accelerator.max_memory_allocated() / 2**20])
            peaks = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(peaks, peak)
            if rank == 0:
                mean_loss = float(loss_sum) / (engine.gradient_accumulation_steps() * world)
                memory = " ".join(f"r{r}={float(p):.0f}MB" for r, p in enumerate(peaks))
                tokens_per_s = window_steps * tokens_per_step / elapsed
                flops = engine.monitor.flops_per_token() or 0.0
                tflops = flops * tokens_per_s / world / 1e12
                mfu = f" | MFU {tflops / engine.monitor.peak_tflops:.1%}" if engine.monitor.peak_tflops else ""
                if bar is not None:
                    bar.set_postfix_str(
                        f"loss {mean_loss:.4f} | {tokens_per_s:.0f} tok/s | {tflops:.3f} TFLOP/s/rank{mfu} | {memory}"
                    )
                    bar.update(step - bar.n)
                else:
                    print(
                        f"step {step:4d} | loss {mean_loss:.4f} | {tokens_per_s:8.0f} tokens/s | {tflops:.3f} TFLOP/s/rank{mfu} "
                        f"| lr {engine.get_lr()[0]:.2e} | peak RSS {memory}",
                        flush=True,
                    )
            window_start, window_steps = time.perf_counter(), 0
    if bar is not None:
        bar.close()
    engine.close()
    dist.barrier()  # without it gloo's teardown can hang when one rank leaves first
    dist.destroy_process_group()


def _progress_bar(mode: str, steps: int):  # returns a tqdm bar or None
    """A tqdm bar in a terminal (``auto``) or when asked (``bar``); None prints lines instead."""
    import sys

    if mode == "lines" or (mode == "auto" and not sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the "monitor" extra
        return None
    return tqdm(total=steps, unit="step", dynamic_ncols=True)


if __name__ == "__main__":
    main()
