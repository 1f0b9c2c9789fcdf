"""``slipstream run``: its options and what running them does.

The ``slipstream`` command itself (every subcommand) is ``slipstream/cli.py``; this module is the
``run`` part of it, and stays importable alone because it is also what runners start on every node:
``python -m slipstream.launcher.cli run --launcher local --num_nodes N --node_rank R ...`` (the
per-node agent, see ``runners.py``). Nothing here imports torch or ``slipstream.engine``; the
modules that launch processes are imported when a run starts, so ``slipstream run --help`` answers
instantly.

Every mistake is one line on stderr (``usage.py``) naming the option or file, the value and the fix.
"""

from __future__ import annotations

import argparse
import os
import sys

from slipstream.launcher.hostfile import MAX_SLOTS
from slipstream.launcher.usage import OneLineParser, fail, parse_command_line, shown

RUN_DESCRIPTION = (
    "Run SCRIPT in --nproc_per_node processes on this machine, or on every node of a "
    "--hostfile, with torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE, "
    "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Exits 0 when every rank succeeds, "
    "otherwise with the exit code of the first rank that failed."
)


def main(argv: list[str] | None = None) -> int:
    """``python -m slipstream.launcher.cli run ...``: the ``run`` subcommand alone.

    The same options as ``slipstream run`` (one parser builds both), without the dispatcher, so
    a node agent started by a runner loads the launcher and nothing else of the command line.
    """
    parser = OneLineParser(prog="slipstream", description="Launch Slipstream training jobs.")
    add_run_parser(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return run(parse_command_line(parser, argv))


def add_run_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand and its options to ``commands``; return its parser."""
    run_parser = commands.add_parser(
        "run",
        help="run a training script in several processes on this machine or on many nodes",
        description=RUN_DESCRIPTION,
    )
    run_parser.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        "--num_gpus",
        "--num-gpus",
        type=_nproc,
        default=None,
        metavar="N",
        help="processes per node (default: the hostfile's slots, else one per CUDA device, or 1)",
    )
    run_parser.add_argument(
        "--master_addr",
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="address of node 0, where rank 0 listens (default: 127.0.0.1, or the first host of the hostfile)",
    )
    run_parser.add_argument(
        "--master_port",
        "--master-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="port for process-group setup (default: a free port on one node, 29500 on several)",
    )
    _add_multi_node_arguments(run_parser)
    run_parser.add_argument(
        "--max_restarts",
        "--max-restarts",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="restart all ranks up to K times after a failure (default: %(default)s)",
    )
    run_parser.add_argument("script", metavar="SCRIPT", help="the Python training script")
    run_parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments passed to every rank's SCRIPT unchanged"
    )
    return run_parser


def _add_multi_node_arguments(run_parser: argparse.ArgumentParser) -> None:
    run_parser.add_argument(
        "--hostfile",
        "-H",
        default=None,
        metavar="FILE",
        help="nodes to run on, one 'HOST slots=N' line each (DeepSpeed/MPI format; # comments)",
    )
    run_parser.add_argument(
        "--include",
        "-i",
        default=None,
        metavar="SPEC",
        help="use only these hosts/slots, e.g. 'host1:0,1@host2' (host2: all its slots)",
    )
    run_parser.add_argument(
        "--exclude", "-e", default=None, metavar="SPEC", help="leave out these hosts/slots (same form as --include)"
    )
    run_parser.add_argument(
        "--num_nodes",
        "--num-nodes",
        "--nnodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="use the first N hosts; without a hostfile, the job's node count (with --node_rank)",
    )
    run_parser.add_argument(
        "--node_rank",
        "--node-rank",
        default=None,
        metavar="R",
        help="this node's rank when starting one node of a multi-node job by hand (0..N-1), "
        "or slurm/mpi to read it from the runner's environment",
    )
    run_parser.add_argument(
        "--launcher",
        choices=("local", "ssh", "pdsh", "slurm", "mpi"),
        default=None,
        help="how to start the per-node agents (default: local without a hostfile, ssh with one)",
    )
    run_parser.add_argument(
        "--launcher_args",
        "--launcher-args",
        default=None,
        metavar="ARGS",
        help="extra arguments for the runner command (ssh/pdsh/srun/mpirun), one shell-quoted string",
    )
    run_parser.add_argument(
        "--ssh_port", "--ssh-port", type=_port, default=None, metavar="PORT", help="ssh port of the hosts"
    )
    run_parser.add_argument(
        "--dry_run",
        "--dry-run",
        action="store_true",
        help="print the exact command for every node and exit without running anything",
    )
    # Set by the ssh runner on the agents it starts: stop when the runner's connection closes.
    run_parser.add_argument("--exit_on_stdin_close", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run ``slipstream run``; returns the exit status (a usage error exits with 2 itself)."""
    _check_script(args.script)
    from slipstream.launcher.launch_plan import PlanError, home_directory, make_plan

    try:
        plan = make_plan(args, os.environ, os.getcwd(), home_directory())
    except PlanError as err:
        fail("slipstream run", str(err))
    if plan.local is not None:
        from slipstream.launcher.agent import agent_command_line, launch

        if args.dry_run:
            print(agent_command_line(plan.local, plan.env))
            return 0
        os.environ.update(plan.env)
        return launch(plan.local)
    from slipstream.launcher import multinode, runners

    assert plan.job is not None and plan.runner is not None
    if args.dry_run:
        print(runners.format_commands(plan.runner, plan.job, plan.argvs))
        return 0
    labels = [f"node {i} ({node.host})" for i, node in enumerate(plan.job.nodes)]
    if plan.runner != "ssh":
        labels = [f"{plan.runner} ({len(plan.job.nodes)} nodes)"]
    return multinode.run(plan.runner, plan.argvs, labels)


def _check_script(script: str) -> None:
    if os.path.isdir(script):
        fail("slipstream run", f"SCRIPT {shown(script)} is a directory; give the training script's .py file")
    if not os.path.isfile(script):
        fail(
            "slipstream run",
            f"script not found: {script} (looked in {os.getcwd()}); give the training script's path "
            "before its arguments, e.g. 'slipstream run train.py --lr 0.1'",
        )


def _int_at_least(minimum: int, text: str) -> int:
    value = _int(text)
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"must be {'at least 1' if minimum == 1 else f'{minimum} or more'}, got {value}"
        )
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def _nproc(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_SLOTS:
        raise argparse.ArgumentTypeError(
            f"{value} processes on one node is more than {MAX_SLOTS}; give one per device (GPU) of the node"
        )
    return value


def _port(text: str) -> int:
    value = _int(text)
    if value == 0:
        # Port 0 would reach the ranks as MASTER_PORT=0; omitting the flag gets a free port.
        raise argparse.ArgumentTypeError("0 is not a usable port; omit --master_port to pick a free one")
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # also a digit string too long to convert (Python's int size limit)
        raise argparse.ArgumentTypeError(f"expected an integer, got {shown(text)}") from None


if __name__ == "__main__":
    sys.exit(main())
