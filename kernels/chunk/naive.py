"""Chunked gated delta rule (KDA / GDN) in pure torch: the same recurrence as `recurrent_delta_rule`, computed
chunk by chunk in WY form, differentiable. Used to train and prefill on CPU, where fla's chunk kernels do not run.

Within a chunk starting from state S0 (log-gates cumulated in the chunk, `G_t = g_1 + ... + g_t`):
    u = (I + A)^-1 (beta v - beta (k * exp(G)) S0),   A[i, j] = beta_i sum_c k_i k_j exp(G_i - G_j)  (j < i)
    o = (q * exp(G)) S0 + P u,                        P[i, j] = sum_c q_i k_j exp(G_i - G_j)          (j <= i)
    S = exp(G_C) S0 + (k * exp(G_C - G))^T u
A and P take the decays `exp(G_i - G_j)` as products of `[C, K]` factors around each channel's midpoint
(`factored_terms`: two matmuls) where the gates allow it (fp32 factors, or fp64 ones for stronger gates), and the
pairwise decays `[C, C, K]` beyond, where every exponent is a decay (<= 0), so nothing overflows however strong
the gate. Only the S0 hand-off between chunks is sequential. `wy_terms` holds the intra-chunk part; the tree verify
(`kernels/verify/chunk.py`) calls it with an ancestor mask in place of the causal one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import check_delta_inputs, math_dtype, prepare_qk


# Widest range of cumulated log-decays (per channel, within a chunk) the factored form takes. A product of two
# factors is e^(G_i - G_j), at most e^span where i does not see j (masked afterwards, but it must stay finite:
# inf * 0 is NaN), so span stays below the dtype's largest exponent (fp32: e^88, fp64: e^709); each factor is
# then at most e^(span / 2), which keeps its relative error (that of its exponent) near the dtype's epsilon.
SPAN = {torch.float32: 80.0, torch.float64: 700.0}


def factored_terms(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, G: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A and P of the WY form from `[C, K]` factors, and which chunks the factors fit.

    The decay between two tokens, `e^(G_i - G_j)`, factors as `e^(G_i - r) e^(r - G_j)` around the midpoint `r`
    of each channel's range of G in the chunk (taken in G's dtype, so fp64 cumulated gates lose nothing), so A
    and P are matmuls over `[C, K]` instead of sums over the pairwise decays `[C, C, K]`. A chunk fits when no
    channel's range is wider than `SPAN`; in the others the factors are clamped to stay finite and A, P are
    wrong there (`wy_terms` replaces them).

    Args: as `wy_terms` (`mask` bool or 0/1 `[..., C, C]`).
    Returns:
        `(A [..., C, C] strictly lower, P [..., C, C], up [..., C, K], kdown [..., C, K], fits)` in q's dtype,
        with `up = e^(G - r)` and `kdown = k e^(r - G)`: `A[i, j] = beta_i (k_i up_i) . kdown_j` for j < i that
        i sees; `fits` is None when every chunk fits (one host read), else `[...]` bool per chunk.
    """
    dt = q.dtype
    lo, hi = G.amin(-2, keepdim=True), G.amax(-2, keepdim=True)  # (not aminmax: torch 2.11 has no derivative for it)
    span = hi - lo
    r = (hi + lo) / 2
    up, down = G - r, r - G
    if float(span.detach().max()) <= SPAN[dt]:  # every chunk fits (one host read; a NaN reads as not fitting)
        fits = None
    else:  # finite factors in the chunks that do not fit (their A and P are replaced)
        fits = (span.amax(-1) <= SPAN[dt]).squeeze(-1)
        up, down = up.clamp(-SPAN[dt] / 2, SPAN[dt] / 2), down.clamp(-SPAN[dt] / 2, SPAN[dt] / 2)
    up, kdown = up.to(dt).exp(), k * down.to(dt).exp_()  # down is a fresh tensor (or its cast): exp in place
    m = mask.to(dt)
    kdT = kdown.transpose(-1, -2)
    A = (beta * ((k * up) @ kdT) * m).tril(-1)                         # strict: j sees itself through I
    P = ((q * up) @ kdT) * m
    return A, P, up, kdown, fits


def _pairwise_terms(q, k, beta, G, mask):
    """(kd, A, P) of `wy_terms` from the pairwise decays `[..., C, C, K]` (every exponent <= 0 where i sees j)."""
    decay = (G[..., :, None, :] - G[..., None, :, :]).to(q.dtype).masked_fill(~mask[..., None], float("-inf")).exp()
    kd = k[..., None, :, :] * decay                                    # [..., C(i), C(j), K]
    A = (beta * (k[..., :, None, :] * kd).sum(-1)).tril(-1)            # strict: j sees itself through I
    return kd, A, (q[..., :, None, :] * kd).sum(-1)


def _strong_terms(q, k, beta, G, mask):
    """A and P, in q's dtype, of chunks `[n, C, .]` whose gates are too strong for factors in q's dtype: fp64
    factors where they fit (`SPAN`: 700 against fp32's 80, so 16 tokens of gates averaging down to ~-45; the
    products rounded to q's dtype once), the pairwise decays `[C, C, K]` only in the chunks beyond. The embedded
    model's gates reach -30: in its prefill many chunks of 16 miss fp32's range, and their pairwise decays cost
    more than all the fp64 factors."""
    dt = q.dtype
    if dt != torch.float64:
        A, P, _, _, fits = factored_terms(q.double(), k.double(), beta.double(), G, mask)
        A, P = A.to(dt), P.to(dt)
        if fits is None:
            return A, P
        idx = (~fits).nonzero().squeeze(1)
        _, A_p, P_p = _pairwise_terms(q[idx], k[idx], beta[idx], G[idx], mask[idx])
        return A.index_copy(0, idx, A_p), P.index_copy(0, idx, P_p)
    _, A, P = _pairwise_terms(q, k, beta, G, mask)
    return A, P


def strong_replaced(A: torch.Tensor, P: torch.Tensor, fits: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    beta: torch.Tensor, G: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`factored_terms`' A and P `[..., C, C]` with the chunks that do not fit (`fits [...]` false) taken from
    `_strong_terms` (fp64 factors, or the pairwise decays beyond them); unchanged when `fits` is None. The other
    arguments as `factored_terms`' (`mask` bool), broadcast to `fits`' leading dims."""
    if fits is None:
        return A, P
    C = A.shape[-1]
    idx = (~fits).reshape(-1).nonzero().squeeze(1)
    pick = lambda x: x.expand(*fits.shape, *x.shape[-2:]).reshape(-1, *x.shape[-2:])[idx]  # noqa: E731
    A_s, P_s = _strong_terms(pick(q), pick(k), pick(beta), pick(G), pick(mask))
    return (A.reshape(-1, C, C).index_copy(0, idx, A_s).view(A.shape),
            P.reshape(-1, C, C).index_copy(0, idx, P_s).view(P.shape))


def wy_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, G: torch.Tensor,
             mask: torch.Tensor, *, pairwise: bool = False) -> tuple[torch.Tensor | None, ...]:
    """The intra-chunk terms of the WY form, for a causal chunk or a tree of tokens.

    Token i sees token j when `mask[i, j]` (j == i or j before i on i's path: the lower triangle for a chain,
    the ancestor mask for a tree); `G_i` is the log-decay summed over the tokens i sees. Each chunk takes A and
    P from `factored_terms` where its gates allow it, else from fp64 factors or the pairwise decays
    (`_strong_terms`; everywhere the pairwise decays with `pairwise=True`).

    Args:
        q: normalized, scaled queries `[..., C, K]`;  k: normalized keys `[..., C, K]`;  v: `[..., C, V]`;
        beta: `[..., C, 1]`;  G: `[..., C, K or 1]` (any float dtype: the differences are taken in it, then cast
        to q's dtype);  mask: `[..., C, C]` bool, true on the diagonal.
    Returns:
        `(kd [..., C, C, K] or None, P [..., C, C], W [..., C, V], Y [..., C, K], eG [..., C, K or 1])` in q's
        dtype, with `kd[i, j] = k_j exp(G_i - G_j)` (0 where i does not see j; given with `pairwise=True`).
        From a start state S0 the records are `u = W - Y S0` (the `d` of each token's step), the outputs
        `o = (q eG) S0 + P u`, and the state after token i is `eG_i S0 + kd[i]^T u`.
    """
    dt = q.dtype
    kd = None
    if pairwise:
        kd, A, P = _pairwise_terms(q, k, beta, G, mask)
    else:
        A, P, _, _, fits = factored_terms(q, k, beta, G, mask)
        A, P = strong_replaced(A, P, fits, q, k, beta, G, mask)
    eG = G.to(dt).exp()
    # (I + A)^-1 once, then two products, as fla's chunk kernels form it: on CPU a batched triangular solve against
    # the C columns of I and two matmuls take less time than two solves against the 2 x 64 columns of v, k
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    Ai = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    W = Ai @ (beta * v)
    Y = Ai @ (beta * k * eG)
    return kd, P, W, Y, eG


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     *, initial_state: torch.Tensor | None = None, scale: float | None = None,
                     eps: float = 1e-6, norm: str = "rsqrt", chunk_size: int = 16,
                     rule: str = "delta") -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over `T` tokens, chunked; same arguments and results as `recurrent_delta_rule`.
    `rule="mamba2"`: no delta correction, the records are `u = beta v` whatever S0 (no solve needed).

    Args:
        q, k: raw (pre-L2-norm) `[B, T, H, K]`;  v: `[B, T, H, V]`.
        g: log-decay `[B, T, H, K]` (KDA) or `[B, T, H]` (GDN);  beta: `[B, T, H]`.
        initial_state: `[B, H, K, V]` (None: zeros).
        chunk_size: tokens per chunk; the intra-chunk decay tensor is `[B, H, T, chunk_size, K]`.
    Returns:
        `(o [B, T, H, V] in v.dtype, S [B, H, K, V])`; math and S in fp32 (fp64 if any input is fp64).
    """
    B, T, H, K, V, g = check_delta_inputs(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    dt = math_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    q, k = prepare_qk(q, k, scale=scale, eps=eps, norm=norm, dtype=dt, rule=rule)
    C, out_dtype = chunk_size, v.dtype
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    if B == 0 or T == 0:  # nothing to run: as the recurrence, empty outputs and (a copy of) the start state
        return v.new_zeros(B, T, H, V), S.clone()
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, X] -> [N, B, H, C, X]; padding: k = beta = g = 0
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad))
        return x.reshape(B, N, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4).contiguous()

    q, k, v = chunks(q), chunks(k), chunks(v)
    # cumulated in fp64: G_i - G_j of two large cumulated gates would otherwise cancel to a few fp32 ulps of |G|
    G = chunks(g.expand(B, T, H, K)).double().cumsum(-2)
    b = chunks(beta[..., None])                                        # [N, B, H, C, 1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # on a GPU the pairwise decays (no host read of which chunks fit; fla's kernels prefill the delta rule there)
    _, P, W, Y, eG = wy_terms(q, k, v, b, G, causal, pairwise=q.is_cuda)
    if rule == "mamba2":
        W, Y = b * v, None
    # From a chunk's start state S: u = W - Y S, o = (q eG) S + P u = (q eG - P Y) S + P W, and the next start
    # exp(G_C) S + kG^T u. Everything not multiplied by S is formed for all chunks at once, so the sequential
    # part is three multiply-adds per chunk, each on contiguous `[B*H, ., .]` blocks.
    qS = q * eG if Y is None else q * eG - P @ Y                       # [N, B, H, C, K]
    PW = P @ W                                                         # [N, B, H, C, V]
    kGT = (k * (G[..., -1:, :] - G).to(dt).exp()).transpose(-1, -2)    # [N, B, H, K, C]: k_j exp(G_C - G_j)
    decay = eG[..., -1, :, None]                                       # [N, B, H, K, 1]: exp(G_C)
    blocks = lambda x: x.reshape(N, B * H, *x.shape[-2:])  # noqa: E731  [N, B*H, ., .]
    qS, PW, kGT, decay, W = blocks(qS), blocks(PW), blocks(kGT), blocks(decay), blocks(W)
    Y = None if Y is None else blocks(Y)
    S = S.reshape(B * H, K, V)
    outs = []
    for n in range(N):
        outs.append(torch.baddbmm(PW[n], qS[n], S))
        u = W[n] if Y is None else torch.baddbmm(W[n], Y[n], S, alpha=-1)
        S = torch.baddbmm(decay[n] * S, kGT[n], u)
    o = torch.stack(outs).view(N, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    S = S.view(B, H, K, V)
    return o.to(out_dtype), S
