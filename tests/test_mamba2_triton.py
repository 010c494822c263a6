"""The mamba2 rule on the Triton kernels (the interpreter on CPU, compiled on a GPU via bench/gpu_check.sh).

The Mamba2 step is the delta step without the delta correction (`d = beta v`; k = B, v = x, q = C taken as they
come, g = dt A, beta = dt), a constexpr flag (`MAMBA2`) of the one shared `triton_utils.delta_step` and of the
verify and fold kernels; the lazy rebuild replays `(d, k, g)` records and needs no flag. Checked here:
- Triton vs the torch reference (`rule="mamba2"`): verify chain and tree (outputs, node states, every ring record),
  lazy verify (pending records rebuilt in the kernel), the exact fold (offsets, track states); buffers are
  NaN-filled, so null, skipped and foreign slots must stay bitwise unchanged; fp32 tolerance (the fp32 rtol of
  `assertions.TOLERANCES`, as in tests/test_triton_kernels.py);
- (the fold of n records == n single-token verify steps, bitwise on each backend, is drawn for the Mamba2 rule
  too by tests/test_fold_exactness.py);
- one corrupted ring record changes the folded state; the flag changes the step (mamba2 != delta);
- the dispatcher runs the Triton kernels for the rule where it runs them for the delta rule, the recurrent
  reference elsewhere;
- the state strategies (snapshot, replay eager and lazy, chains and trees) on the Triton kernels follow the float64
  Mamba2 recurrence within the fp32 tolerance;
- the MAMBA2 variants compile for sm_90 (no GPU needed) with no spills and no fp64 work in their loops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from assertions import max_rel_err, tolerance
from state_harness import random_paths
from test_mamba2_state import Mamba2Harness
from test_triton_kernels import (FOLD_SLOTS, FOLD_TOKENS, L, NULL, RING_START, check_fold, check_values,
                                 check_verify, check_verify_bf16, fold_case, gen, rand, to, verify_case)

from specdec import kernels
from specdec.kernels import dispatch
from specdec.kernels.fold.naive import exact_fold as ref_exact_fold
from specdec.kernels.verify.naive import verify_delta_rule as ref_verify_delta_rule
from specdec.replayssm import StateConfig

triton = pytest.importorskip("triton")

from specdec.kernels.fold import triton as tfold  # noqa: E402
from specdec.kernels.verify import triton as tverify  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
FP32_REL = tolerance(F32)[0]  # Triton vs the torch reference: the fp32 rtol of the table
M2 = "mamba2"
pytestmark = pytest.mark.triton


@pytest.fixture
def device(triton_device):
    """The device the kernels run on (conftest's `triton_device`); the torch references run on CPU copies."""
    return triton_device


@pytest.fixture
def nan_outputs(monkeypatch):
    """Outputs the kernels allocate (`torch.empty`) start as NaN, so an unwritten element fails too."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", filled)


def mamba2_gate(kw: dict, seed: int) -> dict:
    """Mamba2 inputs: beta = dt in (0.05, 0.95), g = dt A with A < 0 per head (GDN layout `[B, T, H]`)."""
    A = -rand(gen(seed), kw["beta"].shape[-1], lo=0.2, hi=1.2)
    kw["g"] = kw["beta"] * A
    kw["rule"] = M2
    return kw


# ----------------------------------------------------------------------------------------- verify

VERIFY_CASES = {
    # id: (K, V, tree, lazy, inter, ring)
    "chain-eager": (5, 6, False, False, True, True),
    "chain-lazy": (5, 6, False, True, False, True),
    "chain-outputs-only-multi-vblock": (3, 70, False, False, False, False),
    "tree-eager": (5, 6, True, False, True, True),
    "tree-lazy": (4, 6, True, True, True, True),
}


@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_verify_mamba2(device, case):
    """Outputs, node states and ring records (d = beta x, k = B as it came, g, rawv, rawk, beta) vs the reference;
    lazy: the start state is the rebuild of the pending records; skipped rows give zeros and write nothing."""
    K, V, tree, lazy, inter, ring = VERIFY_CASES[case]
    kw = mamba2_gate(verify_case(31, K=K, V=V, gdn=True, tree=tree, lazy=lazy, inter=inter, ring=ring), 32)
    o_ref, kt = check_verify(case, kw, device)
    if ring:
        # k = B is stored as it came (no norm): bitwise the raw key record wherever this verify wrote one
        k_rec, raw = kt["ring"][1].cpu(), kt["ring"][4].cpu()
        written = ~raw.isnan()
        assert bool(written.any()) and torch.equal(k_rec[written], raw[written]), f"{case}: k record != rawk"
    # the rule matters: the delta rule on the same inputs gives other outputs
    kr = {n: to(t, "cpu") for n, t in kw.items()}
    assert max_rel_err(o_ref, ref_verify_delta_rule(**{**kr, "rule": "delta"})) > 1e-2


@pytest.mark.usefixtures("nan_outputs")
def test_verify_mamba2_bf16(device):
    """bf16 activations and d / k / rawv / rawk rings (lazy, wrapping) vs the all-fp32 reference."""
    kw = mamba2_gate(verify_case(33, K=5, V=6, gdn=True, tree=False, lazy=True, inter=True, ring=True), 34)
    check_verify_bf16(kw, device, exact=("k", "rawv", "rawk", "beta"))  # k = B: no norm, a copy too


# -------------------------------------------------------------------------------------------- fold

@pytest.mark.parametrize("case", ["offsets-track", "bf16ring-multi-vblock"])
def test_exact_fold_mamba2(device, case):
    Lyr, K, V, rdt = (2, 5, 6, F32) if case == "offsets-track" else (1, 3, 70, BF16)
    inputs = fold_case(35, Lyr=Lyr, K=K, V=V, gdn=True, ring_dt=rdt)
    kw = dict(null_slot=NULL, rule=M2)
    track = case == "offsets-track"
    S_tri = check_fold(case, device, inputs, kw, offsets=track, track=track)
    S, rv, rk, rg, rb = inputs
    idx, rs, nt = torch.tensor(FOLD_SLOTS), torch.tensor(RING_START), torch.tensor(FOLD_TOKENS)
    folded = [5, 0, 2]
    # the flag matters: the delta-rule fold of the same records gives another state
    S_delta = S.clone().to(device)
    delta = {n: to(t, device) for n, t in kw.items() if n not in ("seq_lens", "track_interval")}  # no track copies
    tfold.exact_fold(S_delta, *(to(t, device) for t in (rv, rk, rg, rb, idx, rs, nt)), **{**delta, "rule": "delta"})
    assert max_rel_err(S_delta.cpu()[:, folded], S_tri.cpu()[:, folded]) > 1e-2


def test_teeth_corrupt_one_record_changes_the_fold(device):
    """One ring record off by a little (one element of x, then of B) changes the folded state of its slot and no
    other; a record outside the folded range changes nothing."""
    S, rv, rk, rg, rb = fold_case(36, Lyr=1, K=4, V=5, gdn=True)
    idx, rs, nt = torch.tensor([5, 0]), torch.tensor(RING_START), torch.tensor([4, 3])

    def fold(rv_, rk_):
        out = S.clone().to(device)
        tfold.exact_fold(out, *(to(t, device) for t in (rv_, rk_, rg, rb, idx, rs, nt)), rule=M2)
        return out.cpu()

    clean = fold(rv, rk)
    inside = (RING_START[5] + 2) % L     # slot 5 folds positions start .. start + 3
    outside = (RING_START[5] + 6) % L
    for name in ("rawv", "rawk"):
        for pos, changes in ((inside, True), (outside, False)):
            bad_v, bad_k = rv.clone(), rk.clone()
            (bad_v if name == "rawv" else bad_k)[0, 5, 1, pos, 1] += 1e-3
            got = fold(bad_v, bad_k)
            assert torch.equal(got[:, [0, 1, 2, 3, 4]], clean[:, [0, 1, 2, 3, 4]]), f"{name}: another slot changed"
            assert torch.equal(got[:, 5], clean[:, 5]) != changes, f"{name} at {pos}: changes={changes} expected"


# ---------------------------------------------------------------------------------------- dispatch

def test_dispatch_sends_mamba2_to_triton(monkeypatch, device):
    """On CUDA tensors (on CPU: forced, as the interpreter runs them) the dispatched verify and fold of the rule run
    the Triton kernels; CPU tensors not forced get the recurrent reference (the chunk-form verify is delta-rule
    only); fp64 always goes to the reference."""
    calls = []
    for mod, name in ((tverify, "verify_delta_rule"), (tfold, "exact_fold")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    kw = mamba2_gate(verify_case(37, K=4, V=3, gdn=True, tree=False, lazy=False, inter=False, ring=False), 38)
    args = [kw.pop(n) for n in ("q", "k", "v", "g", "beta", "ssm_state", "ssm_state_indices")]
    want = ref_verify_delta_rule(*args, **kw)
    monkeypatch.delenv("SPECDEC_FORCE_TRITON", raising=False)
    assert torch.equal(kernels.verify_delta_rule(*args, **kw), want) and not calls  # CPU: the recurrence
    if device == "cpu":
        monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")
    got = kernels.verify_delta_rule(*to(tuple(args), device), **kw)
    assert calls == ["verify_delta_rule"]
    check_values("o", got, want)
    S, rv, rk, rg, rb = fold_case(39, Lyr=1, K=4, V=3, gdn=True)
    fargs = (rv, rk, rg, rb, torch.tensor([0, 2]), torch.tensor(RING_START), torch.tensor([3, 2]))
    S_ref, S_tri = S.clone(), S.clone().to(device)
    ref_exact_fold(S_ref, *fargs, rule=M2)
    kernels.exact_fold(S_tri, *to(fargs, device), rule=M2)
    assert calls[-1] == "exact_fold"
    check_values("ssm_state", S_tri, S_ref)
    n = len(calls)
    kernels.exact_fold(S.double().to(device), *to(fargs, device, torch.float64), rule=M2)
    assert len(calls) == n, "fp64 must go to the reference"
    with pytest.raises(ValueError, match="rule"):
        kernels.exact_fold(S.clone(), *fargs, rule="mamba3")


# ---------------------------------------------------------------------------------------- strategies

@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_triton_strategies_follow_mamba2_recurrence(monkeypatch, tree, device):
    """The strategies on the Triton kernels (fp32): committed states follow the float64 Mamba2 recurrence within
    the fp32 tolerance round after round (replay lazy: pending records rebuilt in verify, folded later; track
    boundaries crossed); conv windows bitwise; slots outside the round untouched."""
    monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")  # CPU tensors (the interpreter) take the Triton kernels too
    cfg = StateConfig(num_layers=1, num_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel=3, gate="gdn", rule=M2,
                      max_requests=4, num_verify_tokens=4, track_interval=3)
    h = Mamba2Harness(cfg, seed=41, device=device)
    g_ = gen(42)
    slots = [2, cfg.null_slot, 0, -1, 3]
    valid = [b for b, s in enumerate(slots) if s not in (-1, cfg.null_slot)]
    untouched = [1]
    T = 4
    parent = [-1, 0, 0, 2] if tree else None
    for _ in range(2):
        inp = h.inputs(len(slots), T)
        paths = random_paths(valid, T, g_, parent)
        before = h.states(untouched)
        h.round(slots, inp, paths, parent, width=T)
        for name, strat in h.strats.items():
            ssm, conv = strat.committed_ssm().cpu(), strat.pool.conv.cpu()  # the float64 oracle is on CPU
            for b in valid:
                s = slots[b]
                assert torch.equal(conv[:, s], h.conv[:, s]), f"{name}: conv of slot {s}"
                err = max_rel_err(ssm[:, s], h.ssm[:, s])
                assert err < FP32_REL, f"{name}: ssm of slot {s} rel err {err:.3e}"
            conv0, ssm0 = before[name]
            assert torch.equal(conv[:, untouched], conv0) and torch.equal(ssm[:, untouched], ssm0), name
    assert int(h.strats["snapshot"].pool.track_len.max()) >= 3  # track boundaries were crossed


# ------------------------------------------------------------------------------ compiled (no GPU needed)

SASS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sass_report as sr  # sets TRITON_INTERPRET=0 before triton loads
import torch
ours, _ = sr.cases(2, 16, 3, 2, 2, 4, act=torch.bfloat16, gdn=True, rule="mamba2")
out = {}
for name, fns, call, nbytes in ours:
    if name in ("verify_chain", "verify_tree", "exact_fold"):
        (_, kernel, grid), = sr.capture(fns, call)
        out[name] = sr.summarize(kernel, grid, nbytes)
print(json.dumps(out))
"""


def test_mamba2_kernels_compile_for_sm90(tmp_path):
    """The interpreter accepts code the compiler rejects: the MAMBA2 variants of verify (chain, tree) and the exact
    fold compile for sm_90 (bench/sass_report.py's path, no GPU needed) with no spills, no fp64 work and no
    f32<->f64 conversion in the per-token (per-record) loops, tree verify within 128 registers."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    bench = Path(__file__).resolve().parents[1] / "bench"
    r = subprocess.run([sys.executable, "-c", SASS_SCRIPT, str(bench)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(rep) == {"verify_chain", "verify_tree", "exact_fold"}
    for name, k in rep.items():
        assert k["spill_bytes"] == 0, f"{name} spills {k['spill_bytes']} bytes"
        assert k["loop_fp64_ops"] == 0 and k["loop_f64_conversions"] == 0, (name, k)
        assert k["loop_fp32_ops"] > 0 and k["regs"] > 0, name
    assert rep["verify_tree"]["regs"] <= 128
