"""Fast rebuild: the state after m pending tokens from the checkpoint and the (d, k, g) records."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import check_gate_params, kda_gate, math_dtype


def ring_log_decay(rec: torch.Tensor, dt: torch.dtype, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   head_axis: int) -> torch.Tensor:
    """Gate records `[..., H, ..., n, K or 1]` (heads at `head_axis`, K last) -> log-decays in `dt`: the records
    themselves, or with `A_log` / `dt_bias` (`[..., H]`, `[..., H, K]`) `common.kda_gate` of the input records."""
    if A_log is None:
        return rec.to(dt)
    f = rec.movedim(head_axis, -2)  # heads next to K, as kda_gate takes them
    lead = (slice(None),) * (A_log.dim() - 1) + (None,) * (f.dim() - A_log.dim() - 1)
    return kda_gate(f, A_log[lead], dt_bias[lead]).movedim(-2, head_axis).to(dt)


def fast_rebuild(ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, ring_d: torch.Tensor,
                 ring_k: torch.Tensor, ring_g: torch.Tensor, ring_start: torch.Tensor,
                 num_tokens: torch.Tensor, *, A_log: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`S_m = Diag(A_{1:m}) S_0 + sum_j Diag(A_{j+1:m}) k_j d_j^T`, one matmul per request.

    Open loop: `d` was stored in the ring dtype, so this is for verify outputs only; the checkpoint is
    only ever advanced by the exact fold.

    Args:
        ssm_state: checkpoints of one layer `[N, H, K, V]`.
        ssm_state_indices: slots `[B]` (all valid).
        ring_d `[N, H, L, V]`, ring_k `[N, H, L, K]`, ring_g `[N, H, L, K or 1]`: records of one layer.
        ring_start: `[N]` position of the first pending record;  num_tokens: `[B]` records to apply.
        A_log `[H]`, dt_bias `[H, K]`: given, the g ring holds the KDA gate's input (`common.kda_gate`).
    Returns:
        S `[B, H, K, V]` in fp32 (fp64 with fp64 inputs).
    """
    dt = math_dtype(ssm_state, ring_d, ring_g)
    check_gate_params(A_log, dt_bias, (), ssm_state.shape[1], ssm_state.shape[2], ring_g)
    L = ring_d.shape[2]
    out = []
    for s, m in zip(ssm_state_indices.tolist(), num_tokens.tolist()):
        pos = (ring_start[s] + torch.arange(m, device=ring_d.device)) % L
        d, k = ring_d[s][:, pos].to(dt), ring_k[s][:, pos].to(dt)  # [H, m, *]
        g = ring_log_decay(ring_g[s][:, pos], dt, A_log, dt_bias, 0)
        # log A_{j:m} = g_j + .. + g_m, summed from the newest record back (as the kernel does): each exponent is
        # then accurate to eps of itself, where G_m - G_j of forward sums would carry eps * |G_m| (past fp32
        # tolerance once a queue of strong gates sums to ~-100)
        R = g.flip(1).cumsum(1).flip(1)  # [H, m, K|1]
        Gm = R[:, :1] if m else g.new_zeros(g.shape[0], 1, g.shape[2])  # log A_{1:m}
        kw = k * F.pad(R[:, 1:], (0, 0, 0, 1)).exp()  # k_j A_{j+1:m}: the newest record's is A_{m+1:m} = 1
        S = Gm.exp().transpose(1, 2) * ssm_state[s].to(dt) + kw.transpose(1, 2) @ d
        out.append(S)
    return torch.stack(out)
