"""Triton exact fold: all layers of all requests in one launch, plain-decode op order, fp32 math.

Same signature and semantics as `kernels/fold/naive.py`. The jit helpers at the top (`_exp`, `_l2norm`,
`_delta_update`, `_load_gate`) are shared with the verify kernel so both advance a state the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def check_float(name: str, *tensors: torch.Tensor | None) -> None:
    """The kernels compute in fp32; fp64 inputs go to the references (the dispatcher does that)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            raise ValueError(f"{name}: the Triton kernel computes in fp32 and does not take fp64 tensors; "
                             f"use the reference (specdec.kernels dispatches fp64 there)")


def num_warps_for(block_elems: int) -> int:
    return 1 if block_elems <= 1024 else (2 if block_elems <= 2048 else 4)


@triton.jit
def _cast_to(x, ptr):
    """`x` in the element type of `ptr`; fp32 -> bf16 rounds to nearest even, like torch and the GPU
    (the interpreter's own fp32 -> bf16 cast truncates)."""
    y = x
    if (ptr.dtype.element_ty == tl.bfloat16) and (x.dtype == tl.float32):
        u = x.to(tl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        y = tl.where(x == x, r, 0x7FC0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y.to(ptr.dtype.element_ty)


@triton.jit
def _exp(x):
    """fp32 `exp` rounded from fp64: correctly rounded on every backend, like torch's CPU `exp` (numpy's
    fp32 `exp` in the interpreter and the GPU's fast `exp` are an ulp off often enough to drift a
    state folded over many tokens)."""
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _l2norm(x, eps, SQRT_DIV: tl.constexpr):
    """`x * rsqrt(sum(x^2) + eps)` or `x / sqrt(sum(x^2) + eps)`, correctly rounded like torch on CPU."""
    ss = tl.sum(x.to(tl.float64) * x.to(tl.float64), axis=0).to(tl.float32)  # order-free, see _dot
    r = tl.sqrt((ss + eps).to(tl.float64)).to(tl.float32)  # correctly rounded (kernels/common.py l2norm)
    if SQRT_DIV:
        return tl.math.div_rn(x, r)
    else:
        return x * tl.math.div_rn(1.0, r)


@triton.jit
def _load_gate(ptr, offs_k, mask_k, stride_k, BK: tl.constexpr, GDN: tl.constexpr):
    """The log-decay of one token as a `[BK]` fp32 vector (GDN: one scalar broadcast over K)."""
    if GDN:
        g = tl.zeros([BK], dtype=tl.float32) + tl.load(ptr).to(tl.float32)
    else:
        g = tl.load(ptr + offs_k * stride_k, mask=mask_k, other=0.0).to(tl.float32)
    return g


@triton.jit
def _dot(S, x):
    """`S^T x` over K: exact fp32 products summed in fp64 and rounded once, so the result is the same
    whatever order the backend reduces in (kernels/common.py `dot`)."""
    return tl.sum(S.to(tl.float64) * x.to(tl.float64)[:, None], axis=0).to(tl.float32)


@triton.jit
def _delta_update(S, k, v, g, beta):
    """`S' = exp(g) S`; `d = beta (v - S'^T k)`; `S = S' + k d^T` (kernels/common.py delta_step)."""
    S = S * _exp(g)[:, None]
    d = beta * (v - _dot(S, k))
    S = S + k[:, None] * d[None, :]
    return S, d


@triton.jit
def _exact_fold_kernel(
        state, rawv, rawk, rg, rbeta, idx, ring_start, num_tokens, offsets, seq_lens, track,
        s_sl, s_sn, s_sh, s_sk, s_sv,
        s_vl, s_vn, s_vh, s_vt, s_vv,
        s_kl, s_kn, s_kh, s_kt, s_kk,
        s_gl, s_gn, s_gh, s_gt, s_gk,
        s_bl, s_bn, s_bh, s_bt,
        s_ob, s_om,
        s_tl, s_tn, s_tp, s_th, s_tk, s_tv,
        B, L, null_slot, track_interval, eps,
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GDN: tl.constexpr,
        HAS_OFFSETS: tl.constexpr, HAS_TRACK: tl.constexpr, SQRT_DIV: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    lyr = pid // B
    b = pid % B
    s = tl.load(idx + b).to(tl.int64)
    n = tl.load(num_tokens + b).to(tl.int32)
    if (s < 0) | (s == null_slot) | (n <= 0):
        return
    start = tl.load(ring_start + s).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    st_off = lyr * s_sl + s * s_sn + i_h * s_sh
    kv_off = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    S = tl.load(state + st_off + kv_off, mask=mask_kv, other=0.0).to(tl.float32)
    v_base = rawv + lyr * s_vl + s * s_vn + i_h * s_vh
    k_base = rawk + lyr * s_kl + s * s_kn + i_h * s_kh
    g_base = rg + lyr * s_gl + s * s_gn + i_h * s_gh
    b_base = rbeta + lyr * s_bl + s * s_bn + i_h * s_bh
    if HAS_TRACK:
        seq0 = tl.load(seq_lens + s).to(tl.int64)
    for j in range(n):
        if HAS_OFFSETS:
            off = tl.load(offsets + b * s_ob + j * s_om).to(tl.int64)
        else:
            off = j
        pos = (start + off) % L
        kr = tl.load(k_base + pos * s_kt + offs_k * s_kk, mask=mask_k, other=0.0).to(tl.float32)
        vr = tl.load(v_base + pos * s_vt + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
        gt = _load_gate(g_base + pos * s_gt, offs_k, mask_k, s_gk, BK, GDN)
        bt = tl.load(b_base + pos * s_bt).to(tl.float32)
        kn = _l2norm(kr, eps, SQRT_DIV)
        S, d = _delta_update(S, kn, vr, gt, bt)
        if HAS_TRACK:
            count = seq0 + j + 1
            if count % track_interval == 0:
                par = (count // track_interval) % 2
                t_off = lyr * s_tl + s * s_tn + par * s_tp + i_h * s_th
                tl.store(track + t_off + offs_k[:, None] * s_tk + offs_v[None, :] * s_tv,
                         _cast_to(S, track), mask=mask_kv)
    tl.store(state + st_off + kv_off, _cast_to(S, state), mask=mask_kv)


def exact_fold(ssm_state: torch.Tensor, ring_rawv: torch.Tensor, ring_rawk: torch.Tensor, ring_g: torch.Tensor,
               ring_beta: torch.Tensor, ssm_state_indices: torch.Tensor, ring_start: torch.Tensor,
               num_tokens: torch.Tensor, *, offsets: torch.Tensor | None = None,
               seq_lens: torch.Tensor | None = None, track_interval: int | None = None,
               track_states: torch.Tensor | None = None, eps: float = 1e-6, norm: str = "rsqrt",
               null_slot: int = -1) -> None:
    """Fold accepted records into the checkpoints of every layer, in place (see `naive.exact_fold`).

    One launch over (layer x request, head, V block); per program the K x BV state tile stays in
    registers while the records are stepped through in plain-decode op order.
    """
    check_float("exact_fold", ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, track_states)
    if norm not in ("rsqrt", "sqrt_div"):
        raise ValueError(f"norm: expected 'rsqrt' or 'sqrt_div', got {norm!r}")
    Lyr, N, H, K, V = ssm_state.shape
    L = ring_beta.shape[3]
    if ring_beta.shape != (Lyr, N, H, L):
        raise ValueError(f"ring_beta: expected [{Lyr}, {N}, {H}, L], got {list(ring_beta.shape)}")
    if ring_rawv.shape != (Lyr, N, H, L, V) or ring_rawk.shape != (Lyr, N, H, L, K):
        raise ValueError(f"ring_rawv / ring_rawk: expected [{Lyr}, {N}, {H}, {L}, {V}] / [..., {K}], "
                         f"got {list(ring_rawv.shape)} / {list(ring_rawk.shape)}")
    if ring_g.shape[:4] != (Lyr, N, H, L) or ring_g.dim() != 5 or ring_g.shape[4] not in (1, K):
        raise ValueError(f"ring_g: expected [{Lyr}, {N}, {H}, {L}, {K} or 1], got {list(ring_g.shape)}")
    B = ssm_state_indices.shape[0]
    if num_tokens.shape != (B,):
        raise ValueError(f"num_tokens: expected shape [{B}], got {list(num_tokens.shape)}")
    if B == 0 or Lyr == 0:
        return
    has_track = track_interval is not None and seq_lens is not None
    if has_track:
        if track_states is None or track_states.shape != (Lyr, N, 2, H, K, V):
            raise ValueError(f"track_states: expected [{Lyr}, {N}, 2, {H}, {K}, {V}] with track_interval, got "
                             f"{None if track_states is None else list(track_states.shape)}")
    has_off = offsets is not None
    if has_off and (offsets.dim() != 2 or offsets.shape[0] < B):
        raise ValueError(f"offsets: expected [>={B}, M], got {list(offsets.shape)}")
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32 if BK >= 128 else 64)
    off_t = offsets if has_off else num_tokens
    tr = track_states if has_track else ssm_state
    sl = seq_lens if has_track else ring_start
    grid = (Lyr * B, H, triton.cdiv(V, BV))
    _exact_fold_kernel[grid](
        ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, ssm_state_indices, ring_start, num_tokens, off_t, sl, tr,
        *ssm_state.stride(), *ring_rawv.stride(), *ring_rawk.stride(), *ring_g.stride(), *ring_beta.stride(),
        *(offsets.stride() if has_off else (0, 0)),
        *(track_states.stride() if has_track else (0,) * 6),
        B, L, int(null_slot), int(track_interval) if has_track else 1, float(eps),
        K=K, V=V, BK=BK, BV=BV, GDN=ring_g.shape[4] == 1 and K != 1, HAS_OFFSETS=has_off, HAS_TRACK=has_track,
        SQRT_DIV=norm == "sqrt_div", num_warps=num_warps_for(BK * BV),
        enable_fp_fusion=False)
