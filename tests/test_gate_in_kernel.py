"""Kimi's forget gate computed by the kernels from its input (`gate_in_kernel`, fla's `use_gate_in_kernel`): the g
ring keeps the gate's input f in the activation dtype (bf16: half an fp32 log-decay) instead of the log-decay.

Checked against independent computations: `kda_gate` against transformers' own `KimiLinearForgetGate`, bit for
bit; each kernel with f and the gate parameters against the same kernel fed the log-decays (the torch reference:
bitwise, the gate is the same function; Triton: fp32 tolerance, its own exp/log); the ring holds f bit for bit.
The fold-equals-single-steps property (tests/test_fold_exactness.py), the strategies against plain decode
(tests/test_state_properties.py, tests/test_state_triton.py), the teeth test of a corrupted f record and the
memory plan's allocation (tests/test_memory_plan.py) draw this mode too.
"""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close

from specdec.kernels import dispatch, kda_gate
from specdec.replayssm import StateConfig, make_strategy

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.triton)]


@pytest.fixture
def device(backend, request):
    """The Triton kernels take tensors on conftest's `triton_device`; the torch reference runs on CPU."""
    return request.getfixturevalue("triton_device") if backend == "triton" else "cpu"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kda_gate_is_transformers_forget_gate(dtype):
    """`kda_gate(f_b_proj(f_a_proj(x)), A_log, dt_bias)` is `KimiLinearForgetGate(x)` bit for bit, in every model
    dtype (the module computes in fp32 too), softplus's linear branch (> 20) included."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    cfg = KimiLinearConfig(hidden_size=32, linear_num_heads=3, linear_head_dim=8)
    gen = torch.Generator().manual_seed(0)
    fg = KimiLinearForgetGate(cfg)
    with torch.no_grad():
        for p in fg.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        fg.dt_bias[:4] += 30.0  # a few channels on softplus's linear branch
    fg = fg.to(dtype)
    x = torch.randn(2, 5, 32, generator=gen).to(dtype)
    f = fg.f_b_proj(fg.f_a_proj(x)).view(2, 5, 3, 8)
    got = kda_gate(f, fg.A_log.view(3), fg.dt_bias.view(3, 8))
    want = fg(x)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)
    assert bool((f.float() + fg.dt_bias.float().view(3, 8) > 20).any())


def _inputs(gen, B, T, H, K, V, act, device="cpu"):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=r(B, T, H, K).to(act), k=r(B, T, H, K).to(act), v=r(B, T, H, V).to(act),
             f=(2 * r(B, T, H, K) - 1).to(act), beta=torch.rand(B, T, H, generator=gen),
             A_log=r(H) - 1, dt_bias=r(H, K))
    return {n: t.to(device) for n, t in x.items()}


def _rings(N, H, L, K, V, act, gate_dtype, lazy, device="cpu"):
    nan = lambda *s, dtype=act: torch.full(s, float("nan"), dtype=dtype, device=device)  # noqa: E731
    # fp32 d / k: the rebuild reads d, and a bf16 d would round the two gates' last-bit differences apart
    d, k = (nan(N, H, L, V, dtype=torch.float32), nan(N, H, L, K, dtype=torch.float32)) if lazy else (None, None)
    return (d, k, nan(N, H, L, K, dtype=gate_dtype), nan(N, H, L, V), nan(N, H, L, K), nan(N, H, L,
                                                                                            dtype=torch.float32))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_from_gate_input_equals_verify_from_log_decays(backend, tree, lazy, device):
    """A verify given f and (A_log, dt_bias) gives the outputs of the same verify given `kda_gate(f)` (the reference
    bitwise, Triton within fp32 tolerance), every record but g the same bits, and the g ring holds f itself (bf16);
    lazy: pending f records rebuild the start state as pending log-decays do."""
    impl = dispatch.triton_impl if backend == "triton" else dispatch.reference_impl
    verify = impl("verify_delta_rule")
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V, N, L, act = 2, 5, 3, 8, 6, 4, 16, torch.bfloat16
    x = _inputs(gen, B, T, H, K, V, act, device)
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"])
    g = kda_gate(x["f"], **gate)
    S0 = torch.randn(N, H, K, V, generator=gen).to(device)
    idx = torch.tensor([2, 0], device=device)
    parent = torch.tensor([-1, 0, 0, 1, -1], device=device) if tree else None
    kw = dict(parent=parent)
    if tree and backend == "triton":  # the kernel keeps parent states in a stack; the chunk form needs none
        kw["tree_stack"] = torch.empty(B, 2, H, K, V, device=device)
    rings = {}
    outs = {}
    for mode, gdt in (("g", torch.float32), ("input", act)):
        ring = _rings(N, H, L, K, V, act, gdt, lazy, device)
        extra = {} if mode == "g" else gate
        ring_kw = dict(ring=ring, ring_indices=torch.arange(B, device=device)) if not lazy else dict(
            ring=ring, ring_start=torch.tensor([3, 0, 9, 0], device=device),
            num_pending=torch.zeros(N, dtype=torch.long, device=device))
        if lazy:  # an earlier round's two accepted tokens stay pending in the slot's ring
            pend = _inputs(torch.Generator().manual_seed(2), B, 2, H, K, V, act, device)
            pg = pend["f"] if mode == "input" else kda_gate(pend["f"], **gate)
            verify(pend["q"], pend["k"], pend["v"], pg, pend["beta"], S0, idx, **ring_kw, **extra)
            ring_kw["num_pending"] = torch.tensor([0, 0, 2, 0], device=device).index_fill(0, idx[1:], 2)
        outs[mode] = verify(x["q"], x["k"], x["v"], x["f"] if mode == "input" else g, x["beta"], S0, idx,
                            **kw, **ring_kw, **extra)
        rings[mode] = ring
    if backend == "reference":
        assert torch.equal(outs["input"], outs["g"])
    else:
        assert_close(outs["input"], outs["g"], dtype=torch.float32, msg="outputs, gate in kernel vs log-decays")
    for i in (3, 4, 5):  # rawv, rawk, beta: the same bits
        assert torch.equal(rings["input"][i].nan_to_num(7.0), rings["g"][i].nan_to_num(7.0))
    f_ring = rings["input"][2]
    rows = [(b, int(idx[b])) for b in range(B)]
    for b, s in rows:
        ring_row = s if lazy else b
        got = f_ring[ring_row].transpose(0, 1)  # [L, H, K]
        if lazy:
            start = [3, 0, 9, 0][s]
            got = got[(start + 2 + torch.arange(T, device=device)) % L]
        else:
            got = got[:T]
        assert torch.equal(got, x["f"][b]), f"row {b}: the g ring does not hold the gate input"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_rebuild_from_gate_input(backend, device):
    """The lazy rebuild from f records equals the rebuild from their log-decays (reference bitwise, Triton within
    fp32 tolerance)."""
    rebuild = (dispatch.triton_impl if backend == "triton" else dispatch.reference_impl)("fast_rebuild")
    gen = torch.Generator().manual_seed(3)
    N, H, K, V, L = 3, 2, 8, 5, 8
    f = (2 * torch.randn(N, H, L, K, generator=gen) - 1).to(torch.bfloat16)
    A_log, dt_bias = torch.randn(H, generator=gen) - 1, torch.randn(H, K, generator=gen)
    d, k = torch.randn(N, H, L, V, generator=gen), torch.randn(N, H, L, K, generator=gen)
    S0 = torch.randn(N, H, K, V, generator=gen)
    f, A_log, dt_bias, d, k, S0 = (t.to(device) for t in (f, A_log, dt_bias, d, k, S0))
    g = kda_gate(f.transpose(1, 2), A_log, dt_bias).transpose(1, 2)
    args = (torch.tensor([2, 0], device=device),)
    tail = (torch.tensor([6, 1, 3], device=device), torch.tensor([4, 3], device=device))
    got = rebuild(S0, *args, d, k, f, *tail, A_log=A_log, dt_bias=dt_bias)
    want = rebuild(S0, *args, d, k, g, *tail)
    if backend == "reference":
        assert torch.equal(got, want)
    else:
        assert_close(got, want, dtype=torch.float32, msg="rebuild from f records")


def test_bad_gate_arguments():
    """One error naming the argument, before anything is written."""
    verify = dispatch.reference_impl("verify_delta_rule")
    gen = torch.Generator().manual_seed(4)
    x = _inputs(gen, 1, 2, 2, 4, 4, torch.float32)
    S0 = torch.zeros(2, 2, 4, 4)
    with pytest.raises(ValueError, match="A_log: pass A_log and dt_bias together"):
        verify(x["q"], x["k"], x["v"], x["f"], x["beta"], S0, torch.tensor([0]), A_log=x["A_log"])
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \[2, 4\]"):
        verify(x["q"], x["k"], x["v"], x["f"], x["beta"], S0, torch.tensor([0]), A_log=x["A_log"],
               dt_bias=x["dt_bias"][:, :3])
    with pytest.raises(ValueError, match="g: with A_log / dt_bias, g is the KDA gate's input"):
        verify(x["q"], x["k"], x["v"], x["f"][..., 0], x["beta"], S0, torch.tensor([0]), A_log=x["A_log"],
               dt_bias=x["dt_bias"])
    with pytest.raises(ValueError, match="gate_in_kernel: computes Kimi's per-channel KDA gate"):
        StateConfig.tiny(gate="gdn", gate_in_kernel=True)
    cfg = StateConfig.tiny(gate_in_kernel=True, ssm_dtype=torch.float32, act_dtype=torch.float32)
    st = make_strategy(cfg, "replay")
    with pytest.raises(ValueError, match="A_log: expected 2 entries"):
        st.set_gate(0, torch.zeros(3), torch.zeros(16))
    with pytest.raises(ValueError, match="dt_bias: expected 16 entries"):
        st.set_gate(0, torch.zeros(2), torch.zeros(8))
    slots = st.pool.alloc(1)
    st.begin(slots, num_tokens=2)
    y = _inputs(gen, 1, 2, 2, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match="call set_gate first"):
        st.mix(0, y["q"], y["k"], y["v"], y["f"], y["beta"])
    with pytest.raises(ValueError, match="set_gate: this state takes log-decays"):
        make_strategy(StateConfig.tiny(), "replay").set_gate(0, torch.zeros(2), torch.zeros(16))
