"""Commit copies: one verify step per request into its persistent slot (masked scatter), and the conv window
rebuilt from the pre-conv inputs of the accepted tokens."""

from __future__ import annotations

import torch

from ..common import valid_slots


def check_scatter_args(src: torch.Tensor, dst: torch.Tensor, dst_indices: torch.Tensor, step: torch.Tensor) -> int:
    """The argument checks `masked_scatter` (naive and Triton) shares -> B."""
    B = dst_indices.shape[0]
    if src.dim() != dst.dim() + 1 or src.shape[0] != dst.shape[0] or src.shape[3:] != dst.shape[2:] \
            or src.shape[1] < B:
        raise ValueError(f"src: expected [{dst.shape[0]}, >={B}, T, {', '.join(map(str, dst.shape[2:]))}], "
                         f"got {list(src.shape)}")
    if step.shape != (B,):
        raise ValueError(f"step: expected shape [{B}], got {list(step.shape)}")
    return B


def masked_scatter(src: torch.Tensor, dst: torch.Tensor, dst_indices: torch.Tensor, step: torch.Tensor, *,
                   null_slot: int = -1) -> None:
    """`dst[:, dst_indices[b]] = src[:, b, step[b]]` for every layer, in place.

    Args:
        src: per-request steps `[Lyr, R, T, *S]` (snapshot states or conv windows).
        dst: persistent slots `[Lyr, N, *S]`.
        dst_indices: slot per request `[B]` (B <= R); -1 / `null_slot` rows are skipped.
        step: `[B]` step to copy; -1 skips.
    """
    check_scatter_args(src, dst, dst_indices, step)
    for b in (valid_slots(dst_indices, null_slot) & (step >= 0)).nonzero().flatten().tolist():
        dst[:, int(dst_indices[b])] = src[:, b, int(step[b])].to(dst.dtype)


def rebuild_windows(windows: torch.Tensor, conv_inputs: torch.Tensor, path: torch.Tensor | None,
                    count: torch.Tensor) -> torch.Tensor:
    """The conv window after the first `count` accepted tokens of each row, from the committed window and the
    tokens' pre-conv inputs: the last `Kc-1` columns of `[window, x[path[0]], .., x[path[count-1]]]`. A copy,
    so it equals the window the verify pass would have kept, bit for bit. One gather, no loop.

    Args:
        windows: committed windows of the rows `[Lyr, B, C, Kc-1]`.
        conv_inputs: the rows' verify records `[Lyr, B, T, C]` (pre-conv input of each token / node).
        path: `[B, M]` accepted node indices, root first (a tree's path); None: tokens `0..count-1` (chain).
        count: `[B]` accepted tokens (0: the committed window).
    Returns:
        `[Lyr, B, C, Kc-1]` in the dtype of `windows`.
    """
    Lyr, B, C, W = windows.shape
    T = conv_inputs.shape[2]
    idx = count[:, None] + torch.arange(W, device=count.device)  # [B, W]: index into [window, x along the path]
    from_x = idx >= W
    node = idx - W
    if path is not None:
        node = path.gather(1, node.clamp(0, path.shape[1] - 1))
    node = node.clamp(0, T - 1)
    xs = conv_inputs.gather(2, node[None, :, :, None].expand(Lyr, B, W, C)).transpose(2, 3)  # [Lyr, B, C, W]
    old = windows.gather(3, idx.clamp(max=W - 1)[None, :, None, :].expand(Lyr, B, C, W))
    return torch.where(from_x[None, :, None, :], xs.to(windows.dtype), old)


def commit_conv_windows(conv_state: torch.Tensor, conv_inputs: torch.Tensor, conv_state_indices: torch.Tensor,
                        path: torch.Tensor | None, count: torch.Tensor, *, null_slot: int = -1) -> None:
    """`conv_state[:, slot of row b]` = its window after the row's `count[b]` accepted tokens, in place.

    Args:
        conv_state: persistent windows `[Lyr, N, C, Kc-1]`.
        conv_inputs: verify records `[Lyr, R >= B, >= T, C]`, indexed by row.
        conv_state_indices: slot per row `[B]`; -1 / `null_slot` rows are skipped, as are rows with count 0.
        path: `[B, M]` accepted node indices (None: a chain);  count: `[B]`.
    """
    rows = (valid_slots(conv_state_indices, null_slot) & (count > 0)).nonzero().flatten()
    if rows.numel() == 0:
        return
    slots = conv_state_indices[rows]
    conv_state[:, slots] = rebuild_windows(conv_state[:, slots], conv_inputs[:, rows],
                                           None if path is None else path[rows], count[rows])
