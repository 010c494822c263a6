"""The lean-layout kernel variants compile for sm_90 (no GPU needed): eager-layout verify (ring rows by running
request, no ring start, no d / k), the exact fold with the conv window rebuild in its launch, and the short conv
storing its input records. The interpreter runs Python, so it accepts code the compiler rejects; this compiles
each variant through bench/sass_report.py at Kimi-Linear shapes and reads its SASS: no spills, no fp64 work in
the per-token (per-record) loops, tree verify within 128 registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.triton

SCRIPT = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import sass_report as sr  # sets TRITON_INTERPRET=0 before triton loads
import torch
from specdec.kernels.fold import triton as tf
from specdec.kernels.verify import triton as tv

H, K, V, D, B, Lyr, C, Kc = 32, 128, 128, 8, 64, 20, 32 * 384, 4
bf, e = torch.bfloat16, sr.empty
q, k, v = e(B, D, H, K, dtype=bf), e(B, D, H, K, dtype=bf), e(B, D, H, V, dtype=bf)
g, beta, state, idx = e(B, D, H, K), e(B, D, H), e(B + 1, H, K, V), torch.arange(B)
ring = (None, None, e(B + 1, H, D, K), e(B + 1, H, D, V, dtype=bf), e(B + 1, H, D, K, dtype=bf), e(B + 1, H, D))
parent = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3])
cases = {
    "verify_chain_eager": ([tv._verify_kernel], lambda: tv.verify_delta_rule(
        q, k, v, g, beta, state, idx, ring=ring, ring_indices=idx)),
    "verify_tree_eager": ([tv._verify_kernel], lambda: tv.verify_delta_rule(
        q, k, v, g, beta, state, idx, parent=parent, intermediate_states=e(B + 1, D, H, K, V), ring=ring,
        ring_indices=idx)),
    "fold_eager_conv": ([tf._exact_fold_kernel], lambda: tf.exact_fold(
        e(Lyr, B + 1, H, K, V), e(Lyr, B + 1, H, D, V, dtype=bf), e(Lyr, B + 1, H, D, K, dtype=bf),
        e(Lyr, B + 1, H, D, K), e(Lyr, B + 1, H, D), idx, None, torch.full((B,), D),
        offsets=torch.arange(D).expand(B, D), ring_indices=idx, conv_state=e(Lyr, B + 1, C, Kc - 1, dtype=bf),
        conv_inputs=e(Lyr, B + 1, D, C, dtype=bf))),
    "short_conv_verify_inputs": ([tv._short_conv_verify_kernel], lambda: tv.short_conv_verify(
        e(B, D, C, dtype=bf), e(C, Kc, dtype=bf), None, e(B + 1, C, Kc - 1, dtype=bf), idx,
        conv_inputs=e(B + 1, D, C, dtype=bf))),
}
out = {}
for name, (fns, call) in cases.items():
    (fn, kernel, grid), = sr.capture(fns, call)
    out[name] = sr.summarize(kernel, grid, 1)
print(json.dumps(out))
'''


def test_lean_layout_kernels_compile_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "bench")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(rep) == {"verify_chain_eager", "verify_tree_eager", "fold_eager_conv", "short_conv_verify_inputs"}
    for name, k in rep.items():
        assert k["spill_bytes"] == 0, f"{name} spills {k['spill_bytes']} bytes"
        assert k["loop_instructions"] > 0 and k["regs"] > 0, name
        assert k["loop_fp64_ops"] == 0 and k["loop_f64_conversions"] == 0, (name, k)
    assert rep["verify_tree_eager"]["regs"] <= 128
    # the fold's launch: H head programs and the conv's channel blocks (C / 256) per (layer, request)
    assert rep["fold_eager_conv"]["grid"][:2] == [20 * 64, 32 + 32 * 384 // 256]
