"""Frozen-KV MTP drafter: a small multi-token-prediction head that reads the target's KV cache read-only.

One drafting step, for a request whose committed tokens are `x_0 .. x_t` and whose anchor is `x_{t+1}`:

    x = fc(concat(norm(emb(x_{t+1})), norm(h_t)))        # h_t: the target's final hidden state at t
    x = x + attn(norm(x)); x = x + mlp(norm(x))          # per block (Config.num_layers)
    logits = lm_head(norm(x))                            # emb and lm_head are the target's own

Each block's attention computes queries only. Keys and values are the target's own cache of one
full-attention layer (`Config.attn_layer`, the last one by default), read in place: the drafter keeps no KV
of its own and never writes the target's cache, and its query sits at position `seq_len - 1` (the last
committed token) for every step. Kimi-Linear (MLA, NoPE) stores compressed latents, expanded here with the
target attention module's own `expand_kv`; Qwen3-Next / Qwen3.5 store keys after `k_norm` and RoPE, so the
query gets the target's rotary embedding at that position and the key heads are shared across query
groups (GQA) as in the target. The Mamba2 hybrids' attention layers store plain projected keys (rotated
where the model has a rotary embedding; Falcon-H1's scaled by `key_multiplier`, its input by
`attention_in_multiplier`); Zamba2's one attention is a shared block and is not read. Step i+1 feeds
`emb(draft_i)` and step i's block output as the new h.

Training (`Net.loss`) distils the target: at every position t of a window, from `(hidden[t], tokens[t+1])`
and the target attention layer's keys/values over positions <= t (recomputed with the target's own
modules from the captured input of that layer, causal), predict the target's distribution `logits[t+1]`;
then `Config.train_depth - 1` further chained steps with teacher-forced tokens and the drafter's own h (by
default as many steps as it drafts, gamma 7, step k weighted 0.8**k).

The drafter that runs a net in an engine: `draft/mtp_drafter.py`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.hf_compat import rotary_tables

from .base import DraftBlock, TargetAttention, attention_layers, latent_attention
from .layers import MLP, DraftChain, RMSNorm, SharesTarget, additive_mask, attend, soft_ce, target_logits
from .registry import DraftConfig
from .tree import DynamicTree, log_scores


@dataclass
class Config(DraftConfig):
    """`num_heads` / `head_dim` describe the queries, which follow the target attention layer's geometry."""

    kind: str = "mtp"
    attn_layer: int = -1  # target full-attention layer whose KV the blocks read (-1: the last one)
    # chained steps per position in `loss` (1 = plain next-next-token): as many as the drafter drafts per round
    # (gamma 7), so training sees the chained inputs of every draft it makes
    train_depth: int = 7
    depth_decay: float = 0.8  # weight of chained step k in the loss: depth_decay ** k
    eval_depth: int = 7  # drafts per position measured by `evaluate` (gamma)

    @classmethod
    def for_target(cls, target, **overrides) -> "Config":
        layer = resolve_attn_layer(target, overrides.get("attn_layer", -1))
        attn = target_attention(target, layer).attn
        base = dict(attn_layer=layer, feature_layers=[layer - 1] if layer > 0 else [],
                    num_heads=target.config.get_text_config().num_attention_heads, head_dim=_qk_dim(attn))
        base.update(overrides)
        return super().for_target(target, **base)


def _qk_dim(attn) -> int:
    return attn.qk_head_dim if hasattr(attn, "kv_b_proj") else attn.head_dim


def target_attention(target, layer: int) -> TargetAttention:
    return attention_layers(target)[layer]


def resolve_attn_layer(target, layer: int) -> int:
    """Index of a full-attention layer of `target` (`-1`: the last one); ValueError naming the drafter."""
    full = sorted(attention_layers(target))
    family = target.config.model_type
    if not full:
        raise ValueError(f"drafter: mtp reads the KV cache of one of a hybrid target's own full-attention layers; "
                         f"model_type {family!r} has none it can read")
    if layer == -1:
        return full[-1]
    if layer not in full:
        raise ValueError(f"drafter: mtp attn_layer {layer} is not a full-attention layer of this target "
                         f"(those are {full})")
    return layer


@dataclass
class KVContext:
    """What the query-only attention reads: keys `[B, Hkv, S, Dk]` and values `[B, Hkv, S, Dv]` (the target's own
    key heads, each serving `H / Hkv` query heads), which keys each query sees, `visible` bool `[B or 1, T or 1, S]`,
    and the rotary (cos, sin) of the query positions. An MLA target's context stays latent (keys and values None):
    `latent = (latents [B, 1, S, r + dr] (`[c | k_rot]`), kv_b_proj.weight)`, read by
    `specdec.adapters.latent_attention` (with `visible` made additive), never expanded per head."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    visible: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    latent: tuple[torch.Tensor, torch.Tensor] | None = None


class QueryOnlyAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, qk_dim: int, v_dim: int, scale: float, *, q_norm: bool,
                 eps: float, apply_rope=None):
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim, self.scale = num_heads, qk_dim, v_dim, scale
        self.q_proj = nn.Linear(hidden, num_heads * qk_dim, bias=False)
        self.q_norm = RMSNorm(qk_dim, eps) if q_norm else None
        self.o_proj = nn.Linear(num_heads * v_dim, hidden, bias=False)
        self._apply_rope = apply_rope  # the target's apply_rotary_pos_emb (a plain function, not a module)

    def forward(self, x: torch.Tensor, ctx: KVContext) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.qk_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)  # [B, H, T, Dk]
        if ctx.rope is not None:
            q, _ = self._apply_rope(q, q, *ctx.rope)
        if ctx.latent is not None:  # an MLA target: queries split as its keys are, [nope; rope]
            latents, kv_b = ctx.latent
            dr = latents.shape[-1] - kv_b.shape[-1]
            out = latent_attention(q[..., :-dr], q[..., -dr:], latents, kv_b, additive_mask(ctx.visible, q.dtype),
                                   self.scale)
        else:
            out = attend(q, ctx.keys, ctx.values, None, ctx.visible, scale=self.scale).transpose(1, 2)  # [B, T, H, Dv]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim))


class MTPBlock(nn.Module):
    def __init__(self, cfg: Config, hidden: int, attn_kw: dict):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.attn = QueryOnlyAttention(hidden, eps=cfg.rms_norm_eps, **attn_kw)
        self.mlp_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(hidden, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: KVContext) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), ctx)
        return x + self.mlp(self.mlp_norm(x))


class Net(SharesTarget):
    """The MTP head. Shared target modules are attributes named `target_*` (not saved, not trained)."""

    def __init__(self, config: Config, target):
        super().__init__()
        self.config = config
        tc = target.config.get_text_config()
        layer = resolve_attn_layer(target, config.attn_layer)
        base = target.model
        where = target_attention(target, layer)
        attn = where.attn
        self.mla = hasattr(attn, "kv_b_proj")
        if not self.mla and not all(hasattr(attn, n) for n in ("k_proj", "v_proj", "head_dim")):
            raise ValueError(f"drafter: mtp does not know the attention module {type(attn).__name__}")
        d = tc.hidden_size
        num_heads = tc.num_attention_heads
        qk_dim = _qk_dim(attn)
        v_dim = attn.v_head_dim if self.mla else attn.head_dim
        if (config.num_heads, config.head_dim) != (num_heads, qk_dim):
            raise ValueError(f"drafter: mtp queries must match the target attention layer ({num_heads} heads of "
                             f"{qk_dim}), config has {config.num_heads} x {config.head_dim}")
        for name, v in (("train_depth", config.train_depth), ("eval_depth", config.eval_depth),
                        ("num_layers", config.num_layers)):
            if v < 1:
                raise ValueError(f"drafter: mtp {name} must be >= 1, got {v}")
        self.layer = layer
        self.target_embed = target.get_input_embeddings()
        self.target_lm_head = target.lm_head
        self.target_attn = attn
        self.target_attn_norm = where.norm
        self.attn_in_scale = where.in_scale
        # keys in the cache: after k_norm (Qwen), times key_multiplier (Falcon-H1), rotated where the model
        # has a rotary embedding (not MLA's latents, not Nemotron-H)
        self.target_rotary = None if self.mla else getattr(base, "rotary_emb", None)
        # the target module's own rotation (queries here, keys of the training path)
        self.apply_rope = None if self.target_rotary is None else \
            sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.embed_norm = RMSNorm(d, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        attn_kw = dict(num_heads=num_heads, qk_dim=qk_dim, v_dim=v_dim, scale=float(attn.scaling),
                       q_norm=not self.mla, apply_rope=self.apply_rope)
        self.layers = nn.ModuleList(MTPBlock(config, d, attn_kw) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)

    @classmethod
    def from_target(cls, target, config: Config) -> "Net":
        """A net in the target's device and dtype (so loaded weights are copied in at full precision)."""
        w = target.get_input_embeddings().weight
        return cls(config, target).to(device=w.device, dtype=w.dtype)

    # The shared target modules belong to the target: `.to()` / `.double()` / `.train()` on the net leave them
    # (and the target's numerics, e.g. a float32 rotary buffer in a bf16 model) exactly as they are.
    # ---- shared target pieces (never receive gradients) ----------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.target_embed.weight.detach(), self.target_embed.padding_idx).to(self.dtype)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return target_logits(self.target_lm_head, x)

    def _context(self, states: list[torch.Tensor], visible: torch.Tensor, like: torch.Tensor,
                 positions: torch.Tensor):
        """KVContext in the net's dtype from what the attention layer stores, `[B, h, S, d]` each: keys and values
        as the target's key heads hold them, or an MLA target's latents as `[c | k_rot]` (one tensor where the
        runner's `KimiLatentAttention` stores them so, the module's pair joined); `visible [B or 1, T, S]` bool;
        rotary of the query `positions [B, T]`."""
        dt = self.dtype
        if self.mla:
            kv_b = self.target_attn.kv_b_proj.weight.detach()
            latents = states[0] if len(states) == 1 else torch.cat(states, -1)
            return KVContext(None, None, visible, None, latent=(latents.to(dt), kv_b.to(dt)))
        a, b = states
        rope = None
        if self.target_rotary is not None:
            rope = tuple(x.to(dt) for x in rotary_tables(self.target_rotary, like, positions))
        return KVContext(a.to(dt), b.to(dt), visible, rope)

    @torch.no_grad()
    def context_from_cache(self, kv, slots_t: torch.Tensor, span: int) -> KVContext:
        """The target's committed KV of slots `slots_t [B]` (a `KVCache`), for one query per row at `length - 1`,
        over the first `span` keys of each slot (at least the longest row's length; keys past a row's length are
        masked: a fixed span, the cache's `max_length`, gives every round the same shapes)."""
        if self.layer not in kv.store:
            raise RuntimeError(f"mtp: the target cache has no entries for layer {self.layer} yet")
        S = span
        lens = kv.lengths[slots_t]
        states = kv.read(self.layer, slots_t, S)  # [B, heads, S, dim] each, through the slots' pages
        visible = (torch.arange(S, device=lens.device)[None, :] < lens[:, None])[:, None]  # [B, 1, S]
        return self._context(states, visible, states[0], (lens - 1)[:, None])

    @torch.no_grad()
    def context_from_batch(self, tokens: torch.Tensor, features: dict[int, torch.Tensor]) -> KVContext:
        """Keys/values of the attention layer over a whole window, recomputed with the target's own modules
        from the layer's captured input; query t sees keys <= t."""
        B, S = tokens.shape
        inp = features[self.layer - 1] if self.layer > 0 else self.target_embed(tokens)
        x = self.target_attn_norm(inp.to(self.target_embed.weight.dtype))
        if self.attn_in_scale is not None:
            x = x * self.attn_in_scale
        attn = self.target_attn
        pos = torch.arange(S, device=tokens.device)[None].expand(B, S)
        if self.mla:
            kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], -1)
            states = [torch.cat([attn.kv_a_layernorm(kv_nope), k_rot], -1)[:, None]]  # [B, 1, S, r + dr]
        else:
            shape = (B, S, -1, attn.head_dim)
            a = attn.k_proj(x).view(shape)
            a = (attn.k_norm(a) if hasattr(attn, "k_norm") else a).transpose(1, 2)
            if hasattr(attn, "key_multiplier"):
                a = a * attn.key_multiplier
            b = attn.v_proj(x).view(shape).transpose(1, 2)
            if self.target_rotary is not None:
                a, _ = self.apply_rope(a, a, *rotary_tables(self.target_rotary, x, pos))
            states = [a, b]
        causal = torch.ones(S, S, dtype=torch.bool, device=tokens.device).tril()[None]  # [1, S, S]
        return self._context(states, causal, x, pos)

    # ---- the head ----------------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, h: torch.Tensor, ctx: KVContext) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens `[B, T]`, h `[B, T, d]` -> (logits `[B, T, V]`, block output `[B, T, d]`: the next step's h)."""
        x = self.fc(torch.cat([self.embed_norm(self.embed(tokens)), self.hidden_norm(h.to(self.dtype))], -1))
        for block in self.layers:
            x = block(x, ctx)
        return self.lm_head(self.norm(x)), x

    @torch.no_grad()
    def draft(self, anchors: torch.Tensor, h: torch.Tensor, ctx: KVContext, gamma: int, *, sampling=None,
              generator=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`gamma` chained drafts after `anchors [B]` from `h [B, d]` -> (tokens `[B, gamma]`, probs
        `[B, gamma, V]` when sampling, else None: greedy argmax)."""
        tok, h = anchors[:, None], h[:, None]
        chain = DraftChain(sampling, generator)
        for _ in range(gamma):
            logits, h = self.step(tok, h, ctx)
            tok = chain.pick(logits[:, 0])[:, None]
        return chain.result()

    @torch.no_grad()
    def draft_tree(self, anchors: torch.Tensor, h: torch.Tensor, ctx: KVContext, depth: int, *, topk: int,
                   num_nodes: int, sampling=None) -> DraftBlock:
        """EAGLE-2's dynamic tree (`tree.DynamicTree`) of `depth` levels after `anchors [B]` from `h [B, d]`, as a
        DraftBlock with `parent [B, 1 + G]` and `probs=None`. The head keeps no KV of its own: the nodes of one
        depth are query rows of one step over the same committed KV, each fed its parent step's block output
        (the anchor's step for the first depth), exactly as the chain feeds the previous draft's."""
        B, d = h.shape
        logits, x = self.step(anchors[:, None], h[:, None], ctx)
        tree = DynamicTree(log_scores(logits[:, 0], sampling), topk)
        root_x = x  # [B, 1, d]
        exp_x = x.new_zeros(B, 0, d)  # [B, expanded, d]: the block output of every expanded node
        for _ in range(1, depth):
            sel, src, tok = tree.frontier()
            logits, x = self.step(tok, DynamicTree.parent_states(src, root_x, exp_x), ctx)
            exp_x = torch.cat([exp_x, x], 1)
            tree.grow(sel, log_scores(logits, sampling))
        return tree.block(num_nodes)

    # ---- training ----------------------------------------------------------------------------------
    def _chain(self, batch, depth: int):
        """Steps 0..depth-1 at every position t of the window: step k reads h from step k-1 (the target's
        hidden[t] for k = 0) and the window's token t+1+k (teacher forcing). -> list of logits [B, S, V]."""
        tokens = batch.tokens.to(self.fc.weight.device)
        ctx = self.context_from_batch(tokens, {i: f.to(tokens.device) for i, f in batch.features.items()})
        S = tokens.shape[1]
        h = batch.hidden.to(device=tokens.device, dtype=self.dtype)
        idx = torch.arange(S, device=tokens.device)
        tok = tokens[:, (idx + 1).clamp(max=S - 1)]
        out = []
        for k in range(depth):
            logits, h = self.step(tok, h, ctx)
            out.append(logits)
            tok = tokens[:, (idx + 2 + k).clamp(max=S - 1)]
        return out

    def loss(self, batch) -> torch.Tensor:
        """Weighted soft cross-entropy against the target's distributions, over chained steps."""
        S = batch.tokens.shape[1]
        depth = min(self.config.train_depth, S - 1)
        if depth < 1:
            raise ValueError(f"batch: windows of {S} tokens are too short for the mtp drafter (need >= 2)")
        target_logits = batch.logits.to(self.fc.weight.device)
        total, weight = 0.0, 0.0
        for k, logits in enumerate(self._chain(batch, depth)):
            n = S - 1 - k  # positions t with a target at t + 1 + k
            w = self.config.depth_decay ** k
            total = total + w * soft_ce(logits[:, :n], target_logits[:, 1 + k:])
            weight += w
        return total / weight

    @torch.no_grad()
    def evaluate(self, batch) -> dict:
        """`loss` (as in training) and greedy `per_position[i]`: how often draft i equals the target's argmax,
        given drafts < i did, with the window's tokens as the context of both (teacher forcing)."""
        S = batch.tokens.shape[1]
        depth = min(max(self.config.eval_depth, self.config.train_depth), S - 1)
        target_logits = batch.logits.to(self.fc.weight.device)
        target_argmax = target_logits.argmax(-1)
        reached, per_position, total, weight = None, [], 0.0, 0.0
        for k, logits in enumerate(self._chain(batch, depth)):
            n = S - 1 - k
            if k < self.config.train_depth:
                w = self.config.depth_decay ** k
                total, weight = total + w * float(soft_ce(logits[:, :n], target_logits[:, 1 + k:])), weight + w
            hit = logits[:, :n].argmax(-1) == target_argmax[:, 1 + k:]
            reached = torch.ones_like(hit) if reached is None else reached[:, :n]
            per_position.append(float((hit & reached).sum()) / max(int(reached.sum()), 1))
            reached = reached & hit
        return {"loss": total / weight, "per_position": per_position}
