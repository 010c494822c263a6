"""Exact fold: advance the fp32 checkpoint by the accepted records, in plain-decode op order; the conv
windows of the same rows are rebuilt from their pre-conv input records in the same call."""

from __future__ import annotations

import torch

from ..common import check_gate_params, check_rule, delta_step, math_dtype, prepare_qk, valid_slots
from ..rebuild.naive import ring_log_decay
from ..scatter.naive import commit_conv_windows


def check_fold_args(ssm_state: torch.Tensor, ring_beta: torch.Tensor, ssm_state_indices: torch.Tensor,
                    num_tokens: torch.Tensor, ring_indices: torch.Tensor | None, conv_state: torch.Tensor | None,
                    conv_inputs: torch.Tensor | None, conv_count: torch.Tensor | None) -> None:
    """Argument checks shared by both backends: one `ValueError` naming the argument."""
    Lyr, B = ssm_state.shape[0], ssm_state_indices.shape[0]
    if ring_beta.dim() != 4 or ring_beta.shape[0] != Lyr or ring_beta.shape[2] != ssm_state.shape[2]:
        raise ValueError(f"ring_beta: expected [{Lyr}, N', {ssm_state.shape[2]}, L], got {list(ring_beta.shape)}")
    if num_tokens.shape != (B,):
        raise ValueError(f"num_tokens: expected shape [{B}], got {list(num_tokens.shape)}")
    if ring_indices is not None and ring_indices.shape != (B,):
        raise ValueError(f"ring_indices: expected shape [{B}], got {list(ring_indices.shape)}")
    if (conv_state is None) != (conv_inputs is None):
        raise ValueError("conv_inputs: pass conv_state and conv_inputs together (or neither)")
    if conv_state is not None:
        if conv_state.dim() != 4 or conv_state.shape[:2] != ssm_state.shape[:2]:
            raise ValueError(f"conv_state: expected [{Lyr}, {ssm_state.shape[1]}, C, Kc-1], "
                             f"got {list(conv_state.shape)}")
        if conv_inputs.dim() != 4 or conv_inputs.shape[0] != Lyr or conv_inputs.shape[1] < B \
                or conv_inputs.shape[3] != conv_state.shape[2]:
            raise ValueError(f"conv_inputs: expected [{Lyr}, >={B}, T, {conv_state.shape[2]}], "
                             f"got {list(conv_inputs.shape)}")
        if conv_count is not None and conv_count.shape != (B,):
            raise ValueError(f"conv_count: expected shape [{B}], got {list(conv_count.shape)}")


def exact_fold(ssm_state: torch.Tensor, ring_rawv: torch.Tensor, ring_rawk: torch.Tensor, ring_g: torch.Tensor,
               ring_beta: torch.Tensor, ssm_state_indices: torch.Tensor, ring_start: torch.Tensor | None,
               num_tokens: torch.Tensor, *, offsets: torch.Tensor | None = None,
               ring_indices: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
               track_interval: int | None = None, track_states: torch.Tensor | None = None,
               conv_state: torch.Tensor | None = None, conv_inputs: torch.Tensor | None = None,
               conv_path: torch.Tensor | None = None, conv_count: torch.Tensor | None = None,
               A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               eps: float = 1e-6, norm: str = "rsqrt", null_slot: int = -1, rule: str = "delta") -> None:
    """Fold accepted records into the checkpoints of every layer, in place; optionally rebuild the rows' conv
    windows from their input records. `rule`: the step of `common.delta_step` the records replay ("mamba2": rawv
    = x, rawk = B, g = dt A, beta = dt).

    Args:
        ssm_state: checkpoints of all layers `[Lyr, N, H, K, V]` (updated in place).
        ring_rawv `[Lyr, N', H, L, V]`, ring_rawk `[Lyr, N', H, L, K]`, ring_g `[Lyr, N', H, L, K or 1]`,
        ring_beta `[Lyr, N', H, L]`: the records, row `ring_indices[b]` (default: the slot) for request b.
        ssm_state_indices: slot per request `[B]`; -1 / `null_slot` rows are skipped.
        ring_start: `[N']` ring position of record offset 0 of each ring row, or None: offset = position
            (eager layout, no wrap).
        num_tokens: `[B]` records to fold (0 skips).
        offsets: `[B, M]` record offsets from ring_start (a tree's accepted node path); default `0..n-1`.
        seq_lens: `[N]` tokens already in each checkpoint; with `track_interval`, the state right after
            every token whose count is a multiple of the interval is copied to
            `track_states[layer, slot, (count // interval) % 2]` (`[Lyr, N, 2, H, K, V]`).
        conv_state: persistent windows `[Lyr, N, C, Kc-1]` (updated in place) and conv_inputs
            `[Lyr, R >= B, T, C]` (row b's pre-conv verify inputs): the slot's window becomes the one after
            the row's accepted tokens (`scatter.naive.rebuild_windows`): `conv_count [B]` tokens
            (default num_tokens) along `conv_path [B, M]` (default offsets; None: a chain).
        A_log `[Lyr, H]`, dt_bias `[Lyr, H, K]`: given, ring_g holds the KDA gate's input f and each step's
            log-decay is `common.kda_gate(f)`, as in the verify that wrote it.
    """
    check_rule(rule)
    check_gate_params(A_log, dt_bias, (ssm_state.shape[0],), ssm_state.shape[2], ssm_state.shape[3], ring_g)
    check_fold_args(ssm_state, ring_beta, ssm_state_indices, num_tokens, ring_indices, conv_state, conv_inputs,
                    conv_count)
    if conv_state is not None:
        commit_conv_windows(conv_state, conv_inputs, ssm_state_indices, offsets if conv_path is None else conv_path,
                            num_tokens if conv_count is None else conv_count, null_slot=null_slot)
    L = ring_beta.shape[3]
    dt = math_dtype(ssm_state, ring_rawv, ring_g)
    rows = valid_slots(ssm_state_indices, null_slot) & (num_tokens > 0)
    rows = rows.nonzero().flatten()
    if rows.numel() == 0:
        return
    # every row's records gathered and prepared at once (the same elementwise ops and last-dim norms per record
    # as one row alone); only the steps run row by row, so each state stays in cache while it is advanced
    slots, counts = ssm_state_indices[rows], num_tokens[rows]
    host_slots, host_counts = slots.tolist(), counts.tolist()
    M = max(host_counts)
    r = slots if ring_indices is None else ring_indices[rows]
    off = torch.arange(M, device=ring_beta.device).expand(len(host_counts), M) if offsets is None \
        else offsets[rows, :M]
    pos = off if ring_start is None else (ring_start[r][:, None] + off) % L      # [R, M]
    r, pos = r[:, None], pos.clamp(0, L - 1)  # past a row's count: any record (never stepped)

    def gather(ring: torch.Tensor) -> torch.Tensor:  # [Lyr, N', H, L, *] -> [Lyr, R, M, H, *]
        return ring[:, r, :, pos].permute(2, 0, 1, 3, 4)

    _, k = prepare_qk(None, gather(ring_rawk), scale=1.0, eps=eps, norm=norm, dtype=dt, rule=rule)
    v, beta = gather(ring_rawv).to(dt), ring_beta[:, r, :, pos].permute(2, 0, 1, 3).to(dt)
    g = ring_log_decay(gather(ring_g), dt, A_log, dt_bias, 3)
    tracked = track_interval is not None and seq_lens is not None
    base = seq_lens[slots].tolist() if tracked else None
    for i, (s, n) in enumerate(zip(host_slots, host_counts)):
        S = ssm_state[:, s].to(dt)
        for j in range(n):
            S, _, _ = delta_step(S, None, k[:, i, j], v[:, i, j], g[:, i, j], beta[:, i, j], rule=rule)
            if tracked:
                count = base[i] + j + 1
                if count % track_interval == 0:
                    track_states[:, s, (count // track_interval) % 2] = S.to(track_states.dtype)
        ssm_state[:, s] = S.to(ssm_state.dtype)
