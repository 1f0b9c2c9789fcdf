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
        help="run a training script in several processes on this machine",
        description=(
            "Run SCRIPT in --nproc_per_node processes on this machine with torchrun-style "
            "environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
            "MASTER_PORT). Exits 0 when every rank succeeds, otherwise with the exit code "
            "of the first rank that failed."
        ),
    )
    run.add_argument(
        "--nproc_per_node", "--nproc-per-node", type=_positive_int, default=None, metavar="N",
        help="processes to start (default: one per CUDA device, or 1 without CUDA)",
    )  # fmt: skip
    run.add_argument(
        "--master_addr", "--master-addr", default="127.0.0.1", metavar="ADDR",
        help="address rank 0 listens on for process-group setup (default: %(default)s)",
    )  # fmt: skip
    run.add_argument(
        "--master_port", "--master-port", type=_port, default=None, metavar="PORT",
        help="port for process-group setup (default: a free port chosen at launch)",
    )  # fmt: skip
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
    return parser


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    from slipstream import estimator  # pure Python, no torch

    estimator.add_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        args.subparser.error(f"script not found: {args.script}")
    from slipstream.launcher.local import LocalLaunch, launch

    spec = LocalLaunch(
        script=args.script,
        script_args=tuple(args.script_args),
        nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
    )
    return launch(spec)


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
