"""kernels.chunk_delta_rule (the chunked training / prefill path) against the token-by-token recurrence, and
transformers' models run with it against their own forward."""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close, max_rel_err
from hypothesis import example, given
from hypothesis import strategies as st
from tiny_models import FAMILIES, float64_everywhere, tiny_model, torch_fallbacks

from specdec.kernels.chunk import chunk_delta_rule
from specdec.kernels.recurrent import recurrent_delta_rule
from specdec.hf_compat import CHUNK_FNS

F32, F64 = torch.float32, torch.float64


def _inputs(seed, B, T, H, K, V, *, gdn, dtype, gate_scale=1.0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=F64)  # noqa: E731
    xs = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), -gate_scale * u(*((B, T, H) if gdn else (B, T, H, K))),
          0.05 + 0.9 * u(B, T, H), r(B, H, K, V)]
    return [x.to(dtype).requires_grad_(requires_grad) for x in xs]


@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), T=st.integers(1, 40), H=st.sampled_from([1, 3]),
       K=st.sampled_from([3, 5, 8]), V=st.sampled_from([2, 7]), C=st.sampled_from([1, 3, 8, 16, 64]),
       gdn=st.booleans(), dtype=st.sampled_from([F32, F64]), norm=st.sampled_from(["rsqrt", "sqrt_div"]),
       start=st.booleans())
# single tokens whose query is nearly orthogonal to the key (q.k ~ 2e-3): the output is a cancellation, off by
# ~eps / |q.k| in any fp32 op order (the fp32 recurrence's too: 1e-5 to 2.5e-5 of the tensor's scale), found by
# randomized runs when fp32 was held against the fp32 recurrence
@example(seed=91740933, B=1, T=1, H=1, K=3, V=2, C=1, gdn=False, dtype=F32, norm="rsqrt", start=False)
@example(seed=67, B=1, T=1, H=1, K=8, V=7, C=1, gdn=True, dtype=F32, norm="rsqrt", start=False)
@example(seed=20439, B=1, T=1, H=1, K=3, V=2, C=1, gdn=False, dtype=F32, norm="rsqrt", start=False)
def test_chunk_equals_recurrence(seed, B, T, H, K, V, C, gdn, dtype, norm, start):
    q, k, v, g, beta, S0 = _inputs(seed, B, T, H, K, V, gdn=gdn, dtype=dtype)
    S0 = S0 if start else None
    o, S = chunk_delta_rule(q, k, v, g, beta, initial_state=S0, norm=norm, chunk_size=C)
    assert o.dtype == v.dtype and S.dtype == (F64 if dtype == F64 else F32)
    if dtype == F64:  # a different op order: 1e-12 of each tensor's scale
        o_ref, S_ref = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, norm=norm)
        assert max_rel_err(o, o_ref) < 1e-12 and max_rel_err(S, S_ref) < 1e-12
    else:  # fp32 against a float64 recomputation, element by element at fp32 tolerance
        o_ref, S_ref = recurrent_delta_rule(*(x.double() for x in (q, k, v, g, beta)), norm=norm,
                                            initial_state=None if S0 is None else S0.double())
        assert_close(o, o_ref, dtype=F32, msg="o")
        assert_close(S, S_ref, dtype=F32, msg="S")


@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("B,T", [(2, 0), (0, 5)])
def test_no_tokens(start, B, T):
    """No tokens (T = 0) or no rows (B = 0): empty outputs and the start state, as the recurrence gives them; the
    state a copy, never the caller's tensor."""
    q, k, v, g, beta, S0 = _inputs(4, B, T, 3, 5, 4, gdn=False, dtype=F32)
    S0 = S0 if start else None
    o, S = chunk_delta_rule(q, k, v, g, beta, initial_state=S0, chunk_size=16)
    o_ref, S_ref = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0)
    assert o.shape == o_ref.shape == (B, T, 3, 4) and o.dtype == v.dtype
    assert_close(S, S_ref, exact=True)
    assert S0 is None or S0.numel() == 0 or S.data_ptr() != S0.data_ptr()


@pytest.mark.parametrize("C", [8, 64])
def test_strong_gates_do_not_overflow_or_cancel(C):
    """Per-token log-decays down to -60 (cumulated ~-2000 over a chunk): every exponent stays a decay, and the
    differences of cumulated gates keep full fp32 precision (element-wise vs the fp64 recurrence)."""
    q, k, v, g, beta, S0 = _inputs(0, 2, 64, 2, 8, 4, gdn=False, dtype=F32, gate_scale=60.0)
    o_ref, S_ref = recurrent_delta_rule(*(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double())
    o, S = chunk_delta_rule(q, k, v, g, beta, initial_state=S0, chunk_size=C)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(o, o_ref, dtype=F32, msg="o")
    assert_close(S, S_ref, dtype=F32, msg="S")


@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), T=st.integers(1, 70), H=st.sampled_from([1, 3]),
       K=st.sampled_from([3, 8]), V=st.sampled_from([2, 7]), C=st.sampled_from([4, 8, 16, 32]),
       gate_scale=st.sampled_from([0.5, 6.0, 30.0, 180.0]), gdn=st.booleans(), start=st.booleans())
def test_every_gate_strength_equals_recurrence(seed, B, T, H, K, V, C, gate_scale, gdn, start):
    """Per-token log-decays from -0.5 to -180, so that chunks take fp32 factors, fp64 factors, the pairwise decays,
    or a mix: fp32 outputs and state element-wise within fp32 tolerance of the float64 recurrence."""
    q, k, v, g, beta, S0 = _inputs(seed, B, T, H, K, V, gdn=gdn, dtype=F32, gate_scale=gate_scale)
    S0 = S0 if start else None
    o, S = chunk_delta_rule(q, k, v, g, beta, initial_state=S0, chunk_size=C)
    o_ref, S_ref = recurrent_delta_rule(*(x.double() for x in (q, k, v, g, beta)),
                                        initial_state=None if S0 is None else S0.double())
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(o, o_ref, dtype=F32, msg="o")
    assert_close(S, S_ref, dtype=F32, msg="S")


@pytest.mark.parametrize("gates", ["mild", "strong", "extreme", "mixed"])
def test_factored_and_pairwise_decays(gates, monkeypatch):
    """Chunks of 16 with per-token log-decays down to -6 span up to ~60 per channel: fp32 factors
    (`factored_terms`, factors up to e^+-30) run there. Down to -30 (spans of ~200-300, past fp32's 80): fp64
    factors in those chunks (`_strong_terms`, fp64's range is 700). Down to -180 (spans past 700): the pairwise
    decays. Mixed: each chunk its own. All stay element-wise within the fp32 tolerance of the fp64 recurrence."""
    import specdec.kernels.chunk.naive as naive
    factored, pairwise = [], []  # (dtype, fits) per factored_terms call; chunks per pairwise call
    monkeypatch.setattr(naive, "factored_terms", lambda q, *a, f=naive.factored_terms: (
        lambda r: factored.append((q.dtype, r[-1])) or r)(f(q, *a)))
    monkeypatch.setattr(naive, "_pairwise_terms", lambda q, *a, f=naive._pairwise_terms: (
        pairwise.append(q.shape[0]) or f(q, *a)))
    q, k, v, g, beta, S0 = _inputs(1, 2, 48, 2, 8, 4, gdn=False, dtype=F32, gate_scale=6.0)
    g = g.clone()
    strong, extreme = torch.zeros(2, 2, 3, dtype=torch.bool), torch.zeros(2, 2, 3, dtype=torch.bool)  # [B, H, N]
    if gates in ("strong", "extreme"):
        g *= 5.0 if gates == "strong" else 30.0
        (strong if gates == "strong" else extreme)[:] = True
    elif gates == "mixed":  # the first row: its second chunk strong, its third extreme
        g[0, 16:32] *= 5.0
        g[0, 32:48] *= 30.0
        strong[0, :, 1] = extreme[0, :, 2] = True
    o_ref, S_ref = recurrent_delta_rule(*(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double())
    o, S = chunk_delta_rule(q, k, v, g, beta, initial_state=S0, chunk_size=16)
    misfit = strong | extreme
    by_chunk = lambda x: x.permute(2, 0, 1).reshape(-1)  # noqa: E731  [B, H, N] -> the [N, B, H] order, flat
    if not misfit.any():
        assert [(dt, f) for dt, f in factored] == [(F32, None)] and not pairwise
    else:
        (dt32, fits32), (dt64, fits64) = factored
        assert dt32 == F32 and dt64 == F64
        assert torch.equal(fits32.permute(1, 2, 0), ~misfit)  # fits32 [N, B, H]
        want64 = ~by_chunk(extreme)[by_chunk(misfit)]  # the fp64 call sees the fp32 misfits, in order
        assert (fits64 is None and want64.all()) or torch.equal(fits64, want64)
        assert pairwise == ([int(extreme.sum())] if extreme.any() else [])
    assert_close(o, o_ref, dtype=F32, msg="o")
    assert_close(S, S_ref, dtype=F32, msg="S")


@pytest.mark.parametrize("gdn", [False, True])
def test_gradients_equal_recurrence(gdn):
    """Autograd through the chunked form == autograd through the token loop (fp64)."""
    def grads(fn, **kw):
        xs = _inputs(3, 2, 13, 2, 5, 3, gdn=gdn, dtype=F64, requires_grad=True)
        o, S = fn(*xs[:5], initial_state=xs[5], **kw)
        w = torch.linspace(-1, 1, o.numel(), dtype=F64).view_as(o)
        ((o * w).sum() + (S * S).sum()).backward()
        return [x.grad for x in xs]
    for name, a, b in zip("q k v g beta S0".split(), grads(chunk_delta_rule, chunk_size=4), grads(recurrent_delta_rule)):
        assert_close(a, b, msg=name)


def test_bad_chunk_size_is_one_error():
    q, k, v, g, beta, _ = _inputs(0, 1, 4, 1, 3, 2, gdn=True, dtype=F32)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="beta"):
        chunk_delta_rule(q, k, v, g, beta[:, :2])


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_forward_and_backward_with_chunked_path(family):
    """The model's own forward (and gradients) with its chunked delta rule swapped == without (float64)."""
    model = tiny_model(family, seed=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))

    def run(chunked):
        model.zero_grad()
        with torch_fallbacks(chunked=chunked, chunk_size=8), float64_everywhere():
            logits = model(ids).logits
            logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    ref, ref_grads = run(False)
    out, out_grads = run(True)
    assert max_rel_err(out, ref) < 1e-10
    assert ref_grads.keys() == out_grads.keys() and ref_grads
    for n in ref_grads:
        assert max_rel_err(out_grads[n], ref_grads[n]) < 1e-9, n


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_swapped_function_matches_transformers_chunk(family, l2norm):
    """The swapped module function == transformers' pure-torch chunk function, with and without the in-kernel
    q/k L2 norm (without it the call goes to transformers' own code)."""
    import importlib
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = CHUNK_FNS[family][0]
    gdn = family != "kimi_linear"
    q, k, v, g, beta, S0 = _inputs(5, 2, 21, 2, 8, 6, gdn=gdn, dtype=F64)
    args = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    with torch_fallbacks(family), float64_everywhere():
        o_ref, S_ref = getattr(mod, name)(q, k, v, g, beta, **args)
    with torch_fallbacks(family, chunked=True), float64_everywhere():
        o, S = getattr(mod, name)(q, k, v, g, beta, **args)
    assert max_rel_err(o, o_ref) < 1e-10 and max_rel_err(S, S_ref) < 1e-10
