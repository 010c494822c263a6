"""Command line: `python -m specdec <command> ...` (also installed as `specdec`).

Each command is one module here, listed in `COMMANDS`: its `NAME`, one-line `HELP` and `DESCRIPTION`,
`add_arguments(parser)` for its options, and `run(args, parser)`, which does the work and returns the exit status.
Heavy imports (torch, transformers) happen inside `run`, so `--help` stays fast. Argument errors go through
`parser.error`: one error line on stderr, exit status 2. Library modules (draft/, train_embedded) hold the work
and never import this package.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from . import demo, draft_data, draft_train, generate, memory, native_export, serve, train_embedded

# the order `specdec --help` lists them in: use, inspect, then the training pipeline in the order it runs
COMMANDS: list[ModuleType] = [demo, generate, serve, memory, train_embedded, draft_data, draft_train, native_export]


class _Formatter(argparse.HelpFormatter):
    """Sizes the help column with the commands' own indent (Python 3.11 measures them one level up), so each
    command's name and one-line help share a line."""

    def add_argument(self, action):
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS and hasattr(action, "_get_subactions"):
            width = max((len(self._format_action_invocation(a)) for a in action._get_subactions()), default=0)
            self._action_max_length = max(self._action_max_length,
                                          width + self._current_indent + self._indent_increment)


class _Parser(argparse.ArgumentParser):
    """`error` prints one line (no usage block) and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description=__doc__.splitlines()[0],
                     epilog="`specdec COMMAND --help` shows a command's options.", formatter_class=_Formatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = subparsers.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(p)
        p.set_defaults(func=command.run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:  # no command: the list of commands, as `--help` prints it
            parser.print_help()
            return 0
        return int(args.func(args, args.parser) or 0)
    except SystemExit as exc:  # argparse errors and --help: return the status instead of exiting
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
