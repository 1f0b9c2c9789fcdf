"""Reading a DeepSpeed checkpoint: slipstream's import beside DeepSpeed's own ``zero_to_fp32.py``, time and peak RSS.

    python benchmarks/bench_deepspeed_import.py --deepspeed-python /tmp/dsvenv/bin/python
                                                [--model gpt2-large] [--stages 2,3] [--rounds 3]

DeepSpeed 0.19.8 (its own venv) trains a GPT-2 of BENCHMARKS.md's standard sizes one step at
world 2 (fp32, AdamW, ZeRO ``--stages``) and saves. Then, in fresh processes, alternating
(A B A B):

* A: ``zero_to_fp32.py`` (DeepSpeed's script, in its venv) writes the consolidated fp32 weights
  (pytorch_model.bin: its --safe_serialization fails on tied weights such as GPT-2's) — what users script
  before every resume elsewhere;
* B: slipstream's import (``slipstream.engine.checkpoint.formats.deepspeed.convert``): fp32 masters *and*
  both Adam moments, step, scheduler and counters, resharding-ready, every file fsynced.

Each process's peak RSS comes from ``getrusage(RUSAGE_CHILDREN)`` after it exits. Medians and the
ratio B/A are printed; B does about three times A's output (weights and two moments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_MAKE = r"""
import os, sys, torch, torch.multiprocessing as mp
sys.path.insert(0, {root!r})
def worker(rank, out, model, stage):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29655",
                      DS_ACCELERATOR="cpu")
    import deepspeed
    from benchmarks.common import build_gpt2, random_batches
    deepspeed.init_distributed("gloo")
    net = build_gpt2(model)
    config = {{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {{"stage": stage}}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4), config=config)
    batch = random_batches(1, 2, seed=rank)[0]
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()
    engine.save_checkpoint(out)
if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2], int(sys.argv[3])), nprocs=2)
"""

_IMPORT = r"""
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from slipstream.engine.checkpoint.formats.deepspeed.convert import convert
convert(Path(sys.argv[1]), Path(sys.argv[2]), "converted")
"""


def _rss_of(argv: list[str]) -> tuple[float, float]:
    """Run ``argv`` under a tiny wrapper that reports its own child's peak RSS (isolated from earlier children)."""
    wrapper = (
        "import resource, subprocess, sys, time, json; s = time.perf_counter(); "
        "r = subprocess.run(sys.argv[1:]); "
        "print(json.dumps([time.perf_counter() - s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, r.returncode]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    elapsed, rss, code = json.loads(proc.stdout.strip().splitlines()[-1])
    if code != 0:
        raise RuntimeError(f"{argv[:3]} failed:\n{proc.stderr[-3000:]}")
    return elapsed, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ds-import-"))
    try:
        for stage in [int(s) for s in args.stages.split(",")]:
            saved = work / f"stage{stage}"
            maker = work / "make.py"
            maker.write_text(_MAKE.format(root=str(ROOT)))
            made = subprocess.run(
                [args.deepspeed_python, str(maker), str(saved), args.model, str(stage)], capture_output=True, text=True
            )
            if made.returncode != 0:
                raise SystemExit(f"DeepSpeed could not make the checkpoint:\n{made.stderr[-3000:]}")
            tag = saved / (saved / "latest").read_text().strip()
            size = sum(f.stat().st_size for f in tag.iterdir()) / 2**20
            importer = work / "import.py"
            importer.write_text(_IMPORT.format(root=str(ROOT)))
            script = tag.parent / "zero_to_fp32.py"
            results: dict[str, list[tuple[float, float]]] = {"zero_to_fp32": [], "slipstream": []}
            for _ in range(args.rounds):
                out_a, out_b = work / "fp32", work / "ours"
                results["zero_to_fp32"].append(_rss_of([args.deepspeed_python, str(script), str(saved), str(out_a)]))
                results["slipstream"].append(_rss_of([sys.executable, str(importer), str(tag), str(out_b)]))
                shutil.rmtree(out_a, ignore_errors=True)
                shutil.rmtree(out_b, ignore_errors=True)
            t_a = statistics.median(r[0] for r in results["zero_to_fp32"])
            t_b = statistics.median(r[0] for r in results["slipstream"])
            m_a = statistics.median(r[1] for r in results["zero_to_fp32"])
            m_b = statistics.median(r[1] for r in results["slipstream"])
            print(
                f"{args.model} ZeRO-{stage}, world 2, checkpoint {size:.0f} MiB, {args.rounds} alternating rounds (medians):"
            )
            print(f"  zero_to_fp32.py (fp32 weights only)          {t_a:6.2f} s   peak RSS {m_a:7.0f} MB")
            print(f"  slipstream import (weights + Adam + state)   {t_b:6.2f} s   peak RSS {m_b:7.0f} MB")
            print(f"  ratio slipstream / zero_to_fp32               time {t_b / t_a:.2f}x   RSS {m_b / m_a:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
