"""Verify in chunk form: the T tokens of a round (or the T nodes of a tree) as one WY chunk, no per-token loop.

Delta rule only: `kernels.dispatch` sends the mamba2 rule (`rule="mamba2"`) to the per-token recurrence
(`naive.verify_delta_rule`) on every device.

Same arguments, outputs, ring records and node states as `naive.verify_delta_rule` (the per-token recurrence,
kept as the independent oracle); this is what `kernels.dispatch` serves off the GPU. Per request and head, from
the start state S0 (the checkpoint, or its fast rebuild with pending records), with `path(t)` = t and its
ancestors (a chain: tokens 1..t) and `G_t` = the log-decays summed over `path(t)`:

    (I + A) d = beta v - beta (k e^G) S0,   A[t, j] = beta_t <k_t, e^(G_t - G_j) k_j>   (j a strict ancestor)
    o_t = S0^T (q_t e^G_t) + sum_{j in path(t)} d_j <q_t, e^(G_t - G_j) k_j>
    S_t = e^G_t S0 + sum_{j in path(t)} e^(G_t - G_j) k_j d_j^T

`d_t` is the record the per-token step writes (`beta (v - S'^T k)`), so the rings hold the same quantities, and
each node's output and state are those of its own root-to-node chain: the causal mask of the chunk is the
ancestor mask (`VerifyTree.ancestors`), a chain's is the lower triangle. One triangular solve and a few masked
matmuls, batched over requests and heads, with the decays factored per channel (`chunk_step`); heads whose gates
are too strong for fp32 factors take fp64 ones, as the chunked prefill does (`chunk.strong_replaced`): trained
KDA gates can be strong enough that some verify calls have such a head.

Exactness (docs/EXACTNESS.md). The committed state never comes from here: the exact fold replays the records, which are
the inputs (rawk, rawv, g, beta: copied bit for bit), step by step, so a committed state is still the one plain
decode reaches. Outputs, `d` and node states are the recurrence's in another op order: fp32 tolerance (fp64:
1e-12), not bits. The snapshot strategy commits node states, so its committed state is the recurrence's within
fp32 rounding per round. A one-token verify (a plain decode step) is one `common.delta_step`, the fold's own
step, bit for bit. The path sums `G` are taken in fp64 (one `[T, H, K]` tensor): a decay `e^(G_t - G_j)` from fp32
sums would carry a relative error of about eps * |G| (|G| <= depth x the strongest gate), past fp32 tolerance
once |G| reaches ~100, as nine tokens of strong KDA gates do; the factors and decays themselves are fp32.

fp64 inputs run here too (in fp64), so the float64 property tests of the strategies check the path the CPU runs
at 1e-12; the per-token oracle stays reachable as `naive.verify_delta_rule`.
"""

from __future__ import annotations

import functools

import torch

from ..chunk.naive import factored_terms, strong_replaced, wy_terms
from ..common import delta_step
from ...tensors import outside_inference
from .naive import store_ring_records, verify_inputs


@functools.lru_cache(maxsize=64)
def _lower(T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The chain's mask `[T, T]` in `dtype` (1 on and below the diagonal), made once per shape; never written.
    A normal tensor even when first asked for under `inference_mode`, so autograd callers can use it too."""
    with outside_inference():
        return torch.ones(T, T, dtype=dtype, device=device).tril()


def chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S0: torch.Tensor, mask: torch.Tensor, *, states: torch.Tensor | None = None):
    """One chunk of T tokens / nodes from S0, all in the math dtype.

    The decays between two tokens, `e^(G_t - G_j)`, factor as `e^(G_t - r) e^(r - G_j)` around the midpoint `r`
    of each channel's range of G, so A, P and the node states are plain matmuls over `[T, K]` factors. Where a
    channel's range is too wide for that (a product would leave fp32's exponent range), fp64 factors serve: for
    that head's A and P (`chunk.strong_replaced`), or, when node states are asked for, for every head; only past
    fp64's range too do the pairwise decays `[T, T, K]` of `chunk.wy_terms` come in.

    Args:
        q: normalized, scaled `[R, T, H, K]`;  k: normalized `[R, T, H, K]`;  v: `[R, T, H, V]`;
        g: `[R, T, H, K or 1]`;  beta: `[R, T, H]`;  S0: `[R, H, K, V]`;
        mask: `[R, T, T]` or `[T, T]` bool, t sees u (u == t or an ancestor of t); None: a chain (the lower
            triangle), whose path sums are running sums.
        states: out `[R, T, H, K, V]` in the math dtype (may be a view of the caller's node buffer): the state
            after every token / node, written in place (multi-MB temporaries cost page faults on CPU).
    Returns:
        `(o [R, T, H, V], d [R, T, H, V])`.
    """
    R, T, H, K = k.shape
    V = v.shape[-1]
    heads = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  [R, T, H, X] -> [R, H, T, X], row-major
    tokens = lambda x: x.transpose(1, 2)  # noqa: E731  [R, H, T, ...] -> [R, T, H, ...] (a view)
    # G in fp64: every decay is a difference of two path sums, G_t - G_j, which fp32 sums would give only to
    # about eps * |G| (a relative error of 2e-5 after nine tokens of -20 gates: past fp32 tolerance)
    g64 = g.to(torch.float64)
    if mask is None:  # a chain: G is the running sum, the mask the lower triangle
        mask = _lower(T, q.dtype, q.device)                                # [T, T]
        G = heads(g64.cumsum(1))                                           # [R, H, T, K|1]
    else:
        G = heads((mask.to(torch.float64) @ g64.reshape(R, T, -1)).view(g.shape))  # sums along root paths
        mask = mask.to(q.dtype)
    m = mask if mask.dim() == 2 else mask.unsqueeze(-3)                  # [T, T] or [R, 1, T, T]
    qh, kh, vh, bh = heads(q), heads(k), heads(v), tokens(beta).unsqueeze(-1)
    A, P, up, kdown, fits = factored_terms(qh, kh, bh, G, m)
    if fits is not None and q.dtype != torch.float64:  # some channel's path sums span too far for fp32 factors
        if states is None:  # those heads' A, P from fp64 factors, as in the chunked prefill
            A, P = strong_replaced(A, P, fits, qh, kh, bh, G, m > 0)
            fits = None
        else:  # the node states need the factors themselves: fp64 ones for every head
            A, P, up, kdown, fits = factored_terms(qh.double(), kh.double(), bh.double(), G, m)
            A, P = A.to(q.dtype), P.to(q.dtype)
    if fits is not None:  # past fp64's factors too: every term from the pairwise decays
        kd, P, W, Y, eG = wy_terms(qh, kh, vh, bh, G, m > 0, pairwise=True)
        d = (W - Y @ S0).contiguous()                                      # [R, H, T, V]
        if states is not None:  # sum over the visible j of e^(G_t - G_j) k_j d_j^T
            states.copy_(tokens((kd.transpose(-1, -2).reshape(R, H, T * K, T) @ d).reshape(R, H, T, K, V)))
    else:
        eG = G.exp().to(q.dtype)
        d = torch.linalg.solve_triangular(A, bh * (vh - (kh * eG) @ S0), upper=False, unitriangular=True)
        if states is not None:  # e^(G_t - r) times the sum over the visible j of k_j e^(r - G_j) d_j^T, in the
            d = d.contiguous()  # factors' dtype; LAPACK hands back column-major d, the product below wants rows
            Z = torch.mul(tokens(kdown)[..., None], tokens(d)[..., None, :], out=kdown.new_empty(R, T, H, K, V))
            mask = mask.to(Z.dtype).expand(R, T, T)
            if states.is_contiguous() and states.dtype == Z.dtype:
                torch.bmm(mask, Z.view(R, T, H * K * V), out=states.view(R, T, H * K * V))
                states.mul_(tokens(up)[..., None])
            else:
                states.copy_(torch.bmm(mask, Z.view(R, T, H * K * V)).view(R, T, H, K, V).mul_(tokens(up)[..., None]))
    if states is not None:  # + e^G_t S0
        states.addcmul_(tokens(eG)[..., None], S0[:, None])
    o = (qh * eG) @ S0 + P @ d
    return tokens(o), tokens(d)


def verify_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, **options) -> torch.Tensor:
    """`naive.verify_delta_rule` as one chunk per round (the delta rule): the same keyword options, checks, output
    `o [B, T, H, V]`, ring records and node states; the checkpoint is not written."""
    x = verify_inputs(q, k, v, g, beta, ssm_state, ssm_state_indices, **options)
    intermediate_states, ring = options.get("intermediate_states"), options.get("ring")
    B, T, H, K, V = *q.shape[:4], v.shape[-1]
    if x is None:
        return v.new_zeros(B, T, H, V)
    tree, rows, full, sel, slots, root = x.tree, x.rows, x.full, x.sel, x.slots, x.root
    qn, kn, vv, gg, bb = x.qn, x.kn, x.vv, x.gg, x.bb
    dt = root.dtype
    S = None
    if intermediate_states is not None:  # all rows valid, same dtype: fill the caller's buffer in place
        in_place = full and intermediate_states.dtype == dt
        S = intermediate_states[:B, :T] if in_place else root.new_empty(rows.numel(), T, H, K, V)
    if T == 1:  # a decode step: the fold's own step, so plain decode keeps its op order
        S1, ot, d = delta_step(root, qn[:, 0], kn[:, 0], vv[:, 0], gg[:, 0], bb[:, 0])
        ot, d = ot[:, None], d[:, None]
        if S is not None:
            S[:, 0] = S1
    else:
        ot, d = chunk_step(qn, kn, vv, gg, bb, root, None if tree is None else tree.ancestors(), states=S)
    if full:
        o = ot.to(v.dtype).contiguous()
    else:
        o = v.new_zeros(B, T, H, V)
        o[rows] = ot.to(o.dtype)
    if S is not None and not in_place:
        intermediate_states[rows, :T] = S.to(intermediate_states.dtype)
    if ring is not None:
        store_ring_records(ring, (d, kn, x.grec, sel(v), sel(k), sel(beta)), slots, rows,
                           **{key: options.get(key) for key in ("ring_start", "num_pending", "ring_indices")})
    return o
