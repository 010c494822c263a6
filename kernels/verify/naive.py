"""Verify over D chain tokens or T tree nodes: outputs, ring records, per-step states, conv windows or inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import (check_delta_inputs, check_gate_params, check_shape, check_verify_buffers, delta_step, kda_gate,
                      math_dtype, prepare_qk, valid_slots)
from ..rebuild.naive import fast_rebuild
from ..recurrent.naive import conv_taps
from ..tree import VerifyTree, as_tree


def _pick_parents(root: torch.Tensor, done: list[torch.Tensor], p: torch.Tensor | None) -> torch.Tensor:
    """Per row, the state (or window) a node starts from: `root` for parent -1, else the parent's output
    (`done[parent]`); a chain (`p` None) just continues from the previous token."""
    if p is None:
        return done[-1] if done else root
    return torch.stack([root[i] if p[i] < 0 else done[p[i]][i] for i in range(root.shape[0])])


def _valid_rows(indices: torch.Tensor, null_slot: int):
    """Rows `[R]` of `indices [B]` with a valid slot, whether that is every row (the usual case), and `sel`: a
    `[B, ...]` tensor on those rows (itself when every row is valid: no gathers)."""
    rows = valid_slots(indices, null_slot).nonzero().flatten()
    full = rows.numel() == indices.shape[0]
    return rows, full, (lambda x: x) if full else (lambda x: x[rows])


def conv_columns(conv_state: torch.Tensor, x: torch.Tensor, tree: VerifyTree | None, Kc: int) -> torch.Tensor:
    """The `Kc` conv inputs of every verify token, oldest first, by one row gather (no per-token loop).

    Tap `Kc-1` of token t is `x_t`, tap `Kc-2` its parent's input, ...; past the root the taps come from the
    slot's window, newest first. A chain (`tree` None) reads sliding windows of `[window, x]`, a view.

    Args:
        conv_state: windows `[R, C, Kc-1]`;  x: inputs `[R, T, C]`;  tree: `[R, T]` parents (-1 = the window) or
            None.
    Returns:
        `[R, T, Kc, C]` in the math dtype of `conv_state` and `x`.
    """
    R, T, C = x.shape
    W = Kc - 1
    dt = math_dtype(conv_state, x)
    full = torch.cat([conv_state.to(dt).transpose(1, 2), x.to(dt)], dim=1)  # [R, W + T, C]
    if tree is None:
        return full.unfold(1, Kc, 1).transpose(-1, -2)
    rows = tree.memo(("conv_rows", Kc), lambda: _conv_rows(tree.parent, R, T, Kc))  # [R * T * Kc]
    return full.reshape(R * (W + T), C).index_select(0, rows).view(R, T, Kc, C)


def _conv_rows(parent: torch.Tensor, R: int, T: int, Kc: int) -> torch.Tensor:
    """Rows of `full [R * (Kc-1 + T), C]` (see `conv_columns`) holding each token's `Kc` conv inputs, oldest
    first, flattened from `[R, T, Kc]`. Depends on the tree alone: kept with it, so built once per forward."""
    W = Kc - 1
    # Walk up from each token Kc-1 times (a loop over taps): a node's input is row W + node of `full`;
    # once past the root, the window's rows from the newest one down.
    cur = torch.arange(T, device=parent.device).expand(R, T)
    wrow = torch.full((R, T), W - 1, dtype=torch.long, device=parent.device)
    idx = []
    for _ in range(Kc):
        in_seq = cur >= 0
        idx.append(torch.where(in_seq, W + cur, wrow))
        wrow = torch.where(in_seq, wrow, wrow - 1)
        cur = torch.where(in_seq, parent.gather(1, cur.clamp(min=0)), -1)
    idx = torch.stack(idx[::-1], -1) + (W + T) * torch.arange(R, device=parent.device)[:, None, None]
    return idx.reshape(-1)


def check_conv_verify_args(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                           conv_state_indices: torch.Tensor, window_states: torch.Tensor | None,
                           conv_inputs: torch.Tensor | None, activation: str | None) -> tuple[int, int, int, int]:
    """The argument checks `short_conv_verify` (naive and Triton) shares -> (B, T, C, Kc)."""
    B, T, C = x.shape
    Kc = weight.shape[-1]
    check_shape("weight", weight, (C, Kc))
    check_shape("conv_state", conv_state, (None, C, Kc - 1))
    check_shape("conv_state_indices", conv_state_indices, (B,))
    if window_states is not None and (window_states.dim() != 4 or window_states.shape[0] < B
                                      or window_states.shape[1] < T or window_states.shape[2:] != (C, Kc - 1)):
        raise ValueError(f"window_states: expected [>={B}, >={T}, {C}, {Kc - 1}], got {list(window_states.shape)}")
    if conv_inputs is not None and (conv_inputs.dim() != 3 or conv_inputs.shape[0] < B
                                    or conv_inputs.shape[1] < T or conv_inputs.shape[2] != C):
        raise ValueError(f"conv_inputs: expected [>={B}, >={T}, {C}], got {list(conv_inputs.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    return B, T, C, Kc


def short_conv_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      conv_state_indices: torch.Tensor, *, parent: VerifyTree | torch.Tensor | None = None,
                      window_states: torch.Tensor | None = None, conv_inputs: torch.Tensor | None = None,
                      activation: str | None = "silu", null_slot: int = -1) -> torch.Tensor:
    """Short conv over the verify tokens of each request, from its slot's window, with no per-token loop.

    Args:
        x: pre-conv inputs `[B, T, C]`;  weight `[C, Kc]`;  bias `[C]` or None.
        conv_state: persistent windows of one layer `[N, C, Kc-1]` (read only).
        conv_state_indices: slot per request `[B]`; -1 or `null_slot` rows are skipped (output 0).
        parent: None (chain), a `VerifyTree`, or `[T]` / `[B, T]` tree parents (-1 = the slot's window), checked
            here (one host read): a round passes its `VerifyTree` to every layer.
        window_states: out `[R >= B, >= T, C, Kc-1]`: the window after each token / node (snapshot scheme).
        conv_inputs: out `[R >= B, >= T, C]`: each token's pre-conv input (the record commit rebuilds the
            window from, `scatter.rebuild_windows`).
    Returns:
        y `[B, T, C]` in x.dtype.
    """
    B, T, C, Kc = check_conv_verify_args(x, weight, conv_state, conv_state_indices, window_states, conv_inputs,
                                         activation)
    if T == 0:  # nothing to run (as the Triton kernel: an empty output)
        return x.new_zeros(B, 0, C)
    tree = as_tree(parent, B, T, x.device)
    rows, full, sel = _valid_rows(conv_state_indices, null_slot)
    if rows.numel() == 0:
        return x.new_zeros(B, T, C)
    cols = conv_columns(conv_state[sel(conv_state_indices)], sel(x), tree and tree.rows(None if full else rows), Kc)
    yr = conv_taps(cols, weight, bias, activation).to(x.dtype)  # [R, T, Kc, C] -> [R, T, C]
    if full:
        y = yr
    else:
        y = x.new_zeros(B, T, C)
        y[rows] = yr
    if window_states is not None:
        window_states[rows, :T] = cols[:, :, 1:].transpose(-1, -2).to(window_states.dtype)
    if conv_inputs is not None:
        conv_inputs[rows, :T] = sel(x).to(conv_inputs.dtype)
    return y


def check_ring_args(ring, ring_start, num_pending, ring_indices, B: int, T: int) -> None:
    """The ring arguments of `verify_delta_rule` (both backends): one `ValueError` naming the argument."""
    if ring is None:
        if num_pending is not None:
            raise ValueError("num_pending: needs ring (the pending records live there)")
        return
    if len(ring) != 6:
        raise ValueError(f"ring: expected (d, k, g, rawv, rawk, beta), got {len(ring)} tensors")
    if any(t is None for t in ring[2:]):
        raise ValueError("ring: g, rawv, rawk and beta are required (d and k may be None)")
    L = ring[2].shape[2]
    if T > L:
        raise ValueError(f"q: {T} verify tokens do not fit a ring of depth L={L}")
    if num_pending is not None:
        if ring_start is None or ring[0] is None or ring[1] is None:
            raise ValueError("num_pending: pending records need ring_start and the d, k rings (lazy layout)")
        if ring_indices is not None:
            raise ValueError("ring_indices: pending records live in per-slot rings; pass no ring_indices with "
                             "num_pending")
    if ring_indices is not None:
        check_shape("ring_indices", ring_indices, (B,))


def store_ring_records(ring: tuple[torch.Tensor | None, ...], recs: tuple[torch.Tensor, ...], slots: torch.Tensor,
                       rows: torch.Tensor, *, ring_start: torch.Tensor | None, num_pending: torch.Tensor | None,
                       ring_indices: torch.Tensor | None) -> None:
    """Write the verify records of the valid requests `rows [R]` (slots `slots [R]`) into the rings (both
    references): `recs = (d, k, g, rawv, rawk, beta)`, each `[R, T, H, dim]` (`beta` `[R, T, H]`); None rings
    (eager: d, k) are skipped. Request b's ring row is `ring_indices[b]` (default its slot); token t goes to
    position `(ring_start[r] + num_pending[r] + t) % L`, or t without `ring_start`."""
    T, L = recs[0].shape[1], ring[2].shape[2]
    ridx = slots if ring_indices is None else ring_indices[rows]
    base = torch.zeros_like(ridx) if ring_start is None else ring_start[ridx]
    if num_pending is not None:
        base = base + num_pending[ridx]
    pos = (base[:, None] + torch.arange(T, device=base.device)) % L  # [R, T]
    for buf, rec in zip(ring, recs):
        if buf is not None:
            buf[ridx[:, None], :, pos] = rec.to(buf.dtype)


@dataclass
class VerifyInputs:
    """A verify's checked inputs, restricted to its valid rows (`rows [R]`; `full`: all B rows, not gathered)."""

    tree: VerifyTree | None  # the valid rows' tree; None: a chain
    rows: torch.Tensor  # [R] long: rows whose slot is valid
    full: bool
    slots: torch.Tensor  # [R]
    qn: torch.Tensor  # [R, T, H, K] prepared q, k in the math dtype
    kn: torch.Tensor
    vv: torch.Tensor  # [R, T, H, V]
    gg: torch.Tensor  # [R, T, H, K or 1] log-decays
    grec: torch.Tensor  # [R, T, H, K or 1] what the g ring keeps: gg, or the KDA gate's input (A_log / dt_bias given)
    bb: torch.Tensor  # [R, T, H]
    root: torch.Tensor  # [R, H, K, V] the state the round starts from (checkpoint, + pending records if lazy)

    def sel(self, x: torch.Tensor) -> torch.Tensor:
        """`x [B, ...]` on the valid rows."""
        return x if self.full else x[self.rows]


def verify_inputs(q, k, v, g, beta, ssm_state, ssm_state_indices, *, parent=None, intermediate_states=None, ring=None,
                  ring_start=None, num_pending=None, ring_indices=None, scale=None, eps=1e-6, norm="rsqrt",
                  null_slot=-1, rule="delta", A_log=None, dt_bias=None) -> VerifyInputs | None:
    """The checks and preparation every CPU verify (per-token and chunk form) runs before computing: one error
    naming the argument before anything is written. -> None when there is nothing to run (no token, or no row with
    a valid slot)."""
    B, T, H, K, V, g = check_delta_inputs(q, k, v, g, beta)
    gate_in = check_gate_params(A_log, dt_bias, (), H, K, g)
    check_verify_buffers(B, T, H, K, V, ssm_state, ssm_state_indices, intermediate_states)
    check_ring_args(ring, ring_start, num_pending, ring_indices, B, T)
    if T == 0:  # nothing to run (as the Triton kernels: an empty output)
        return None
    tree = as_tree(parent, B, T, k.device)
    rows, full, sel = _valid_rows(ssm_state_indices, null_slot)
    if rows.numel() == 0:
        return None
    slots = sel(ssm_state_indices)
    dt = math_dtype(ssm_state, q, k, v, g, beta)
    scale = K ** -0.5 if scale is None else scale
    qn, kn = prepare_qk(sel(q), sel(k), scale=scale, eps=eps, norm=norm, dtype=dt, rule=rule)
    if num_pending is not None and bool((num_pending[slots] > 0).any()):
        root = fast_rebuild(ssm_state, slots, ring[0], ring[1], ring[2], ring_start, num_pending[slots],
                            A_log=A_log, dt_bias=dt_bias).to(dt)
    else:
        root = ssm_state[slots].to(dt)
    grec = sel(g)
    gg = kda_gate(grec, A_log, dt_bias).to(dt) if gate_in else grec.to(dt)
    return VerifyInputs(tree and tree.rows(None if full else rows), rows, full, slots, qn, kn, sel(v).to(dt), gg,
                        grec if gate_in else gg, sel(beta).to(dt), root)


def verify_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, *,
                      parent: VerifyTree | torch.Tensor | None = None,
                      intermediate_states: torch.Tensor | None = None,
                      ring: tuple[torch.Tensor | None, ...] | None = None, ring_start: torch.Tensor | None = None,
                      num_pending: torch.Tensor | None = None, ring_indices: torch.Tensor | None = None,
                      A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                      scale: float | None = None, eps: float = 1e-6, norm: str = "rsqrt",
                      null_slot: int = -1, rule: str = "delta") -> torch.Tensor:
    """Run the verify tokens of each request from its slot's checkpoint; the checkpoint is not written.
    The per-token recurrence of either rule (`rule="mamba2"`: `common.delta_step` without the delta correction;
    q = C, k = B, v = x, g = dt A, beta = dt, taken as they come).

    Args:
        q, k: raw `[B, T, H, K]`;  v: `[B, T, H, V]`;  g: `[B, T, H, K]` (KDA) or `[B, T, H]` (GDN);
        beta: `[B, T, H]`.
        ssm_state: checkpoints of one layer `[N, H, K, V]` (read only).
        ssm_state_indices: slot per request `[B]`; -1 or `null_slot` rows are skipped (output 0).
        parent: None (chain: token t follows t-1), a `VerifyTree`, or `[T]` / `[B, T]` tree parents (-1 = the
            checkpoint), checked here (one host read): a round passes its `VerifyTree` to every layer.
        intermediate_states: out `[R >= B, T, H, K, V]`: the state after each token / node (snapshot
            strategy; per-layer node buffer of tree verify).
        ring: this layer's records `(d, k, g, rawv, rawk, beta)`, each `[N', H, L, dim]` (`beta` `[N', H, L]`);
            `d` and `k` may be None (eager commit: only the fold's records are kept). Token t of request b goes
            to ring row `r = ring_indices[b]` (default: its slot), position `(ring_start[r] + num_pending[r] + t)
            % L`, or position t without `ring_start` (eager layout: one record per verify token).
        ring_start, num_pending: `[N']` long. With pending records the start state is the fast rebuild
            of checkpoint + pending `(d, k, g)` (lazy commit: rings per slot, so no `ring_indices`).
        ring_indices: `[B]` long ring row per request (eager layout: the running row 0..B-1).
        A_log `[H]`, dt_bias `[H, K]`: given, g is the KDA gate's input f `[B, T, H, K]`; the log-decay is
            `common.kda_gate(f)` and the g ring keeps f (fla's `use_gate_in_kernel`).
    Returns:
        o `[B, T, H, V]` in v.dtype.
    """
    x = verify_inputs(q, k, v, g, beta, ssm_state, ssm_state_indices, parent=parent,
                      intermediate_states=intermediate_states, ring=ring, ring_start=ring_start,
                      num_pending=num_pending, ring_indices=ring_indices, scale=scale, eps=eps, norm=norm,
                      null_slot=null_slot, rule=rule, A_log=A_log, dt_bias=dt_bias)
    B, T, H, V = *q.shape[:3], v.shape[-1]
    o = v.new_zeros(B, T, H, V)
    if x is None:
        return o
    tree, rows, slots, root = x.tree, x.rows, x.slots, x.root
    qn, kn, vv, gg, bb = x.qn, x.kn, x.vv, x.gg, x.bb
    states: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    ds: list[torch.Tensor] = []
    for t in range(T):
        prev = _pick_parents(root, states, None if tree is None else tree.parent[:, t])
        S, ot, d = delta_step(prev, qn[:, t], kn[:, t], vv[:, t], gg[:, t], bb[:, t], rule=rule)
        states.append(S)
        outs.append(ot)
        ds.append(d)
    # one write per buffer after the loop (plain copies: the same values as writing token by token)
    o[rows] = torch.stack(outs, 1).to(o.dtype)
    if intermediate_states is not None:
        intermediate_states[rows, :T] = torch.stack(states, 1).to(intermediate_states.dtype)
    if ring is not None:
        store_ring_records(ring, (torch.stack(ds, 1), kn, x.grec, x.sel(v), x.sel(k), x.sel(beta)), slots, rows,
                           ring_start=ring_start, num_pending=num_pending, ring_indices=ring_indices)
    return o
