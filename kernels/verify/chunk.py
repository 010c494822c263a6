"""Verify in chunk form: the T tokens of a round (or the T nodes of a tree) as one WY chunk, no per-token loop.

Same arguments, outputs, ring records and node states as `naive.verify_delta_rule` (the per-token recurrence,
kept as the independent oracle); this is what `kernels.dispatch` serves off the GPU. Per request and head, from
the start state S0 (the checkpoint, or its fast rebuild with pending records), with `path(t)` = t and its
ancestors (a chain: tokens 1..t) and `G_t` = the log-decays summed over `path(t)`:

    (I + A) d = beta v - beta (k e^G) S0,   A[t, j] = beta_t <k_t, e^(G_t - G_j) k_j>   (j a strict ancestor)
    o_t = S0^T (q_t e^G_t) + sum_{j in path(t)} d_j <q_t, e^(G_t - G_j) k_j>
    S_t = e^G_t S0 + sum_{j in path(t)} e^(G_t - G_j) k_j d_j^T

`d_t` is the record the per-token step writes (`beta (v - S'^T k)`), so the rings hold the same quantities, and
each node's output and state are those of its own root-to-node chain: the causal mask of the chunk is the
ancestor mask (`common.ancestor_mask`), a chain's is the lower triangle. The triangular solve and the masked
products are batched over requests, heads and nodes (`chunk.wy_terms`, shared with the chunked prefill).

Exactness (DESIGN §5). The committed state never comes from here: the exact fold replays the records, which are
the inputs (rawk, rawv, g, beta: copied bit for bit), step by step, so a committed state is still the one plain
decode reaches. Outputs, `d` and node states are the recurrence's in another op order: fp32 tolerance (fp64:
1e-12), not bits. The snapshot strategy commits node states, so its committed state is the recurrence's within
fp32 rounding per round. A one-token verify (a plain decode step) is one `common.delta_step`, the fold's own
step, bit for bit. The path sums `G` are taken in the math dtype: the decays carry a relative error of about
eps * |G| (|G| <= depth x the strongest gate), well inside fp32 tolerance at verify depths.

fp64 inputs run here too (in fp64), so the float64 property tests of the strategies check the path the CPU runs
at 1e-12; the per-token oracle stays reachable as `naive.verify_delta_rule`.
"""

from __future__ import annotations

import torch

from ..chunk.naive import wy_terms
from ..common import (ancestor_mask, check_delta_inputs, check_verify_buffers, delta_step, math_dtype, prepare_qk,
                      valid_slots)
from ..rebuild.naive import fast_rebuild
from .naive import _parents


def chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S0: torch.Tensor, mask: torch.Tensor, *, states: bool = False):
    """One chunk of T tokens / nodes from S0, all in the math dtype.

    Args:
        q: normalized, scaled `[R, T, H, K]`;  k: normalized `[R, T, H, K]`;  v: `[R, T, H, V]`;
        g: `[R, T, H, K or 1]`;  beta: `[R, T, H]`;  S0: `[R, H, K, V]`;
        mask: `[R, T, T]` or `[T, T]` bool, t sees u (u == t or an ancestor of t).
        states: also return the state after every token / node.
    Returns:
        `(o [R, T, H, V], d [R, T, H, V], S [R, T, H, K, V] or None)`.
    """
    R, T, H, _ = k.shape
    heads = lambda x: x.transpose(1, 2)  # noqa: E731  [R, T, H, X] -> [R, H, T, X]
    G = (mask.to(g.dtype) @ g.reshape(R, T, -1)).reshape(g.shape)  # sums along each root path
    m = mask[:, None] if mask.dim() == 3 else mask
    qh, kh = heads(q), heads(k)
    kd, P, W, Y, eG = wy_terms(qh, kh, heads(v), heads(beta[..., None]), heads(G), m)
    d = W - Y @ S0                                                   # [R, H, T, V]
    o = (qh * eG) @ S0 + P @ d
    S = None
    if states:  # S_t = e^G_t S0 + sum_j kd[t, j]^T d_j: one batched matmul over (request, head)
        K, V = S0.shape[-2:]
        S = (eG[..., None] * S0[:, :, None]
             + (kd.transpose(-1, -2).reshape(R, H, T * K, T) @ d).reshape(R, H, T, K, V))
        S = S.transpose(1, 2)
    return heads(o), heads(d), S


def verify_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, *,
                      parent: torch.Tensor | None = None, intermediate_states: torch.Tensor | None = None,
                      ring: tuple[torch.Tensor, ...] | None = None, ring_start: torch.Tensor | None = None,
                      num_pending: torch.Tensor | None = None, scale: float | None = None, eps: float = 1e-6,
                      norm: str = "rsqrt", null_slot: int = -1) -> torch.Tensor:
    """Run the verify tokens of each request from its slot's checkpoint, as one chunk; the checkpoint is not written.

    Args:
        q, k: raw `[B, T, H, K]`;  v: `[B, T, H, V]`;  g: `[B, T, H, K]` (KDA) or `[B, T, H]` (GDN);
        beta: `[B, T, H]`.
        ssm_state: checkpoints of one layer `[N, H, K, V]` (read only).
        ssm_state_indices: slot per request `[B]`; -1 or `null_slot` rows are skipped (output 0).
        parent: None (chain: token t follows t-1) or `[T]` / `[B, T]` tree parents (-1 = the checkpoint).
        intermediate_states: out `[R >= B, T, H, K, V]`: the state after each token / node.
        ring: this layer's records `(d, k, g, rawv, rawk, beta)`, each `[N, H, L, dim]` (`beta` `[N, H, L]`);
            token t of a request in slot s goes to position `(ring_start[s] + num_pending[s] + t) % L`.
        ring_start, num_pending: `[N]` long. With pending records the start state is the fast rebuild
            of checkpoint + pending `(d, k, g)` (lazy commit).
    Returns:
        o `[B, T, H, V]` in v.dtype.
    """
    B, T, H, K, V, g = check_delta_inputs(q, k, v, g, beta)
    check_verify_buffers(B, T, H, K, V, ssm_state, ssm_state_indices, intermediate_states, ring, ring_start)
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
        root = fast_rebuild(ssm_state, slots, ring[0], ring[1], ring[2], ring_start, num_pending[slots]).to(dt)
    else:
        root = ssm_state[slots].to(dt)
    want_states = intermediate_states is not None
    if T == 1:  # a decode step: the fold's own step, so plain decode keeps its op order
        S, ot, d = delta_step(root, qn[:, 0], kn[:, 0], vv[:, 0], gg[:, 0], bb[:, 0])
        ot, d, S = ot[:, None], d[:, None], S[:, None]
    else:
        mask = (torch.ones(T, T, dtype=torch.bool, device=k.device).tril() if chain
                else ancestor_mask(parent[rows]))
        ot, d, S = chunk_step(qn, kn, vv, gg, bb, root, mask, states=want_states)
    o[rows] = ot.to(o.dtype)
    if want_states:
        intermediate_states[rows, :T] = S.to(intermediate_states.dtype)
    if ring is not None:
        L = ring[0].shape[2]
        base = ring_start[slots] + (num_pending[slots] if num_pending is not None else 0)
        pos = (base[:, None] + torch.arange(T, device=base.device)) % L  # [R, T]
        recs = (d, kn, gg, v[rows], k[rows], beta[rows])  # [R, T, H, dim] / beta [R, T, H]
        for buf, rec in zip(ring, recs):
            buf[slots[:, None], :, pos] = rec.to(buf.dtype)
    return o
