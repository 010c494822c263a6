"""Verify over D chain tokens or T tree nodes: outputs, ring records, per-step states and conv windows."""

from __future__ import annotations

import torch

from ..common import (check_delta_inputs, check_shape, conv_step, delta_step, math_dtype, prepare_qk,
                      valid_slots)
from ..rebuild.naive import fast_rebuild


def _pick_parents(root: torch.Tensor, done: list[torch.Tensor], p: torch.Tensor, chain: bool) -> torch.Tensor:
    """Per row, the state (or window) a node starts from: `root` for parent -1, else the parent's output
    (`done[parent]`); a chain just continues from the previous token."""
    if chain:
        return done[-1] if done else root
    return torch.stack([root[i] if p[i] < 0 else done[p[i]][i] for i in range(root.shape[0])])


def _parents(parent: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """`None` (chain) / `[T]` / `[B, T]` -> `[B, T]` long, checked: -1 <= parent[i] < i."""
    if parent is None:
        return torch.arange(-1, T - 1, device=device).expand(B, T)
    if parent.dim() == 1:
        parent = parent.expand(B, -1)
    check_shape("parent", parent, (B, T))
    idx = torch.arange(T, device=parent.device)
    if bool(((parent < -1) | (parent >= idx)).any()):
        raise ValueError(f"parent: expected -1 <= parent[i] < i (topological order), got {parent.tolist()}")
    return parent.long()


def short_conv_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      conv_state_indices: torch.Tensor, *, parent: torch.Tensor | None = None,
                      window_states: torch.Tensor | None = None, activation: str | None = "silu",
                      null_slot: int = -1) -> torch.Tensor:
    """Short conv over the verify tokens of each request, from its slot's window.

    Args:
        x: pre-conv inputs `[B, T, C]`;  weight `[C, Kc]`;  bias `[C]` or None.
        conv_state: persistent windows of one layer `[N, C, Kc-1]` (read only).
        conv_state_indices: slot per request `[B]`; -1 or `null_slot` rows are skipped (output 0).
        parent: None (chain) or `[T]` / `[B, T]` tree parents (-1 = the slot's window).
        window_states: out `[R >= B, T, C, Kc-1]`: the window after each token / node.
    Returns:
        y `[B, T, C]` in x.dtype.
    """
    B, T, C = x.shape
    Kc = weight.shape[-1]
    check_shape("weight", weight, (C, Kc))
    check_shape("conv_state", conv_state, (None, C, Kc - 1))
    check_shape("conv_state_indices", conv_state_indices, (B,))
    if window_states is not None and (window_states.dim() != 4 or window_states.shape[0] < B
                                      or window_states.shape[1] < T or window_states.shape[2:] != (C, Kc - 1)):
        raise ValueError(f"window_states: expected [>={B}, >={T}, {C}, {Kc - 1}], got {list(window_states.shape)}")
    chain = parent is None
    parent = _parents(parent, B, T, x.device)
    rows = valid_slots(conv_state_indices, null_slot).nonzero().flatten()
    y = x.new_zeros(B, T, C)
    if rows.numel() == 0:
        return y
    root = conv_state[conv_state_indices[rows]]
    windows: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for t in range(T):
        p = parent[rows, t]
        prev = _pick_parents(root, windows, p, chain)
        yt, wt = conv_step(prev, x[rows, t], weight, bias, activation)
        windows.append(wt)
        ys.append(yt)
    # one write per buffer after the loop (plain copies: the same values as writing token by token)
    y[rows] = torch.stack(ys, 1).to(x.dtype)
    if window_states is not None:
        window_states[rows, :T] = torch.stack(windows, 1).to(window_states.dtype)
    return y


def verify_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, *,
                      parent: torch.Tensor | None = None, intermediate_states: torch.Tensor | None = None,
                      ring: tuple[torch.Tensor, ...] | None = None, ring_start: torch.Tensor | None = None,
                      num_pending: torch.Tensor | None = None, scale: float | None = None, eps: float = 1e-6,
                      norm: str = "rsqrt", null_slot: int = -1) -> torch.Tensor:
    """Run the verify tokens of each request from its slot's checkpoint; the checkpoint is not written.

    Args:
        q, k: raw `[B, T, H, K]`;  v: `[B, T, H, V]`;  g: `[B, T, H, K]` (KDA) or `[B, T, H]` (GDN);
        beta: `[B, T, H]`.
        ssm_state: checkpoints of one layer `[N, H, K, V]` (read only).
        ssm_state_indices: slot per request `[B]`; -1 or `null_slot` rows are skipped (output 0).
        parent: None (chain: token t follows t-1) or `[T]` / `[B, T]` tree parents (-1 = the checkpoint).
        intermediate_states: out `[R >= B, T, H, K, V]`: the state after each token / node (snapshot
            strategy; per-layer node buffer of tree verify).
        ring: this layer's records `(d, k, g, rawv, rawk, beta)`, each `[N, H, L, dim]` (`beta` `[N, H, L]`);
            token t of a request in slot s goes to position `(ring_start[s] + num_pending[s] + t) % L`.
        ring_start, num_pending: `[N]` long. With pending records the start state is the fast rebuild
            of checkpoint + pending `(d, k, g)` (lazy commit).
    Returns:
        o `[B, T, H, V]` in v.dtype.
    """
    B, T, H, K, V, g = check_delta_inputs(q, k, v, g, beta)
    check_shape("ssm_state", ssm_state, (None, H, K, V))
    check_shape("ssm_state_indices", ssm_state_indices, (B,))
    if intermediate_states is not None and (intermediate_states.dim() != 5 or intermediate_states.shape[0] < B
                                            or intermediate_states.shape[1] < T
                                            or intermediate_states.shape[2:] != (H, K, V)):
        raise ValueError(f"intermediate_states: expected [>={B}, >={T}, {H}, {K}, {V}], "
                         f"got {list(intermediate_states.shape)}")
    if ring is not None:
        L = ring[0].shape[2]
        if T > L:
            raise ValueError(f"q: {T} verify tokens do not fit a ring of depth L={L}")
        if ring_start is None:
            raise ValueError("ring_start: required with ring")
    chain = parent is None
    parent = _parents(parent, B, T, k.device)
    rows = valid_slots(ssm_state_indices, null_slot).nonzero().flatten()
    o = v.new_zeros(B, T, H, V)
    if rows.numel() == 0:
        return o
    slots = ssm_state_indices[rows]
    dt = math_dtype(ssm_state, q, k, v, g, beta)
    scale = K ** -0.5 if scale is None else scale
    qn, kn = prepare_qk(q[rows], k[rows], scale=scale, eps=eps, norm=norm, dtype=dt)
    vv, gg, bb = v[rows].to(dt), g[rows].to(dt), beta[rows].to(dt)
    if num_pending is not None and bool((num_pending[slots] > 0).any()):
        d_ring, k_ring, g_ring = ring[0], ring[1], ring[2]
        root = fast_rebuild(ssm_state, slots, d_ring, k_ring, g_ring, ring_start, num_pending[slots]).to(dt)
    else:
        root = ssm_state[slots].to(dt)
    if ring is not None:
        L = ring[0].shape[2]
        base = ring_start[slots] + (num_pending[slots] if num_pending is not None else 0)
    states: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    ds: list[torch.Tensor] = []
    for t in range(T):
        p = parent[rows, t]
        prev = _pick_parents(root, states, p, chain)
        S, ot, d = delta_step(prev, qn[:, t], kn[:, t], vv[:, t], gg[:, t], bb[:, t])
        states.append(S)
        outs.append(ot)
        ds.append(d)
    # one write per buffer after the loop (plain copies: the same values as writing token by token)
    o[rows] = torch.stack(outs, 1).to(o.dtype)
    if intermediate_states is not None:
        intermediate_states[rows, :T] = torch.stack(states, 1).to(intermediate_states.dtype)
    if ring is not None:
        pos = (base[:, None] + torch.arange(T, device=base.device)) % L  # [R, T]
        recs = (torch.stack(ds, 1), kn, gg, v[rows], k[rows], beta[rows])  # [R, T, H, dim] / beta [R, T, H]
        for buf, rec in zip(ring, recs):
            buf[slots[:, None], :, pos] = rec.to(buf.dtype)
    return o
