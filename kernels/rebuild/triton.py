"""Triton fast rebuild: the state after m pending records from the checkpoint and the (d, k, g) rings.

Same signature and semantics as `kernels/rebuild/naive.py`. `rebuild_tile` is also inlined at the
start of the lazy verify kernel, so verify does not need a separate launch (or a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_gate_params
from ..triton_utils import check_float, device_name, gate_params, log_decay, state_blocks, state_tile


@triton.jit
def _ring_g(g_base, pos, s_gt, s_gk, offs_k, mask_k, neg_a, bias, GDN: tl.constexpr, GATE_IN: tl.constexpr):
    """The log-decay of ring position `pos`: a scalar (GDN) or `[BK]` (KDA, from its input record with
    `GATE_IN`)."""
    if GDN:
        g = tl.load(g_base + pos * s_gt).to(tl.float32)
    else:
        g = log_decay(tl.load(g_base + pos * s_gt + offs_k * s_gk, mask=mask_k, other=0.0).to(tl.float32), neg_a,
                      bias, GATE_IN)
    return g


@triton.jit
def rebuild_tile(S0, d_base, k_base, g_base, start, m, s_dt, s_dv, s_kt, s_kk, s_gt, s_gk,
                 offs_k, offs_v, mask_k, mask_v, neg_a, bias, L: tl.constexpr, BK: tl.constexpr, GDN: tl.constexpr,
                 GATE_IN: tl.constexpr):
    """`exp(G_m) S0 + sum_j (k_j exp(R_j)) d_j^T`, `G_m = g_1 + .. + g_m`, `R_j = g_{j+1} + .. + g_m` summed from
    the newest record back (so each decay is accurate to eps of itself, where the difference of two forward sums,
    G_m - G_j, carries eps * |G_m|); fp32.

    Pointers are the request's ring rows of one head; `start` / `m`: first pending position and count;
    `neg_a`, `bias`: `triton_utils.gate_params` when the g ring holds the KDA gate's input (`GATE_IN`).
    """
    Gm = tl.zeros([BK], dtype=tl.float32)
    for j in range(m):
        pos = (start + j) & (L - 1)
        Gm += _ring_g(g_base, pos, s_gt, s_gk, offs_k, mask_k, neg_a, bias, GDN, GATE_IN)
    S = S0 * tl.exp(Gm)[:, None]  # S0 is not needed past here (its registers free for the loop)
    R = tl.zeros([BK], dtype=tl.float32)
    for i in range(m):
        pos = (start + m - 1 - i) & (L - 1)
        kj = tl.load(k_base + pos * s_kt + offs_k * s_kk, mask=mask_k, other=0.0).to(tl.float32)
        dj = tl.load(d_base + pos * s_dt + offs_v * s_dv, mask=mask_v, other=0.0).to(tl.float32)
        S = tl.fma((kj * tl.exp(R))[:, None], dj[None, :], S)
        R += _ring_g(g_base, pos, s_gt, s_gk, offs_k, mask_k, neg_a, bias, GDN, GATE_IN)
    return S


@triton.jit
def _fast_rebuild_kernel(state, idx, rd, rk, rg, ring_start, num_tokens, out, a_log, dt_bias,
                         s_sn, s_sh, s_sk, s_sv,
                         s_dn, s_dh, s_dt, s_dv,
                         s_kn, s_kh, s_kt, s_kk,
                         s_gn, s_gh, s_gt, s_gk,
                         s_ah, s_bh, s_bk,
                         H,
                         L: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         GDN: tl.constexpr, GATE_IN: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    offs_k, offs_v, mask_k, mask_v, mask_kv = state_tile(K, V, BK, BV)
    o_ptr = out + ((i_b * H + i_h) * K + offs_k[:, None]) * V + offs_v[None, :]
    s = tl.load(idx + i_b).to(tl.int64)
    if s < 0:
        tl.store(o_ptr, tl.zeros([BK, BV], dtype=tl.float32), mask=mask_kv)
        return
    m = tl.load(num_tokens + i_b).to(tl.int32)
    start = tl.load(ring_start + s).to(tl.int64)
    S0 = tl.load(state + s * s_sn + i_h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv,
                 mask=mask_kv, other=0.0).to(tl.float32)
    neg_a, bias = gate_params(a_log, dt_bias, i_h, offs_k, mask_k, s_ah, s_bh, s_bk, BK, GATE_IN)
    S = rebuild_tile(S0, rd + s * s_dn + i_h * s_dh, rk + s * s_kn + i_h * s_kh, rg + s * s_gn + i_h * s_gh,
                     start, m, s_dt, s_dv, s_kt, s_kk, s_gt, s_gk, offs_k, offs_v, mask_k, mask_v, neg_a, bias, L, BK,
                     GDN, GATE_IN)
    tl.store(o_ptr, S, mask=mask_kv)


def fast_rebuild(ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, ring_d: torch.Tensor,
                 ring_k: torch.Tensor, ring_g: torch.Tensor, ring_start: torch.Tensor,
                 num_tokens: torch.Tensor, *, A_log: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`S_m = Diag(A_{1:m}) S_0 + sum_j Diag(A_{j+1:m}) k_j d_j^T` per request (see `naive.fast_rebuild`).

    Returns `[B, H, K, V]` fp32; a row whose slot is negative comes back as zeros.
    """
    check_float("fast_rebuild", ssm_state, ring_d, ring_k, ring_g)
    N, H, K, V = ssm_state.shape
    L = ring_d.shape[2]
    B = ssm_state_indices.shape[0]
    if L & (L - 1):
        raise ValueError(f"ring_d: ring depth L={L} must be a power of two")
    if ring_d.shape[:3] != (N, H, L) or ring_d.shape[3] != V or ring_k.shape != (N, H, L, K):
        raise ValueError(f"ring_d / ring_k: expected [{N}, {H}, L, {V}] / [{N}, {H}, L, {K}], "
                         f"got {list(ring_d.shape)} / {list(ring_k.shape)}")
    if ring_g.dim() != 4 or ring_g.shape[:3] != (N, H, L) or ring_g.shape[3] not in (1, K):
        raise ValueError(f"ring_g: expected [{N}, {H}, {L}, {K} or 1], got {list(ring_g.shape)}")
    if num_tokens.shape != (B,):
        raise ValueError(f"num_tokens: expected shape [{B}], got {list(num_tokens.shape)}")
    gate_in = check_gate_params(A_log, dt_bias, (), H, K, ring_g)
    out = torch.empty(B, H, K, V, dtype=torch.float32, device=ssm_state.device)
    if B == 0:
        return out
    BK, BV, num_warps = state_blocks(K, V, "rebuild", device_name(ssm_state))
    _fast_rebuild_kernel[(B, H, triton.cdiv(V, BV))](
        ssm_state, ssm_state_indices, ring_d, ring_k, ring_g, ring_start, num_tokens, out,
        A_log if gate_in else out, dt_bias if gate_in else out,
        *ssm_state.stride(), *ring_d.stride(), *ring_k.stride(), *ring_g.stride(),
        *(A_log.stride() + dt_bias.stride() if gate_in else (0, 0, 0)), H,
        L=L, K=K, V=V, BK=BK, BV=BV, GDN=ring_g.shape[3] == 1 and K != 1, GATE_IN=gate_in, num_warps=num_warps,
        enable_fp_fusion=False)
    return out
