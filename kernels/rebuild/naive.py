"""Fast rebuild: the state after m pending tokens from the checkpoint and the (d, k, g) records."""

from __future__ import annotations

import torch

from ..common import math_dtype


def fast_rebuild(ssm_state: torch.Tensor, ssm_state_indices: torch.Tensor, ring_d: torch.Tensor,
                 ring_k: torch.Tensor, ring_g: torch.Tensor, ring_start: torch.Tensor,
                 num_tokens: torch.Tensor) -> torch.Tensor:
    """`S_m = Diag(A_{1:m}) S_0 + sum_j Diag(A_{j+1:m}) k_j d_j^T`, one matmul per request.

    Open loop: `d` was stored in the ring dtype, so this is for verify outputs only; the checkpoint is
    only ever advanced by the exact fold.

    Args:
        ssm_state: checkpoints of one layer `[N, H, K, V]`.
        ssm_state_indices: slots `[B]` (all valid).
        ring_d `[N, H, L, V]`, ring_k `[N, H, L, K]`, ring_g `[N, H, L, K or 1]`: records of one layer.
        ring_start: `[N]` position of the first pending record;  num_tokens: `[B]` records to apply.
    Returns:
        S `[B, H, K, V]` in fp32 (fp64 with fp64 inputs).
    """
    dt = math_dtype(ssm_state, ring_d, ring_g)
    L = ring_d.shape[2]
    out = []
    for s, m in zip(ssm_state_indices.tolist(), num_tokens.tolist()):
        pos = (ring_start[s] + torch.arange(m, device=ring_d.device)) % L
        d, k, g = ring_d[s][:, pos].to(dt), ring_k[s][:, pos].to(dt), ring_g[s][:, pos].to(dt)  # [H, m, *]
        G = g.cumsum(1)  # [H, m, K|1]: log A_{1:j}
        Gm = G[:, -1:] if m else g.new_zeros(g.shape[0], 1, g.shape[2])
        kw = k * (Gm - G).exp()  # k_j * A_{j+1:m}
        S = Gm.exp().transpose(1, 2) * ssm_state[s].to(dt) + kw.transpose(1, 2) @ d
        out.append(S)
    return torch.stack(out)
