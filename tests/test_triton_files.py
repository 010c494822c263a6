"""The listing the GPU check runs (`python tests/triton_files.py`): every test file that reaches a Triton kernel
carries the `triton` marker, so a new one cannot be left out of the GPU run, and the marker is registered."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import triton_files as tf

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_that_reaches_a_triton_kernel_is_listed():
    listed = set(tf.marked_files())
    missing = [p.name for p in tf.test_files() if tf.needs_marker(p) and p not in listed]
    assert not missing, (f"{missing} run Triton kernels but carry no `triton` marker: add `pytestmark = "
                         "pytest.mark.triton` (or mark the tests) and build their tensors on the `triton_device` fixture")
    names = {p.name for p in listed}
    assert {"test_triton_kernels.py", "test_state_triton.py", "test_gate_in_kernel.py"} <= names


def test_the_rule_sees_each_way_in(tmp_path):
    """Teeth: each way of reaching a kernel is caught (the snippets are split so this file matches none)."""
    force = "SPECDEC_FORCE_" + "TRITON"
    ways = ["from specdec.kernels.verify" + ".triton import short_conv_verify",
            "from specdec.kernels.fold import " + "triton as tfold",
            "from specdec.kernels.fold import (naive, " + "triton)",
            "import specdec.kernels.scatter" + ".triton",
            "impl = dispatch.triton" + "_impl if backend else None",
            f'monkeypatch.setenv("{force}", "1")',
            f'env = {{"{force}": "1"}}',
            f"{force}=1 pytest"]
    for i, line in enumerate(ways):
        p = tmp_path / f"test_way{i}.py"
        p.write_text(line + "\n")
        assert tf.needs_marker(p), line
    quiet = tmp_path / "test_quiet.py"
    quiet.write_text(f'from specdec.kernels import dispatch\nmonkeypatch.delenv("{force}", raising=False)\n'
                     "# pytest.mark.triton in a comment is no marker\n")
    assert not tf.needs_marker(quiet) and not tf.has_marker(quiet)
    quiet.write_text("import pytest\npytestmark = pytest.mark.triton\n")
    assert tf.has_marker(quiet)


def test_listing_command_prints_the_marked_files(tmp_path):
    """Absolute paths by default: bench/gpu_check.py runs pytest on them from another directory."""
    script = str(ROOT / "tests" / "triton_files.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [Path(line) for line in r.stdout.split()] == tf.marked_files()
    r = subprocess.run([sys.executable, script, "--relative"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.stdout.split() == [str(p.relative_to(ROOT)) for p in tf.marked_files()]


def test_marker_is_registered():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'(?ms)^\[tool\.pytest\.ini_options\].*^markers = \[[^]]*"triton:', text)
