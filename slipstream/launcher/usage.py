"""Usage errors as one line: ``slipstream run: error: --master_port: must be ... ; see ...``.

argparse prints its usage block (a dozen lines for ``run``) above every error, which buries the one
line that says what is wrong. Every ``slipstream`` parser is a :class:`OneLineParser`: a mistake
on the command line is exactly one line on stderr and exit status 2, as the user-facing promise of
the CLI says (the file or option, the value, the fix; never a usage block, never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

USAGE_EXIT_CODE = 2  # argparse's own status for a usage error


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ending with where to read the options.

    Sub-parsers created with ``add_subparsers`` inherit the class, so one instance at the top
    covers every subcommand.
    """

    def error(self, message: str) -> NoReturn:
        """argparse's own complaints (unknown option, missing SCRIPT, a value its type refused)."""
        fail(self.prog, f"{message}; see '{self.prog} --help'")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with an unknown option blamed on its subcommand.

    argparse reports a subcommand's unknown option from the top-level parser, whose help does not
    list the subcommand's options; the error should point at ``slipstream run --help``.
    """
    args, extras = parser.parse_known_args(argv)
    if extras:
        prog = f"{parser.prog} {args.command}" if getattr(args, "command", None) else parser.prog
        fail(prog, f"unrecognized arguments: {' '.join(extras)}; see '{prog} --help'")
    return args


def fail(prog: str, message: str) -> NoReturn:
    """Print ``PROG: error: MESSAGE`` as one line on stderr and exit with status 2."""
    line = " ".join(message.split())  # a message that wraps would no longer be one line
    print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def shown(value: str, limit: int = 60) -> str:
    """``repr(value)``, shortened: an error line quotes what it refuses, not a megabyte of it."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"
