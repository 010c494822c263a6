"""The compiled state step (sm_90 TTGIR, no GPU) is the same arithmetic in verify (chain, tree, snapshot tree,
lazy), exact fold and fast rebuild, for every drawn variant at K = 3 and 128, and at K = 128 the same at every
state tile bench/tile_sweep.py tries (against the default 32x4: so each kernel may take its own), under this
environment's triton and under each triton named by `SPECDEC_TRITON_PATHS` (`os.pathsep`-separated folders, each
holding one triton package: `.ci/run` installs torch 2.11's triton 3.6 there). bench/step_check.py holds the check
and runs in a process of its own (compiling for real needs TRITON_INTERPRET=0 before any kernel is imported, which
the other tests of a worker must not see); here also the teeth of its canonical form."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import step_check  # noqa: E402

# importing the check must not switch this worker's triton from the interpreter to compiling
assert "sass_report" not in sys.modules or os.environ.get("TRITON_INTERPRET") is not None

ALT = [p for p in os.environ.get("SPECDEC_TRITON_PATHS", "").split(os.pathsep) if p]
TILES = [f"{bv}x{w}" for bv, w in load_bench("tile_sweep").CANDIDATES if (bv, w) != (32, 4)]  # all but the default


@pytest.mark.parametrize("path", [None, *ALT], ids=lambda p: p or "this-triton")
def test_same_step_in_every_kernel(path, tmp_path):
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    found = subprocess.run([sys.executable, "-c", "import triton; print(triton.__file__)"], env=env,
                           capture_output=True, text=True, cwd=tmp_path).stdout
    assert path is None or found.startswith(path), f"triton came from {found!r}, not {path}"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "step_check.py"), "--head-dims", "3,128",
                          "--tiles", ",".join(TILES), "--json", str(tmp_path / "s.json")], env=env, capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the same step in every kernel" in out.stdout
    r = json.loads((tmp_path / "s.json").read_text())
    assert len(r["variants"]) == 2 * len(step_check.VARIANTS) and all(v["ok"] for v in r["variants"])
    for v in r["variants"]:  # the check compared something: the fold has one step and every verify kernel holds it
        ks = v["kernels"]
        assert len(ks["exact_fold"]) == 1 and all(ks[n] for n in ks), (v["K"], v["rule"], v["gate"])
        # at K = 128 every kernel compiled at each other tile the sweep tries steps as at the default (32 x 4),
        # V width aside
        assert v.get("tiles") == ({t: True for t in TILES} if v["K"] == 128 else None), (v["K"], v.get("tiles"))


_MODULE = """#b4 = #ttg.blocked<{{sizePerThread = [{a}], threadsPerWarp = [32], warpsPerCTA = [1], order = [0]}}>
#b2 = #ttg.blocked<{{sizePerThread = [{b}, 1], threadsPerWarp = [{c}, 16], warpsPerCTA = [1, 1], order = [1, 0]}}>
module {{
  tt.func @k(%p: !tt.ptr<f32>) {{
    %x = tt.load %p : tensor<{n}xf32, #b4>
    %y = arith.mulf %x, %x : tensor<{n}xf32, #b4>
    %s = "tt.reduce"(%y) <{{axis = 0 : i32}}> ({{
    ^bb0(%u: f32, %v: f32):
      %w = arith.addf %u, %v : f32
      tt.reduce.return %w : f32
    }}) : (tensor<{n}xf32, #b4>) -> f32
    %r = math.{op} %s : f32
    %t = tt.splat %r : f32 -> tensor<2x2xf32, #b2>
    %S = tt.load %p : tensor<2x2xf32, #b2>
    %f = math.fma %t, %S, %S : tensor<2x2xf32, #b2>
    tt.return
  }}
}}
"""


def _updates(**kw):
    return step_check.TTGIR(_MODULE.format(**{"a": 1, "b": 1, "c": 2, "n": 4, "op": "rsqrt", **kw})).updates()


def test_check_has_teeth():
    base = _updates()
    assert len(base) == 1 and "tt.reduce" in base[0] and "math.rsqrt" in base[0]
    # a reduction over 4 elements in another layout sums in another order: a different step
    assert _updates(a=4) != base
    # over 2 elements the layout cannot change the sum
    assert _updates(n=2) == _updates(n=2, a=2)
    # another op, another step; a layout of the update tile alone (no reduction over it) changes nothing
    assert _updates(op="sqrt") != base
    assert _updates(b=2, c=1) == base


def test_width_is_the_only_dim_set_aside():
    """Across tiles only the V width may differ: dims of that length become `V`, no other dim does."""
    e = "a:tensor<128x32xf32> b:tensor<32xf32> c:tensor<2x2x32xi1> d:tensor<128xbf16> e:tensor<1x32xf32> f:f32"
    assert step_check.modulo_width(e, 32) == ("a:tensor<128xVxf32> b:tensor<Vxf32> c:tensor<2x2xVxi1> "
                                              "d:tensor<128xbf16> e:tensor<1xVxf32> f:f32")
    assert step_check.modulo_width(e, 8) == e
