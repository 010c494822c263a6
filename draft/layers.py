"""Small transformer pieces the trained drafters are built from: RMSNorm, rotary positions, attention over a
given context plus own keys, a SwiGLU MLP, a pre-norm block, and the distillation loss."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.tensors import per_tensor

if TYPE_CHECKING:
    from .registry import DraftConfig


def target_logits(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The target's `lm_head` on a drafter's `x [..., d]` -> `[..., V]`, never training the target: under autograd
    through the detached weight (the loss reaches x alone); otherwise the module itself, so the copy a CPU target's
    verify keeps warm (`specdec.cpu_linear`'s blocked weight) serves the drafter too, instead of the original
    weight read cold from memory every round."""
    if isinstance(head, nn.Linear):
        w = head.weight
        x = x.to(w.dtype)
        if torch.is_grad_enabled():
            return F.linear(x, w.detach(), None if head.bias is None else head.bias.detach())
    return head(x)


def pick_draft(logits: torch.Tensor, sampling=None, generator=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of `logits [..., V]`: drawn from `q = probs_from_logits(logits, sampling)` when
    sampling (-> (tokens `[...]`, q `[..., V]`)), else the argmax (-> (tokens `[...]`, None))."""
    if sampling is None or not sampling.do_sample:
        return logits.argmax(-1), None
    from specdec.verify import probs_from_logits
    q = probs_from_logits(logits, sampling)
    return torch.multinomial(q.to(torch.float64), 1, generator=generator)[..., 0], q


class DraftChain:
    """A chain's drafts picked one at a time with `pick_draft` (argmax, or drawn when sampling), and the
    distributions they were drawn from when sampling: `pick(logits [B, V]) -> tokens [B]` per draft, then
    `result() -> (tokens [B, G], probs [B, G, V] or None)`."""

    def __init__(self, sampling=None, generator=None):
        self.sampling, self.generator = sampling, generator
        self.sample = sampling is not None and sampling.do_sample
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        tok, q = pick_draft(logits, self.sampling, self.generator)
        if self.sample:
            self.probs.append(q)
        self.tokens.append(tok)
        return tok

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.stack(self.tokens, 1), (torch.stack(self.probs, 1) if self.sample else None)


def additive_mask(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool visibility `[..., T, S]` -> additive mask `[B, 1, T, S]` (0 where visible, the dtype's minimum
    elsewhere), for the attention that takes one (an MLA target's `latent_attention`); the drafters' own `attend`
    takes the bool visibility itself."""
    mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, torch.finfo(dtype).min)
    return mask if mask.dim() == 4 else mask[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim, as one op."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


_INV_FREQ: dict = {}  # (D, theta, device) -> the inverse frequencies `[D/2]` in float64


def _inv_freq(D: int, theta: float, device: torch.device) -> torch.Tensor:
    """`theta ** (-2i / D)`, i < D/2, in float64: made once per (D, theta, device), outside any CUDA-graph
    capture (a tensor made during one would live in the graph's memory pool)."""
    key = (D, float(theta), torch.device(device))
    inv = _INV_FREQ.get(key)
    if inv is None:
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float64) / D))
        if not (inv.is_cuda and torch.cuda.is_current_stream_capturing()):
            _INV_FREQ[key] = inv
    return inv


@per_tensor
def _rope_tables(positions: torch.Tensor, D: int, theta: float, dtype: torch.dtype):
    """`(cos, sin)` `[B, 1, T, D]` in `dtype` of `positions [B, T]`, each half's angles twice, sin negated on the
    first half: made once for the q and k of a layer."""
    ang = positions[:, None, :, None].to(torch.float64) * _inv_freq(D, theta, positions.device)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of x `[B, H, T, D]` by `positions [B, T]` (half-split RoPE): `(x1 cos - x2 sin, x2 cos +
    x1 sin)` for the halves x1, x2, as `x * cos + (x2, x1) * (-sin, sin)`: the same roundings (a negation is
    exact), in four ops instead of seven."""
    D = x.shape[-1]
    cos, sin = _rope_tables(positions, D, theta, x.dtype)
    return x * cos + torch.cat([x[..., D // 2:], x[..., : D // 2]], dim=-1) * sin


# Queries per attention call and per forward of a drafter's prefill. `attend` runs longer query runs this many at a
# time, so the mask the kernel makes of a bool visibility (and any score tile it keeps) covers one chunk of queries,
# never T x S; a drafter that observes a whole prompt runs its layers over this many positions at a time, the earlier
# chunks' keys cached (a `KVRoom`), and builds the visibility of that chunk only.
QUERY_CHUNK = 512


def ring_positions(lens: torch.Tensor, span: int, cap: int) -> torch.Tensor:
    """The position each of the first `span` slots of a ring of `cap` slots holds, per row of `lens [B]` positions
    written (position p at slot p % cap): the latest p < the row's length with p = slot (mod cap), negative where no
    position reached the slot yet. -> `[B, span]`."""
    last = lens[:, None] - 1
    return last - (last - torch.arange(span, device=lens.device)) % cap


def ring_write(cache, rows_t: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, kvs) -> None:
    """K/V per layer `[B, H, R, D]` of `positions [B, R]` (consecutive per row, R <= the ring: distinct slots) into
    the ring buffers `cache` (per layer `(K, V)`, `[rows, H, cap, D]`) at slots `positions % cap` of rows `rows_t
    [B]`, where `valid [B, R]`; the other slots keep what they hold. One masked indexed write per buffer."""
    cache = list(cache)
    keep = valid[..., None, None]
    at = (rows_t[:, None], slice(None), positions % cache[0][0].shape[2])  # every layer's ring has cap slots
    for (ck, cv), (k, v) in zip(cache, kvs):
        ck[at] = torch.where(keep, k.transpose(1, 2), ck[at])
        cv[at] = torch.where(keep, v.transpose(1, 2), cv[at])


class KVRoom(NamedTuple):
    """Key / value buffers `k, v [B, Hkv, L, D]` whose first `at` positions hold the keys attended so far: `attend`
    writes a call's new keys at `at .. at + T` in place and reads `[:at + T]`, so keys that grow call by call (a
    prompt's chunks, a draft tree's depths) are never copied or concatenated per call."""

    k: torch.Tensor
    v: torch.Tensor
    at: int


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past, visible: torch.Tensor | None, *,
           scale: float) -> torch.Tensor:
    """Softmax attention of queries `q [B, H, T, D]` over `past`'s keys then the new keys / values
    `k, v [B, Hkv, T, D]` (`Hkv` divides `H`: each key head serves `H / Hkv` query heads, GQA), through
    `scaled_dot_product_attention`: no additive mask or score matrix is built here, and queries run `QUERY_CHUNK`
    at a time.

    `past`: None (the keys are `k, v` alone), a `(k, v)` pair `[B, Hkv, S, D]` (joined with the new ones), or a
    `KVRoom` holding S = `at` keys (the new ones are written into it). `visible`: bool `[B or 1, T or 1, S + T]`
    (or with a head axis, `[B or 1, 1, T or 1, S + T]`), true where a query sees a key; None: every key.
    -> `[B, H, T, D]`."""
    if isinstance(past, KVRoom):
        end = past.at + k.shape[2]
        past.k[:, :, past.at:end] = k
        past.v[:, :, past.at:end] = v
        k, v = past.k[:, :, :end], past.v[:, :, :end]
    elif past is not None:
        k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
    mask = visible if visible is None or visible.dim() == 4 else visible[:, None]
    gqa = q.shape[1] != k.shape[1]
    T = q.shape[2]
    outs = []
    for t0 in range(0, max(T, 1), QUERY_CHUNK):
        t1 = min(T, t0 + QUERY_CHUNK)
        m = mask if mask is None or mask.shape[2] == 1 else mask[:, :, t0:t1]
        outs.append(F.scaled_dot_product_attention(q[:, :, t0:t1], k, v, attn_mask=m, scale=scale, enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


class Attention(nn.Module):
    """Multi-head attention over `[context K/V (given), own K/V]` with a bool visibility (`attend`); returns its
    new K/V so callers keep their own cache (or none)."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, *, rope_theta: float = 10000.0):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_theta = num_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[B, H, T, D]` of inputs x `[B, T, hidden]` at `positions [B, T]`."""
        return rotary(self.heads(self.k_proj(x)), positions, self.rope_theta), self.heads(self.v_proj(x))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor] | KVRoom | None = None):
        """x `[B, T, hidden]` at `positions [B, T]`; `visible` bool `[B or 1, T, S + T]` over the past keys then
        x's own (None: all); `past` None, one `(k, v)` pair `[B, H, S, D]` or a `KVRoom` (see `attend`)
        -> (out `[B, T, hidden]`, (k, v) of x `[B, H, T, D]`)."""
        q = rotary(self.heads(self.q_proj(x)), positions, self.rope_theta)
        k, v = self.kv(x, positions)
        out = attend(q, k, v, past, visible, scale=1 / math.sqrt(self.head_dim))
        B, H, T, D = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D)), (k, v)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: attention (see `Attention`) + SwiGLU MLP."""

    def __init__(self, cfg: DraftConfig, hidden: int):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.attn = Attention(hidden, cfg.num_heads, cfg.head_dim, rope_theta=cfg.rope_theta)
        self.mlp_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(hidden, cfg.intermediate_size)

    def forward(self, x, positions, visible, past=None):
        a, kv = self.attn(self.attn_norm(x), positions, visible, past)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), kv


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the drafter's `logits [..., V]` against the target's distribution (distillation)."""
    return -(target_logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1).mean()


class SharesTarget(nn.Module):
    """A drafter net that holds some of the target's own modules as `target_*` children (embedding, lm_head,
    norms, layers) without owning them: `.to()` / `.float()` and `.train()` leave them as the target has them."""

    def _apply(self, fn, recurse=True):
        saved = dict(self._modules)
        for n in [n for n in self._modules if n.startswith("target_")]:
            del self._modules[n]
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules.clear()
            self._modules.update(saved)

    def train(self, mode: bool = True):
        self.training = mode
        for name, mod in self.named_children():
            if not name.startswith("target_"):
                mod.train(mode)
        return self
