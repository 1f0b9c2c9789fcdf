"""The ``slipstream`` command: argument parsing and dispatch only.

Nothing here imports torch; the subcommand modules are imported when their subcommand runs, so
``slipstream --help`` and ``slipstream run --help`` answer instantly.
"""

from __future__ import annotations

import argparse
import os
import sys

from slipstream.version import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slipstream`` console script; returns the process exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "report":
        from slipstream.launcher import report

        return report.main()
    if args.command == "estimate":
        from slipstream import estimator

        return estimator.main(args)
    if args.command == "checkpoint":  # reads checkpoint files: imports torch, never the run path
        from slipstream.engine.checkpoint import cli as checkpoint_cli

        return checkpoint_cli.main(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Launch and inspect Slipstream training jobs.",
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run a training script in several processes on this machine or on many nodes",
        description=(
            "Run SCRIPT in --nproc_per_node processes on this machine, or on every node of a "
            "--hostfile, with torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE, "
            "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Exits 0 when every rank succeeds, "
            "otherwise with the exit code of the first rank that failed."
        ),
    )
    run.add_argument(
        "--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus", type=_positive_int, default=None,
        metavar="N", help="processes per node (default: the hostfile's slots, else one per CUDA device, or 1)",
    )  # fmt: skip
    run.add_argument(
        "--master_addr", "--master-addr", default=None, metavar="ADDR",
        help="address of node 0, where rank 0 listens (default: 127.0.0.1, or the first host of the hostfile)",
    )  # fmt: skip
    run.add_argument(
        "--master_port", "--master-port", type=_port, default=None, metavar="PORT",
        help="port for process-group setup (default: a free port on one node, 29500 on several)",
    )  # fmt: skip
    _add_multi_node_arguments(run)
    run.add_argument(
        "--max_restarts", "--max-restarts", type=_non_negative_int, default=0, metavar="K",
        help="restart all ranks up to K times after a failure (default: %(default)s)",
    )  # fmt: skip
    run.set_defaults(subparser=run)
    run.add_argument("script", metavar="SCRIPT", help="the Python training script")
    run.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="...",
        help="arguments passed to every rank's SCRIPT unchanged",
    )  # fmt: skip

    commands.add_parser(
        "report",
        help="print versions, devices and build tools for a bug report",
        description="Print the environment facts a Slipstream bug report needs.",
    )
    estimate = commands.add_parser(
        "estimate",
        help="memory per device by ZeRO stage, and a configuration that fits",
        description="Per-device bytes for model states (ZeRO paper formulas) and activations, by ZeRO stage.",
    )
    _add_estimate_arguments(estimate)
    _add_checkpoint_parser(commands)
    return parser


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    from slipstream import estimator  # pure Python, no torch

    estimator.add_arguments(parser)


def _add_multi_node_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--hostfile", "-H", default=None, metavar="FILE",
        help="nodes to run on, one 'HOST slots=N' line each (DeepSpeed/MPI format; # comments)",
    )  # fmt: skip
    run.add_argument(
        "--include", "-i", default=None, metavar="SPEC",
        help="use only these hosts/slots, e.g. 'host1:0,1@host2' (host2: all its slots)",
    )  # fmt: skip
    run.add_argument(
        "--exclude", "-e", default=None, metavar="SPEC", help="leave out these hosts/slots (same form as --include)"
    )  # fmt: skip
    run.add_argument(
        "--num_nodes", "--num-nodes", "--nnodes", type=_positive_int, default=None, metavar="N",
        help="use the first N hosts; without a hostfile, the job's node count (with --node_rank)",
    )  # fmt: skip
    run.add_argument(
        "--node_rank", "--node-rank", default=None, metavar="R",
        help="this node's rank when starting one node of a multi-node job by hand (0..N-1), "
        "or slurm/mpi to read it from the runner's environment",
    )  # fmt: skip
    run.add_argument(
        "--launcher", choices=("local", "ssh", "pdsh", "slurm", "mpi"), default=None,
        help="how to start the per-node agents (default: local without a hostfile, ssh with one)",
    )  # fmt: skip
    run.add_argument(
        "--launcher_args", "--launcher-args", default=None, metavar="ARGS",
        help="extra arguments for the runner command (ssh/pdsh/srun/mpirun), one shell-quoted string",
    )  # fmt: skip
    run.add_argument("--ssh_port", "--ssh-port", type=_port, default=None, metavar="PORT", help="ssh port of the hosts")
    run.add_argument(
        "--dry_run", "--dry-run", action="store_true",
        help="print the exact command for every node and exit without running anything",
    )  # fmt: skip
    # Set by the ssh runner on the agents it starts: stop when the runner's connection closes.
    run.add_argument("--exit_on_stdin_close", action="store_true", help=argparse.SUPPRESS)


def _add_checkpoint_parser(commands: argparse._SubParsersAction) -> None:
    checkpoint = commands.add_parser(
        "checkpoint", help="inspect or export a checkpoint", description="Read a checkpoint from its files alone."
    )
    actions = checkpoint.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    inspect = actions.add_parser("inspect", help="summarize a checkpoint (and list those in a save directory)")
    inspect.add_argument("dir", metavar="DIR", help="a save directory (its latest checkpoint) or a checkpoint directory")
    inspect.add_argument("--tag", default=None, help="the checkpoint in DIR to read (default: latest)")
    inspect.add_argument("--verify", action="store_true", help="check every file's CRC-32")
    export = actions.add_parser("export", help="write one consolidated fp32 safetensors file of the model's state_dict")
    export.add_argument("dir", metavar="DIR", help="a save directory (its latest checkpoint) or a checkpoint directory")
    export.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    export.add_argument("--tag", default=None, help="the checkpoint in DIR to export (default: latest)")


def _run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        args.subparser.error(f"script not found: {args.script}")
    from slipstream.launcher.plan import PlanError, home_directory, make_plan

    try:
        plan = make_plan(args, os.environ, os.getcwd(), home_directory())
    except PlanError as err:
        args.subparser.error(str(err))
    if plan.local is not None:
        from slipstream.launcher.local import agent_command_line, launch

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


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
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
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
