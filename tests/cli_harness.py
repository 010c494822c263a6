"""Runs `python -m specdec COMMAND ...` as a user would, and checks its argument errors.

The subprocess runs from the checkout without the test run's TRITON_INTERPRET: on CPU, transformers would then
send its linear-attention layers to fla's Triton kernels, which specdec must never call, prefill included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_specdec(command: str, *args, timeout: float, cwd=ROOT, env: dict | None = None):
    """`python -m specdec COMMAND ARGS...` (each argument through `str`) in `cwd` -> the CompletedProcess (text).
    `env`: variables set on top of this process's environment (TRITON_INTERPRET dropped)."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "specdec", command, *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=full, timeout=timeout)


def bad_arguments(args: list[str], model, tmp_path: Path) -> list[str]:
    """`args` with `{model}` the saved model's directory, `{missing}` a path that does not exist and `{empty}` an
    empty directory (made here, in `tmp_path`)."""
    (tmp_path / "empty").mkdir()
    names = {"model": model, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    return [a.format(**names) for a in args]


def assert_argument_error(proc, command: str, flag: str) -> None:
    """Exit status 2, nothing on stdout, and one line on stderr, `specdec COMMAND: error: ...`, naming `flag`."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"specdec {command}: error: ") and flag in lines[0], proc.stderr
