"""The ``slipstream`` command: one parser, and one dispatch per subcommand.

Each subcommand lives with the code it drives: ``run`` in ``slipstream.launcher`` (which never
imports ``slipstream.engine``), ``report`` beside it, ``estimate`` in ``slipstream.estimator_cli`` (its formulas in ``slipstream.estimator``),
``checkpoint`` in ``slipstream.engine.checkpoint``. Only this dispatcher knows them all, so the
launcher does not depend on the engine to offer ``slipstream checkpoint``.

Building the parser imports no torch; a subcommand's module is imported when that subcommand runs,
so ``slipstream --help`` and ``slipstream run --help`` answer instantly. Every usage error is one line
(``slipstream.launcher.usage``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from slipstream import estimator_cli  # pure Python, no torch: the estimate options
from slipstream.launcher import cli as run_cli
from slipstream.launcher.usage import OneLineParser, fail, parse_command_line
from slipstream.version import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slipstream`` console script; returns the process exit code."""
    args = parse_command_line(build_parser(), argv)
    return COMMANDS[args.command](args)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="slipstream", description="Launch and inspect Slipstream training jobs.")
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run_cli.add_run_parser(commands)
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
    estimator_cli.add_arguments(estimate)
    _add_checkpoint_parser(commands)
    commands.add_parser(
        "plan",
        help="(not available yet) a recommended mesh and config for a model and a cluster",
        description="Reserved: a later release recommends a mesh and a config for a model and a cluster.",
    )
    return parser


def _add_checkpoint_parser(commands: argparse._SubParsersAction) -> None:
    checkpoint = commands.add_parser(
        "checkpoint",
        help="inspect, export or convert a checkpoint",
        description="Read a checkpoint from its files alone.",
    )
    actions = checkpoint.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    inspect = actions.add_parser("inspect", help="summarize a checkpoint (and list those in a save directory)")
    inspect.add_argument(
        "dir", metavar="DIR", help="a save directory (its latest checkpoint) or a checkpoint directory"
    )
    inspect.add_argument("--tag", default=None, help="the checkpoint in DIR to read (default: latest)")
    inspect.add_argument("--verify", action="store_true", help="check every file's CRC-32")
    export = actions.add_parser(
        "export",
        help="write the model's weights: one fp32 safetensors file, or Hugging Face's sharded layout (--format hf)",
    )
    export.add_argument("dir", metavar="DIR", help="a save directory (its latest checkpoint) or a checkpoint directory")
    export.add_argument(
        "out", metavar="OUT", help="the file to write (OUT.safetensors), or the directory for --format hf"
    )
    export.add_argument("--tag", default=None, help="the checkpoint in DIR to export (default: latest)")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors: one fp32 file of every state_dict key (default); hf: model-0000i-of-0000n.safetensors "
        "+ model.safetensors.index.json in OUT, as save_pretrained writes them (tied weights once)",
    )
    convert = actions.add_parser(
        "convert",
        help="DeepSpeed checkpoint -> slipstream's format, or slipstream's -> DeepSpeed's universal layout",
        description="Convert between DeepSpeed's checkpoints (ZeRO 0-3, universal) and slipstream's, from the files alone. "
        "The direction follows DIR: a DeepSpeed checkpoint becomes a slipstream one (any world size loads it); a slipstream "
        'checkpoint becomes a DeepSpeed universal checkpoint (load it with "checkpoint": {"load_universal": true}).',
    )
    convert.add_argument(
        "dir", metavar="DIR", help="a save directory (its latest checkpoint) or a checkpoint directory"
    )
    convert.add_argument("out", metavar="OUT", help="the save directory to write into (its 'latest' names the result)")
    convert.add_argument("--tag", default=None, help="the checkpoint in DIR to convert (default: latest)")
    export.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="--format hf: the weights' dtype (default fp32)"
    )
    export.add_argument(
        "--max-shard-size", default=None, help="--format hf: the largest file, e.g. 5GB (default) or 500MiB"
    )


def _report(args: argparse.Namespace) -> int:
    from slipstream.launcher import report

    return report.main()


def _estimate(args: argparse.Namespace) -> int:
    return estimator_cli.main(args)


def _checkpoint(args: argparse.Namespace) -> int:
    from slipstream.engine.checkpoint import cli as checkpoint_cli  # reads checkpoint files: imports torch

    return checkpoint_cli.main(args)


def _plan(args: argparse.Namespace) -> int:
    fail(
        "slipstream plan",
        "not available yet; 'slipstream estimate' gives the memory per device by ZeRO stage "
        "and a configuration that fits",
    )


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run_cli.run,
    "report": _report,
    "estimate": _estimate,
    "checkpoint": _checkpoint,
    "plan": _plan,
}


if __name__ == "__main__":
    sys.exit(main())
