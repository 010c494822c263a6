"""Triton kernels against their torch references.

On CPU the kernels run in the Triton interpreter (`TRITON_INTERPRET=1`, set by conftest); with
`TRITON_INTERPRET=0` and a GPU (bench/gpu_check.sh) the same tests run the compiled kernels on CUDA
tensors. References always run on CPU copies in fp32, so both paths are checked against one oracle.

Every buffer a kernel writes (rings, intermediate states, conv windows, track states, scatter targets)
is pre-filled with NaN: an element that should be written and is not stays NaN and fails, and elements
that must not be written are compared bitwise (NaN equal to NaN). Shapes are tiny and
non-powers of two (the interpreter is slow); slot maps are reversed and hold -1 and the null slot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from assertions import assert_close, max_rel_err

from specdec.kernels import dispatch
from specdec.kernels.fold.naive import exact_fold as ref_exact_fold
from specdec.kernels.rebuild.naive import fast_rebuild as ref_fast_rebuild
from specdec.kernels.recurrent import recurrent_delta_rule
from specdec.kernels.scatter.naive import masked_scatter as ref_masked_scatter
from specdec.kernels.verify.naive import short_conv_verify as ref_short_conv_verify
from specdec.kernels.verify.naive import verify_delta_rule as ref_verify_delta_rule

triton = pytest.importorskip("triton")

from specdec.kernels.fold import triton as tfold  # noqa: E402
from specdec.kernels.rebuild import triton as trebuild  # noqa: E402
from specdec.kernels.scatter import triton as tscatter  # noqa: E402
from specdec.kernels.verify import triton as tverify  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
EPS32 = torch.finfo(F32).eps
FP32_REL = 1e-5
NAN = float("nan")
pytestmark = pytest.mark.triton


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def device(triton_device):
    """The device the kernels run on (conftest's `triton_device`); the torch references run on CPU copies."""
    return triton_device


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """Outputs the kernels allocate (`torch.empty`) start as NaN, so an unwritten element fails too."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(NAN) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", filled)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=F32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def rand(g, *shape, lo=0.0, hi=1.0, dtype=F32):
    return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)).to(dtype)


def bf16_values(t: torch.Tensor) -> torch.Tensor:
    """fp32 tensor holding bf16-representable values (so bf16 and fp32 runs see the same inputs)."""
    return t.to(BF16).to(F32)


def nan(*shape, dtype=F32):
    return torch.full(shape, NAN, dtype=dtype)


def to(x, device, dtype=None):
    """Clone tensors (and tuples of tensors) onto `device`, optionally casting floating tensors."""
    if isinstance(x, tuple):
        return tuple(to(t, device, dtype) for t in x)
    if not isinstance(x, torch.Tensor):
        return x
    x = x.clone().to(device)
    return x.to(dtype) if dtype is not None and x.is_floating_point() else x


def check_written(name: str, got: torch.Tensor, want: torch.Tensor, *, tol_dtype=F32) -> None:
    """`want` is NaN exactly where nothing may be written: there `got` must be bitwise equal (NaN);
    everywhere else `got` must hold a value within the tolerance of `tol_dtype`."""
    got = got.detach().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    unwritten = want.isnan()
    assert_close(got[unwritten], want[unwritten].to(got.dtype), exact=True, msg=f"{name} (must not be written)")
    g, w = got[~unwritten].double(), want[~unwritten].double()
    assert not bool(g.isnan().any()), f"{name}: {int(g.isnan().sum())} elements left unwritten"
    if g.numel() == 0:
        return
    if tol_dtype == F32:
        err = max_rel_err(g, w)
        assert err < FP32_REL, f"{name}: max relative error {err:.3e} >= {FP32_REL}"
    else:
        assert_close(g, w, dtype=tol_dtype, msg=name)


def check_values(name: str, got: torch.Tensor, want: torch.Tensor, *, tol_dtype=F32) -> None:
    check_written(name, got, want.to(F32) if want.dtype != F32 else want, tol_dtype=tol_dtype)


# --------------------------------------------------------------------------------------------- verify

B, T, H, N, L = 5, 5, 3, 6, 8
SLOTS = [5, -1, 3, 4, 0]          # reversed; row 1 is -1, row 3 maps to the null slot
NULL = 4
RING_START = [6, 1, 7, 3, 2, 5]   # 6 and 7 wrap around L = 8
PENDING = [3, 0, 2, 1, 0, 3]      # slots 5, 3 pending (lazy); slot 0 none
TREE = [[-1, 0, 0, 1, -1], [-1, 0, 1, 2, 3], [-1, -1, 1, 2, 0], [-1, 0, 1, 2, 3], [-1, 0, 1, 1, 3]]


def verify_case(seed, *, K, V, gdn, tree, lazy, inter, ring, ring_g_dim=None):
    """Inputs on CPU (fp32, bf16-representable), NaN-filled buffers, pending records for lazy."""
    g_ = gen(seed)
    q, k = bf16_values(randn(g_, B, T, H, K)), bf16_values(randn(g_, B, T, H, K))
    v = bf16_values(randn(g_, B, T, H, V))
    gate = rand(g_, *((B, T, H) if gdn else (B, T, H, K)), lo=-0.7, hi=0.0)
    beta = rand(g_, B, T, H, lo=0.05, hi=0.95)
    S = randn(g_, N, H, K, V)
    kw = dict(q=q, k=k, v=v, g=gate, beta=beta, ssm_state=S, ssm_state_indices=torch.tensor(SLOTS), null_slot=NULL)
    if tree:
        kw["parent"] = torch.tensor(TREE)
    if inter:
        kw["intermediate_states"] = nan(B + 1, T + 1, H, K, V)
    if ring:
        gk = ring_g_dim or (1 if gdn else K)
        rings = (nan(N, H, L, V), nan(N, H, L, K), nan(N, H, L, gk), nan(N, H, L, V), nan(N, H, L, K), nan(N, H, L))
        kw["ring"], kw["ring_start"] = rings, torch.tensor(RING_START)
        if lazy:
            kw["num_pending"] = torch.tensor(PENDING)
            for s in range(N):
                for j in range(PENDING[s]):
                    p = (RING_START[s] + j) % L
                    rings[0][s, :, p] = bf16_values(randn(g_, H, V) * 0.5)
                    rings[1][s, :, p] = bf16_values(torch.nn.functional.normalize(randn(g_, H, K), dim=-1))
                    gj = rand(g_, H, lo=-0.7, hi=0.0)
                    rings[2][s, :, p] = gj[:, None].expand(H, gk) if gdn else rand(g_, H, gk, lo=-0.7, hi=0.0)
    return kw


def run_verify(kw, device, *, act=None, ring_act=None):
    """Triton run on `device`: activations (q, k, v) in `act`, ring d/k/rawv/rawk in `ring_act`."""
    kt = {n: to(t, device) for n, t in kw.items()}
    if act is not None:
        for n in ("q", "k", "v"):
            kt[n] = kt[n].to(act)
    if ring_act is not None and "ring" in kt:
        r = kt["ring"]
        kt["ring"] = (r[0].to(ring_act), r[1].to(ring_act), r[2], r[3].to(ring_act), r[4].to(ring_act), r[5])
    o = tverify.verify_delta_rule(**kt)
    return o, kt


VERIFY_CASES = {
    # id: (K, V, gdn, tree, lazy, inter, ring, norm, ring_g_dim)
    "chain-eager-kda-rsqrt": (5, 6, False, False, False, True, True, "rsqrt", None),
    "chain-lazy-gdn-sqrtdiv": (5, 6, True, False, True, False, True, "sqrt_div", None),
    "chain-outputs-only": (3, 7, False, False, False, False, False, "rsqrt", None),
    "chain-eager-multi-vblock": (3, 70, False, False, False, True, True, "rsqrt", None),
    "tree-eager-kda": (5, 6, False, True, False, True, True, "sqrt_div", None),
    "tree-lazy-gdn-ringgK": (5, 6, True, True, True, True, True, "rsqrt", 5),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_verify_delta_rule(device, case):
    K, V, gdn, tree, lazy, inter, ring, norm, rgd = VERIFY_CASES[case]
    kw = verify_case(1, K=K, V=V, gdn=gdn, tree=tree, lazy=lazy, inter=inter, ring=ring, ring_g_dim=rgd)
    kw["norm"] = norm
    check_verify(case, kw, device)


def check_verify(case: str, kw: dict, device):
    """Triton vs the reference on the inputs of `verify_case`: outputs, node states and ring records where the
    case has them; skipped rows give zeros, the checkpoint is never written. -> (o_ref, Triton's arguments)."""
    kr = {n: to(t, "cpu") for n, t in kw.items()}
    o_ref = ref_verify_delta_rule(**kr)
    o, kt = run_verify(kw, device)
    check_values(f"{case}: o", o, o_ref)
    assert bool((o.cpu()[[1, 3]] == 0).all()), f"{case}: skipped rows must give zero outputs"
    assert_close(kt["ssm_state"].cpu(), kw["ssm_state"], exact=True, msg=f"{case}: checkpoint written")
    if "intermediate_states" in kw:
        check_written(f"{case}: intermediate_states", kt["intermediate_states"], kr["intermediate_states"])
    if "ring" in kw:
        for name, got, want in zip(("d", "k", "g", "rawv", "rawk", "beta"), kt["ring"], kr["ring"]):
            check_written(f"{case}: ring {name}", got, want)
    return o_ref, kt


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_eager_layout(device, tree):
    """Eager layout: rings `[R, H, D, *]` indexed by the running row (`ring_indices`), record t at position t
    (no `ring_start`), no d / k rings. Triton vs the reference, and on each backend the records equal the
    per-slot layout's bit for bit."""
    K, V, D = 5, 6, T + 1
    kw = verify_case(7, K=K, V=V, gdn=False, tree=tree, lazy=False, inter=True, ring=True)
    per_slot = kw.pop("ring")
    kw.pop("ring_start")
    rows = torch.tensor([3, 0, 4, 1, 2])  # a permutation: ring row of each request
    eager = (None, None, nan(B + 1, H, D, K), nan(B + 1, H, D, V), nan(B + 1, H, D, K), nan(B + 1, H, D))
    kr = {n: to(t, "cpu") for n, t in kw.items()}
    ring_ref = to(eager, "cpu")
    o_ref = ref_verify_delta_rule(**kr, ring=ring_ref, ring_indices=rows)
    kt = {n: to(t, device) for n, t in kw.items()}
    ring_tri = to(eager, device)
    o = tverify.verify_delta_rule(**kt, ring=ring_tri, ring_indices=rows.to(device))
    check_values("o", o, o_ref)
    for name, got, want in zip(("g", "rawv", "rawk", "beta"), ring_tri[2:], ring_ref[2:]):
        check_written(f"eager ring {name}", got, want)
    # the same verify into per-slot rings: the same records, bit for bit, on each backend
    for impl, ring, dev in ((ref_verify_delta_rule, ring_ref, "cpu"), (tverify.verify_delta_rule, ring_tri, device)):
        slot_rings = to(per_slot, dev)
        impl(**{n: to(t, dev) for n, t in kw.items()}, ring=slot_rings, ring_start=torch.tensor(RING_START).to(dev))
        for b, s in enumerate(SLOTS):
            if s in (-1, NULL):
                assert all(bool(r[int(rows[b])].isnan().all()) for r in ring[2:]), "skipped row written"
                continue
            pos = (RING_START[s] + torch.arange(T)) % L
            for name, e, p in zip(("g", "rawv", "rawk", "beta"), ring[2:], slot_rings[2:]):
                assert_close(e[int(rows[b]), :, :T].cpu(), p[s][:, pos].cpu(), exact=True, msg=f"{name} row {b}")


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view: every second element of a wider last dim (NaN between)."""
    return torch.stack([t, torch.full_like(t, NAN)], -1).flatten(-2)[..., ::2]


def test_verify_strided_inputs(device):
    """q / k / v / g / beta are read at their own strides (views of fused projections, no copies): the same
    outputs and ring records, bit for bit, as from contiguous inputs."""
    kw = verify_case(4, K=5, V=6, gdn=False, tree=False, lazy=True, inter=True, ring=True)
    o, kt = run_verify(kw, device)
    ks = {n: to(t, device) for n, t in kw.items()}
    for n in ("q", "k", "v", "g", "beta"):
        ks[n] = strided(ks[n])
        assert not ks[n].is_contiguous()
    o2 = tverify.verify_delta_rule(**ks)
    assert_close(o2.cpu(), o.cpu(), exact=True, msg="o")
    assert_close(ks["intermediate_states"].cpu(), kt["intermediate_states"].cpu(), exact=True, msg="states")
    for name, a, b in zip(("d", "k", "g", "rawv", "rawk", "beta"), ks["ring"], kt["ring"]):
        assert_close(a.cpu(), b.cpu(), exact=True, msg=f"ring {name}")


def test_verify_bf16_storage(device):
    """bf16 activations and bf16 d/k/rawv/rawk rings (lazy, wrapping) vs the all-fp32 reference."""
    kw = verify_case(2, K=5, V=6, gdn=False, tree=False, lazy=True, inter=True, ring=True)
    check_verify_bf16(kw, device, exact=("rawv", "rawk", "beta"))  # d / k are rounded results


def check_verify_bf16(kw: dict, device, *, exact: tuple[str, ...]) -> None:
    """Triton with bf16 activations and d / k / rawv / rawk rings vs the all-fp32 reference, at the bf16
    tolerance; the records named in `exact` are copies of bf16-representable inputs: bitwise."""
    kr = {n: to(t, "cpu") for n, t in kw.items()}
    o_ref = ref_verify_delta_rule(**kr)
    o, kt = run_verify(kw, device, act=BF16, ring_act=BF16)
    assert o.dtype == BF16
    check_values("o", o, o_ref, tol_dtype=BF16)
    check_written("intermediate_states", kt["intermediate_states"], kr["intermediate_states"], tol_dtype=BF16)
    for name, got, want in zip(("d", "k", "g", "rawv", "rawk", "beta"), kt["ring"], kr["ring"]):
        check_written(f"ring {name}", got, want, tol_dtype=BF16 if got.dtype == BF16 else F32)
        if name in exact:
            assert_close(got.cpu().float(), want, exact=True, msg=f"ring {name}")


def test_verify_all_rows_skipped_and_errors(device):
    kw = verify_case(3, K=4, V=4, gdn=False, tree=True, lazy=False, inter=True, ring=True)
    kw["ssm_state_indices"] = torch.tensor([-1, NULL, -1, NULL, -1])
    o, kt = run_verify(kw, device)
    assert bool((o == 0).all())
    assert bool(kt["intermediate_states"].isnan().all()) and all(bool(r.isnan().all()) for r in kt["ring"])
    kt = {n: to(t, device) for n, t in kw.items()}
    kt["intermediate_states"] = None
    with pytest.raises(ValueError, match="intermediate_states"):
        tverify.verify_delta_rule(**kt)
    kt = {n: to(t, device) for n, t in kw.items()}
    kt["q"] = kt["q"].double()
    with pytest.raises(ValueError, match="fp64"):
        tverify.verify_delta_rule(**kt)


# ----------------------------------------------------------------------------------------- short conv

CONV_CASES = {
    # id: (C, Kc, tree, bias, activation, dtype)
    "chain-silu-bias-fp32": (10, 4, False, True, "silu", F32),
    "chain-none-bf16": (10, 4, False, False, None, BF16),
    "tree-silu-bf16-kc3": (10, 3, True, True, "silu", BF16),
    "tree-none-fp32-multi-cblock": (300, 4, True, False, None, F32),
    "chain-silu-fp32-kc2": (10, 2, False, True, "silu", F32),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_short_conv_verify(device, case):
    C, Kc, tree, bias, act, dt = CONV_CASES[case]
    g_ = gen(4)
    x = bf16_values(randn(g_, B, T, C))
    w = bf16_values(randn(g_, C, Kc) * 0.5)
    b = bf16_values(randn(g_, C)) if bias else None
    cs = bf16_values(randn(g_, N, C, Kc - 1))
    idx = torch.tensor(SLOTS)
    parent = torch.tensor(TREE) if tree else None
    win_ref = nan(B + 1, T + 1, C, Kc - 1)
    y_ref = ref_short_conv_verify(x, w, b, cs, idx, parent=parent, window_states=win_ref, activation=act,
                                  null_slot=NULL)
    win = nan(B + 1, T + 1, C, Kc - 1, dtype=dt).to(device)
    y = tverify.short_conv_verify(to(x, device, dt), to(w, device, dt), to(b, device, dt), to(cs, device, dt),
                                  idx.to(device), parent=None if parent is None else parent.to(device),
                                  window_states=win, activation=act, null_slot=NULL)
    assert y.dtype == dt
    check_values(f"{case}: y", y, y_ref, tol_dtype=dt)
    assert bool((y.cpu()[[1, 3]] == 0).all())
    # windows are copies of inputs: bitwise, NaN where nothing may be written
    assert_close(win.cpu().float(), win_ref, exact=True, msg=f"{case}: window_states")


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_short_conv_verify_inputs_and_rebuilt_windows(device, tree):
    """The conv records: each token's pre-conv input is stored (bitwise); the window rebuilt from them at commit
    (inside the exact fold's launch, Triton and reference) equals the window the verify pass keeps today for
    the last accepted node, bit for bit."""
    C, Kc, Lyr = 10, 4, 2
    g_ = gen(11)
    x = bf16_values(randn(g_, Lyr, B, T, C)).to(BF16)
    w = bf16_values(randn(g_, C, Kc) * 0.5).to(BF16)
    cs = bf16_values(randn(g_, Lyr, N, C, Kc - 1)).to(BF16)
    idx = torch.tensor(SLOTS)
    parent = torch.tensor(TREE) if tree else None
    windows = nan(Lyr, B + 1, T + 1, C, Kc - 1, dtype=BF16)
    inputs = nan(Lyr, B + 1, T + 1, C, dtype=BF16)
    for lyr in range(Lyr):
        ref_short_conv_verify(x[lyr], w, None, cs[lyr], idx, parent=parent, window_states=windows[lyr],
                              null_slot=NULL)
        got = nan(B + 1, T + 1, C, dtype=BF16).to(device)
        tverify.short_conv_verify(to(x[lyr], device), to(w, device), None, to(cs[lyr], device), idx.to(device),
                                  parent=None if parent is None else parent.to(device), conv_inputs=got, null_slot=NULL)
        ref_short_conv_verify(x[lyr], w, None, cs[lyr], idx, parent=parent, conv_inputs=inputs[lyr], null_slot=NULL)
        assert_close(got.cpu(), inputs[lyr], exact=True, msg="conv_inputs (NaN where nothing may be written)")
    # accepted paths: a root-to-node path per row (tree) or a prefix (chain); row 2 accepts its whole chain
    paths = ([[0, 1, 3], [0], [1, 2, 3], [0, 1], [0, 1, 3, 4]] if tree
             else [[0, 1], [0], [0, 1, 2, 3, 4], [0], [0, 1, 2]])
    n = torch.tensor([len(p) for p in paths])
    path = torch.tensor([p + [-1] * (T - len(p)) for p in paths]).clamp(min=0)
    want = cs.clone()
    for b, s in enumerate(SLOTS):
        if s not in (-1, NULL):
            want[:, s] = windows[:, b, paths[b][-1]]
    # the eager commit's one launch: fold the accepted records (eager rings by running row) and rebuild the windows
    S = randn(g_, Lyr, N, H, 3, 2)
    ring = (randn(g_, Lyr, B, H, T, 2), randn(g_, Lyr, B, H, T, 3), rand(g_, Lyr, B, H, T, 3, lo=-0.7, hi=0.0),
            rand(g_, Lyr, B, H, T, lo=0.05, hi=0.95))
    out = {}
    for name, impl, dev in (("reference", ref_exact_fold, "cpu"), ("triton", tfold.exact_fold, device)):
        conv, state = cs.clone().to(dev), S.clone().to(dev)
        impl(state, *to(ring, dev), idx.to(dev), None, n.to(dev), offsets=path.to(dev),
             ring_indices=torch.arange(B).to(dev), conv_state=conv, conv_inputs=inputs.to(dev), null_slot=NULL)
        assert_close(conv.cpu(), want, exact=True, msg=f"{name}: rebuilt windows")
        out[name] = state.cpu()
    folded = [5, 3, 0]
    check_values("ssm_state", out["triton"][:, folded], out["reference"][:, folded])
    assert_close(out["triton"][:, [1, 2, 4]], S[:, [1, 2, 4]], exact=True, msg="untouched slots")
    assert max_rel_err(out["reference"][:, folded], S[:, folded]) > 1e-2  # the fold did something


def test_short_conv_verify_kernel_size_limit(device):
    """The kernel keeps the window in registers for kernel sizes up to 4 (every hybrid's conv); larger ones
    are one clear error before anything runs."""
    z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
    with pytest.raises(ValueError, match="weight: the Triton short conv takes kernel sizes 2..4"):
        tverify.short_conv_verify(z(1, 2, 3), z(3, 5), None, z(2, 3, 4), torch.tensor([0], device=device))


# ---------------------------------------------------------------------------------------------- fold

FOLD_SLOTS = [5, -1, 3, 4, 0, 2]
FOLD_TOKENS = [5, 3, 0, 4, 8, 2]   # row 2 folds nothing; rows 1 and 3 are skipped
SEQ_LENS = [3, 0, 5, 6, 1, 250]    # track boundaries at multiples of 4 (and one of 256 unused)


def fold_case(seed, *, Lyr, K, V, gdn, ring_dt=F32):
    g_ = gen(seed)
    S = randn(g_, Lyr, N, H, K, V)
    rv = bf16_values(randn(g_, Lyr, N, H, L, V)).to(ring_dt)
    rk = bf16_values(randn(g_, Lyr, N, H, L, K)).to(ring_dt)
    rg = rand(g_, Lyr, N, H, L, 1 if gdn else K, lo=-0.7, hi=0.0)
    rb = rand(g_, Lyr, N, H, L, lo=0.05, hi=0.95)
    return S, rv, rk, rg, rb


FOLD_CASES = {
    # id: (Lyr, K, V, gdn, norm, offsets, track, ring dtype)
    "kda-rsqrt-track": (2, 5, 6, False, "rsqrt", False, True, F32),
    "gdn-sqrtdiv-offsets-bf16ring": (2, 5, 6, True, "sqrt_div", True, False, BF16),
    "kda-multi-vblock-offsets-track": (1, 3, 70, False, "rsqrt", True, True, F32),
}


@pytest.mark.parametrize("case", list(FOLD_CASES))
def test_exact_fold(device, case):
    Lyr, K, V, gdn, norm, use_off, track, rdt = FOLD_CASES[case]
    check_fold(case, device, fold_case(5, Lyr=Lyr, K=K, V=V, gdn=gdn, ring_dt=rdt), dict(norm=norm, null_slot=NULL),
               offsets=use_off, track=track)


def check_fold(case: str, device, inputs: tuple, kw: dict, *, offsets: bool, track: bool) -> torch.Tensor:
    """Triton's fold of `fold_case` records (`FOLD_SLOTS` / `FOLD_TOKENS`, optionally tree-path `offsets` and
    track states) vs the reference: folded slots within the fp32 tolerance, every other slot bitwise unchanged;
    -> Triton's state."""
    S, rv, rk, rg, rb = inputs
    Lyr, _, Hh, K, V = S.shape
    idx, rs, nt = torch.tensor(FOLD_SLOTS), torch.tensor(RING_START), torch.tensor(FOLD_TOKENS)
    if offsets:  # an accepted tree path: node offsets in any order
        kw["offsets"] = torch.tensor([[0, 2, 3, 5, 6, 7, 1, 4]] * len(FOLD_SLOTS))
    if track:
        kw.update(seq_lens=torch.tensor(SEQ_LENS), track_interval=4)
    S_ref = S.clone()
    tr_ref = nan(Lyr, N, 2, Hh, K, V) if track else None
    ref_exact_fold(S_ref, rv, rk, rg, rb, idx, rs, nt, track_states=tr_ref, **kw)
    S_tri = S.clone().to(device)
    tr = nan(Lyr, N, 2, Hh, K, V).to(device) if track else None
    tfold.exact_fold(S_tri, *(to(t, device) for t in (rv, rk, rg, rb, idx, rs, nt)), track_states=tr,
                     **{n: to(t, device) for n, t in kw.items()})
    folded = [5, 0, 2]  # slots with tokens to fold
    untouched = [s for s in range(N) if s not in folded]
    assert_close(S_tri.cpu()[:, untouched], S[:, untouched], exact=True, msg=f"{case}: untouched slots")
    check_values(f"{case}: ssm_state", S_tri[:, folded], S_ref[:, folded])
    assert max_rel_err(S_ref[:, folded], S[:, folded]) > 1e-2  # the fold did something
    if track:
        assert not bool(tr_ref.isnan().all())
        check_written(f"{case}: track_states", tr, tr_ref)
    return S_tri


# -------------------------------------------------------------------------------------- fast rebuild

@pytest.mark.parametrize("gdn,dt", [(False, F32), (True, BF16)], ids=["kda-fp32", "gdn-bf16"])
def test_fast_rebuild(device, gdn, dt):
    K, V = 5, 6
    g_ = gen(6)
    S = randn(g_, N, H, K, V)
    d = bf16_values(randn(g_, N, H, L, V))
    k = bf16_values(torch.nn.functional.normalize(randn(g_, N, H, L, K), dim=-1))
    gg = rand(g_, N, H, L, 1 if gdn else K, lo=-0.7, hi=0.0)
    idx, rs = torch.tensor([5, 3, 2, 0]), torch.tensor(RING_START)
    m = torch.tensor([7, 0, 3, 8])  # wraps; 0 = the checkpoint itself
    want = ref_fast_rebuild(S, idx, d, k, gg, rs, m)
    got = trebuild.fast_rebuild(to(S, device), idx.to(device), to(d, device, dt), to(k, device, dt), to(gg, device),
                                rs.to(device), m.to(device))
    assert got.dtype == F32 and got.shape == want.shape
    check_values("fast_rebuild", got, want)
    assert_close(got.cpu()[1], S[3], exact=True, msg="m = 0 returns the checkpoint")


@pytest.mark.parametrize("seed", range(6))
def test_fast_rebuild_strong_gates(device, seed):
    """Full queues of KDA gates down to -30 (log-decays summing to ~-120) against a float64 recomputation: each
    decay is summed from the newer records alone, never as a difference of two large sums."""
    K, V = 16, 16
    g_ = gen(100 + seed)
    S, d = randn(g_, N, H, K, V), randn(g_, N, H, L, V)
    k = torch.nn.functional.normalize(randn(g_, N, H, L, K), dim=-1)
    gg = rand(g_, N, H, L, K, lo=-30.0, hi=0.0)
    idx, rs, m = torch.tensor([5, 3, 2, 0]), torch.tensor(RING_START), torch.full((4,), L)
    want = ref_fast_rebuild(S.double(), idx, d.double(), k.double(), gg.double(), rs, m)
    got = trebuild.fast_rebuild(to(S, device), idx.to(device), to(d, device), to(k, device), to(gg, device),
                                rs.to(device), m.to(device))
    assert_close(got.cpu().double(), want, dtype=F32, msg="rebuilt state")


# ------------------------------------------------------------------------------------- masked scatter

@pytest.mark.parametrize("what", ["ssm-fp32", "conv-bf16", "fp32-to-bf16", "strided-dst"])
def test_masked_scatter(device, what):
    Lyr, R, Ts = 2, 6, 4
    g_ = gen(7)
    shape = {"ssm-fp32": (H, 5, 6), "conv-bf16": (10, 3), "fp32-to-bf16": (H, 5, 6), "strided-dst": (3, 5)}[what]
    sdt, ddt = {"ssm-fp32": (F32, F32), "conv-bf16": (BF16, BF16), "fp32-to-bf16": (F32, BF16),
                "strided-dst": (F32, F32)}[what]
    src = randn(g_, Lyr, R, Ts, *shape).to(sdt)
    dst = nan(Lyr, N, *shape, dtype=ddt)
    dst[:, 1] = 7.0
    if what == "strided-dst":  # trailing dims not dense: a slice of a wider buffer
        wide = nan(Lyr, N, shape[0], shape[1] + 2, dtype=ddt)
        dst = wide[..., 1:-1]
    idx = torch.tensor([5, -1, 3, 4, 0, 1])
    step = torch.tensor([3, 0, -1, 2, 0, 1])  # row 2 skips (step -1)
    want = dst.clone()
    ref_masked_scatter(src, want, idx, step, null_slot=NULL)
    got = dst.clone().to(device)
    if what == "strided-dst":
        got = wide.clone().to(device)[..., 1:-1]
    tscatter.masked_scatter(src.to(device), got, idx.to(device), step.to(device), null_slot=NULL)
    assert_close(got.cpu(), want, exact=True, msg=what)
    assert not bool(want[:, [5, 0, 1]].isnan().any())


# ----------------------------------------------------------------------------------- fold vs decode

# Across backends the contract is fp32 tolerance (docs/EXACTNESS.md): the kernel and the reference round differently
# (reduction order, exp), so the state drifts like a random walk of a few eps per round. The bound grows by
# 2 eps of the state's max per round; it still catches any systematic error (a state rounded through bf16,
# ~4e-3, an open-loop rebuild from bf16 `d`, a misplaced gate). Within one backend the fold is bitwise equal
# to single steps: tests/test_fold_exactness.py.
DRIFT_EPS_PER_ROUND = 2


@pytest.mark.parametrize("gdn,norm", [(False, "rsqrt"), (True, "sqrt_div")], ids=["kda-rsqrt", "gdn-sqrtdiv"])
def test_fold_matches_plain_decode_64_rounds(device, gdn, norm):
    """64 chained rounds: write D records per slot into the rings, fold a random accepted count with the
    Triton fold, and compare every round with the reference's plain fp32 decode of the same tokens."""
    g_ = gen(9)
    Bq, Hq, K, V, D, Lq = 2, 2, 6, 7, 8, 16
    slots = torch.tensor([1, 0])  # reversed
    S0 = randn(g_, Bq, Hq, K, V)
    state = S0.clone()[None].to(device)
    dec = S0.clone()              # decode states, indexed by slot like the checkpoints
    rv, rk = torch.zeros(1, Bq, Hq, Lq, V), torch.zeros(1, Bq, Hq, Lq, K)
    rg, rb = torch.zeros(1, Bq, Hq, Lq, 1 if gdn else K), torch.zeros(1, Bq, Hq, Lq)
    start = torch.zeros(Bq, dtype=torch.long)
    worst = 0.0
    for r in range(64):
        n = torch.randint(1, D + 1, (Bq,), generator=g_)
        k, v = randn(g_, Bq, D, Hq, K), randn(g_, Bq, D, Hq, V)
        gate = rand(g_, *((Bq, D, Hq) if gdn else (Bq, D, Hq, K)), lo=-0.3, hi=0.0)
        beta = rand(g_, Bq, D, Hq, lo=0.05, hi=0.95)
        for b in range(Bq):
            s = int(slots[b])
            pos = (start[s] + torch.arange(D)) % Lq
            rv[0, s][:, pos] = v[b].transpose(0, 1)
            rk[0, s][:, pos] = k[b].transpose(0, 1)
            rg[0, s][:, pos] = (gate[b][..., None] if gdn else gate[b]).transpose(0, 1)
            rb[0, s][:, pos] = beta[b].transpose(0, 1)
        tfold.exact_fold(state, *(t.to(device) for t in (rv, rk, rg, rb, slots, start, n)), norm=norm)
        for b in range(Bq):
            s, m = int(slots[b]), int(n[b])
            _, dec[s:s + 1] = recurrent_delta_rule(k[b:b + 1, :m], k[b:b + 1, :m], v[b:b + 1, :m],
                                                   gate[b:b + 1, :m], beta[b:b + 1, :m],
                                                   initial_state=dec[s:s + 1], norm=norm)
            start[s] = (start[s] + m) % Lq
        err = max_rel_err(state[0].cpu(), dec) / EPS32
        assert err <= DRIFT_EPS_PER_ROUND * (r + 1), f"round {r}: fold drifted {err:.2f} eps from plain decode"
        worst = max(worst, err / (r + 1))
    print(f"fold vs plain decode: worst {worst:.2f} eps per round over 64 rounds")


# ------------------------------------------------------------------------------------------- dispatch

def test_dispatch_picks(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv("SPECDEC_FORCE_TRITON", raising=False)
    for name in dispatch.OPS:
        assert dispatch.pick(name, x) is dispatch.reference_impl(name)
    monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")
    assert dispatch.pick("exact_fold", x) is tfold.exact_fold
    assert dispatch.pick("verify_delta_rule", x, (x, x), None) is tverify.verify_delta_rule
    assert dispatch.pick("short_conv_verify", x) is tverify.short_conv_verify
    assert dispatch.pick("fast_rebuild", x) is trebuild.fast_rebuild
    assert dispatch.pick("masked_scatter", x) is tscatter.masked_scatter
    assert dispatch.pick("exact_fold", x, x.double()) is ref_exact_fold  # fp64 -> reference


def test_dispatched_op_runs_triton(monkeypatch, device):
    import specdec.kernels as K
    if device == "cpu":
        monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")
    src = randn(gen(10), 1, 2, 2, 3).to(device)
    dst = torch.zeros(1, 3, 3, device=device)
    calls = []
    monkeypatch.setattr(tscatter, "_flat", lambda t, lead, f=tscatter._flat: calls.append(1) or f(t, lead))
    K.masked_scatter(src, dst, torch.tensor([2, 0], device=device), torch.tensor([1, 0], device=device))
    assert calls, "the Triton scatter did not run"
    assert_close(dst[0, 2].cpu(), src[0, 0, 1].cpu(), exact=True)
    assert_close(dst[0, 0].cpu(), src[0, 1, 0].cpu(), exact=True)


def test_import_does_not_load_triton():
    code = "import sys, specdec.kernels as k; k.pick('exact_fold'); assert 'triton' not in sys.modules, 'triton'"
    env = {**os.environ}
    env.pop("SPECDEC_FORCE_TRITON", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------ compiled (no GPU needed)

SASS_REPORT = Path(__file__).resolve().parents[1] / "bench" / "sass_report.py"


SMALL = ["--heads", "2", "--head-dim", "16", "--draft-tokens", "3", "--requests", "2", "--layers", "2"]


@pytest.mark.parametrize("shapes,act,gate", [("small", "bf16", "kda"), ("small", "fp32", "gdn"),
                                             ("kimi", "bf16", "kda-input")])
def test_kernels_compile_for_sm90(tmp_path, shapes, act, gate):
    """The interpreter runs Python, so it accepts code the compiler rejects: compile every kernel for an
    H100/H200 target through bench/sass_report.py (no GPU needed) and read its SASS. The per-token (per
    record) loops of verify, fold and rebuild hold no fp64 work and no f32<->f64 conversion; nothing spills.
    At Kimi-Linear shapes (the script's defaults), with the gate computed from its input records as the package
    runs Kimi-Linear, the chain verify loop is at most 1.3x the instructions of fla's fused_recurrent_kda loop (its
    `use_gate_in_kernel` too), and tree verify fits 128 registers."""
    out = tmp_path / "sass.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, str(SASS_REPORT), *(SMALL if shapes == "small" else []), "--act-dtype", act,
           "--json", str(out)] + {"gdn": ["--gdn"], "kda-input": ["--gate-in-kernel"]}.get(gate, [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert set(rep["kernels"]) == {"verify_chain", "verify_tree", "exact_fold", "fast_rebuild", "short_conv_verify",
                                   "masked_scatter"}
    for name, k in rep["kernels"].items():
        assert k["spill_bytes"] == 0, f"{name} spills {k['spill_bytes']} bytes"
        assert k["loop_instructions"] > 0 and k["regs"] > 0, name
        if name != "masked_scatter":  # a copy: the loop stat is the whole kernel, with no math to check
            assert k["loop_fp64_ops"] == 0 and k["loop_f64_conversions"] == 0, (name, k)
    assert rep["kernels"]["verify_tree"]["regs"] <= 128
    if shapes == "kimi":
        ratio = rep["kernels"]["verify_chain"]["loop_instructions"] / rep["fla_fused_recurrent_kda"]["loop_instructions"]
        assert ratio <= 1.3, f"verify chain loop is {ratio:.2f}x fla's"
