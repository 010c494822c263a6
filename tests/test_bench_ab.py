"""`bench/ab.py`: the JSON paths it collects, a run against a revision in which each side imports its own
package (the old side from the worktree, never the working tree), and its `--kernels` case (bench/kernel_speed.py's
torch references, per op)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ab.py"


def test_flatten_and_pick():
    ab = load_bench("ab")
    doc = {"ratios": {"chain_8": 1.25, "tree_49": 2.5}, "drafters": {"eagle": {"speedup": 1.7, "ok": True,
                                                                               "name": "x"}},
           "rows": [{"ms": 3}, {"ms": 4.5}], "n": 7}
    flat = ab.flatten(doc)
    assert flat == {"ratios.chain_8": 1.25, "ratios.tree_49": 2.5, "drafters.eagle.speedup": 1.7,
                    "rows.0.ms": 3.0, "rows.1.ms": 4.5, "n": 7.0}  # bools and strings left out
    assert ab.pick(flat, ["ratios.*"]) == {"ratios.chain_8": 1.25, "ratios.tree_49": 2.5}
    assert ab.pick(flat, ["drafters.*.speedup", "n"]) == {"drafters.eagle.speedup": 1.7, "n": 7.0}
    assert ab.pick(flat, ["rows.*.ms"]) == {"rows.0.ms": 3.0, "rows.1.ms": 4.5}
    assert ab.pick(flat, ["ratios"]) == {}  # one part matches one part: a prefix is not a match
    assert ab.pick(flat, ["*"]) == {"n": 7.0}


def test_kernel_references_are_the_reference_rows_by_op():
    ab = load_bench("ab")
    doc = {"results": [{"op": "exact_fold_n1", "impl": "reference", "ms": 2.0},
                       {"op": "exact_fold_n1", "impl": "triton", "ms": 0.5},
                       {"op": "masked_scatter", "impl": "reference", "ms": 0.25}]}
    assert ab.kernel_references(doc) == {"exact_fold_n1": 2.0, "masked_scatter": 0.25}


def test_bad_arguments_give_one_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for args, said in ((["--kernels", "--metric", "x"], "not with --kernels"), ([], "at least one"),
                       (["--metric", "x"], "a bench script"), (["--metric", "x", "--rounds", "0", "y.py"], "--rounds")):
        done = subprocess.run([sys.executable, str(SCRIPT), "--old", "HEAD", *args], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr[-500:])


needs_git = pytest.mark.skipif(
    subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode,
    reason="needs the git checkout the script makes its worktree from")


@needs_git
def test_each_side_imports_its_own_tree(tmp_path):
    """A probe script reports where `specdec`'s kernels came from: the new side from this checkout, the old side
    from the worktree of HEAD, never from here."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "import specdec.kernels.common as c\n"
        f"here = os.path.realpath(c.__file__).startswith({str(ROOT.resolve())!r} + '/')\n"
        "out = sys.argv[sys.argv.index('--json') + 1]\n"
        "json.dump({'here': int(here), 'value': float(sys.argv[1])}, open(out, 'w'))\n")
    out = tmp_path / "ab.json"
    worktrees = lambda: subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,  # noqa: E731
                                       text=True).stdout
    before = worktrees()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--old", "HEAD", "--rounds", "2", "--metric", "*",
                           "--json", str(out), "--", str(probe), "2.5"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["here"]["new"] == [1.0, 1.0] and rows["here"]["old"] == [0.0, 0.0]
    assert rows["value"]["old_median"] == rows["value"]["new_median"] == 2.5 and rows["value"]["ratio"] == 1.0
    assert "value" in done.stdout  # the table
    # the script named relative to the caller's directory (the runs themselves start elsewhere)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--old", "HEAD", "--rounds", "1", "--metric", "nothing.*",
                          "--", probe.name, "1"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert bad.returncode != 0 and "matched nothing" in bad.stderr
    assert worktrees() == before  # the old revision's worktree is removed afterwards


@needs_git
def test_kernels_case_compares_the_references_per_op(tmp_path):
    """`--kernels`: kernel_speed.py's references on the CPU, its arguments after `--`; one row per op."""
    out = tmp_path / "ab.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--old", "HEAD", "--rounds", "1", "--kernels", "--json",
                           str(out), "--", "--ops", "short_conv_verify,masked_scatter", "--reps", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["kernels"] and res["script"] == "kernel_speed.py"
    assert res["args"][:2] == ["--device", "cpu"] and res["args"][-2:] == ["--reps", "1"]
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"short_conv_verify", "masked_scatter"}
    assert all(r["old_median"] > 0 and r["new_median"] > 0 and len(r["old"]) == len(r["new"]) == 1
               for r in rows.values())
    assert "masked_scatter" in done.stdout and "spread" in done.stdout
