"""A/B of the engine layer between two revisions: time to first loss and step time, alternating.

    python benchmarks/bench_engine_layer.py --before REV [--after REV|worktree] [--model gpt2-large]
                                            [--rounds 3] [--steps 20 --warmup 5]
                                            [--configs zero0,zero2,zero3,pp2,tp2] [--launcher slipstream|torchrun]

Shows that a behaviour-preserving refactor leaves time to first loss (TTFL) and step time unchanged
within noise. Each revision is exported with ``git archive REV | tar -x`` into a temporary directory
(``--after worktree``, the default, uses this checkout as it is) and every measurement is a fresh
2-rank job started from that tree with ``PYTHONPATH=<tree>``, so the revision's own ``slipstream`` is
imported (each run checks ``slipstream.__file__`` and the first run of each side prints it). The
rank script is this file from the *after* tree (this checkout's copy when the after revision does
not contain it yet), with its ``common.py``: only the ``slipstream`` package differs between A and B,
and the script uses nothing but the public API (``slipstream.initialize(model, config)``,
``engine(input_ids=..., labels=...).loss``, ``engine.backward(loss)``, ``engine.step()``).

Workload (BENCHMARKS.md): GPT-2 (gpt2-large: 8 layers, n_embd 512, vocab 8192, 29.48M parameters),
seq 128, micro-batch 4 per rank, AdamW lr 1e-3 wd 0.01 from the config, fp32, gradient clipping
1.0, 2 ranks (gloo), ``torch.set_num_threads(1)`` per rank, ``OMP_NUM_THREADS=1`` and
``THP_MEM_ALLOC_ENABLE=1`` (as ``slipstream run`` sets them; unless already set). Configurations:

* ``zero0`` / ``zero1`` / ``zero2`` / ``zero3``: data parallel 2 at that ZeRO stage (each rank its own data);
* ``pp2``: ``pipeline.stages`` 2, ``--pp-micro-batches`` (4) micro-batches per optimizer step, every
  loss a deferred one read after the window's last ``engine.backward``;
* ``tp2``: ``tensor_parallel.autotp_size`` 2 (both ranks see the same micro-batch).

TTFL is the wall time from starting the launcher (``--launcher slipstream``: the revision's own
``slipstream run``, as ``bench_startup.py``; ``torchrun``: ``python -m torch.distributed.run
--standalone``) to rank 0 printing a marker after its first optimizer step (for ``pp2``: after the
first window). Step time is rank 0's median over ``--steps`` optimizer steps after ``--warmup``
(a barrier before each). Runs alternate per round and per configuration, A B in odd rounds and
B A in even ones (so neither side always runs first: use an even ``--rounds``), after one
untimed priming run per side (byte-code, page cache; ``--no-prime`` skips it). Each run also reports
its first and last loss: the two sides should agree bit for bit when the change preserves behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = Path(__file__).name
FIRST = "BENCH_ENGINE_LAYER_FIRST_STEP"
RESULT = "BENCH_ENGINE_LAYER_RESULT"
CONFIGS = ("zero0", "zero1", "zero2", "zero3", "pp2", "tp2")
LOAD_WARN = 1.5
OWN_LOAD = 2.0  # what our own 2 busy ranks add to the load average


# --------------------------------------------------------------------------- rank side (the worker)


def engine_config(name: str, pp_micro_batches: int) -> dict:
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    }
    if name.startswith("zero"):
        return {**base, "zero_optimization": {"stage": int(name[4:])}}
    if name == "pp2":
        return {**base, "gradient_accumulation_steps": pp_micro_batches, "pipeline": {"stages": 2}}
    if name == "tp2":
        return {**base, "tensor_parallel": {"autotp_size": 2}}
    raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")


def worker(args: argparse.Namespace) -> None:
    """One rank of one measurement; rank 0 prints the first-step marker and the result line."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from common import build_gpt2, random_batches  # this file's neighbour: the after tree's harness

    import slipstream

    rank = int(os.environ["RANK"])
    where = os.path.realpath(slipstream.__file__)
    expected = os.path.realpath(args.expect_tree)
    if not where.startswith(expected + os.sep):
        raise SystemExit(f"{SCRIPT}: slipstream imported from {where}, expected under {expected}")
    model = build_gpt2(args.model)
    params = sum(p.numel() for p in model.parameters())
    micro = args.pp_micro_batches if args.worker == "pp2" else 1
    # data parallel: each rank its own data; pipeline and tensor parallel: the same micro-batches on both
    seed = rank if args.worker.startswith("zero") else 0
    batches = random_batches((args.warmup + args.steps) * micro, seed=seed)
    engine = slipstream.initialize(model, engine_config(args.worker, args.pp_micro_batches))

    losses: list[float] = []
    times: list[float] = []
    for k in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        window = []
        for batch in batches[k * micro : (k + 1) * micro]:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            window.append(loss)
        # under a pipeline the losses are deferred ones, filled in by the window's last backward
        losses.append(sum(float(x) for x in window) / len(window))
        elapsed = time.perf_counter() - start
        if k == 0 and rank == 0:
            print(f"{FIRST} loss={losses[0]!r}", flush=True)
        if k >= args.warmup:
            times.append(elapsed)
    if rank == 0:
        result = {
            "times": times,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "slipstream": where,
            "params": params,
        }
        print(f"{RESULT} {json.dumps(result)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver side


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def describe(rev: str) -> str:
    if rev == "worktree":
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "slipstream")
        return f"working tree {ROOT} (HEAD {git('rev-parse', '--short', 'HEAD')}{', slipstream/ modified' if dirty else ''})"
    return f"{rev} = {git('log', '-1', '--format=%h %s', rev)}"


def export(rev: str, scratch: Path, label: str) -> Path:
    """``git archive rev | tar -x`` into ``scratch/label``; ``worktree``: this checkout itself."""
    if rev == "worktree":
        return ROOT
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = scratch / label
    tree.mkdir()
    archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout)
    assert archive.stdout is not None
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise SystemExit(f"{SCRIPT}: could not export {rev} ({commit}) with git archive | tar")
    if not (tree / "slipstream" / "__init__.py").exists():
        raise SystemExit(f"{SCRIPT}: {rev} has no slipstream package at its root")
    return tree


def command(
    args: argparse.Namespace, tree: Path, worker_script: Path, config: str, steps: int, warmup: int
) -> list[str]:
    rank_args = [
        "--worker",
        config,
        "--expect-tree",
        str(tree),
        "--model",
        args.model,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--pp-micro-batches",
        str(args.pp_micro_batches),
    ]
    if args.launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(worker_script),
            *rank_args,
        ]
    # the revision's own `slipstream run`, exactly as its console script starts it
    entry = "import sys; from slipstream.cli import main; sys.argv[0] = 'slipstream'; sys.exit(main())"
    return [sys.executable, "-c", entry, "run", "--nproc_per_node", "2", str(worker_script), *rank_args]


def measure(cmd: list[str], tree: Path, timeout: float) -> dict:
    """Run one job from ``tree``; return rank 0's result plus ``ttfl`` (launch to the first-step marker)."""
    env = {
        "OMP_NUM_THREADS": "1",
        "THP_MEM_ALLOC_ENABLE": "1",
        **os.environ,
        "PYTHONPATH": str(tree),
        "PYTHONUNBUFFERED": "1",
    }
    # cwd is the tree: `python -c` and `python -m` put the current directory first on sys.path
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=tree,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
    timer.start()
    ttfl, result, tail = None, None, []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if ttfl is None and line.startswith(FIRST):
                ttfl = time.perf_counter() - start
            elif line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
            else:
                tail = (tail + [line.rstrip()])[-25:]
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode != 0 or ttfl is None or result is None:
        why = f"killed after {timeout:.0f} s" if proc.returncode == -9 else f"exit code {proc.returncode}"
        raise SystemExit(f"{SCRIPT}: run failed ({why}): {shlex.join(cmd)}\n  cwd {tree}\n  " + "\n  ".join(tail))
    return {**result, "ttfl": ttfl}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="git revision A (the baseline)")
    parser.add_argument(
        "--after", default="worktree", help='git revision B, or "worktree" (default): this checkout as it is'
    )
    parser.add_argument("--model", default="gpt2-large", choices=("gpt2-small", "gpt2-large"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps before them")
    parser.add_argument(
        "--configs", default="zero0,zero2,zero3,pp2,tp2", help=f"comma-separated, from {','.join(CONFIGS)}"
    )
    parser.add_argument(
        "--pp-micro-batches", type=int, default=4, help="pp2: gradient_accumulation_steps (micro-batches per step)"
    )
    parser.add_argument(
        "--launcher",
        choices=("slipstream", "torchrun"),
        default="slipstream",
        help="slipstream: each revision's own `slipstream run`; torchrun: python -m torch.distributed.run",
    )
    parser.add_argument("--no-prime", action="store_true", help="skip the untimed priming run of each side")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before one run is killed")
    parser.add_argument("--keep", action="store_true", help="keep the exported trees (their paths are printed)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--expect-tree", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.before:
        parser.error("--before REV is required")
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            parser.error(f"--configs: unknown {c!r}; choose from {', '.join(CONFIGS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")

    load_before = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="bench_engine_layer_"))
    try:
        trees = {"A": export(args.before, scratch, "A"), "B": export(args.after, scratch, "B")}
        worker_script = trees["B"] / "benchmarks" / SCRIPT
        harness_note = ""
        if not (worker_script.exists() and (worker_script.parent / "common.py").exists()):
            worker_script = HERE / SCRIPT
            harness_note = f" (the after revision has no benchmarks/{SCRIPT} yet: this checkout's copy)"
        for tree in trees.values():  # byte-code for both sides alike (exported trees start without any)
            compile_all = [sys.executable, "-m", "compileall", "-q", str(tree / "slipstream")]
            subprocess.run(compile_all, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        print(f"A (before): {describe(args.before)}\n   tree {trees['A']}")
        print(f"B (after):  {describe(args.after)}\n   tree {trees['B']}")
        print(f"rank script: {worker_script}{harness_note}")
        print(
            f"{args.model}, 2 ranks (gloo, 1 thread each), micro-batch 4 x seq 128, AdamW fp32, clip 1.0; launcher "
            f"{args.launcher}; {args.rounds} round(s) x {args.steps} timed steps after {args.warmup} warm-up; "
            f"pp2 with {args.pp_micro_batches} micro-batches per step"
        )
        print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}", flush=True)

        seen: dict[str, str] = {}

        def run(side: str, config: str, steps: int, warmup: int) -> dict:
            result = measure(
                command(args, trees[side], worker_script, config, steps, warmup), trees[side], args.timeout
            )
            if side not in seen:
                seen[side] = result["slipstream"]
                print(
                    f"{side}: slipstream imported from {result['slipstream']} ({result['params'] / 1e6:.2f}M parameters)",
                    flush=True,
                )
            return result

        if not args.no_prime:
            for side in ("A", "B"):
                run(side, configs[0], 1, 0)
        runs: dict[str, dict[str, list[dict]]] = {c: {"A": [], "B": []} for c in configs}
        for r in range(args.rounds):
            for config in configs:
                for side in ("A", "B") if r % 2 == 0 else ("B", "A"):  # neither side always goes first
                    result = run(side, config, args.steps, args.warmup)
                    runs[config][side].append(result)
                    print(
                        f"  round {r + 1} {config:<6} {side}: TTFL {result['ttfl']:6.2f} s  step "
                        f"{median(result['times']) * 1e3:8.1f} ms  first loss {result['first_loss']:.6f}",
                        flush=True,
                    )
        load_after = os.getloadavg()
    finally:
        if args.keep:
            print(f"exported trees kept under {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    print()
    header = f"{'config':<7} {'TTFL A s':>9} {'TTFL B s':>9} {'B/A':>6}   {'step A ms':>10} {'step B ms':>10} {'B/A':>6}   losses"
    print(header)
    print("-" * len(header))
    mismatches = []
    for config in configs:
        a, b = runs[config]["A"], runs[config]["B"]
        ttfl_a, ttfl_b = median([x["ttfl"] for x in a]), median([x["ttfl"] for x in b])
        step_a = median([t for x in a for t in x["times"]]) * 1e3
        step_b = median([t for x in b for t in x["times"]]) * 1e3
        same = all(x[k] == y[k] for x, y in zip(a, b) for k in ("first_loss", "last_loss"))
        if not same:
            mismatches.append(config)
        print(
            f"{config:<7} {ttfl_a:9.2f} {ttfl_b:9.2f} {ttfl_b / ttfl_a:6.3f}   {step_a:10.1f} {step_b:10.1f} "
            f"{step_b / step_a:6.3f}   {'A == B' if same else 'DIFFER'}"
        )
    print()
    print("per round B/A (TTFL; step) - the spread says how much noise to allow:")
    for config in configs:
        a, b = runs[config]["A"], runs[config]["B"]
        pairs = [f"{y['ttfl'] / x['ttfl']:.3f}; {median(y['times']) / median(x['times']):.3f}" for x, y in zip(a, b)]
        ranges = [
            f"{side} step min-max {min(t for x in runs[config][side] for t in x['times']) * 1e3:.0f}-"
            f"{max(t for x in runs[config][side] for t in x['times']) * 1e3:.0f} ms"
            for side in ("A", "B")
        ]
        print(f"  {config:<7} " + " | ".join(pairs) + "   (" + ", ".join(ranges) + ")")
    if mismatches:
        print(
            f"WARNING: first/last losses differ between A and B for {', '.join(mismatches)}: the change is not behaviour-preserving "
            "(or the run is not deterministic)"
        )
        for config in mismatches:
            for x, y in zip(runs[config]["A"], runs[config]["B"]):
                print(
                    f"  {config}: A {x['first_loss']!r} -> {x['last_loss']!r}   B {y['first_loss']!r} -> {y['last_loss']!r}"
                )
    print(
        f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}; after: {' '.join(f'{x:.2f}' for x in load_after)}"
    )
    # the 1-minute average after the runs includes our own 2 ranks (~2 on this 2-core machine)
    if load_before[0] > LOAD_WARN or load_after[0] > LOAD_WARN + OWN_LOAD:
        print(
            f"WARNING: the machine was not quiet (1-minute load average {load_before[0]:.2f} before, above {LOAD_WARN}, or "
            f"{load_after[0]:.2f} after, above {LOAD_WARN + OWN_LOAD:.1f} = {LOAD_WARN} + our own 2 ranks): the ratios are noisy"
        )


if __name__ == "__main__":
    main()
