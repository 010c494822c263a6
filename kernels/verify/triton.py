"""Triton verify: delta rule over D chain tokens or T tree nodes, and the short conv in front of it.

Same signatures and semantics as `kernels/verify/naive.py`. One program per (request, head, V block):
- chain: the state stays in registers across the tokens;
- tree: the nodes run in the order of `tree.tree_schedule` (depth first, smaller subtree first); a node
  whose parent ran just before goes on from the state in registers, any other reloads its parent's state,
  from `tree_stack` (`[>= B, tree_stack_slots(T), H, K, V]`: a state is kept only while a later child needs
  it) or, without it, from `intermediate_states` (every node's state, the snapshot strategy's buffer); an
  fp32 buffer takes parents bit for bit, a bf16 one rounds them; a root (parent -1) restarts from the
  checkpoint;
- rings: `d`, `k` (normalized), `g`, `rawv`, `rawk`, `beta` of token t go to position
  `(ring_start[r] + num_pending[r] + t) & (L - 1)` of the request's ring row r (its slot, or with
  `ring_indices` its running row); without `ring_start` (eager layout) to position t, and without the
  `d`, `k` rings only the four records the fold reads;
- lazy: with `num_pending`, the start state is the fast rebuild of the checkpoint and the pending
  `(d, k, g)` records, computed in the same program (no separate launch).
The step is `triton_utils.delta_step`, the one the exact fold takes (`rule="mamba2"`: its Mamba2 form, a
constexpr flag of the same kernel). The checkpoint is never written.
Rows whose slot is -1 or `null_slot` write zero outputs and nothing else.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ..common import (check_delta_inputs, check_gate_params, check_rule, check_shape, check_verify_buffers,
                      keyword_options)
from ..tree import VerifyTree, as_tree, tree_stack_slots
from .naive import check_conv_verify_args, check_ring_args
from .naive import verify_delta_rule as reference_verify
from ..rebuild.triton import rebuild_tile
from ..triton_utils import (cast_to, check_float, delta_step, device_name, gate_params, load_gate, num_warps_for,
                            prepare_k, prepare_q, readout, state_blocks, state_tile)


@triton.jit
def _pick(j: tl.constexpr, a, b, c, d):
    """The j-th of four values (j known at compile time)."""
    if j == 0:
        r = a
    elif j == 1:
        r = b
    elif j == 2:
        r = c
    else:
        r = d
    return r


@triton.jit
def _load_col(ptr, j: tl.constexpr, n: tl.constexpr, stride, mask, BC: tl.constexpr):
    """Column j of a per-channel `[C, n]` table as a `[BC]` fp32 vector (zeros for j >= n)."""
    if j < n:
        r = tl.load(ptr + j * stride, mask=mask, other=0.0).to(tl.float32)
    else:
        r = tl.zeros([BC], dtype=tl.float32)
    return r


@triton.jit
def _short_conv_verify_kernel(
        x, w, bias, conv_state, idx, parent, win, xin, y,
        s_xb, s_xt, s_xc, s_wc, s_wk, s_cn, s_cc, s_ck, s_pb, s_pt,
        s_wb, s_wt, s_wcc, s_wkk, s_ib, s_it, s_ic,
        T, C, null_slot,
        KC: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        IS_TREE: tl.constexpr, HAS_WIN: tl.constexpr, HAS_IN: tl.constexpr):
    # KC <= 4: the weights and the slot's window live in registers as column vectors, read once per program;
    # in the token loop every load is a contiguous [BC] vector of x.
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    offs_c = i_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    y_base = y + i_b * T * C + offs_c
    s = tl.load(idx + i_b).to(tl.int64)
    if (s < 0) | (s == null_slot):
        for t in range(T):
            tl.store(y_base + t * C, cast_to(tl.zeros([BC], dtype=tl.float32), y), mask=mask_c)
        return
    x_base = x + i_b * s_xb + offs_c * s_xc
    w_base = w + offs_c * s_wc
    w0 = _load_col(w_base, 0, KC, s_wk, mask_c, BC)
    w1 = _load_col(w_base, 1, KC, s_wk, mask_c, BC)
    w2 = _load_col(w_base, 2, KC, s_wk, mask_c, BC)
    w3 = _load_col(w_base, 3, KC, s_wk, mask_c, BC)
    c_base = conv_state + s * s_cn + offs_c * s_cc  # window columns, oldest first
    c0 = _load_col(c_base, 0, KC - 1, s_ck, mask_c, BC)
    c1 = _load_col(c_base, 1, KC - 1, s_ck, mask_c, BC)
    c2 = _load_col(c_base, 2, KC - 1, s_ck, mask_c, BC)
    if HAS_BIAS:
        bv = tl.load(bias + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for t in range(T):
        # Walk from the token up its ancestors: column KC-1 of the conv input is x_t, column KC-2 its
        # parent's x, ...; once past the root the columns come from the slot's window, newest first.
        cur = tl.zeros([], dtype=tl.int32) + t
        wcol = tl.zeros([], dtype=tl.int32) + (KC - 2)
        acc = tl.zeros([BC], dtype=tl.float32)
        for jj in tl.static_range(KC):
            in_seq = cur >= 0
            xv = tl.load(x_base + tl.maximum(cur, 0) * s_xt, mask=mask_c, other=0.0).to(tl.float32)
            wv = tl.where(wcol == 0, c0, tl.where(wcol == 1, c1, c2))
            val = tl.where(in_seq, xv, wv)
            acc = tl.fma(val, _pick(KC - 1 - jj, w0, w1, w2, w3), acc)
            if HAS_IN:
                if jj == 0:  # the token's own pre-conv input: the record commit rebuilds windows from
                    tl.store(xin + i_b * s_ib + t * s_it + offs_c * s_ic, cast_to(val, xin), mask=mask_c)
            if HAS_WIN:
                if jj < KC - 1:
                    tl.store(win + i_b * s_wb + t * s_wt + offs_c * s_wcc + (KC - 2 - jj) * s_wkk,
                             cast_to(val, win), mask=mask_c)
            if IS_TREE:
                nxt = tl.load(parent + i_b * s_pb + tl.maximum(cur, 0) * s_pt)
            else:
                nxt = cur - 1
            wcol = tl.where(in_seq, wcol, wcol - 1)
            cur = tl.where(in_seq, nxt, -1)
        if HAS_BIAS:
            acc = acc + bv
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_base + t * C, cast_to(acc, y), mask=mask_c)


def short_conv_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      conv_state_indices: torch.Tensor, *, parent: VerifyTree | torch.Tensor | None = None,
                      window_states: torch.Tensor | None = None, conv_inputs: torch.Tensor | None = None,
                      activation: str | None = "silu", null_slot: int = -1) -> torch.Tensor:
    """Short conv over the verify tokens of each request, from its slot's window (see `naive`)."""
    check_float("short_conv_verify", x, weight, bias, conv_state, window_states, conv_inputs)
    B, T, C, Kc = check_conv_verify_args(x, weight, conv_state, conv_state_indices, window_states, conv_inputs,
                                         activation)
    if bias is not None:
        check_shape("bias", bias, (C,))
        bias = bias.contiguous()
    tree = as_tree(parent, B, T, x.device)
    par = None if tree is None else tree.int32()
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    if B == 0 or T == 0:
        return y
    if not 2 <= Kc <= 4:
        raise ValueError(f"weight: the Triton short conv takes kernel sizes 2..4, got {Kc}")
    BC = min(triton.next_power_of_2(C), 256)
    win = window_states if window_states is not None else y
    xin = conv_inputs if conv_inputs is not None else y
    _short_conv_verify_kernel[(B, triton.cdiv(C, BC))](
        x, weight, bias if bias is not None else weight, conv_state, conv_state_indices,
        par if par is not None else conv_state_indices, win, xin, y,
        *x.stride(), *weight.stride(), *conv_state.stride(), *(par.stride() if par is not None else (0, 0)),
        *(window_states.stride() if window_states is not None else (0,) * 4),
        *(conv_inputs.stride() if conv_inputs is not None else (0,) * 3),
        T, C, int(null_slot),
        KC=Kc, BC=BC, HAS_BIAS=bias is not None, SILU=activation == "silu", IS_TREE=par is not None,
        HAS_WIN=window_states is not None, HAS_IN=conv_inputs is not None, num_warps=num_warps_for(BC * 8),
        enable_fp_fusion=False)
    return y


@triton.jit
def _root_state(state, s, i_h, s_sn, s_sh, kv_state, mask_kv, d_base, k_base, g_base, start, m,
                s_dt, s_dv, s_kt, s_kk, s_gt, s_gk, offs_k, offs_v, mask_k, mask_v, neg_a, bias,
                L: tl.constexpr, BK: tl.constexpr, RING_GDN: tl.constexpr, HAS_PENDING: tl.constexpr,
                GATE_IN: tl.constexpr):
    """The state a request's verify starts from: its checkpoint, plus the pending records (lazy)."""
    S = tl.load(state + s * s_sn + i_h * s_sh + kv_state, mask=mask_kv, other=0.0).to(tl.float32)
    if HAS_PENDING:
        S = rebuild_tile(S, d_base, k_base, g_base, start, m, s_dt, s_dv, s_kt, s_kk, s_gt, s_gk,
                         offs_k, offs_v, mask_k, mask_v, neg_a, bias, L, BK, RING_GDN, GATE_IN)
    return S


@triton.jit
def _verify_kernel(
        q, k, v, g, beta, state, idx, parent, order, load, store, inter, stack, o,
        rd, rk, rg, rrv, rrk, rb, ring_start, num_pending, ring_idx, a_log, dt_bias,
        sq_b, sq_t, sq_h, sq_k, sk_b, sk_t, sk_h, sk_k, sv_b, sv_t, sv_h, sv_v,
        sg_b, sg_t, sg_h, sg_k, sb_b, sb_t, sb_h,
        s_sn, s_sh, s_sk, s_sv,
        s_ib, s_it, s_ih, s_ik, s_iv,
        s_tb, s_tt, s_th, s_tk, s_tv,
        s_dn, s_dh, s_dt, s_dv,
        s_kn, s_kh, s_kt, s_kk,
        s_gn, s_gh, s_gt, s_gk,
        s_vn, s_vh, s_vt, s_vv,
        s_rn, s_rh, s_rt, s_rk,
        s_bn, s_bh, s_bt,
        s_ah, s_ch, s_ck,
        T, H, null_slot, scale, eps,
        L: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        GDN: tl.constexpr, RING_GDN: tl.constexpr, RGK, IS_TREE: tl.constexpr, HAS_INTER: tl.constexpr,
        HAS_STACK: tl.constexpr,
        HAS_RING: tl.constexpr, HAS_START: tl.constexpr, HAS_DK: tl.constexpr, HAS_PENDING: tl.constexpr,
        SQRT_DIV: tl.constexpr, STAGES: tl.constexpr, MAMBA2: tl.constexpr, GATE_IN: tl.constexpr):
    # inputs [B, T, H, *] at any strides; o [B, T, H, V] contiguous; parent, order, load, store [B, T]
    # contiguous int32.
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    offs_k, offs_v, mask_k, mask_v, mask_kv = state_tile(K, V, BK, BV)
    o_ptr = o + (i_b * T * H + i_h) * V + offs_v
    s = tl.load(idx + i_b).to(tl.int64)
    if (s < 0) | (s == null_slot):
        for t in range(T):
            tl.store(o_ptr + t * H * V, cast_to(tl.zeros([BV], dtype=tl.float32), o), mask=mask_v)
        return
    kv_state = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    neg_a, bias = gate_params(a_log, dt_bias, i_h, offs_k, mask_k, s_ah, s_ch, s_ck, BK, GATE_IN)
    base = 0
    m = 0
    start = 0
    ri = s  # ring row: the slot (rings per slot) or the request's running row (eager layout)
    if HAS_RING:
        ri = tl.load(ring_idx + i_b).to(tl.int64)
    d_base = rd + ri * s_dn + i_h * s_dh
    k_base = rk + ri * s_kn + i_h * s_kh
    g_base = rg + ri * s_gn + i_h * s_gh
    v_base = rrv + ri * s_vn + i_h * s_vh
    r_base = rrk + ri * s_rn + i_h * s_rh
    b_base = rb + ri * s_bn + i_h * s_bh
    if HAS_START:
        start = tl.load(ring_start + ri).to(tl.int64)
        base = start
        if HAS_PENDING:
            m = tl.load(num_pending + ri).to(tl.int32)
            base = start + m
    S = _root_state(state, s, i_h, s_sn, s_sh, kv_state, mask_kv, d_base, k_base, g_base, start, m,
                    s_dt, s_dv, s_kt, s_kk, s_gt, s_gk, offs_k, offs_v, mask_k, mask_v, neg_a, bias, L, BK, RING_GDN,
                    HAS_PENDING, GATE_IN)
    kv_inter = offs_k[:, None] * s_ik + offs_v[None, :] * s_iv
    kv_stack = offs_k[:, None] * s_tk + offs_v[None, :] * s_tv
    q0 = q + i_b * sq_b + i_h * sq_h + offs_k * sq_k
    k0 = k + i_b * sk_b + i_h * sk_h + offs_k * sk_k
    v0 = v + i_b * sv_b + i_h * sv_h + offs_v * sv_v
    g0 = g + i_b * sg_b + i_h * sg_h
    b0 = beta + i_b * sb_b + i_h * sb_h
    o0 = o_ptr
    p_q, p_k, p_v, p_g, p_b = q0, k0, v0, g0, b0
    for t in tl.range(0, T, num_stages=STAGES):
        n = t  # the node of this step (a chain: the token)
        if IS_TREE:  # the schedule's node, its inputs and output, and where its start state is
            n = tl.load(order + i_b * T + t).to(tl.int64)
            p_q, p_k, p_v, p_g, p_b = q0 + n * sq_t, k0 + n * sk_t, v0 + n * sv_t, g0 + n * sg_t, b0 + n * sb_t
            o_ptr = o0 + n * H * V
            ld = tl.load(load + i_b * T + t)
            if ld == -1:
                S = _root_state(state, s, i_h, s_sn, s_sh, kv_state, mask_kv, d_base, k_base, g_base, start, m,
                                s_dt, s_dv, s_kt, s_kk, s_gt, s_gk, offs_k, offs_v, mask_k, mask_v, neg_a, bias,
                                L, BK, RING_GDN, HAS_PENDING, GATE_IN)
            elif ld >= 0:
                if HAS_STACK:
                    S = tl.load(stack + i_b * s_tb + ld.to(tl.int64) * s_tt + i_h * s_th + kv_stack,
                                mask=mask_kv, other=0.0).to(tl.float32)
                else:
                    pn = tl.load(parent + i_b * T + n).to(tl.int64)
                    S = tl.load(inter + i_b * s_ib + pn * s_it + i_h * s_ih + kv_inter,
                                mask=mask_kv, other=0.0).to(tl.float32)
        qt = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        kt = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        vt = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        gt, alpha = load_gate(p_g, offs_k, mask_k, sg_k, BK, GDN, GATE_IN, neg_a, bias)
        bt = tl.load(p_b).to(tl.float32)
        kn = prepare_k(kt, eps, SQRT_DIV, MAMBA2)
        S, d = delta_step(S, kn, vt, alpha, bt, MAMBA2)
        ot = readout(S, prepare_q(qt, eps, scale, SQRT_DIV, MAMBA2))
        tl.store(o_ptr, cast_to(ot, o), mask=mask_v)
        if HAS_INTER:
            tl.store(inter + i_b * s_ib + n * s_it + i_h * s_ih + kv_inter, cast_to(S, inter), mask=mask_kv)
        if IS_TREE:
            if HAS_STACK:
                st = tl.load(store + i_b * T + t)
                if st >= 0:
                    tl.store(stack + i_b * s_tb + st.to(tl.int64) * s_tt + i_h * s_th + kv_stack,
                             cast_to(S, stack), mask=mask_kv)
            tl.debug_barrier()  # a later step's reload reads what other threads of this program stored
        if HAS_RING:
            if HAS_START:
                pos = (base + n) & (L - 1)
            else:  # eager layout: record n at position n
                pos = n
            if HAS_DK:
                tl.store(d_base + pos * s_dt + offs_v * s_dv, cast_to(d, rd), mask=mask_v)
            tl.store(v_base + pos * s_vt + offs_v * s_vv, cast_to(vt, rrv), mask=mask_v)
            if i_v == 0:
                if HAS_DK:
                    tl.store(k_base + pos * s_kt + offs_k * s_kk, cast_to(kn, rk), mask=mask_k)
                tl.store(g_base + pos * s_gt + offs_k * s_gk, cast_to(gt, rg), mask=offs_k < RGK)
                tl.store(r_base + pos * s_rt + offs_k * s_rk, cast_to(kt, rrk), mask=mask_k)
                tl.store(b_base + pos * s_bt, cast_to(bt, rb))
        if not IS_TREE:
            p_q += sq_t
            p_k += sk_t
            p_v += sv_t
            p_g += sg_t
            p_b += sb_t
            o_ptr += H * V


def verify_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, *,
                      tree_stack: torch.Tensor | None = None, **options) -> torch.Tensor:
    """`naive.verify_delta_rule` (the same arguments and keyword options) in one launch.

    Trees need `tree_stack` `[>= B, tree.tree_stack_slots(T), H, K, V]` (the parent states a later child
    reloads) or `intermediate_states` (every node's state); the walk is the tree's `VerifyTree.schedule()`, made
    once per tree: a round passes one `VerifyTree` to every layer. Ring records are stored in the ring tensors'
    dtypes; the checkpoint is read only. `rule="mamba2"`: the same kernel with the Mamba2 step (q = C, k = B
    taken as they come: no norm, no scale; the `k` ring holds B). `A_log` `[H]`, `dt_bias` `[H, K]`: g is the KDA
    gate's input f, the kernel computes `common.kda_gate(f)` per token and the g ring keeps f (in its dtype: a
    bf16 ring holds a bf16 model's f exactly, half the bytes of an fp32 log-decay).
    """
    opt = SimpleNamespace(**keyword_options(reference_verify, options))
    check_rule(opt.rule)
    check_float("verify_delta_rule", q, k, v, g, beta, ssm_state, opt.intermediate_states, tree_stack,
                *(t for t in (opt.ring or ()) if t is not None))
    B, T, H, K, V, g = check_delta_inputs(q, k, v, g, beta)
    if g.shape[-1] not in (1, K):
        raise ValueError(f"g: expected last dim {K} (KDA) or none (GDN), got {list(g.shape)}")
    gate_in = check_gate_params(opt.A_log, opt.dt_bias, (), H, K, g)
    check_verify_buffers(B, T, H, K, V, ssm_state, ssm_state_indices, opt.intermediate_states)
    if opt.norm not in ("rsqrt", "sqrt_div"):
        raise ValueError(f"norm: expected 'rsqrt' or 'sqrt_div', got {opt.norm!r}")
    tree = as_tree(opt.parent, B, T, k.device)
    par = None if tree is None else tree.int32()
    if par is not None and opt.intermediate_states is None and tree_stack is None:
        raise ValueError("tree_stack: a tree verify needs tree_stack or intermediate_states (where parent states "
                         "are kept)")
    if tree_stack is not None:
        slots = tree_stack_slots(T)
        if tree_stack.dim() != 5 or tree_stack.shape[0] < B or tree_stack.shape[1] < slots \
                or tree_stack.shape[2:] != (H, K, V):
            raise ValueError(f"tree_stack: expected [>={B}, >={slots}, {H}, {K}, {V}], got {list(tree_stack.shape)}")
    if par is not None:
        order, load, store = (t.contiguous() for t in tree.schedule())
    check_ring_args(opt.ring, opt.ring_start, opt.num_pending, opt.ring_indices, B, T)
    has_dk = False
    if opt.ring is not None:
        rd, rk, rg, rrv, rrk, rb = opt.ring
        N, L = rg.shape[0], rg.shape[2]
        has_dk = rd is not None and rk is not None
        for name, t, dim in (("d", rd, V), ("k", rk, K), ("rawv", rrv, V), ("rawk", rrk, K)):
            if t is not None:
                check_shape(f"ring[{name}]", t, (N, H, L, dim))
        check_shape("ring[beta]", rb, (N, H, L))
        if rg.dim() != 4 or rg.shape[:3] != (N, H, L) or rg.shape[3] not in (1, K) \
                or (rg.shape[3] == 1 and g.shape[-1] == K and K != 1):
            raise ValueError(f"ring[g]: expected [{N}, {H}, {L}, {g.shape[-1]}], got {list(rg.shape)}")
        if opt.ring_start is not None and L & (L - 1):
            raise ValueError(f"ring: ring depth L={L} must be a power of two")
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return o
    scale = K ** -0.5 if opt.scale is None else float(opt.scale)
    BK, BV, num_warps = state_blocks(K, V, "verify", device_name(ssm_state))
    has_ring = opt.ring is not None
    has_inter = opt.intermediate_states is not None
    has_stack = par is not None and tree_stack is not None
    if par is None:
        order = load = store = ssm_state_indices
    if has_ring:
        if not has_dk:  # eager layout: no d / k records (never written)
            rd, rk = rrv, rrk
        ring_args = (rd, rk, rg, rrv, rrk, rb)
        ring_strides = (*rd.stride(), *rk.stride(), *rg.stride(), *rrv.stride(), *rrk.stride(), *rb.stride())
        RGK = rg.shape[3]
    else:
        ring_args = (ssm_state,) * 6
        ring_strides = (0,) * 23
        L, RGK = 1, 1
    _verify_kernel[(B, H, triton.cdiv(V, BV))](
        q, k, v, g, beta, ssm_state, ssm_state_indices, par if par is not None else ssm_state_indices,
        order, load, store, opt.intermediate_states if has_inter else o, tree_stack if has_stack else o, o, *ring_args,
        opt.ring_start if opt.ring_start is not None else ssm_state_indices,
        opt.num_pending if opt.num_pending is not None else ssm_state_indices,
        opt.ring_indices if opt.ring_indices is not None else ssm_state_indices,
        opt.A_log if gate_in else o, opt.dt_bias if gate_in else o,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        *ssm_state.stride(), *(opt.intermediate_states.stride() if has_inter else (0,) * 5),
        *(tree_stack.stride() if has_stack else (0,) * 5), *ring_strides,
        *(opt.A_log.stride() + opt.dt_bias.stride() if gate_in else (0, 0, 0)),
        T, H, int(opt.null_slot), scale, float(opt.eps),
        L=L, K=K, V=V, BK=BK, BV=BV, GDN=g.shape[-1] == 1 and K != 1, RING_GDN=has_ring and RGK == 1 and K != 1,
        RGK=RGK, IS_TREE=par is not None, HAS_INTER=has_inter, HAS_STACK=has_stack, HAS_RING=has_ring,
        HAS_START=has_ring and opt.ring_start is not None, HAS_DK=has_dk,
        HAS_PENDING=opt.num_pending is not None, SQRT_DIV=opt.norm == "sqrt_div",
        STAGES=1 if par is not None else 2,
        MAMBA2=opt.rule == "mamba2", GATE_IN=gate_in, num_warps=num_warps, enable_fp_fusion=False,
        **({"maxnreg": 128} if par is not None else {}))
    return o
