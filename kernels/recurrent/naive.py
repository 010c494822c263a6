"""Plain (non-speculative) prefill / decode: the sequence every speculative path must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import check_delta_inputs, check_shape, delta_step, math_dtype, prepare_qk


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               conv_state: torch.Tensor | None = None,
               activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise short conv over `T` tokens, continuing from a window, with no per-token loop: the
    `Kc` taps are `Kc` shifted multiply-adds over `[window, x]` (`2 Kc - 1` ops whatever `T`).

    The taps are summed left to right, the order in which `common.conv_step` (the verify and decode path) sums
    them on CPU: there y matches `T` steps of `conv_step` bitwise before the activation and within an ulp after
    it (silu's vector and scalar CPU paths differ in the last bit), and one call equals `T` one-token calls
    bitwise. `F.conv1d` would be one launch, but sums the taps in another order in fp32 (a few ulps off the
    verify path, beyond the state tests' 2-ulp bound) and may use TF32 on GPUs.

    Args:
        x: pre-conv inputs `[B, T, C]`;  weight: `[C, Kc]`;  bias: `[C]` or None.
        conv_state: window of the last `Kc-1` inputs `[B, C, Kc-1]` (None: zeros).
    Returns:
        `(y [B, T, C] in x.dtype, window [B, C, Kc-1] in x.dtype)`: window = last `Kc-1` columns of
        `[conv_state, x_1..x_T]`.
    """
    B, T, C = x.shape
    Kc = weight.shape[-1]
    check_shape("weight", weight, (C, None))
    if conv_state is None:
        conv_state = x.new_zeros(B, C, Kc - 1)
    check_shape("conv_state", conv_state, (B, C, Kc - 1))
    if T == 0:
        return x.new_zeros(B, 0, C), conv_state.to(x.dtype)
    dt = math_dtype(conv_state, x, weight)
    full = torch.cat([conv_state.to(dt).transpose(1, 2), x.to(dt)], dim=1)  # [B, Kc-1+T, C]
    # token t reads rows t .. t+Kc-1: `unfold` gives `[B, T, C, Kc]`, a view, read as `[B, T, Kc, C]`
    y = conv_taps(full.unfold(1, Kc, 1).transpose(-1, -2), weight, bias, activation)
    return y.to(x.dtype), full[:, T:].transpose(1, 2).to(x.dtype)


def conv_taps(cols: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str | None) -> torch.Tensor:
    """Depthwise conv of gathered inputs `cols [R, T, Kc, C]` (oldest tap first) with `weight [C, Kc]` ->
    `[R, T, C]` (math dtype).

    One arithmetic for plain decode (`short_conv`: sliding windows of `[window, x]`) and the verify (the
    gathered inputs of each node's root path): taps multiplied and summed left to right, then the bias, then a
    silu whose rounding does not depend on the tensor's size. So every verify token's output equals plain
    decode of its root path, bit for bit. Channels are the innermost dimension, so the sum over the taps runs
    along contiguous rows of channels.
    """
    # every product in one op, then the adds left to right (not torch's `sum`, whose order over the taps depends on
    # the shapes); Kc ops, not 2 Kc - 1
    # More than one row: contiguous taps let the product run whole vectors; one row reads the strided view faster
    # than it copies it.
    w = weight.to(cols.dtype).t()  # [Kc, C]
    if cols.numel() > w.numel():
        w = w.contiguous()
    prod = cols * w  # [R, T, Kc, C] * [Kc, C]
    # The sums go into the first tap's slice (no [R, T, C] temporary per tap); the last add is out of place, so the
    # result is contiguous.
    y, Kc = prod[..., 0, :], prod.shape[-2]
    for j in range(1, Kc):
        y = y.add_(prod[..., j, :]) if j < Kc - 1 else y + prod[..., j, :]
    if bias is not None:
        y = y + bias.to(cols.dtype)
    if activation == "silu":
        y = _silu(y)
    elif activation is not None:
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    return y


def _silu(y: torch.Tensor) -> torch.Tensor:
    """`silu` whose every element rounds the same whatever the tensor's size. The CPU kernel runs whole SIMD
    vectors and a scalar tail, which can differ in the last bit; padding the flat tensor to a multiple of 64
    puts every element in a vector (below the kernel's parallel grain), so one call over T tokens matches T
    calls of one token bitwise."""
    if y.is_cuda or y.numel() == 0:
        return F.silu(y)
    pad = (-y.numel()) % 64
    if pad == 0 and y.is_contiguous():  # already whole vectors (the model's conv widths are multiples of 64)
        return F.silu(y)
    flat = y.reshape(-1)
    return F.silu(F.pad(flat, (0, pad)))[:flat.numel()].view_as(y)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         *, initial_state: torch.Tensor | None = None, scale: float | None = None,
                         eps: float = 1e-6, norm: str = "rsqrt",
                         rule: str = "delta") -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule (KDA, or GDN when `g` has no channel dim) token by token, from raw q/k; `rule="mamba2"`:
    a Mamba2 head (q = C, k = B, v = x, g = dt A `[B, T, H]`, beta = dt; no norm, no scale, no D skip).

    Args:
        q, k: raw (pre-L2-norm) `[B, T, H, K]`;  v: `[B, T, H, V]`.
        g: log-decay `[B, T, H, K]` (KDA) or `[B, T, H]` (GDN);  beta: `[B, T, H]`.
        initial_state: `[B, H, K, V]` (None: zeros).
    Returns:
        `(o [B, T, H, V] in v.dtype, S [B, H, K, V])`; S in fp32 (fp64 if any input is fp64).
    """
    B, T, H, K, V, g = check_delta_inputs(q, k, v, g, beta)
    dt = math_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    q, k = prepare_qk(q, k, scale=scale, eps=eps, norm=norm, dtype=dt, rule=rule)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt).clone()
    o = q.new_zeros(B, T, H, V)
    for t in range(T):
        S, o[:, t], _ = delta_step(S, q[:, t], k[:, t], v[:, t].to(dt), g[:, t].to(dt), beta[:, t].to(dt),
                                   rule=rule)
    return o.to(v.dtype), S
