"""Exact fold: advance the fp32 checkpoint by the accepted records, in plain-decode op order."""

from __future__ import annotations

import torch

from ..common import delta_step, math_dtype, prepare_qk, valid_slots


def exact_fold(ssm_state: torch.Tensor, ring_rawv: torch.Tensor, ring_rawk: torch.Tensor, ring_g: torch.Tensor,
               ring_beta: torch.Tensor, ssm_state_indices: torch.Tensor, ring_start: torch.Tensor,
               num_tokens: torch.Tensor, *, offsets: torch.Tensor | None = None,
               seq_lens: torch.Tensor | None = None, track_interval: int | None = None,
               track_states: torch.Tensor | None = None, eps: float = 1e-6, norm: str = "rsqrt",
               null_slot: int = -1) -> None:
    """Fold accepted records into the checkpoints of every layer, in place.

    Args:
        ssm_state: checkpoints of all layers `[Lyr, N, H, K, V]` (updated in place).
        ring_rawv `[Lyr, N, H, L, V]`, ring_rawk `[Lyr, N, H, L, K]`, ring_g `[Lyr, N, H, L, K or 1]`,
        ring_beta `[Lyr, N, H, L]`: the records.
        ssm_state_indices: slot per request `[B]`; -1 / `null_slot` rows are skipped.
        ring_start: `[N]` ring position of record offset 0 of each slot.
        num_tokens: `[B]` records to fold (0 skips).
        offsets: `[B, M]` record offsets from ring_start (a tree's accepted node path); default `0..n-1`.
        seq_lens: `[N]` tokens already in each checkpoint; with `track_interval`, the state right after
            every token whose count is a multiple of the interval is copied to
            `track_states[layer, slot, (count // interval) % 2]` (`[Lyr, N, 2, H, K, V]`).
    """
    Lyr, N, H, L = ring_beta.shape
    dt = math_dtype(ssm_state, ring_rawv, ring_g)
    rows = valid_slots(ssm_state_indices, null_slot).nonzero().flatten().tolist()
    for b in rows:
        s, n = int(ssm_state_indices[b]), int(num_tokens[b])
        if n == 0:
            continue
        off = torch.arange(n, device=ring_beta.device) if offsets is None else offsets[b, :n]
        pos = (ring_start[s] + off) % L
        _, k = prepare_qk(None, ring_rawk[:, s][:, :, pos], scale=1.0, eps=eps, norm=norm, dtype=dt)
        v, g, beta = (ring_rawv[:, s][:, :, pos].to(dt), ring_g[:, s][:, :, pos].to(dt),
                      ring_beta[:, s][:, :, pos].to(dt))  # [Lyr, H, n, *]
        S = ssm_state[:, s].to(dt)
        for j in range(n):
            S, _, _ = delta_step(S, None, k[:, :, j], v[:, :, j], g[:, :, j], beta[:, :, j])
            if track_interval is not None and seq_lens is not None:
                count = int(seq_lens[s]) + j + 1
                if count % track_interval == 0:
                    track_states[:, s, (count // track_interval) % 2] = S.to(track_states.dtype)
        ssm_state[:, s] = S.to(ssm_state.dtype)
