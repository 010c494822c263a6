"""The exactness contract (docs/EXACTNESS.md): on one backend, the exact fold of n accepted records gives bit for bit
the state of n single-token verify steps from the same checkpoint.

Both backends are checked, each against itself: the torch reference, and the Triton kernels (in the
interpreter on CPU, compiled on a GPU). Hypothesis draws shapes (K, V not powers of two), the delta rule with
KDA (log-decay records, or Kimi's gate computed from its input records) and GDN gates and the Mamba2 rule, both norms, fp32 and bf16 activations, chains and trees (with second
roots), and eager and lazy commit (lazy: records of an earlier verify still pending, the fold replays them first).
The ring positions wrap.

A single step is a one-token verify, which on either backend is the fold's own step. The node states of a
T-token verify are the same steps in the Triton kernel (bitwise), but the torch verify of the delta rule is the
chunk form (`kernels/verify/chunk.py`), the recurrence in another op order: there they are held to the fp32
tolerance (the torch verify of the Mamba2 rule is the recurrence: bitwise).
"""

from __future__ import annotations

import os

import pytest
import torch
from assertions import assert_close, root_path
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kernels import dispatch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.triton)]
F32, BF16 = torch.float32, torch.bfloat16


def ops(backend: str, rule: str = "delta"):
    """(verify, fold) of `backend` for `rule`, each taking `rule=` (the torch verify of the Mamba2 rule is
    the recurrence, dispatch's `MAMBA2_REFS`)."""
    if backend == "triton":
        return dispatch.triton_impl("verify_delta_rule"), dispatch.triton_impl("exact_fold")
    verify = dispatch.MAMBA2_REFS["verify_delta_rule"] if rule == "mamba2" else dispatch.reference_impl(
        "verify_delta_rule")
    if rule == "delta":  # the chunk form takes no rule
        return (lambda *a, rule="delta", **kw: verify(*a, **kw)), dispatch.reference_impl("exact_fold")
    return verify, dispatch.reference_impl("exact_fold")


def device_of(backend: str, request) -> str:
    """The Triton kernels take tensors on conftest's `triton_device` (session-scoped, so hypothesis accepts it);
    the torch reference runs on CPU."""
    return request.getfixturevalue("triton_device") if backend == "triton" else "cpu"


# The drawn step families, one test each (they spread over workers: on a GPU each example compiles new variants)
FAMILIES = {"kda": dict(rule="delta", gdn=False, gate_in=False), "gdn": dict(rule="delta", gdn=True, gate_in=False),
            "kimi-gate": dict(rule="delta", gdn=False, gate_in=True), "mamba2": dict(rule="mamba2", gdn=True,
                                                                                       gate_in=False)}


@st.composite
def cases(draw, family: str):
    K, V, H = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    tree = draw(st.booleans())
    parent = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)] if tree else None
    pending = draw(st.integers(1, 4)) if draw(st.booleans()) else 0
    L = 1 << max(1, (2 * (pending + T) - 1).bit_length())
    if parent is None:
        path = list(range(draw(st.integers(1, T))))
    else:  # the accepted root-to-node path of a random node
        path = root_path(parent, draw(st.integers(0, T - 1)))
    return dict(K=K, V=V, H=H, T=T, parent=parent, pending=pending, L=L, path=path,
                start=draw(st.integers(0, L - 1)), **FAMILIES[family],
                norm=draw(st.sampled_from(["rsqrt", "sqrt_div"])), act=draw(st.sampled_from([F32, BF16])),
                seed=draw(st.integers(0, 2**16)))


def tokens(g, T, H, K, V, gdn, act, dev, rule="delta", gate_in=False):
    """Raw verify inputs of T tokens for one request: q, k `[1, T, H, K]`, v, gate, beta (Mamba2: C, B, x,
    g = dt A per head, dt; `gate_in`: the gate is Kimi's gate input f, in act dtype)."""
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    q, k, v = r(1, T, H, K).to(act), r(1, T, H, K).to(act), r(1, T, H, V).to(act)
    if rule == "mamba2":
        dt = (0.05 + 0.9 * torch.rand(1, T, H, generator=g)).to(dev)
        return q, k, v, dt * -(0.2 + torch.rand(H, generator=g)).to(dev), dt
    gate = -torch.rand(*((1, T, H) if gdn else (1, T, H, K)), generator=g).to(dev) * 0.7
    if gate_in:
        gate = (2 * torch.randn(1, T, H, K, generator=g) - 1).to(act).to(dev)
    beta = 0.05 + 0.9 * torch.rand(1, T, H, generator=g).to(dev)
    return q, k, v, gate, beta


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6 if INTERPRET else 20)
@given(data=st.data())
def test_fold_equals_single_steps(backend, family, request, data):
    c = data.draw(cases(family))
    rule = c["rule"]
    verify, fold = ops(backend, rule)
    dev = device_of(backend, request)
    K, V, H, T, L, act, norm = c["K"], c["V"], c["H"], c["T"], c["L"], c["act"], c["norm"]
    gdn = c["gdn"] or rule == "mamba2"  # a Mamba2 head's decay is one scalar
    gate_in = c["gate_in"] and not gdn and K > 1
    g = torch.Generator().manual_seed(c["seed"])
    N, slot = 3, 1
    S0 = torch.randn(N, H, K, V, generator=g).to(dev)
    gk = 1 if gdn else K
    ring = tuple(torch.full((N, H, L, d), float("nan"), dtype=dt, device=dev)
                 for d, dt in ((V, act), (K, act), (gk, act if gate_in else F32), (V, act), (K, act)))
    ring = ring + (torch.full((N, H, L), float("nan"), device=dev),)
    start = torch.full((N,), c["start"], dtype=torch.long, device=dev)
    idx = torch.tensor([slot], device=dev)
    gate = {}
    if gate_in:  # Kimi's gate from its input: A_log [H], dt_bias [H, K] (the fold takes them per layer)
        gate = dict(A_log=(torch.randn(H, generator=g) - 1).to(dev), dt_bias=torch.randn(H, K, generator=g).to(dev))
    kw = dict(ring=ring, ring_start=start, norm=norm, rule=rule, **gate)
    m = c["pending"]
    pend = tokens(g, m, H, K, V, gdn, act, dev, rule, gate_in) if m else None
    if m:  # lazy: an earlier round's accepted records, written into the ring and not folded yet
        verify(*pend, S0, idx, num_pending=torch.zeros(N, dtype=torch.long, device=dev), **kw)
    new = tokens(g, T, H, K, V, gdn, act, dev, rule, gate_in)
    inter = torch.full((1, T, H, K, V), float("nan"), device=dev)
    parent = None if c["parent"] is None else torch.tensor(c["parent"], device=dev)
    verify(*new, S0, idx, parent=parent, intermediate_states=inter,
           num_pending=torch.full((N,), m, dtype=torch.long, device=dev), **kw)

    path = c["path"]
    offsets = torch.tensor([list(range(m)) + [m + p for p in path]], device=dev)
    state = S0.clone()[None]
    fold(state, ring[3][None], ring[4][None], ring[2][None], ring[5][None], idx, start,
         torch.tensor([m + len(path)], device=dev), offsets=offsets, norm=norm, rule=rule,
         **{name: t[None] for name, t in gate.items()})

    # the oracle: one verify step per token from the checkpoint, each step's state read back in fp32
    steps = [tuple(t[:, j:j + 1] for t in pend) for j in range(m)] + [tuple(t[:, j:j + 1] for t in new) for j in path]
    cur = S0[slot:slot + 1].clone()
    for tok in steps:
        out = torch.full((1, 1, H, K, V), float("nan"), device=dev)
        verify(*tok, cur, torch.tensor([0], device=dev), intermediate_states=out, norm=norm, rule=rule, **gate)
        cur = out[:, 0]
    assert torch.equal(state[0, slot], cur[0]), (
        f"fold differs from {len(steps)} single steps: max abs {(state[0, slot] - cur[0]).abs().max().item():.3e}")
    if m == 0 and (backend == "triton" or rule == "mamba2"):  # eager: the round's node state, bit for bit
        assert torch.equal(inter[0, path[-1]], cur[0]), "node state differs from single steps"
    elif m == 0:  # the chunk form: the same state in another op order
        assert_close(inter[0, path[-1]], cur[0], dtype=F32, msg="node state vs single steps")
    others = [s for s in range(N) if s != slot]
    assert torch.equal(state[0, others], S0[others]), "a foreign slot was written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_teeth_one_corrupted_record_breaks_equality(backend, request):
    """The equality above is not vacuous: a few ulps in one element of one ring record (one ulp can vanish in
    the key's normalization) and the fold no longer matches the single steps."""
    verify, fold = ops(backend)
    dev = device_of(backend, request)
    g = torch.Generator().manual_seed(3)
    H, K, V, T, L = 2, 5, 6, 4, 8
    S0 = torch.randn(1, H, K, V, generator=g).to(dev)
    ring = tuple(torch.zeros(1, H, L, d, device=dev) for d in (V, K, K, V, K)) + (torch.zeros(1, H, L, device=dev),)
    idx, start = torch.tensor([0], device=dev), torch.zeros(1, dtype=torch.long, device=dev)
    toks = tokens(g, T, H, K, V, False, F32, dev)
    verify(*toks, S0, idx, ring=ring, ring_start=start)
    cur = S0.clone()
    for j in range(T):  # the oracle: one-token verifies
        out = torch.zeros(1, 1, H, K, V, device=dev)
        verify(*(t[:, j:j + 1] for t in toks), cur, idx, intermediate_states=out)
        cur = out[:, 0]
    for corrupt in (False, True):
        if corrupt:
            ring[4][0, 1, 2, 3] *= 1 + 2 ** -20
        state = S0.clone()[None]
        fold(state, ring[3][None], ring[4][None], ring[2][None], ring[5][None], idx, start,
             torch.tensor([T], device=dev))
        assert torch.equal(state[0, 0], cur[0]) != corrupt


@st.composite
def batches(draw):
    """Several requests folded in one call: distinct slots in any order (a null-slot row and rows with nothing
    to fold among them), own ring rows or shared ones, ring starts that wrap, chain or tree offsets, the KDA
    gate as records or from its input, and the interval snapshots of the lazy layout."""
    Lyr, H, K, V = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    N, L = 6, 8
    B = draw(st.integers(1, 5))
    slots = draw(st.permutations(list(range(N - 1))))[:B]  # slot N - 1 is the null slot
    if draw(st.booleans()):
        slots[draw(st.integers(0, B - 1))] = N - 1
    n = [draw(st.integers(0, 5)) for _ in range(B)]
    tree = draw(st.booleans())
    offsets = [draw(st.permutations(list(range(L))))[:5] for _ in range(B)] if tree else None
    return dict(Lyr=Lyr, H=H, K=K, V=V, N=N, L=L, slots=slots, n=n, offsets=offsets,
                ring_rows=draw(st.permutations(list(range(N)))) if draw(st.booleans()) else None,
                start=[draw(st.integers(0, L - 1)) for _ in range(N)], gate_in=draw(st.booleans()) and K > 1,
                interval=draw(st.sampled_from([None, 2, 3])), seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15 if INTERPRET else 60, deadline=None)
@given(c=batches())
def test_fold_rows_together_equal_one_by_one(backend, request, c):
    """One fold call over many rows == the same rows folded one call each (each of which is n single steps,
    above), bit for bit: checkpoints and interval snapshots; the null-slot row and foreign slots untouched.
    The Triton kernel folds the rows in parallel programs, the torch reference one after the other."""
    _, fold = ops(backend)
    dev = device_of(backend, request)
    g = torch.Generator().manual_seed(c["seed"])
    Lyr, H, K, V, N, L = c["Lyr"], c["H"], c["K"], c["V"], c["N"], c["L"]
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    rawv, rawk = r(Lyr, N, H, L, V), r(Lyr, N, H, L, K)
    gate = (2 * r(Lyr, N, H, L, K) - 1) if c["gate_in"] else -torch.rand(Lyr, N, H, L, K, generator=g).to(dev)
    beta = (0.05 + 0.9 * torch.rand(Lyr, N, H, L, generator=g)).to(dev)
    kw = dict(A_log=r(Lyr, H) - 1, dt_bias=r(Lyr, H, K)) if c["gate_in"] else {}
    S0, snaps0 = r(Lyr, N, H, K, V), r(Lyr, N, 2, H, K, V)
    seq = torch.randint(0, 7, (N,), generator=g).to(dev)
    start = torch.tensor(c["start"], device=dev)
    B = len(c["slots"])
    rows = list(range(B))

    def run(sel, state, snaps):
        state, snaps = state.clone(), snaps.clone()
        idx = torch.tensor([c["slots"][b] for b in sel], device=dev)
        extra = dict(kw, null_slot=N - 1)
        if c["offsets"] is not None:
            extra["offsets"] = torch.tensor([c["offsets"][b] for b in sel], device=dev)
        if c["ring_rows"] is not None:
            extra["ring_indices"] = torch.tensor([c["ring_rows"][b] for b in sel], device=dev)
        if c["interval"] is not None:
            extra.update(seq_lens=seq, track_interval=c["interval"], track_states=snaps)
        fold(state, rawv, rawk, gate, beta, idx, start, torch.tensor([c["n"][b] for b in sel], device=dev), **extra)
        return state, snaps

    together = run(rows, S0, snaps0)
    state, snaps = S0, snaps0
    for b in rows:  # one row at a time, each call on the previous one's result
        state, snaps = run([b], state, snaps)
    assert torch.equal(together[0], state), "rows folded together differ from one by one"
    assert torch.equal(together[1], snaps), "interval snapshots differ"
    untouched = [s for s in range(N) if s not in c["slots"] or s == N - 1 or
                 c["n"][c["slots"].index(s)] == 0]
    assert torch.equal(together[0][:, untouched], S0[:, untouched]), "a slot with nothing to fold was written"
