"""Per-family linear-attention mixers: the model's own projections, gates and output norm around our
short conv and delta rule. Each `run` mirrors the transformers module's forward op for op."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class MixerOps(Protocol):
    """What a mixer calls for the stateful parts (prefill: plain recurrence; verify: the state strategy)."""

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None) -> torch.Tensor: ...

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> torch.Tensor: ...


class KimiDeltaMixer:
    """`KimiLinearDeltaAttention`: KDA (per-channel decay), l2norm as x / sqrt(|x|^2 + eps)."""

    gate, norm = "kda", "sqrt_div"

    @staticmethod
    def module(layer):
        return layer.self_attn

    @staticmethod
    def dims(mod) -> dict:
        return dict(num_heads=mod.num_heads, head_k_dim=mod.head_dim, head_v_dim=mod.head_dim,
                    conv_dim=mod.conv_dim, conv_kernel=mod.conv_kernel_size)

    @staticmethod
    def run(mod, x: torch.Tensor, ops: MixerOps) -> torch.Tensor:
        """x `[B, T, hidden]` (after the input norm) -> `[B, T, hidden]`."""
        B, T, _ = x.shape
        mixed = torch.cat([mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)], dim=-1)
        y = ops.conv(mixed, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.activation)
        q, k, v = (t.reshape(B, T, -1, mod.head_dim) for t in torch.split(y, [mod.qkv_dim] * 3, dim=-1))
        g = mod.forget_gate(x)
        beta = torch.sigmoid(mod.b_proj(x))
        o = ops.mix(q, k, v, g, beta)
        gate = mod.g_b_proj(mod.g_a_proj(x)).view(B, T, -1, mod.head_dim)
        return mod.o_proj(mod.o_norm(o, gate).reshape(B, T, -1))


class GatedDeltaMixer:
    """Gated DeltaNet of Qwen3-Next (`in_proj_qkvz` / `in_proj_ba`) and Qwen3.5 (`in_proj_qkv`, `_z`, `_b`,
    `_a`): scalar decay per head, grouped value heads (q, k shared by `num_v_heads // num_k_heads`)."""

    gate, norm = "gdn", "rsqrt"

    @staticmethod
    def module(layer):
        return layer.linear_attn

    @staticmethod
    def dims(mod) -> dict:
        return dict(num_heads=mod.num_v_heads, head_k_dim=mod.head_k_dim, head_v_dim=mod.head_v_dim,
                    conv_dim=mod.conv_dim, conv_kernel=mod.conv_kernel_size)

    @staticmethod
    def run(mod, x: torch.Tensor, ops: MixerOps) -> torch.Tensor:
        B, T, _ = x.shape
        if hasattr(mod, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
            q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x), mod.in_proj_ba(x))
            mixed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
        else:  # Qwen3.5
            mixed = mod.in_proj_qkv(x)
            z = mod.in_proj_z(x).reshape(B, T, -1, mod.head_v_dim)
            b, a = mod.in_proj_b(x), mod.in_proj_a(x)
        y = ops.conv(mixed, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.activation)
        q, k, v = torch.split(y, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        rep = mod.num_v_heads // mod.num_k_heads
        q = q.reshape(B, T, -1, mod.head_k_dim).repeat_interleave(rep, dim=2)
        k = k.reshape(B, T, -1, mod.head_k_dim).repeat_interleave(rep, dim=2)
        v = v.reshape(B, T, -1, mod.head_v_dim)
        beta = b.sigmoid()
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
        o = ops.mix(q, k, v, g, beta)
        o = mod.norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1]))
        return mod.out_proj(o.reshape(B, T, -1))


MIXERS = {"kimi_linear": KimiDeltaMixer, "qwen3_next": GatedDeltaMixer, "qwen3_5": GatedDeltaMixer,
          "qwen3_5_text": GatedDeltaMixer}
