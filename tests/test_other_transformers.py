"""The hybrid and generic runners, the drafters and transformers' own references under each transformers named by
`SPECDEC_TRANSFORMERS_PATHS` (`os.pathsep`-separated folders, each holding one transformers package installed with
`pip install --no-deps --target`; `.ci/run` installs 5.17, the H200 image's, there), in a site without the
`kernels` package (which 5.17 does not bring). The rest of the suite runs under this environment's transformers.

transformers' interfaces move between releases (the cache keyword of a layer was `past_key_values` and is now
`cache`; Qwen3.5's rotary took `[3, B, T]` positions only; the Mamba models took `cache_params`): these test files
compare specdec's rounds with that transformers' own forward and greedy `generate`, in a pytest of their own.
Families that transformers lacks are deselected (5.17 has no bailing_hybrid)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from site_view import site_view

ROOT = Path(__file__).resolve().parents[1]
ALT = [p for p in os.environ.get("SPECDEC_TRANSFORMERS_PATHS", "").split(os.pathsep) if p]
FILES = ["test_reference_oracles.py", "test_adapters.py", "test_generic_families.py",
         "test_generate.py", "test_generate_conventions.py", "test_native_drafter.py", "test_drafter_mtp.py", "test_static_shapes.py"]
PROBE = "import transformers, sys; print(transformers.__version__, transformers.__file__); sys.exit(0)"


def _run(path: str, view: Path, code: str, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = path  # ahead of the view: its transformers, not this environment's
    return subprocess.run([sys.executable, "-S", "-c", f"import site; site.addsitedir({str(view)!r})\n{code}"],
                          env=env, capture_output=True, text=True, cwd=ROOT, **kw)


if ALT:  # (without a folder to test there is nothing to run: no test, rather than a skipped one)
    @pytest.mark.parametrize("path", ALT)
    def test_suite_under_another_transformers(path, tmp_path):
        from specdec.hf_compat import ALL_FAMILIES

        view = site_view(tmp_path / "site", without=("transformers", "kernels"))
        probe = _run(path, view, PROBE, timeout=300)
        assert probe.returncode == 0, probe.stderr[-3000:]
        version, where = probe.stdout.split()
        assert where.startswith(path), f"transformers came from {where}, not {path}"
        lacking = [f for f in ALL_FAMILIES if not os.path.isdir(os.path.join(path, "transformers", "models", f))]
        args = [str(ROOT / "tests" / f) for f in FILES] + ["-q", "-p", "no:cacheprovider"]
        if lacking:
            args += ["-k", " and ".join(f"not {f}" for f in lacking)]
        out = _run(path, view, f"import sys, pytest; sys.exit(pytest.main({args!r}))", timeout=1800)
        tail = out.stdout[-4000:] + out.stderr[-2000:]
        assert out.returncode == 0, f"transformers {version}, without {lacking}:\n{tail}"
        summary = out.stdout.strip().splitlines()[-1]
        assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
