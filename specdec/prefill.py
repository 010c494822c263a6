"""Prefill of `HybridRunner`: a right-padded chunk of prompts (`Chunk`), the linear-attention layers' prefill ops
(`PrefillOps`: conv window and state written straight to the slots' pool) and the chunked delta rule
(`prefill_delta_rule`: fla on CUDA, `kernels.chunk_delta_rule` elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import kernels
from specdec.replayssm import StateConfig


@dataclass
class Chunk:
    """One prefill chunk over a right-padded batch `[B, T]`: row b holds `n[b]` (1..T) real tokens first."""
    n: torch.Tensor  # [B] long: real tokens per row
    counts: list[int]  # the same on the host
    padded: bool  # some row has fewer than T real tokens
    last_logits: bool  # logits only at each row's last real token: `[B, 1, vocab]`
    valid: torch.Tensor | None = None  # [B, T] bool (padded chunks only)
    flat: torch.Tensor | None = None  # [sum n] long: the real tokens' indices in the flattened `[B * T]`
    cu_seqlens: torch.Tensor | None = None  # [B + 1] long, cumulated n (fla varlen), on the device
    cu_seqlens_cpu: torch.Tensor | None = None  # the same on the host

    @classmethod
    def make(cls, n: list[int], T: int, device, last_logits: bool = False) -> "Chunk":
        n_t = torch.tensor(n, dtype=torch.long, device=device)
        if all(m == T for m in n):
            return cls(n_t, list(n), False, last_logits)
        cu = torch.tensor([0] + n, dtype=torch.long).cumsum(0)
        flat = torch.cat([torch.arange(m) + b * T for b, m in enumerate(n)])
        valid = torch.arange(T, device=device)[None] < n_t[:, None]
        return cls(n_t, list(n), True, last_logits, valid, flat.to(device), cu.to(device), cu)


class PrefillOps:
    """Prefill from the slots' state, written straight back (prefill has nothing to roll back). Over a
    right-padded chunk each row's state ends at its last real token: the conv window is gathered there and
    the delta rule leaves the state unchanged at padded positions."""

    def __init__(self, runner: "HybridRunner", li: int, slots: torch.Tensor, chunk: Chunk | None = None):
        self.r, self.li, self.slots, self.chunk = runner, li, slots, chunk

    def conv(self, x, weight, bias, activation):
        pool = self.r.state.pool
        state = pool.conv[self.li, self.slots]
        y, win = kernels.short_conv(x, weight, bias, conv_state=state, activation=activation)
        if self.chunk is not None and self.chunk.padded:  # window at row b's end: columns n_b .. n_b+Kc-2
            full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, Kc-1+T]
            idx = self.chunk.n[:, None] + torch.arange(state.shape[-1], device=x.device)
            win = full.gather(2, idx[:, None, :].expand(-1, full.shape[1], -1))
        pool.conv[self.li, self.slots] = win.to(pool.conv.dtype)
        return y

    def mix(self, q, k, v, g, beta):
        pool, cfg = self.r.state.pool, self.r.state.cfg
        if cfg.gate_in_kernel:  # g is the gate's input: the verify kernels compute the gate, prefill does it here
            g = kernels.kda_gate(g, **self.r.state.gate(self.li))
        o, S = prefill_delta_rule(q, k, v, g, beta, pool.ssm[self.li, self.slots], cfg, chunk=self.chunk)
        pool.ssm[self.li, self.slots] = S.to(pool.ssm.dtype)
        return o


def prefill_delta_rule(q, k, v, g, beta, state: torch.Tensor, cfg: StateConfig, *, chunk: Chunk | None = None):
    """Prefill of one chunk: fla's chunk kernels on CUDA, `kernels.chunk_delta_rule` elsewhere (the same
    recurrence in chunked form). q, k `[B, T, H, K]` raw; -> (o `[B, T, H, V]`, S `[B, H, K, V]`).

    A padded `chunk` (row b real at its first `n[b]` positions) runs on CUDA as fla varlen (`cu_seqlens`, the
    real tokens packed, no padding); elsewhere the padded positions get q = k = v = g = beta = 0, the values
    `chunk_delta_rule` pads its own chunks with, so the state passes them unchanged (no decay, no update) and
    each row's S is its state after its last real token. o is 0 at padded positions. The mamba2 rule has no fla
    kernel here: it takes the chunked reference on every device."""
    padded = chunk is not None and chunk.padded
    if q.is_cuda and cfg.rule == "delta":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.kda import chunk_kda
        except ImportError:
            pass
        else:
            fn = chunk_kda if cfg.gate == "kda" else chunk_gated_delta_rule
            if not padded:
                o, S = fn(q, k, v, g.float(), beta, scale=cfg.scale, initial_state=state.float(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
                return o, S
            B, T = q.shape[:2]

            def pack(x):  # [B, T, ...] -> [1, sum n, ...]
                return x.flatten(0, 1).index_select(0, chunk.flat)[None]

            o, S = fn(pack(q), pack(k), pack(v), pack(g.float()), pack(beta), scale=cfg.scale,
                      initial_state=state.float(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=chunk.cu_seqlens, cu_seqlens_cpu=chunk.cu_seqlens_cpu)
            out = o.new_zeros(B * T, *o.shape[2:]).index_copy_(0, chunk.flat, o[0])
            return out.view(B, T, *o.shape[2:]), S
    if padded:
        def real(x):  # 0 at padded positions
            return torch.where(chunk.valid.view(*chunk.valid.shape, *[1] * (x.dim() - 2)), x, x.new_zeros(()))

        q, k, v, g, beta = real(q), real(k), real(v), real(g), real(beta)
    return kernels.chunk_delta_rule(q, k, v, g, beta, initial_state=state, scale=cfg.scale, eps=cfg.norm_eps,
                                    norm=cfg.norm, rule=cfg.rule)
