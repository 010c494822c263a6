"""Command line: `python -m specdec <command> ...` (also installed as `specdec`).

Each command is one module here (`memory`, `generate`, `demo`) whose `add_parser(subparsers)` is listed in
`COMMANDS`; it builds the command's parser and sets `func` (called with the parsed args and that parser, returns
the exit status). Heavy imports (torch, transformers) happen inside `func`, so `--help` stays fast.
Argument errors go through `parser.error`: one error line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import demo, generate, memory

COMMANDS: list[Callable] = [memory.add_parser, generate.add_parser, demo.add_parser]


class _Parser(argparse.ArgumentParser):
    """`error` prints one line (no usage block) and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in COMMANDS:
        add_parser(subparsers)
    parser.set_defaults(command_names=sorted(subparsers.choices))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.error("a command is required: " + ", ".join(args.command_names))
        return int(args.func(args, args.parser) or 0)
    except SystemExit as exc:  # argparse errors and --help: return the status instead of exiting
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


