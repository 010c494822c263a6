"""bench/gpu_check.py's reading of a test report: the compiled fold property counts as bitwise only when every
family of tests/test_fold_exactness.py ran and passed (a run cut by its budget says so instead); and its shipped
autotune results: seeded into triton's cache folder and collected from it in triton's own layout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import BENCH, load_bench

gc = load_bench("gpu_check")


def _xml(tmp_path, cases):
    tag = {"failed": "<failure/>", "skipped": "<skipped/>"}
    body = "".join(f'<testcase classname="tests.x" name="{n}">{tag.get(s, "")}</testcase>' for n, s in cases)
    p = tmp_path / "r.xml"
    p.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return p


def test_fold_bitwise_needs_every_family(tmp_path):
    fams = gc.fold_families()
    assert set(fams) >= {"kda", "gdn", "mamba2"}
    ids = [f"test_fold_equals_single_steps[triton-{f}]" for f in fams]
    counts, fold = gc.read_report(_xml(tmp_path, [(i, "passed") for i in ids] + [("test_other", "failed")]))
    assert counts == {"passed": len(ids), "failed": 1, "skipped": 0}
    assert gc.fold_bitwise(fold, fams) == (True, [])
    # one family cut by the budget: not known, and said so
    _, fold = gc.read_report(_xml(tmp_path, [(i, "passed") for i in ids[1:]]))
    assert gc.fold_bitwise(fold, fams) == (None, [fams[0]])
    # one failed (or skipped: the kernels did not run) is not bitwise
    for bad in ("failed", "skipped"):
        _, fold = gc.read_report(_xml(tmp_path, [(ids[0], bad)] + [(i, "passed") for i in ids[1:]]))
        assert gc.fold_bitwise(fold, fams)[0] is False
    # the reference backend's passes do not count for the compiled kernels
    _, fold = gc.read_report(_xml(tmp_path, [(i.replace("triton", "reference"), "passed") for i in ids]))
    assert gc.fold_bitwise(fold, fams) == (None, fams)
    assert gc.read_report(tmp_path / "missing.xml") == ({"passed": 0, "failed": 0, "skipped": 0}, {})


def test_gpu_folder():
    assert gc.gpu_folder("NVIDIA H200") == "NVIDIA_H200"
    assert gc.gpu_folder("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert gc.gpu_folder("??") == "unknown_gpu"


def test_autotune_seed_and_collect(tmp_path):
    shipped, cache, out = tmp_path / "shipped", tmp_path / "cache", tmp_path / "out"
    for rel, text in (("aa/k1.autotune.json", "shipped k1"), ("bb/k2.autotune.json", "shipped k2")):
        (shipped / rel).parent.mkdir(parents=True)
        (shipped / rel).write_text(text)
    (cache / "bb").mkdir(parents=True)
    (cache / "bb" / "k2.autotune.json").write_text("tuned here")  # a result already in the cache is kept
    (cache / "bb" / "k2.cubin").write_bytes(b"\0")  # compiled kernels are not autotune results
    assert gc.seed_autotune(shipped, cache) == 1
    assert (cache / "aa" / "k1.autotune.json").read_text() == "shipped k1"
    assert (cache / "bb" / "k2.autotune.json").read_text() == "tuned here"
    before = gc.autotune_files(cache)
    assert before == {"aa/k1.autotune.json", "bb/k2.autotune.json"}
    (cache / "cc").mkdir()
    (cache / "cc" / "k3.autotune.json").write_text("new")
    assert gc.collect_autotune(cache, out, before) == ["k3"]
    assert gc.autotune_files(out) == before | {"cc/k3.autotune.json"}
    assert gc.seed_autotune(tmp_path / "missing", cache) == 0


ROUND_TRIP = r"""
import sys
sys.path.insert(0, sys.argv[1])
import sass_report as sr  # a compile-only sm_90 driver (no GPU needed)
import gpu_check as gc
import triton
import triton.language as tl
from pathlib import Path
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner

@triton.jit
def kernel(x, N: tl.constexpr, B: tl.constexpr):
    tl.store(x + tl.arange(0, B), tl.zeros([B], dtype=tl.float32))

configs = [triton.Config({"B": 16}, num_warps=1), triton.Config({"B": 32}, num_warps=2)]
driver.set_active(sr._CompileOnlyDriver())

def tuner():
    return Autotuner(kernel, kernel.arg_names, configs, ["N"], None, None)

benched = []
def bench(t):
    def run():
        benched.append(1)
        t.configs_timings = {configs[0]: [2.0], configs[1]: [1.0]}
    return run

cache, out = Path(sys.argv[2]), Path(sys.argv[3])
t = tuner()
assert t.check_disk_cache((128,), configs, bench(t)) is False and benched == [1]  # tuned, result written
tuned = gc.collect_autotune(cache, out, set())
assert tuned == ["kernel"], tuned
fresh = Path(sys.argv[4])  # another machine: an empty cache seeded from what was collected
assert gc.seed_autotune(out, fresh) == 1
import os
os.environ["TRITON_CACHE_DIR"] = str(fresh)
t2 = tuner()
assert t2.check_disk_cache((128,), configs, bench(t2)) is True and benched == [1]  # read back, not tuned
assert t2.cache[(128,)].kwargs == {"B": 32}
print("round trip ok")
"""


def test_autotune_round_trip_through_triton(tmp_path):
    """The layout seed / collect assume is triton's own: a result triton's autotuner writes is collected, seeded into
    another cache folder and read back there by triton without tuning again."""
    pytest.importorskip("triton")
    cache, out, fresh = tmp_path / "cache", tmp_path / "out", tmp_path / "fresh"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_INTERPRET": "0"}
    script = tmp_path / "round_trip.py"  # a file: triton reads a jit function's source from it
    script.write_text(ROUND_TRIP)
    r = subprocess.run([sys.executable, str(script), str(BENCH), str(cache), str(out), str(fresh)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "round trip ok" in r.stdout, r.stderr[-4000:]


def test_tiles_part_ships_the_picks_and_judges_the_goals_there(tmp_path, monkeypatch):
    rows = [{"tile": "32x4", "verify_replay_eager": {"ms": 0.75, "frac_copy_bw": 0.06},
             "exact_fold_n1": {"ms": 1.9, "frac_copy_bw": 0.71}, "fast_rebuild": {"ms": 0.24, "frac_copy_bw": 0.3}},
            {"tile": "8x1", "verify_replay_eager": {"ms": 0.40, "frac_copy_bw": 0.11},
             "exact_fold_n1": {"ms": 1.8, "frac_copy_bw": 0.75}, "fast_rebuild": {"error": "refused"}}]
    sweep = {"rows": rows, "fastest": {"verify_replay_eager": "8x1", "exact_fold_n1": "8x1", "fast_rebuild": "32x4"},
             "state_tiles": {"devices": {"NVIDIA H200": {"verify": "8x1", "fold": "32x4", "rebuild": "32x4"}}}}

    def fake_run(name, argv, hard_s):
        assert name == "tile_sweep"
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(sweep))
        return 0

    monkeypatch.setattr(gc, "_run_main", fake_run)
    (tmp_path / "kernels.json").write_text(json.dumps({"results": [
        {"op": "fla_fused_recurrent_kda", "impl": "fla", "ms": 0.47, "frac_copy_bw": 0.15},
        {"op": "verify_replay_eager", "impl": "triton", "ms": 0.75, "frac_copy_bw": 0.06}]}))
    res = gc.part_tiles(tmp_path, 30)
    assert json.loads((tmp_path / "state_tiles.json").read_text()) == sweep["state_tiles"]
    goals = res["kernel_goals_best_tile"]
    assert goals["verify_chain_vs_fla"]["value"] == pytest.approx(0.40 / 0.47) and goals["verify_chain_vs_fla"]["met"]
    # at the fold's picked tile (32x4: its n = 1..8 together), not at n = 1's own fastest (8x1)
    assert goals["exact_fold_n1"]["value"] == 0.71 and goals["exact_fold_n1"]["met"] is False
    assert goals["exact_fold_n2"]["met"] is None and goals["short_conv_verify"]["met"] is None  # not swept
