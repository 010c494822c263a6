"""Triton commit copies: the masked scatter of one verify step per request into its persistent slot (all layers
in one launch), and `conv_commit_tile`, the conv window rebuilt from the accepted tokens' input records, which
the exact fold's launch runs beside the fold.

Same semantics as `kernels/scatter/naive.py`. Pure copies (with a dtype cast on store), so fp64 is fine for
the scatter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..triton_utils import cast_to
from .naive import check_scatter_args


@triton.jit
def conv_commit_tile(conv, xin, path, s, b, lyr, n, i_c, C,
                     s_cl, s_cn, s_cc, s_ck, s_xl, s_xr, s_xt, s_xc, s_pb, s_pm,
                     W: tl.constexpr, BC: tl.constexpr, HAS_PATH: tl.constexpr):
    """Channels `[i_c * BC, (i_c + 1) * BC)` of slot s's window `conv[lyr, s]` `[C, W]` become the window after
    row b's first n (>= 1) accepted tokens (`naive.rebuild_windows`): column j (oldest first) is committed column
    n + j while that is < W, else the input record `xin[lyr, b, node]` of node `path[b, n + j - W]` (token
    n + j - W without a path). In place, column after column: column j reads column n + j > j, not yet written.
    """
    offs_c = i_c * BC + tl.arange(0, BC)
    mask = offs_c < C
    c_base = conv + lyr * s_cl + s * s_cn + offs_c * s_cc
    x_base = xin + lyr * s_xl + b * s_xr + offs_c * s_xc
    for j in tl.static_range(W):
        src = n + j
        if src < W:
            val = tl.load(c_base + src * s_ck, mask=mask, other=0.0).to(tl.float32)
        else:
            if HAS_PATH:
                node = tl.load(path + b * s_pb + (src - W) * s_pm).to(tl.int64)
            else:
                node = (src - W).to(tl.int64)
            val = tl.load(x_base + node * s_xt, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_base + j * s_ck, cast_to(val, conv), mask=mask)


@triton.jit
def _masked_scatter_kernel(src, dst, idx, step, B, E, null_slot,
                           s_sl, s_sr, s_st, s_dl, s_dn, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    lyr = pid // B
    b = pid % B
    s = tl.load(idx + b).to(tl.int64)
    t = tl.load(step + b).to(tl.int64)
    if (s < 0) | (s == null_slot) | (t < 0):
        return
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    x = tl.load(src + lyr * s_sl + b * s_sr + t * s_st + offs, mask=mask)
    tl.store(dst + lyr * s_dl + s * s_dn + offs, cast_to(x, dst), mask=mask)


def _flat(t: torch.Tensor, lead: int) -> torch.Tensor | None:
    """View `t` as `[*t.shape[:lead], E]` without a copy, or None when the trailing dims are not dense."""
    try:
        return t.view(*t.shape[:lead], math.prod(t.shape[lead:]))
    except RuntimeError:
        return None


def masked_scatter(src: torch.Tensor, dst: torch.Tensor, dst_indices: torch.Tensor, step: torch.Tensor, *,
                   null_slot: int = -1) -> None:
    """`dst[:, dst_indices[b]] = src[:, b, step[b]]` for every layer, in place (see `naive.masked_scatter`).

    Trailing (per-state) dims must be dense in both tensors (any layer / slot / step strides are fine);
    otherwise the data goes through contiguous copies.
    """
    B = check_scatter_args(src, dst, dst_indices, step)
    Lyr = dst.shape[0]
    E = math.prod(dst.shape[2:])
    if B == 0 or Lyr == 0 or E == 0:
        return
    s3 = _flat(src, 3)
    if s3 is None:
        s3 = src.contiguous().view(*src.shape[:3], E)
    d2 = _flat(dst, 2)
    target = None
    if d2 is None:
        target, d2 = dst, dst.contiguous().view(*dst.shape[:2], E)
    BLOCK = min(triton.next_power_of_2(E), 2048)
    _masked_scatter_kernel[(Lyr * B, triton.cdiv(E, BLOCK))](
        s3, d2, dst_indices, step, B, E, int(null_slot),
        s3.stride(0), s3.stride(1), s3.stride(2), d2.stride(0), d2.stride(1), BLOCK=BLOCK,
        num_warps=4 if BLOCK >= 1024 else 1)
    if target is not None:
        target.copy_(d2.view(target.shape))
