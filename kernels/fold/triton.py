"""Triton exact fold: all layers of all requests in one launch, fp32, the verify kernel's own step; the conv
windows of the same rows are rebuilt from their input records by extra programs of that launch.

Same arguments and semantics as `kernels/fold/naive.py` (its signature is the op's one). The step, norm and gate
come from `kernels/triton_utils.py`, shared with the verify kernel, so on one device the fold of n records gives bit
for bit the state of n verify steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ..scatter.triton import conv_commit_tile
from ..triton_utils import (cast_to, check_float, delta_step, device_name, gate_params, load_gate, prepare_k,
                           state_blocks, state_tile)
from ..common import check_gate_params, check_rule, keyword_options
from .naive import check_fold_args
from .naive import exact_fold as reference_fold


@triton.jit
def _exact_fold_kernel(
        state, rawv, rawk, rg, rbeta, idx, ring_idx, ring_start, num_tokens, offsets, seq_lens, track,
        conv, xin, cpath, ccount, a_log, dt_bias,
        s_sl, s_sn, s_sh, s_sk, s_sv,
        s_vl, s_vn, s_vh, s_vt, s_vv,
        s_kl, s_kn, s_kh, s_kt, s_kk,
        s_gl, s_gn, s_gh, s_gt, s_gk,
        s_bl, s_bn, s_bh, s_bt,
        s_ob, s_om,
        s_tl, s_tn, s_tp, s_th, s_tk, s_tv,
        s_cl, s_cn, s_cc, s_ck, s_xl, s_xr, s_xt, s_xc, s_pb, s_pm,
        s_al, s_ah, s_el, s_eh, s_ek,
        B, H, C, null_slot, track_interval, eps,
        L: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GDN: tl.constexpr,
        HAS_OFFSETS: tl.constexpr, HAS_START: tl.constexpr, HAS_TRACK: tl.constexpr, SQRT_DIV: tl.constexpr,
        W: tl.constexpr, BC: tl.constexpr, HAS_CPATH: tl.constexpr, MAMBA2: tl.constexpr, GATE_IN: tl.constexpr):
    # grid (Lyr * B, H + conv channel blocks, V blocks): heads fold the state, the extra programs (first V block
    # only) rebuild the conv window of the same (layer, row)
    pid = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    lyr = pid // B
    b = pid % B
    s = tl.load(idx + b).to(tl.int64)
    if i_h >= H:
        if W > 0:
            nc = tl.load(ccount + b).to(tl.int32)
            if (i_v == 0) & (s >= 0) & (s != null_slot) & (nc > 0):
                conv_commit_tile(conv, xin, cpath, s, b, lyr, nc, (i_h - H).to(tl.int32), C,
                                 s_cl, s_cn, s_cc, s_ck, s_xl, s_xr, s_xt, s_xc, s_pb, s_pm, W, BC, HAS_CPATH)
        return
    n = tl.load(num_tokens + b).to(tl.int32)
    if (s < 0) | (s == null_slot) | (n <= 0):
        return
    r = tl.load(ring_idx + b).to(tl.int64)
    start = 0
    if HAS_START:
        start = tl.load(ring_start + r).to(tl.int64)
    offs_k, offs_v, mask_k, mask_v, mask_kv = state_tile(K, V, BK, BV)
    st_off = lyr * s_sl + s * s_sn + i_h * s_sh
    kv_off = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    S = tl.load(state + st_off + kv_off, mask=mask_kv, other=0.0).to(tl.float32)
    neg_a, bias = gate_params(a_log + lyr * s_al, dt_bias + lyr * s_el, i_h, offs_k, mask_k, s_ah, s_eh, s_ek, BK,
                              GATE_IN)
    v_base = rawv + lyr * s_vl + r * s_vn + i_h * s_vh
    k_base = rawk + lyr * s_kl + r * s_kn + i_h * s_kh
    g_base = rg + lyr * s_gl + r * s_gn + i_h * s_gh
    b_base = rbeta + lyr * s_bl + r * s_bn + i_h * s_bh
    if HAS_TRACK:
        # the next token count that is a multiple of the interval, and its ping-pong parity: one division
        # before the loop instead of a 64-bit modulo per record
        seq0 = tl.load(seq_lens + s).to(tl.int64)
        nxt = (seq0 // track_interval + 1) * track_interval
        par = (seq0 // track_interval + 1) % 2
    for j in tl.range(0, n, num_stages=2):
        if HAS_OFFSETS:
            off = tl.load(offsets + b * s_ob + j * s_om).to(tl.int64)
        else:
            off = j
        if HAS_START:
            pos = (start + off) & (L - 1)
        else:  # eager layout: offset = position
            pos = off
        kr = tl.load(k_base + pos * s_kt + offs_k * s_kk, mask=mask_k, other=0.0).to(tl.float32)
        vr = tl.load(v_base + pos * s_vt + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
        _, alpha = load_gate(g_base + pos * s_gt, offs_k, mask_k, s_gk, BK, GDN, GATE_IN, neg_a, bias)
        bt = tl.load(b_base + pos * s_bt).to(tl.float32)
        S, _ = delta_step(S, prepare_k(kr, eps, SQRT_DIV, MAMBA2), vr, alpha, bt, MAMBA2)
        if HAS_TRACK:
            if seq0 + j + 1 == nxt:
                t_off = lyr * s_tl + s * s_tn + par * s_tp + i_h * s_th
                tl.store(track + t_off + offs_k[:, None] * s_tk + offs_v[None, :] * s_tv,
                         cast_to(S, track), mask=mask_kv)
                nxt += track_interval
                par = 1 - par
    tl.store(state + st_off + kv_off, cast_to(S, state), mask=mask_kv)


def exact_fold(ssm_state: torch.Tensor, ring_rawv: torch.Tensor, ring_rawk: torch.Tensor, ring_g: torch.Tensor,
               ring_beta: torch.Tensor, ssm_state_indices: torch.Tensor, ring_start: torch.Tensor | None,
               num_tokens: torch.Tensor, **options) -> None:
    """`naive.exact_fold` (the same arguments and keyword options, checked as there) in one launch.

    One launch over (layer x request, head + conv channel block, V block); per program the K x BV state tile
    stays in registers while the records are stepped through in plain-decode op order. `rule="mamba2"`: the
    records replay the Mamba2 step (rawk = B, not normalized), a constexpr flag of the same kernel. `A_log`
    `[Lyr, H]`, `dt_bias` `[Lyr, H, K]`: ring_g holds the KDA gate's input and each step computes the gate as the
    verify kernel does (`triton_utils.kda_gate`).
    """
    o = SimpleNamespace(**keyword_options(reference_fold, options))
    check_rule(o.rule)
    check_float("exact_fold", ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, o.track_states, o.conv_state,
                o.conv_inputs)
    if o.norm not in ("rsqrt", "sqrt_div"):
        raise ValueError(f"norm: expected 'rsqrt' or 'sqrt_div', got {o.norm!r}")
    check_fold_args(ssm_state, ring_beta, ssm_state_indices, num_tokens, o.ring_indices, o.conv_state,
                    o.conv_inputs, o.conv_count)
    Lyr, N, H, K, V = ssm_state.shape
    R, L = ring_beta.shape[1], ring_beta.shape[3]
    if ring_start is not None and L & (L - 1):
        raise ValueError(f"ring_beta: ring depth L={L} must be a power of two")
    if ring_rawv.shape != (Lyr, R, H, L, V) or ring_rawk.shape != (Lyr, R, H, L, K):
        raise ValueError(f"ring_rawv / ring_rawk: expected [{Lyr}, {R}, {H}, {L}, {V}] / [..., {K}], "
                         f"got {list(ring_rawv.shape)} / {list(ring_rawk.shape)}")
    if ring_g.shape[:4] != (Lyr, R, H, L) or ring_g.dim() != 5 or ring_g.shape[4] not in (1, K):
        raise ValueError(f"ring_g: expected [{Lyr}, {R}, {H}, {L}, {K} or 1], got {list(ring_g.shape)}")
    gate_in = check_gate_params(o.A_log, o.dt_bias, (Lyr,), H, K, ring_g)
    B = ssm_state_indices.shape[0]
    if B == 0 or Lyr == 0:
        return
    has_track = o.track_interval is not None and o.seq_lens is not None
    if has_track:
        if o.track_states is None or o.track_states.shape != (Lyr, N, 2, H, K, V):
            raise ValueError(f"track_states: expected [{Lyr}, {N}, 2, {H}, {K}, {V}] with track_interval, got "
                             f"{None if o.track_states is None else list(o.track_states.shape)}")
    has_off = o.offsets is not None
    if has_off and (o.offsets.dim() != 2 or o.offsets.shape[0] < B):
        raise ValueError(f"offsets: expected [>={B}, M], got {list(o.offsets.shape)}")
    has_conv = o.conv_state is not None
    cpath = o.offsets if o.conv_path is None else o.conv_path
    if has_conv and cpath is not None and (cpath.dim() != 2 or cpath.shape[0] < B):
        raise ValueError(f"conv_path: expected [>={B}, M], got {list(cpath.shape)}")
    C, W = (o.conv_state.shape[2], o.conv_state.shape[3]) if has_conv else (0, 0)
    BC = min(triton.next_power_of_2(max(C, 1)), 256)
    BK, BV, num_warps = state_blocks(K, V, "fold", device_name(ssm_state))
    off_t = o.offsets if has_off else num_tokens
    tr = o.track_states if has_track else ssm_state
    sl = o.seq_lens if has_track else num_tokens
    grid = (Lyr * B, H + (triton.cdiv(C, BC) if has_conv else 0), triton.cdiv(V, BV))
    _exact_fold_kernel[grid](
        ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, ssm_state_indices,
        ssm_state_indices if o.ring_indices is None else o.ring_indices,
        num_tokens if ring_start is None else ring_start, num_tokens, off_t, sl, tr,
        o.conv_state if has_conv else ssm_state, o.conv_inputs if has_conv else ssm_state,
        cpath if (has_conv and cpath is not None) else num_tokens,
        (num_tokens if o.conv_count is None else o.conv_count) if has_conv else num_tokens,
        o.A_log if gate_in else ssm_state, o.dt_bias if gate_in else ssm_state,
        *ssm_state.stride(), *ring_rawv.stride(), *ring_rawk.stride(), *ring_g.stride(), *ring_beta.stride(),
        *(o.offsets.stride() if has_off else (0, 0)),
        *(o.track_states.stride() if has_track else (0,) * 6),
        *(o.conv_state.stride() if has_conv else (0,) * 4), *(o.conv_inputs.stride() if has_conv else (0,) * 4),
        *(cpath.stride() if (has_conv and cpath is not None) else (0, 0)),
        *(o.A_log.stride() + o.dt_bias.stride() if gate_in else (0,) * 5),
        B, H, C, int(o.null_slot), int(o.track_interval) if has_track else 1, float(o.eps),
        L=L, K=K, V=V, BK=BK, BV=BV, GDN=ring_g.shape[4] == 1 and K != 1, HAS_OFFSETS=has_off,
        HAS_START=ring_start is not None, HAS_TRACK=has_track, SQRT_DIV=o.norm == "sqrt_div",
        W=W, BC=BC, HAS_CPATH=has_conv and cpath is not None, MAMBA2=o.rule == "mamba2", GATE_IN=gate_in,
        num_warps=num_warps,
        enable_fp_fusion=False)
