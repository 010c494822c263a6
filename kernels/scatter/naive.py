"""Masked scatter of one verify step per request into its persistent slot."""

from __future__ import annotations

import torch

from ..common import valid_slots


def masked_scatter(src: torch.Tensor, dst: torch.Tensor, dst_indices: torch.Tensor, step: torch.Tensor, *,
                   null_slot: int = -1) -> None:
    """`dst[:, dst_indices[b]] = src[:, b, step[b]]` for every layer, in place.

    Args:
        src: per-request steps `[Lyr, R, T, *S]` (snapshot states or conv windows).
        dst: persistent slots `[Lyr, N, *S]`.
        dst_indices: slot per request `[B]` (B <= R); -1 / `null_slot` rows are skipped.
        step: `[B]` step to copy; -1 skips.
    """
    B = dst_indices.shape[0]
    if src.dim() != dst.dim() + 1 or src.shape[0] != dst.shape[0] or src.shape[3:] != dst.shape[2:] \
            or src.shape[1] < B:
        raise ValueError(f"src: expected [{dst.shape[0]}, >={B}, T, {', '.join(map(str, dst.shape[2:]))}], "
                         f"got {list(src.shape)}")
    if step.shape != (B,):
        raise ValueError(f"step: expected shape [{B}], got {list(step.shape)}")
    for b in (valid_slots(dst_indices, null_slot) & (step >= 0)).nonzero().flatten().tolist():
        dst[:, int(dst_indices[b])] = src[:, b, int(step[b])].to(dst.dtype)
