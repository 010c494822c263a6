"""Plain (non-speculative) prefill / decode: the sequence every speculative path must reproduce."""

from __future__ import annotations

import torch

from ..common import check_delta_inputs, check_shape, conv_step, delta_step, math_dtype, prepare_qk


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               conv_state: torch.Tensor | None = None,
               activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise short conv over `T` tokens, continuing from a window.

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
    window, ys = conv_state, []
    for t in range(T):
        y, window = conv_step(window, x[:, t], weight, bias, activation)
        ys.append(y)
    y = torch.stack(ys, 1) if ys else x.new_zeros(B, 0, C)
    return y.to(x.dtype), window.to(x.dtype)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         *, initial_state: torch.Tensor | None = None, scale: float | None = None,
                         eps: float = 1e-6, norm: str = "rsqrt") -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule (KDA, or GDN when `g` has no channel dim) token by token, from raw q/k.

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
    q, k = prepare_qk(q, k, scale=scale, eps=eps, norm=norm, dtype=dt)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt).clone()
    o = q.new_zeros(B, T, H, V)
    for t in range(T):
        S, o[:, t], _ = delta_step(S, q[:, t], k[:, t], v[:, t].to(dt), g[:, t].to(dt), beta[:, t].to(dt))
    return o.to(v.dtype), S
