"""The torch references of kernels/ against independent implementations.

Oracles: fla's naive recurrences, transformers' pure-torch fallbacks (Kimi-Linear, Qwen3-Next, Qwen3.5),
and literal fp64 loops written here. Shapes are drawn by hypothesis (non-powers of two included);
tensors come from a seeded generator, drawn in fp64 and cast, so fp32 and fp64 cases share values.
"""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close, max_rel_err, root_path, tolerance
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdec.hf_compat import torch_fallbacks, torch_original
from specdec.kernels.common import l2norm
from specdec.kernels.fold import exact_fold
from specdec.kernels.rebuild import fast_rebuild
from specdec.kernels.recurrent import recurrent_delta_rule, short_conv
from specdec.kernels.scatter import masked_scatter
from specdec.kernels.verify import short_conv_verify, verify_delta_rule

F32, F64 = torch.float32, torch.float64

Hs = st.sampled_from([1, 2, 3])
Ks = st.sampled_from([2, 3, 5, 7, 8, 12])
Vs = st.sampled_from([1, 3, 5, 7, 12])
Ts = st.integers(1, 9)
Bs = st.integers(1, 3)
seeds = st.integers(0, 2**31 - 1)
dtypes = st.sampled_from([F32, F64])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=F32):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _rand(gen, *shape, lo=0.0, hi=1.0, dtype=F32):
    return (lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=F64)).to(dtype)


def _delta_inputs(gen, B, T, H, K, V, *, gdn: bool, dtype):
    """Raw q, k, v, log-decay g (KDA `[B,T,H,K]`, GDN `[B,T,H]`), beta, initial state."""
    q, k = _randn(gen, B, T, H, K, dtype=dtype), _randn(gen, B, T, H, K, dtype=dtype)
    v = _randn(gen, B, T, H, V, dtype=dtype)
    g = _rand(gen, *((B, T, H) if gdn else (B, T, H, K)), lo=-1.0, hi=0.0, dtype=dtype)
    beta = _rand(gen, B, T, H, lo=0.05, hi=0.95, dtype=dtype)
    S0 = _randn(gen, B, H, K, V, dtype=dtype)
    return q, k, v, g, beta, S0


def _near_exact(actual: torch.Tensor, expected: torch.Tensor, msg: str, ulps: int = 2) -> None:
    """Bitwise, or within `ulps` machine epsilons of the tensor's scale (same op order, other batching)."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if bool((actual == expected).all()):
        return
    eps = torch.finfo(expected.dtype).eps
    scale = expected.abs().max().clamp_min(1.0)
    err = (actual - expected).abs().max()
    assert err <= ulps * eps * scale, f"{msg}: max abs diff {err.item():.3e} > {ulps} eps * {scale.item():.3e}"


def _random_parents(gen, T: int) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(T)]


# ----------------------------------------------------------------------------------------------------------------
# 1. recurrent_delta_rule vs fla's naive recurrences
# ----------------------------------------------------------------------------------------------------------------

@settings(max_examples=30)
@given(B=Bs, T=Ts, H=Hs, K=Ks, V=Vs, gdn=st.booleans(), dtype=dtypes, seed=seeds,
       scale=st.one_of(st.none(), st.floats(0.25, 2.0)))
def test_recurrent_vs_fla_naive(B, T, H, K, V, gdn, dtype, seed, scale):
    kda_naive = pytest.importorskip("fla.ops.kda.naive")
    gdn_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta, S0 = _delta_inputs(_gen(seed), B, T, H, K, V, gdn=gdn, dtype=dtype)
    o, S = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, scale=scale)
    assert S.dtype == dtype
    # fla's naive takes normalized q/k, casts everything to fp32 and applies `scale` itself.
    qn, kn = l2norm(q.float()), l2norm(k.float())
    args = dict(q=qn, k=kn, v=v.float(), g=g.float(), beta=beta.float(), scale=scale,
                initial_state=S0.float().clone(), output_final_state=True)
    if gdn:
        o_ref, S_ref = gdn_naive.naive_recurrent_gated_delta_rule(**args)
    else:
        o_ref, S_ref = kda_naive.naive_recurrent_kda(**args)
    # Different op order (and fp32 oracle for fp64 runs): the fp32 entry of the table.
    assert_close(o, o_ref.to(dtype), dtype=F32, msg="o")
    assert_close(S, S_ref.to(dtype), dtype=F32, msg="S")


# ----------------------------------------------------------------------------------------------------------------
# 2. recurrent_delta_rule vs transformers' pure-torch recurrences (norm modes)
# ----------------------------------------------------------------------------------------------------------------

def _torch_fallback(fn):
    """transformers' pure-torch function behind a dispatching name (`specdec.hf_compat.torch_original`)."""
    orig = torch_original(fn)
    assert orig is not None, f"{fn!r}: no pure-torch original found behind it"
    return orig


def _kimi():
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _qwen_modules():
    mods = []
    for name in ("transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5"):
        mods.append(pytest.importorskip(name))
    return mods


def test_transformers_fallbacks_are_wrapped_torch_functions():
    """With fla installed the public names dispatch to fla (and, with the `kernels` package, through a function
    module): behind each sits the modeling module's own torch function, which `torch_fallbacks` puts in its place
    for the duration of the context and no longer."""
    mk = _kimi()
    names = [(mk, n) for n in ("recurrent_kimi_delta_attention", "causal_conv1d_update", "causal_conv1d_fn")]
    names += [(m, "torch_recurrent_gated_delta_rule") for m in _qwen_modules()]
    for mod, name in names:
        public = getattr(mod, name)
        torch_fn = _torch_fallback(public)
        assert torch_fn.__module__ == mod.__name__ and torch_fn.__name__ == name, (mod.__name__, name, torch_fn)
        assert torch_fn is not public
        with torch_fallbacks(mod.__name__.split(".")[-2]):
            assert getattr(mod, name) is torch_fn
        assert getattr(mod, name) is public
    assert torch_original(mk.l2norm) is None and torch_original(torch.nn.Linear(2, 2)) is None


def test_torch_fallbacks_restores_on_a_failed_swap_and_defaults_to_installed_families():
    """A family the installed transformers lacks fails the context before its body runs, with every swap made
    before it undone (a partly patched module would leak into later tests); the default is the families that are
    installed (the shared matrix's three at least; the others only where transformers lacks them are left out)."""
    import importlib

    from specdec.hf_compat import ALL_FAMILIES, FAMILIES, installed_families

    mk = _kimi()
    public = mk.recurrent_kimi_delta_attention
    with pytest.raises(ModuleNotFoundError):
        with torch_fallbacks("kimi_linear", "no_such_family"):
            pytest.fail("the body ran")
    assert mk.recurrent_kimi_delta_attention is public
    fams = installed_families()
    assert set(FAMILIES) <= set(fams) <= set(ALL_FAMILIES)
    for fam in set(ALL_FAMILIES) - set(fams):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    with torch_fallbacks():
        assert mk.recurrent_kimi_delta_attention is _torch_fallback(public)
    assert mk.recurrent_kimi_delta_attention is public


@settings(max_examples=20)
@given(B=Bs, T=Ts, H=Hs, K=Ks, V=Vs, seed=seeds)
def test_recurrent_sqrt_div_vs_transformers_kimi(B, T, H, K, V, seed):
    kimi = _torch_fallback(_kimi().recurrent_kimi_delta_attention)
    q, k, v, g, beta, S0 = _delta_inputs(_gen(seed), B, T, H, K, V, gdn=False, dtype=F32)
    o_ref, S_ref = kimi(q, k, v, g, beta, S0.clone(), True, use_qk_l2norm_in_kernel=True)
    # Same formula; our reductions are summed in fp64 and rounded once (order-free), transformers' in
    # fp32 torch order: equal up to fp32 rounding.
    o, S = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, norm="sqrt_div", scale=1 / (K ** 0.5))
    assert_close(S, S_ref, dtype=F32, msg="S")
    assert_close(o, o_ref, dtype=F32, msg="o")
    o_default, S_default = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, norm="sqrt_div")
    assert_close(S_default, S_ref, dtype=F32, msg="S (default scale)")
    assert_close(o_default, o_ref, dtype=F32, msg="o (default scale)")


@settings(max_examples=20)
@given(B=Bs, T=Ts, H=Hs, K=Ks, V=Vs, seed=seeds, which=st.sampled_from([0, 1]))
def test_recurrent_rsqrt_vs_transformers_qwen(B, T, H, K, V, seed, which):
    gdn_ref = _torch_fallback(_qwen_modules()[which].torch_recurrent_gated_delta_rule)
    q, k, v, g, beta, S0 = _delta_inputs(_gen(seed), B, T, H, K, V, gdn=True, dtype=F32)
    o_ref, S_ref = gdn_ref(q, k, v, g, beta, initial_state=S0.clone(), output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
    o, S = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, norm="rsqrt")
    # Order-free fp64 sums (ours) vs fp32 torch sums; Qwen divides q by sqrt(K) where we multiply by K**-0.5.
    assert_close(S, S_ref, dtype=F32, msg="S")
    assert_close(o, o_ref, dtype=F32, msg="o")


@pytest.mark.parametrize("family", ["kimi", "qwen3_next", "qwen3_5"])
def test_wrong_norm_formula_changes_state_bits(family):
    """Why `norm` matters: the other formula gives a different state, while the difference stays at fp32
    rounding level (~1e-7 relative over 64 tokens), so only bitwise tests (ours: kernel vs reference) see it."""
    B, T, H, K, V = 1, 64, 2, 12, 7
    q, k, v, g, beta, S0 = _delta_inputs(_gen(1234), B, T, H, K, V, gdn=family != "kimi", dtype=F32)
    if family == "kimi":
        ref = _torch_fallback(_kimi().recurrent_kimi_delta_attention)
        _, S_ref = ref(q, k, v, g, beta, S0.clone(), True, use_qk_l2norm_in_kernel=True)
        right, wrong = "sqrt_div", "rsqrt"
    else:
        mod = _qwen_modules()[0 if family == "qwen3_next" else 1]
        ref = _torch_fallback(mod.torch_recurrent_gated_delta_rule)
        _, S_ref = ref(q, k, v, g, beta, initial_state=S0.clone(), output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
        right, wrong = "rsqrt", "sqrt_div"
    _, S_right = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, norm=right)
    _, S_wrong = recurrent_delta_rule(q, k, v, g, beta, initial_state=S0, norm=wrong)
    assert_close(S_right, S_ref, dtype=F32, msg=f"S with norm={right!r}")
    assert bool((S_wrong != S_right).any()), f"norm={wrong!r} unexpectedly reproduced the state bitwise"
    assert max_rel_err(S_wrong, S_ref) < tolerance(F32)[0]


# ----------------------------------------------------------------------------------------------------------------
# 3. short_conv vs transformers' causal_conv1d_fn / causal_conv1d_update (window Kc vs Kc-1)
# ----------------------------------------------------------------------------------------------------------------

@settings(max_examples=25)
@given(B=Bs, T=Ts, T2=st.integers(1, 5), C=st.sampled_from([1, 3, 5, 12]), Kc=st.sampled_from([2, 3, 4]),
       bias=st.booleans(), dtype=dtypes, seed=seeds)
def test_short_conv_vs_transformers(B, T, T2, C, Kc, bias, dtype, seed):
    mk = _kimi()
    conv_fn, conv_update = _torch_fallback(mk.causal_conv1d_fn), _torch_fallback(mk.causal_conv1d_update)
    gen = _gen(seed)
    x, x2 = _randn(gen, B, T, C, dtype=dtype), _randn(gen, B, T2, C, dtype=dtype)
    w = _randn(gen, C, Kc, dtype=dtype)
    b = _randn(gen, C, dtype=dtype) if bias else None
    tol = dict(dtype=dtype)  # fp64: 1e-12 (F.conv1d vs a literal sum)

    # Prefill from zeros.
    y, window = short_conv(x, w, b, activation="silu")
    y_ref = conv_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    assert_close(y, y_ref, **tol, msg="prefill y")
    # transformers keeps the last Kc inputs (left-padded with zeros); ours the last Kc-1.
    tf_state = torch.cat([x.new_zeros(B, C, Kc), x.transpose(1, 2)], -1)[..., -Kc:].contiguous()
    assert_close(window, tf_state[..., 1:], exact=True, msg="prefill window")

    # Continue: token-by-token decode on transformers' side, one call (and token by token) on ours.
    ys_ref = []
    for t in range(T2):
        ys_ref.append(conv_update(x2[:, t, :, None], tf_state, w, b, activation="silu")[..., 0])
    y_ref2 = torch.stack(ys_ref, 1)
    y2, window2 = short_conv(x2, w, b, conv_state=window, activation="silu")
    assert_close(y2, y_ref2, **tol, msg="decode y")
    assert_close(window2, tf_state[..., 1:], exact=True, msg="decode window")
    wstep, ystep = window, []
    for t in range(T2):
        yt, wstep = short_conv(x2[:, t:t + 1], w, b, conv_state=wstep, activation="silu")
        ystep.append(yt[:, 0])
    assert_close(torch.stack(ystep, 1), y2, exact=True, msg="one call vs token by token")
    assert_close(wstep, window2, exact=True, msg="window one call vs token by token")

    # A multi-token continuation through causal_conv1d_update (it accepts seq_len > 1) agrees too.
    tf_state2 = torch.cat([x.new_zeros(B, C, Kc), x.transpose(1, 2)], -1)[..., -Kc:].contiguous()
    y_ref3 = conv_update(x2.transpose(1, 2).contiguous(), tf_state2, w, b, activation="silu").transpose(1, 2)
    assert_close(y2, y_ref3, **tol, msg="multi-token update y")
    assert_close(window2, tf_state2[..., 1:], exact=True, msg="multi-token update window")


# ----------------------------------------------------------------------------------------------------------------
# 4. fast_rebuild vs literal fp64 loops over wrapped ring positions
# ----------------------------------------------------------------------------------------------------------------

def _fold_dkg_fp64(S0, d, k, g, positions):
    """Per head, literal loop: S = exp(g) * S + k d^T, all in fp64. S0 `[H,K,V]`; rings `[H,L,*]`."""
    S = S0.double().clone()
    H = S.shape[0]
    for p in positions:
        for h in range(H):
            a = g[h, p].double().exp()  # [K] or [1]
            S[h] = a[:, None] * S[h] + torch.outer(k[h, p].double(), d[h, p].double())
    return S


@settings(max_examples=30)
@given(B=Bs, H=Hs, K=Ks, V=Vs, L=st.sampled_from([8, 16]), gdn=st.booleans(), dtype=dtypes, seed=seeds,
       data=st.data())
def test_fast_rebuild_vs_fp64_loops(B, H, K, V, L, gdn, dtype, seed, data):
    gen = _gen(seed)
    N = B + 2
    ssm = _randn(gen, N, H, K, V, dtype=dtype)
    ring_d = _randn(gen, N, H, L, V, dtype=dtype)
    ring_k = l2norm(_randn(gen, N, H, L, K, dtype=F64)).to(dtype)
    # strong gates too (30): a long lazy queue then sums log-decays in the hundreds, whose differences give A_{j+1:m}
    scale = data.draw(st.sampled_from([1.0, 30.0]), label="gate scale")
    ring_g = _rand(gen, N, H, L, 1 if gdn else K, lo=-scale, hi=0.0, dtype=dtype)
    # ring_start near L-1 so that the records wrap around the end of the ring.
    ring_start = torch.tensor([L - 1 - data.draw(st.integers(0, 2)) for _ in range(N)])
    slots = torch.tensor(data.draw(st.permutations(list(range(N))))[:B])
    num = torch.tensor([data.draw(st.integers(0, L)) for _ in range(B)])
    S = fast_rebuild(ssm, slots, ring_d, ring_k, ring_g, ring_start, num)
    assert S.shape == (B, H, K, V) and S.dtype == dtype
    for b in range(B):
        s, m = int(slots[b]), int(num[b])
        pos = [(int(ring_start[s]) + j) % L for j in range(m)]
        expected = _fold_dkg_fp64(ssm[s], ring_d[s], ring_k[s], ring_g[s], pos)
        if m == 0:
            assert_close(S[b], ssm[s], exact=True, msg="m=0 returns the checkpoint")
        assert_close(S[b].double(), expected, dtype=dtype, msg=f"request {b} (slot {s}, m={m})")


@pytest.mark.parametrize("seed", range(12))
def test_fast_rebuild_of_a_full_ring_of_strong_gates(seed):
    """16 pending records with KDA gates down to -30 (log-decays summed to ~-250): fp32 within tolerance of the
    fp64 loop. The decay from record j to the end is a sum of the newer gates alone (forward sums G_m - G_j would
    carry eps * |G_m|)."""
    gen = _gen(seed)
    H, K, V, L = 2, 8, 8, 16
    ssm = _randn(gen, 1, H, K, V)
    ring_d = _randn(gen, 1, H, L, V)
    ring_k = l2norm(_randn(gen, 1, H, L, K, dtype=F64)).to(F32)
    ring_g = _rand(gen, 1, H, L, K, lo=-30.0, hi=0.0)
    S = fast_rebuild(ssm, torch.tensor([0]), ring_d, ring_k, ring_g, torch.tensor([0]), torch.tensor([L]))
    expected = _fold_dkg_fp64(ssm[0], ring_d[0], ring_k[0], ring_g[0], range(L))
    assert_close(S[0].double(), expected, dtype=F32, msg="rebuilt state")


# ----------------------------------------------------------------------------------------------------------------
# 5. exact_fold over layers vs recurrent_delta_rule per layer (wrap, offsets, track interval)
# ----------------------------------------------------------------------------------------------------------------

def _recurrent_states(rawk, rawv, g, beta, S0, norm="rsqrt"):
    """States after each record of one layer/slot via recurrent_delta_rule. Records `[H, n, *]`."""
    states = []
    n = rawk.shape[1]
    for j in range(n):
        kk = rawk[:, :j + 1].transpose(0, 1)[None]  # [1, j+1, H, K]
        vv = rawv[:, :j + 1].transpose(0, 1)[None]
        gg = g[:, :j + 1].transpose(0, 1)[None]
        gg = gg[..., 0] if gg.shape[-1] == 1 else gg  # GDN gate [1, T, H]
        bb = beta[:, :j + 1].transpose(0, 1)[None]
        _, S = recurrent_delta_rule(kk, kk, vv, gg, bb, initial_state=S0[None], norm=norm)
        states.append(S[0])
    return states


@settings(max_examples=30)
@given(B=Bs, H=Hs, K=Ks, V=Vs, Lyr=st.integers(2, 3), L=st.sampled_from([8, 16]), gdn=st.booleans(),
       dtype=dtypes, use_offsets=st.booleans(), interval=st.sampled_from([None, 1, 2, 3, 5]),
       norm=st.sampled_from(["rsqrt", "sqrt_div"]), seed=seeds, data=st.data())
def test_exact_fold_vs_recurrent(B, H, K, V, Lyr, L, gdn, dtype, use_offsets, interval, norm, seed, data):
    gen = _gen(seed)
    N = B + 2
    null_slot = N - 1
    ssm = _randn(gen, Lyr, N, H, K, V, dtype=dtype)
    rawv = _randn(gen, Lyr, N, H, L, V, dtype=dtype)
    rawk = _randn(gen, Lyr, N, H, L, K, dtype=dtype)
    ring_g = _rand(gen, Lyr, N, H, L, 1 if gdn else K, lo=-1.0, hi=0.0, dtype=dtype)
    ring_beta = _rand(gen, Lyr, N, H, L, lo=0.05, hi=0.95, dtype=dtype)
    ring_start = torch.tensor([L - 1 - data.draw(st.integers(0, 3)) for _ in range(N)])
    slots = data.draw(st.permutations(list(range(N - 1))))[:B]
    # Some rows go to the null slot or -1: skipped.
    slots = [s if data.draw(st.integers(0, 4)) else data.draw(st.sampled_from([-1, null_slot])) for s in slots]
    idx = torch.tensor(slots)
    n_max = L // 2
    paths = []
    for b in range(B):
        if use_offsets:  # a root path of a random tree of T nodes written at offsets 0..T-1
            T = data.draw(st.integers(1, n_max))
            parent = _random_parents(gen, T)
            paths.append(root_path(parent, data.draw(st.integers(0, T - 1))) if data.draw(st.integers(0, 5))
                         else [])
        else:
            paths.append(list(range(data.draw(st.integers(0, n_max)))))
    num = torch.tensor([len(p) for p in paths])
    M = max(1, max(len(p) for p in paths))
    offsets = torch.tensor([p + [0] * (M - len(p)) for p in paths]) if use_offsets else None
    seq_lens = torch.tensor([data.draw(st.integers(0, 12)) for _ in range(N)])
    track = _randn(gen, Lyr, N, 2, H, K, V, dtype=dtype) if interval else None

    ssm_before, track_before = ssm.clone(), None if track is None else track.clone()
    exact_fold(ssm, rawv, rawk, ring_g, ring_beta, idx, ring_start, num, offsets=offsets,
               seq_lens=seq_lens if interval else None, track_interval=interval, track_states=track,
               norm=norm, null_slot=null_slot)

    expected = ssm_before.clone()
    expected_track = None if track is None else track_before.clone()
    touched = torch.zeros(Lyr, N, 2, dtype=torch.bool)
    for b, s in enumerate(slots):
        if s < 0 or s == null_slot or not paths[b]:
            continue
        pos = torch.tensor([(int(ring_start[s]) + o) % L for o in paths[b]])
        for layer in range(Lyr):
            states = _recurrent_states(rawk[layer, s][:, pos], rawv[layer, s][:, pos], ring_g[layer, s][:, pos],
                                       ring_beta[layer, s][:, pos], ssm_before[layer, s], norm=norm)
            expected[layer, s] = states[-1]
            if interval:
                for j, St in enumerate(states):
                    count = int(seq_lens[s]) + j + 1
                    if count % interval == 0:
                        expected_track[layer, s, (count // interval) % 2] = St
                        touched[layer, s, (count // interval) % 2] = True
    if dtype == F32:
        _near_exact(ssm, expected, "ssm_state")
    else:
        assert_close(ssm, expected, dtype=F64, msg="ssm_state")
    # Slots not folded (null, -1, unmapped, n=0) are untouched bitwise.
    folded = torch.zeros(N, dtype=torch.bool)
    for b, s in enumerate(slots):
        if s >= 0 and s != null_slot and paths[b]:
            folded[s] = True
    assert_close(ssm[:, ~folded], ssm_before[:, ~folded], exact=True, msg="unfolded slots")
    if interval:
        assert_close(track[~touched], track_before[~touched], exact=True, msg="track entries not at a boundary")
        if dtype == F32:
            _near_exact(track[touched], expected_track[touched], "track_states")
        else:
            assert_close(track[touched], expected_track[touched], dtype=F64, msg="track_states")


# ----------------------------------------------------------------------------------------------------------------
# 6. masked_scatter
# ----------------------------------------------------------------------------------------------------------------

@settings(max_examples=40)
@example(B=3, T=3, Lyr=2, conv=False, order="reversed", dtype=F32, seed=0, steps=[-1, 2, 0], kinds=[0, 0, 0])
@example(B=3, T=2, Lyr=1, conv=True, order="id", dtype=F64, seed=1, steps=[1, 1, 0], kinds=[1, 2, 0])
@given(B=Bs, T=Ts, Lyr=st.integers(1, 3), conv=st.booleans(), order=st.sampled_from(["id", "reversed", "perm"]),
       dtype=dtypes, seed=seeds, steps=st.lists(st.integers(-1, 8), min_size=3, max_size=3),
       kinds=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=3, max_size=3))
def test_masked_scatter(B, T, Lyr, conv, order, dtype, seed, steps, kinds):
    """kinds: 0 = a real slot, 1 = slot -1, 2 = the null slot; step -1 skips."""
    gen = _gen(seed)
    N = B + 2
    null_slot = N - 1
    S = (5, 3) if conv else (2, 3, 5)  # conv window [C, Kc-1] or state [H, K, V]
    R = B + seed % 2  # src may hold more request rows than are scattered
    src = _randn(gen, Lyr, R, T, *S, dtype=dtype)
    dst = _randn(gen, Lyr, N, *S, dtype=dtype)
    base = list(range(N - 1))
    if order == "reversed":
        base = base[::-1]
    elif order == "perm":
        base = torch.randperm(N - 1, generator=gen).tolist()
    slots = [(s, -1, null_slot)[kind] for s, kind in zip(base[:B], kinds)]
    step = [min(st_, T - 1) for st_ in steps[:B]]
    before = dst.clone()
    masked_scatter(src, dst, torch.tensor(slots), torch.tensor(step), null_slot=null_slot)
    # Inverse formulation: for each destination slot, which (row, step) should land there.
    source_of = {s: (b, st_) for b, (s, st_) in enumerate(zip(slots, step)) if s >= 0 and s != null_slot and st_ >= 0}
    for s in range(N):
        if s in source_of:
            b, st_ = source_of[s]
            assert_close(dst[:, s], src[:, b, st_], exact=True, msg=f"slot {s} <- row {b} step {st_}")
        else:
            assert_close(dst[:, s], before[:, s], exact=True, msg=f"slot {s} untouched")


# ----------------------------------------------------------------------------------------------------------------
# 7. verify (chain and tree) vs recurrent_delta_rule along each root path; ring records; conv windows
# ----------------------------------------------------------------------------------------------------------------

def _expected_d(S_prev, kn, v, g, beta):
    """d = beta (v - (exp(g) S_prev)^T k) in fp64; S_prev `[H,K,V]`, kn `[H,K]`, g `[H,K|1]`."""
    S = g.double().exp()[..., None] * S_prev.double()
    return beta.double()[:, None] * (v.double() - torch.einsum("hkv,hk->hv", S, kn.double()))


def _check_verify(q, k, v, g, beta, ssm, slots, parents, *, null_slot, L, ring_start, norm, dtype):
    """Run verify with rings and node states, check against recurrent_delta_rule per root path."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = ssm.shape[0]
    gdn = g.dim() == 3
    gen = _gen(7)
    ring = (_randn(gen, N, H, L, V, dtype=dtype), _randn(gen, N, H, L, K, dtype=dtype),
            _randn(gen, N, H, L, 1 if gdn else K, dtype=dtype), _randn(gen, N, H, L, V, dtype=dtype),
            _randn(gen, N, H, L, K, dtype=dtype), _randn(gen, N, H, L, dtype=dtype))
    ring_before = tuple(r.clone() for r in ring)
    inter = torch.full((B + 1, T, H, K, V), float("nan"), dtype=dtype)
    ssm_before = ssm.clone()
    idx = torch.tensor(slots)
    parent_arg = None if parents is None else torch.tensor(parents)
    o = verify_delta_rule(q, k, v, g, beta, ssm, idx, parent=parent_arg, intermediate_states=inter, ring=ring,
                          ring_start=ring_start, norm=norm, null_slot=null_slot)
    assert_close(ssm, ssm_before, exact=True, msg="checkpoint is read only")
    written = [torch.zeros(N, H, L, dtype=torch.bool) for _ in ring]
    for b, s in enumerate(slots):
        if s < 0 or s == null_slot:
            assert_close(o[b], torch.zeros_like(o[b]), exact=True, msg=f"skipped row {b} output")
            continue
        par = list(range(-1, T - 1)) if parents is None else parents[b]
        kn_all = l2norm(k[b].to(F64), norm=norm)  # [T, H, K] fp64 oracle normalization
        for i in range(T):
            path = root_path(par, i)
            gp = g[b, path][None]
            o_ref, S_ref = recurrent_delta_rule(q[b, path][None], k[b, path][None], v[b, path][None], gp,
                                                beta[b, path][None], initial_state=ssm_before[s][None], norm=norm)
            _near_exact(o[b, i], o_ref[0, -1], f"row {b} node {i} output")
            _near_exact(inter[b, i], S_ref[0], f"row {b} node {i} state")
            if len(path) > 1:
                _, S_prev = recurrent_delta_rule(q[b, path[:-1]][None], k[b, path[:-1]][None], v[b, path[:-1]][None],
                                                 gp[:, :-1], beta[b, path[:-1]][None],
                                                 initial_state=ssm_before[s][None], norm=norm)
                S_prev = S_prev[0]
            else:
                S_prev = ssm_before[s]
            p = (int(ring_start[s]) + i) % L
            gi = g[b, i][:, None] if gdn else g[b, i]
            d_ring, k_ring, g_ring, rawv_ring, rawk_ring, beta_ring = (r[s, :, p] for r in ring)
            assert_close(d_ring.double(), _expected_d(S_prev, kn_all[i], v[b, i], gi, beta[b, i]), dtype=dtype,
                         msg=f"row {b} node {i} ring d")
            assert_close(k_ring.double(), kn_all[i], dtype=dtype, msg=f"row {b} node {i} ring k")
            assert_close(g_ring, gi, exact=True, msg="ring g")
            assert_close(rawv_ring, v[b, i], exact=True, msg="ring rawv")
            assert_close(rawk_ring, k[b, i], exact=True, msg="ring rawk")
            assert_close(beta_ring, beta[b, i], exact=True, msg="ring beta")
            for w in written:
                w[s, :, p] = True
    for r, r0, w in zip(ring, ring_before, written):
        assert_close(r[~w], r0[~w], exact=True, msg="ring entries outside the written positions")


@settings(max_examples=25)
@given(B=Bs, T=Ts, H=Hs, K=Ks, V=Vs, gdn=st.booleans(), tree=st.booleans(), dtype=dtypes,
       norm=st.sampled_from(["rsqrt", "sqrt_div"]), seed=seeds, data=st.data())
def test_verify_vs_recurrent_along_root_paths(B, T, H, K, V, gdn, tree, dtype, norm, seed, data):
    gen = _gen(seed)
    q, k, v, g, beta, _ = _delta_inputs(gen, B, T, H, K, V, gdn=gdn, dtype=dtype)
    N = B + 2
    null_slot = N - 1
    ssm = _randn(gen, N, H, K, V, dtype=dtype)
    L = 16
    ring_start = torch.tensor([data.draw(st.integers(0, L - 1)) for _ in range(N)])
    slots = data.draw(st.permutations(list(range(N - 1))))[:B]
    slots = [s if data.draw(st.integers(0, 4)) else data.draw(st.sampled_from([-1, null_slot])) for s in slots]
    parents = [_random_parents(gen, T) for _ in range(B)] if tree else None
    _check_verify(q, k, v, g, beta, ssm, slots, parents, null_slot=null_slot, L=L, ring_start=ring_start,
                  norm=norm, dtype=dtype)


@settings(max_examples=20)
@given(B=Bs, T1=st.integers(1, 6), T2=st.integers(1, 6), H=Hs, K=Ks, V=Vs, gdn=st.booleans(), dtype=dtypes,
       seed=seeds, data=st.data())
def test_verify_with_pending_records_vs_recurrent(B, T1, T2, H, K, V, gdn, dtype, seed, data):
    """Lazy commit: records of a fully accepted first verify stay pending; the second verify starts from
    the fast rebuild and matches plain decode of both windows within the dtype's tolerance."""
    gen = _gen(seed)
    q, k, v, g, beta, _ = _delta_inputs(gen, B, T1 + T2, H, K, V, gdn=gdn, dtype=dtype)
    N, L = B + 1, 16
    ssm = _randn(gen, N, H, K, V, dtype=dtype)
    ring = (torch.zeros(N, H, L, V, dtype=dtype), torch.zeros(N, H, L, K, dtype=dtype),
            torch.zeros(N, H, L, 1 if gdn else K, dtype=dtype), torch.zeros(N, H, L, V, dtype=dtype),
            torch.zeros(N, H, L, K, dtype=dtype), torch.zeros(N, H, L, dtype=dtype))
    ring_start = torch.tensor([L - 1 - data.draw(st.integers(0, 4)) for _ in range(N)])
    idx = torch.tensor(data.draw(st.permutations(list(range(N))))[:B])
    first, second = slice(0, T1), slice(T1, T1 + T2)
    verify_delta_rule(q[:, first], k[:, first], v[:, first], g[:, first], beta[:, first], ssm, idx, ring=ring,
                      ring_start=ring_start)
    num_pending = torch.zeros(N, dtype=torch.long)
    num_pending[idx] = T1
    o2 = verify_delta_rule(q[:, second], k[:, second], v[:, second], g[:, second], beta[:, second], ssm, idx,
                           ring=ring, ring_start=ring_start, num_pending=num_pending)
    o_ref, _ = recurrent_delta_rule(q, k, v, g, beta, initial_state=ssm[idx])
    assert_close(o2, o_ref[:, second], dtype=dtype, msg="outputs after fast rebuild")
    for b in range(B):
        s = int(idx[b])
        for t in range(T2):
            p = (int(ring_start[s]) + T1 + t) % L
            assert_close(ring[3][s, :, p], v[b, T1 + t], exact=True, msg="rawv appended after pending")
            assert_close(ring[5][s, :, p], beta[b, T1 + t], exact=True, msg="beta appended after pending")


@settings(max_examples=25)
@given(B=Bs, T=Ts, C=st.sampled_from([1, 3, 5, 12]), Kc=st.sampled_from([2, 3, 4]), tree=st.booleans(),
       bias=st.booleans(), dtype=dtypes, seed=seeds, data=st.data())
def test_short_conv_verify_vs_short_conv_along_root_paths(B, T, C, Kc, tree, bias, dtype, seed, data):
    gen = _gen(seed)
    N = B + 2
    null_slot = N - 1
    x = _randn(gen, B, T, C, dtype=dtype)
    w = _randn(gen, C, Kc, dtype=dtype)
    bb = _randn(gen, C, dtype=dtype) if bias else None
    conv_state = _randn(gen, N, C, Kc - 1, dtype=dtype)
    before = conv_state.clone()
    slots = data.draw(st.permutations(list(range(N - 1))))[:B]
    slots = [s if data.draw(st.integers(0, 4)) else data.draw(st.sampled_from([-1, null_slot])) for s in slots]
    parents = [_random_parents(gen, T) for _ in range(B)] if tree else None
    windows = torch.full((B, T, C, Kc - 1), float("nan"), dtype=dtype)
    y = short_conv_verify(x, w, bb, conv_state, torch.tensor(slots),
                          parent=None if parents is None else torch.tensor(parents), window_states=windows,
                          null_slot=null_slot)
    assert_close(conv_state, before, exact=True, msg="conv_state is read only")
    for b, s in enumerate(slots):
        if s < 0 or s == null_slot:
            assert_close(y[b], torch.zeros_like(y[b]), exact=True, msg=f"skipped row {b}")
            continue
        par = list(range(-1, T - 1)) if parents is None else parents[b]
        for i in range(T):
            path = root_path(par, i)
            y_ref, w_ref = short_conv(x[b, path][None], w, bb, conv_state=before[s][None])
            # Same op order on other batch shapes: vectorized vs scalar-tail silu may differ in the last bit.
            _near_exact(y[b, i], y_ref[0, -1], f"row {b} node {i} y")
            assert_close(windows[b, i], w_ref[0], exact=True, msg=f"row {b} node {i} window")
            # The window is the last Kc-1 columns of [root window, x along the path].
            full = torch.cat([before[s], x[b, path].T], -1)
            assert_close(windows[b, i], full[:, -(Kc - 1):], exact=True, msg=f"row {b} node {i} window columns")
