"""`python -m specdec`: one parser whose registered commands are all listed by `--help` (and with no arguments), each
with its own `--help`; library modules hold the work and never import the command line."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys

import pytest

from specdec.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = sorted(next(a for a in build_parser()._actions  # every registered command
                       if isinstance(a, argparse._SubParsersAction)).choices)
# the commands users are told about (README, bench/*.sh): none may go missing from the registry
DOCUMENTED = {"demo", "generate", "memory", "train-embedded", "draft-data", "draft-train", "native-export"}


def _specdec(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["COLUMNS"] = "80"  # a terminal's usual width, whatever runs the tests
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def _listed(help_text: str) -> dict[str, str]:
    """command -> its one-line help, from the COMMAND block of the top-level help."""
    lines = help_text.split("  COMMAND\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return dict(line.strip().split(None, 1) for line in lines)


@pytest.mark.parametrize("args", [["--help"], []], ids=["--help", "no-arguments"])
def test_every_command_is_listed_with_a_description(args):
    proc = _specdec(*args)
    assert proc.returncode == 0, proc.stderr
    listed = _listed(proc.stdout)
    assert DOCUMENTED <= set(COMMANDS)
    assert sorted(listed) == COMMANDS, proc.stdout
    assert all(listed.values()), proc.stdout  # a description on the command's own line


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    """Each command's `--help` exits 0 without importing torch (its work imports it when it runs)."""
    code = (f"import sys; from specdec.cli import main; rc = main([{command!r}, '--help']); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: specdec {command}") and proc.stdout.rstrip().endswith("no torch")
    assert _specdec(command, "--help").returncode == 0


def test_unknown_command_is_an_argument_error():
    proc = _specdec("nonsense")
    assert proc.returncode == 2 and "invalid choice: 'nonsense'" in proc.stderr and not proc.stdout


def test_choices_match_the_library():
    """The command line lists the drafter kinds and model families itself (so `--help` needs no torch): they are
    the library's."""
    from specdec import train_embedded
    from specdec.cli import draft_train, train_embedded as train_embedded_cli
    from specdec.draft.registry import KINDS
    assert set(draft_train.DRAFTER_KINDS) == set(KINDS)
    assert set(train_embedded_cli.FAMILIES) == set(train_embedded.FAMILIES)


def _library_files():
    for folder in ("draft", "replayssm", "verify", "kernels", "specdec"):
        for dp, dns, fns in os.walk(os.path.join(ROOT, folder)):
            dns[:] = [d for d in dns if d not in ("__pycache__", "cli", "embedded")]
            yield from (os.path.join(dp, f) for f in fns if f.endswith(".py"))


def test_one_entry_point():
    """No library module has a `__main__` block or imports `specdec.cli` (the dependency runs cli -> library);
    `specdec/__main__.py` is the one `python -m` entry."""
    for path in _library_files():
        if path == os.path.join(ROOT, "specdec", "__main__.py"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                raise AssertionError(f"{path}:{node.lineno} has a __main__ block; add a command to specdec/cli")
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 1 and os.path.dirname(path) == os.path.join(ROOT, "specdec"):  # `from .cli ...`
                    module = "specdec." + module if module else "specdec"
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            assert not any(n == "specdec.cli" or n.startswith("specdec.cli.") for n in names), \
                f"{path}:{node.lineno} imports the command line"
    assert not os.path.exists(os.path.join(ROOT, "draft", "__main__.py"))
