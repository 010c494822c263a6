"""The chunk-form verify (`kernels/verify/chunk.py`) against the per-token recurrence (`kernels/verify/naive.py`).

Hypothesis draws chains and trees (second roots included), KDA and GDN gates, both norms, fp32 and fp64, rows
mapped to -1 or the null slot, both ring layouts (lazy: rings per slot, wrapped positions, pending records; eager:
rings per running row, the fold's four records only). Both verifies run on the
same inputs into NaN-filled rings and node buffers; outputs, `d` records and node states must agree within the
dtype's tolerance (a different op order), the input records (normalized k, g, rawv, rawk, beta) bit for bit, and
everything a verify must not write stays as it was. `ancestor_mask` is checked against a walk over the parents.
"""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close, root_path
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdec.kernels import dispatch
from specdec.kernels.tree import ancestor_mask
from specdec.kernels.rebuild.naive import fast_rebuild
from specdec.kernels.recurrent import recurrent_delta_rule
from specdec.kernels.verify.chunk import verify_delta_rule as chunk_verify
from specdec.kernels.verify.naive import verify_delta_rule as naive_verify

F32, F64 = torch.float32, torch.float64
RECORDS = ("d", "k", "g", "rawv", "rawk", "beta")


@st.composite
def cases(draw):
    T = draw(st.integers(1, 9))
    B = draw(st.integers(1, 3))
    tree = draw(st.booleans())
    # trees: parent[i] in [-1, i-1], so -1 after node 0 is a second root
    parents = [[-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)] for _ in range(B)] if tree else None
    N = B + 2
    kinds = [draw(st.sampled_from([0, 0, 0, 1, 2])) for _ in range(B)]  # 0: a slot, 1: -1, 2: the null slot
    slots = draw(st.permutations(list(range(N - 1))))[:B]
    slots = [(s, -1, N - 1)[kind] for s, kind in zip(slots, kinds)]
    layout = draw(st.sampled_from(["lazy", "eager"]))
    return dict(B=B, T=T, N=N, H=draw(st.integers(1, 3)), K=draw(st.sampled_from([2, 3, 5, 8, 12])),
                V=draw(st.sampled_from([1, 3, 7, 12])), gdn=draw(st.booleans()), parents=parents, slots=slots,
                norm=draw(st.sampled_from(["rsqrt", "sqrt_div"])), dtype=draw(st.sampled_from([F32, F64])),
                layout=layout, pending=0 if layout == "eager" else draw(st.sampled_from([0, 0, 1, 3])),
                start=draw(st.integers(0, 15)), seed=draw(st.integers(0, 2**31 - 1)),
                rows=draw(st.permutations(list(range(B)))),
                gate_scale=draw(st.sampled_from([1.0, 1.0, 1.0, 30.0])),  # 30: often past the factored range
                spare=draw(st.sampled_from([0, 0, 2])),
                states=draw(st.sampled_from([True, True, False])))  # False: outputs and records only (replay)


def inputs(c: dict, gen: torch.Generator) -> dict:
    """Raw verify inputs drawn in fp64 and cast: q, k `[B, T, H, K]`, v `[B, T, H, V]`, g, beta, checkpoints."""
    B, T, H, K, V, N, dt = c["B"], c["T"], c["H"], c["K"], c["V"], c["N"], c["dtype"]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64).to(dt)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=F64).to(dt)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V),
                g=-c.get("gate_scale", 1.0) * u(*((B, T, H) if c["gdn"] else (B, T, H, K))),
                beta=0.05 + 0.9 * u(B, T, H),
                ssm=r(N, H, K, V))


def run(verify, c: dict, x: dict, *, L: int = 16, ring_seed: int = 5):
    """One verify into NaN-filled rings / node buffer. Lazy layout: rings per slot from `start`, random pending
    records (the same for every verify); eager layout: rings per running row `c["rows"][b]`, no d and k.
    -> (o, node states [B + 1, T, H, K, V], ring tuple, ring before)."""
    B, T, H, K, V, N, dt = c["B"], c["T"], c["H"], c["K"], c["V"], c["N"], c["dtype"]
    gen = torch.Generator().manual_seed(ring_seed)
    eager = c.get("layout") == "eager"
    n_rows = B if eager else N
    ring = tuple(torch.full((n_rows, H, L, d), float("nan"), dtype=dt) for d in (V, K, 1 if c["gdn"] else K, V, K))
    ring += (torch.full((n_rows, H, L), float("nan"), dtype=dt),)
    start = torch.full((N,), c["start"], dtype=torch.long)
    m = c["pending"]
    if m:  # pending (d, k, g) records before the new tokens: the start state is their fast rebuild
        for s in range(N):
            pos = (start[s] + torch.arange(m)) % L
            ring[0][s][:, pos] = torch.randn(H, m, V, generator=gen, dtype=F64).to(dt)
            kk = torch.randn(H, m, K, generator=gen, dtype=F64)
            ring[1][s][:, pos] = (kk / kk.norm(dim=-1, keepdim=True)).to(dt)
            ring[2][s][:, pos] = -c.get("gate_scale", 1.0) * torch.rand(H, m, ring[2].shape[-1], generator=gen,
                                                                         dtype=F64).to(dt)
    if eager:
        ring = (None, None) + ring[2:]
        kw = dict(ring_indices=torch.tensor(c["rows"]))
    else:
        kw = dict(ring_start=start, num_pending=torch.full((N,), m, dtype=torch.long) if m else None)
    before = tuple(None if r is None else r.clone() for r in ring)
    inter = torch.full((B + 1, T + c.get("spare", 0), H, K, V), float("nan"), dtype=dt)  # spare: a deeper buffer
    parent = None if c["parents"] is None else torch.tensor(c["parents"])
    o = verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm"], torch.tensor(c["slots"]), parent=parent,
               intermediate_states=inter if c.get("states", True) else None, ring=ring, norm=c["norm"],
               null_slot=c["N"] - 1, **kw)
    return o, inter, ring, before


def compare(c: dict, x: dict, got, want) -> None:
    """Chunk results `got` against the per-token results `want` (both from `run`)."""
    (o, inter, ring, before), (o_ref, inter_ref, ring_ref, _) = got, want
    dt = c["dtype"]
    assert_close(o, o_ref, dtype=dt, msg="outputs")
    valid = [b for b, s in enumerate(c["slots"]) if s not in (-1, c["N"] - 1)]
    for b in range(c["B"]):
        if b not in valid:
            assert_close(o[b], torch.zeros_like(o[b]), exact=True, msg=f"skipped row {b} output")
    T = c["T"]
    if c.get("states", True):
        assert_close(inter[valid, :T], inter_ref[valid, :T], dtype=dt, msg="node states")
    skipped = [b for b in range(c["B"] + 1) if b not in valid]
    assert bool(inter[skipped].isnan().all()), "node states of a skipped row were written"
    assert bool(inter[:, T:].isnan().all()), "node states past T were written"
    for name, r, r_ref, r0 in zip(RECORDS, ring, ring_ref, before):
        if r is None:  # eager layout: no d, k rings
            continue
        written = ~(r_ref.isnan()) & r0.isnan()  # what the per-token verify wrote
        if name == "d":
            assert_close(r[written], r_ref[written], dtype=dt, msg="ring d")
        else:  # the inputs themselves: bit for bit
            assert_close(r, r_ref, exact=True, msg=f"ring {name}")
        assert_close(r[~written], r0[~written], exact=True, msg=f"ring {name} outside the new records")


@settings(max_examples=150, deadline=None)
@given(c=cases())
# nine tokens of strong KDA gates: path sums near -190, whose differences fp32 sums give only to ~2e-5 (found by a
# randomized run; the path sums are fp64 since)
@example(c=dict(B=2, T=9, N=4, H=1, K=2, V=7, gdn=False, parents=None, slots=[0, 1], norm="rsqrt", dtype=F32,
                layout="lazy", pending=0, start=0, seed=2151, rows=[0, 1], gate_scale=30.0, spare=0))
# the same without node states: the heads past fp32's factored range take fp64 factors
@example(c=dict(B=2, T=9, N=4, H=1, K=2, V=7, gdn=False, parents=None, slots=[0, 1], norm="rsqrt", dtype=F32,
                layout="lazy", pending=0, start=0, seed=2151, rows=[0, 1], gate_scale=30.0, spare=0, states=False))
def test_chunk_equals_per_token_recurrence(c):
    x = inputs(c, torch.Generator().manual_seed(c["seed"]))
    ssm_before = x["ssm"].clone()
    got = run(chunk_verify, c, x)
    assert_close(x["ssm"], ssm_before, exact=True, msg="checkpoints are read only")
    compare(c, x, got, run(naive_verify, c, x))


@settings(max_examples=15, deadline=None)
@given(T=st.integers(2, 9), gdn=st.booleans(), dtype=st.sampled_from([F32, F64]), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_tree_node_equals_its_own_chain(T, gdn, dtype, seed, data):
    """Each tree node's output and state are those of the chain of its root path, run through
    `recurrent_delta_rule` (plain decode, not the verify)."""
    parent = [-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, T)]
    c = dict(B=1, T=T, N=2, H=2, K=5, V=3, gdn=gdn, dtype=dtype)
    x = inputs(c, torch.Generator().manual_seed(seed))
    inter = torch.zeros(1, T, 2, 5, 3, dtype=dtype)
    o = chunk_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm"], torch.tensor([1]),
                     parent=torch.tensor(parent), intermediate_states=inter)
    for node in range(T):
        p = root_path(parent, node)
        o_ref, S_ref = recurrent_delta_rule(*(x[n][:, p] for n in ("q", "k", "v", "g", "beta")),
                                            initial_state=x["ssm"][1:2])
        assert_close(o[0, node], o_ref[0, -1], dtype=dtype, msg=f"node {node} output")
        assert_close(inter[0, node], S_ref[0], dtype=dtype, msg=f"node {node} state")


@pytest.mark.parametrize("what", ["v", "g", "parent"])
def test_teeth_one_corrupted_input_fails(what):
    """The comparison has teeth: one element of one node's input changed by 1e-4 (or one parent moved) in the
    chunk verify's input, and outputs, records or node states no longer agree."""
    c = dict(B=2, T=6, N=4, H=2, K=5, V=3, gdn=False, parents=[[-1, 0, 0, 1, 2, -1]] * 2, slots=[2, 0],
             norm="rsqrt", dtype=F64, pending=0, start=3)
    x = inputs(c, torch.Generator().manual_seed(11))
    want = run(naive_verify, c, x)
    compare(c, x, run(chunk_verify, c, x), want)  # untouched: equal
    bad = {n: t.clone() for n, t in x.items()}
    cb = dict(c)
    if what == "parent":
        cb["parents"] = [[-1, 0, 0, 1, 1, -1], c["parents"][1]]
    else:
        bad[what][1, 3, 0, 0] *= 1 + 1e-4
    with pytest.raises(AssertionError):
        compare(c, x, run(chunk_verify, cb, bad), want)


@settings(max_examples=20, deadline=None)
@given(T1=st.integers(2, 8), T2=st.integers(1, 8), gdn=st.booleans(), dtype=st.sampled_from([F32, F64]),
       seed=st.integers(0, 2**31 - 1))
def test_rebuild_from_chunk_records_reproduces_the_states(T1, T2, gdn, dtype, seed):
    """Lazy commit: the `d`, `k` records a chunk verify writes, rebuilt into the start state of the next verify,
    give plain decode's outputs over both windows, and the rebuilt state is plain decode's state."""
    c = dict(B=2, T=T1 + T2, N=3, H=2, K=5, V=3, gdn=gdn, dtype=dtype)
    x = inputs(c, torch.Generator().manual_seed(seed))
    L, H, K, V, N = 16, 2, 5, 3, 3
    ring = tuple(torch.zeros(N, H, L, d, dtype=dtype) for d in (V, K, 1 if gdn else K, V, K))
    ring += (torch.zeros(N, H, L, dtype=dtype),)
    start, idx = torch.tensor([14, 3, 9]), torch.tensor([2, 0])
    first, second = slice(0, T1), slice(T1, T1 + T2)
    part = lambda sl: [x[n][:, sl] for n in ("q", "k", "v", "g", "beta")]  # noqa: E731
    chunk_verify(*part(first), x["ssm"], idx, ring=ring, ring_start=start)
    pending = torch.zeros(N, dtype=torch.long)
    pending[idx] = T1
    o2 = chunk_verify(*part(second), x["ssm"], idx, ring=ring, ring_start=start, num_pending=pending)
    o_ref, _ = recurrent_delta_rule(*part(slice(0, T1 + T2)), initial_state=x["ssm"][idx])
    assert_close(o2, o_ref[:, second], dtype=dtype, msg="outputs after the rebuild")
    _, S1 = recurrent_delta_rule(*part(first), initial_state=x["ssm"][idx])
    assert_close(fast_rebuild(x["ssm"], idx, ring[0], ring[1], ring[2], start, pending[idx]), S1, dtype=dtype,
                 msg="rebuilt state")


def test_one_token_is_the_fold_step_bit_for_bit():
    """T = 1 (a decode step) runs `delta_step`, the step of the exact fold: bitwise the per-token verify."""
    for gdn in (False, True):
        c = dict(B=3, T=1, N=5, H=2, K=7, V=5, gdn=gdn, parents=None, slots=[3, -1, 0], norm="sqrt_div", dtype=F32,
                 pending=0, start=15)
        x = inputs(c, torch.Generator().manual_seed(2))
        (o, inter, ring, _), (o_ref, inter_ref, ring_ref, _) = run(chunk_verify, c, x), run(naive_verify, c, x)
        assert_close(o, o_ref, exact=True, msg="o")
        assert_close(inter, inter_ref, exact=True, msg="state")
        for name, r, r_ref in zip(RECORDS, ring, ring_ref):
            assert_close(r, r_ref, exact=True, msg=name)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("strength, terms", [(6.0, ["fp32"]), (30.0, ["fp32", "fp64"]),
                                             (150.0, ["fp32", "fp64", "pairwise"])])
@pytest.mark.parametrize("states", [True, False])
def test_strong_gates_stay_finite_and_accurate(tree, strength, terms, states, monkeypatch):
    """Log-decays of -strength..-(strength + 1) per token, up to 9 tokens deep: fp32 factors (up to e^+-26 each at
    -6), past their range fp64 factors (for the strong heads' A and P, or every head's when node states are asked
    for), past those too (-150: a range past 700 within 6 tokens) the pairwise decays; nothing overflows, and fp32
    stays within the fp32 tolerance of the fp64 recurrence."""
    import specdec.kernels.chunk.naive as chunk_naive
    import specdec.kernels.verify.chunk as chunk_mod
    calls = []

    def factored(*a, f=chunk_naive.factored_terms):
        calls.append({torch.float32: "fp32", torch.float64: "fp64"}[a[0].dtype])
        return f(*a)

    monkeypatch.setattr(chunk_mod, "factored_terms", factored)
    monkeypatch.setattr(chunk_naive, "factored_terms", factored)
    monkeypatch.setattr(chunk_naive, "_pairwise_terms", lambda *a, f=chunk_naive._pairwise_terms:
                        calls.append("pairwise") or f(*a))
    T = 9
    parent = [-1, 0, 1, 1, 2, 4, -1, 6, 5] if tree else list(range(-1, T - 1))
    c = dict(B=1, T=T, N=2, H=2, K=8, V=4, gdn=False, dtype=F64)
    x = inputs(c, torch.Generator().manual_seed(4))
    x["g"] = x["g"] - strength
    inter = torch.zeros(1, T, 2, 8, 4) if states else None
    o = chunk_verify(*(x[n].float() for n in ("q", "k", "v", "g", "beta", "ssm")), torch.tensor([0]),
                     parent=torch.tensor(parent) if tree else None, intermediate_states=inter)
    assert calls == terms
    assert bool(o.isfinite().all())
    inter_ref = torch.zeros(1, T, 2, 8, 4, dtype=F64)
    o_ref = naive_verify(*(x[n] for n in ("q", "k", "v", "g", "beta", "ssm")), torch.tensor([0]),
                         parent=torch.tensor(parent), intermediate_states=inter_ref)
    assert_close(o, o_ref.float(), dtype=F32, msg="o")
    if states:
        assert bool(inter.isfinite().all())
        assert_close(inter, inter_ref.float(), dtype=F32, msg="states")


def test_bad_input_raises_before_anything_is_written():
    """One error naming the argument before anything is written; no tokens is not an error (an empty output)."""
    c = dict(B=1, T=3, N=2, H=1, K=3, V=2, gdn=True, dtype=F32)
    x = inputs(c, torch.Generator().manual_seed(0))
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "ssm")] + [torch.tensor([0])]
    ring = tuple(torch.zeros(2, 1, 4, d) for d in (2, 3, 1, 2, 3)) + (torch.zeros(2, 1, 4),)
    inter = torch.zeros(1, 3, 1, 3, 2)
    ok = dict(intermediate_states=inter, ring=ring, ring_start=torch.zeros(2, dtype=torch.long))
    for bad, arg in ((dict(parent=torch.tensor([-1, 1, 0])), "parent"),
                     (dict(intermediate_states=torch.zeros(1, 3, 1, 3, 3)), "intermediate_states"),
                     (dict(ssm_state_indices=None), "ssm_state_indices"),
                     (dict(ring_indices=torch.tensor([0, 1])), "ring_indices"),
                     (dict(ring=tuple(r[:, :, :2] for r in ring)), "ring of depth")):
        call = list(args)
        if "ssm_state_indices" in bad:
            call[-1], bad = torch.tensor([0, 1]), {}
        with pytest.raises(ValueError, match=arg):
            chunk_verify(*call, **{**ok, **bad})
        assert bool((inter == 0).all()) and all(bool((r == 0).all()) for r in ring), f"{arg}: written"
    with pytest.raises(ValueError, match="q"):
        chunk_verify(x["q"][:, :2], *args[1:])
    for verify in (chunk_verify, naive_verify):  # no tokens: an empty output, nothing written (as the Triton kernel)
        o = verify(*(a[:, :0] for a in args[:5]), *args[5:], **ok)
        assert o.shape == (1, 0, 1, 2)
        assert bool((inter == 0).all()) and all(bool((r == 0).all()) for r in ring), "no tokens: written"


def test_dispatch_serves_the_chunk_form_off_the_gpu(monkeypatch):
    monkeypatch.delenv("SPECDEC_FORCE_TRITON", raising=False)
    for dt in (F32, F64):
        assert dispatch.pick("verify_delta_rule", torch.zeros(2, dtype=dt)) is chunk_verify


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 40), data=st.data())
def test_ancestor_mask_equals_a_walk_over_the_parents(B, T, data):
    parent = [[-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, T)] for _ in range(B)]
    got = ancestor_mask(torch.tensor(parent))
    want = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            want[b, t, root_path(parent[b], t)] = True
    assert got.dtype == torch.bool and torch.equal(got, want)
    chain = ancestor_mask(torch.arange(-1, T - 1)[None])
    assert torch.equal(chain[0], torch.ones(T, T, dtype=torch.bool).tril())
