"""EAGLE-3 style drafter: fused low / mid / high target features, one decoder layer with its own KV cache,
the target's embedding and lm_head (shared), and a dynamic draft tree verified as a tree.

Net. The target's decoder-layer outputs at `feature_layers` are fused, `fuse(concat(f_low, f_mid, f_high))`
(`[3d] -> [d]`). The drafter's input at committed position t pairs the fused feature at t with the next
token: `x_t = fc(concat(emb_norm(emb(x_{t+1})), feat_norm(fused_t)))`, runs through `num_layers` decoder
blocks (`layers.Block`, rotary positions t) and `norm`, and the target's `lm_head` scores token t+2.
Past the last committed position there are no target features: a draft step feeds the drafter's own
hidden output (the last block's output, before `norm`) of its parent step in place of the fused feature
(EAGLE-3), and training unrolls that "training-time test" for `ttt_steps` extra steps.

Cache. Only committed positions (pairs of a target feature and the token after it) are ever kept in the
drafter's KV cache. After a prefill `observe` runs the prompt's pairs, all rows in one forward; after a round
it queues the pairs whose next token is now committed (the previous root pair, then the accepted ones) on
the device, and keeps each row's last committed feature (`root_f`) and cached length (`len_t`) there too.
A draft runs each row's queue and its root pair (that feature and the anchor) in one forward: the queue's
K/V join the cache, the root's stays in the round's scratch. Then the tree: its nodes live in that scratch
and see the committed cache plus their own ancestors (ancestor mask), at positions `root + depth`; nothing
of a round's tree survives it, so rollback is free.

Tree: EAGLE-2's dynamic tree (`tree.DynamicTree`): at every depth the `topk` best candidates of the newest
depth are expanded into their `topk` most likely children; the best `num_nodes` by cumulative draft
log-probability are kept, in topological order. The drafts are deterministic functions of the committed
history, so the block carries `probs=None` (one-hot q): recursive rejection over distinct siblings with
one-hot q is exactly sampling from the target, so this is lossless for sampling as well as greedy.

Static shapes (the CUDA-graph path): the cache is sized once for the target's `max_length` and the queue for one
verify window, and `draft_step` drafts over all of both; `propose` over the rows' longest cache and queue
(host bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.kernels.common import outside_inference

from .base import BufferSpec, DraftBlock, Drafter, grown_kv_specs, observed_counts, padded
from .layers import Block, RMSNorm, soft_ce, target_logits
from .registry import DraftConfig, TargetBatch, check_target
from .tree import DynamicTree, log_scores, tree_options


@dataclass
class Config(DraftConfig):
    kind: str = "eagle"
    # Training-time test: steps beyond the first that feed the drafter's own hidden state. The reference
    # (EAGLE-3; SpecForge's ttt_length = 7) unrolls 7 steps in all, so 6 extra; drafters saved with fewer keep
    # theirs (the field is in their config.json).
    ttt_steps: int = 6
    ttt_decay: float = 0.8  # loss weight of step k is ttt_decay ** k (the reference's 0.8 ** k)

    @classmethod
    def for_target(cls, target, **overrides) -> "Config":
        """Sized like one of the target's layers; features from its first, middle and last decoder layer."""
        tc = target.config.get_text_config()
        L, d = tc.num_hidden_layers, tc.hidden_size
        heads = int(getattr(tc, "num_attention_heads", 0) or 0)
        if heads < 1 or d % heads:
            heads = 4 if d % 4 == 0 else 1
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        base = dict(feature_layers=sorted({0, L // 2, L - 1}), num_heads=heads, head_dim=d // heads,
                    intermediate_size=int(getattr(tc, "intermediate_size", 0) or 4 * d),
                    rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6) or 1e-6),
                    rope_theta=float(theta or getattr(tc, "rope_theta", None) or 10000.0))
        base.update(overrides)
        return super().for_target(target, **base)


def _additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool visibility `[..., T, S]` -> additive mask `[B, 1, T, S]`."""
    mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, torch.finfo(dtype).min)
    return mask if mask.dim() == 4 else mask[:, None]


class Net(nn.Module):
    """The EAGLE-3 head. Shared target modules are attributes named `target_*` (not saved, not trained)."""

    def __init__(self, config: Config, target):
        super().__init__()
        self.config = config
        d = config.target_hidden_size
        if not config.feature_layers:
            raise ValueError("feature_layers: the eagle drafter needs at least one target layer")
        self.target_embed = target.get_input_embeddings()
        self.target_lm_head = target.get_output_embeddings()
        self.fuse = nn.Linear(len(config.feature_layers) * d, d, bias=False)
        self.emb_norm = RMSNorm(d, config.rms_norm_eps)
        self.feat_norm = RMSNorm(d, config.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([Block(config, d) for _ in range(config.num_layers)])
        self.norm = RMSNorm(d, config.rms_norm_eps)

    @classmethod
    def from_target(cls, target, config: Config) -> "Net":
        return cls(config, target)

    # ---- pieces --------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.target_embed
        if type(emb) is nn.Embedding:  # the target's weights, never trained through the drafter
            return F.embedding(ids, emb.weight.detach(), emb.padding_idx)
        with torch.no_grad():
            return emb(ids)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft scores `[..., V]` of the drafter's hidden output `h [..., d]`."""
        return target_logits(self.target_lm_head, self.norm(h))

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., len(feature_layers) * d]` (concatenated in layer order) -> `[..., d]`."""
        return self.fuse(features)

    @property
    def feature_width(self) -> int:
        """Width F of the concatenated target features `fused` takes."""
        return self.fuse.in_features

    def attentions(self) -> list[nn.Module]:
        """Each layer's attention (`num_heads` or `num_kv` K/V heads, `head_dim`): what the drafter's cache holds."""
        return [b.attn for b in self.layers]

    def inputs(self, tokens: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """Layer input from the next tokens `[B, T]` and a fused target feature or own hidden `[B, T, d]`."""
        return self.fc(torch.cat([self.emb_norm(self.embed(tokens)), self.feat_norm(feat)], -1))

    def run(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, past=None):
        """Decoder blocks over `x [B, T, d]`; `past` per layer `(k, v) [B, H, S, D]` or None ->
        (hidden `[B, T, d]`, new (k, v) per layer)."""
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, mask, None if past is None else past[i])
            kvs.append(kv)
        return x, kvs

    # ---- training ------------------------------------------------------------------------------------
    def _unroll(self, batch: TargetBatch):
        """Teacher-forced steps 1..1+ttt_steps over a batch. Step 1 at position t sees the fused target
        feature at t and token t+1; step k sees its own step k-1 hidden at t-1 (valid for t >= k-1), the
        step-1 keys at positions <= t-k+1 and the step-i keys at t-k+i, as a depth k-1 tree node does.
        -> per step (draft logits `[B, S-1, V]`, valid positions `[S-1]` bool); targets `[B, S-1, V]`."""
        cfg = self.config
        tokens = batch.tokens
        B, S = tokens.shape
        if S < 2:
            raise ValueError(f"batch: need windows of >= 2 tokens, got {S}")
        T = S - 1
        feats = torch.cat([batch.features[i][:, :-1] for i in cfg.feature_layers], -1)
        nxt = tokens[:, 1:]
        dev, dt = feats.device, feats.dtype
        positions = torch.arange(T, device=dev).expand(B, T)
        t = torch.arange(T, device=dev)
        outs, past, feat = [], None, self.fused(feats)
        for k in range(1, cfg.ttt_steps + 2):
            x = self.inputs(nxt, feat)
            # visibility of query t over keys [step 1 | step 2 | ... | step k], each T long
            blocks = [t[None, :] <= (t[:, None] - (k - 1))]
            blocks += [t[None, :] == (t[:, None] - (k - i)) for i in range(2, k + 1)]
            mask = _additive(torch.cat(blocks, 1)[None].expand(B, T, k * T), dt)
            h, kvs = self.run(x, positions, mask, past)
            past = kvs if past is None else [(torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2))
                                             for p, n in zip(past, kvs)]
            outs.append((self.lm_logits(h), t >= (k - 1)))
            feat = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # own hidden at t-1 feeds step k+1 at t
        return outs, batch.logits[:, 1:]

    def _weighted(self, outs, target, fn) -> torch.Tensor:
        """Weighted mean of `fn(draft logits, target logits)` over the steps (valid positions only)."""
        terms = [(self.config.ttt_decay ** k, fn(logits[:, valid], target[:, valid]))
                 for k, (logits, valid) in enumerate(outs) if bool(valid.any())]
        return sum(w * x for w, x in terms) / sum(w for w, _ in terms)

    def loss(self, batch: TargetBatch) -> torch.Tensor:
        """Soft cross-entropy against the target's next-token distribution, steps weighted by ttt_decay**k."""
        outs, target = self._unroll(batch)
        return self._weighted(outs, target, soft_ce)

    @torch.no_grad()
    def evaluate(self, batch: TargetBatch) -> dict:
        """`loss` as in training and `kl` (the same minus the target's entropy); `per_position[i]`: greedy
        acceptance of chain draft i given drafts < i were accepted (teacher forced: a chain started at t
        drafts with step i+1 at position t+i, a hit when its argmax is the target's argmax); `tau` = 1 +
        expected accepted chain length; `accuracy`: hit rate per step."""
        outs, target = self._unroll(batch)
        loss = float(self._weighted(outs, target, soft_ce))
        kl = loss - float(self._weighted(outs, target, lambda _, t: soft_ce(t, t)))
        best = target.argmax(-1)  # [B, T]
        T = best.shape[1]
        K = len(outs)
        hits = [(logits.argmax(-1) == best) for logits, _ in outs]  # step k hit at each position
        starts = T - (K - 1)
        per_position, accuracy = [], []
        alive = torch.ones(best.shape[0], max(starts, 0), dtype=torch.bool, device=best.device)
        tau = 1.0
        for k in range(K):
            valid = outs[k][1]
            accuracy.append(float(hits[k][:, valid].double().mean()) if bool(valid.any()) else 0.0)
            if starts <= 0:
                per_position.append(0.0)
                continue
            h = hits[k][:, k:k + starts]  # chain from start s: step k+1 at position s+k
            reached = int(alive.sum())
            ok = alive & h
            per_position.append(int(ok.sum()) / reached if reached else 0.0)
            alive = ok
            tau += float(alive.double().mean())
        return {"loss": loss, "kl": kl, "per_position": per_position, "tau": tau, "accuracy": accuracy}


# ---- drafter ---------------------------------------------------------------------------------------------
class _Row:
    __slots__ = ("length", "pending", "rooted")

    def __init__(self):
        # the host's copies of `len_t` and `pend_n` (committed pairs in the cache, queued for the next draft):
        # host bounds of the dynamic path, not kept with static shapes
        self.length = 0
        self.pending = 0
        self.rooted = False  # the row's last committed feature is in `root_f`


# The default tree, by the device the drafter runs on. On a GPU a verify of 49 tokens costs about what one token
# does (weights are read once), so the tree is EAGLE-2's size (its reference runs 60-token trees of top-10
# children). On a CPU every node is target compute (bench/verify_cost.py), and a narrow tree wins on the embedded
# model: 16 nodes of top-2 children ran faster than 48 of top-8 despite a lower tau (bench/results/HISTORY.md,
# "EAGLE's default tree, by device").
DEFAULT_TREE = {"cuda": dict(topk=8, num_nodes=48), "cpu": dict(topk=2, num_nodes=16)}


def default_tree(device: torch.device) -> dict:
    """`{"topk", "num_nodes"}` of the default tree on `device` (a CPU's, or the accelerators' one)."""
    return DEFAULT_TREE["cpu" if torch.device(device).type == "cpu" else "cuda"]


class EagleDrafter(Drafter):
    """Dynamic-tree drafts from an EAGLE-3 `Net`; see the module docstring. `propose` and `draft_step` (the
    engine's CUDA-graph path) draft the same way (`_draft`), over a span of the cache that is the rows' longest
    committed length or, with static shapes, the whole cache; what either writes to the cache is committed pairs
    only (the tree's K/V stay in the round's scratch)."""

    name = "eagle"
    static_draft = True

    def __init__(self, net: Net, *, gamma: int = 7, max_batch_size: int = 8, topk: int | None = None,
                 depth: int | None = None, num_nodes: int | None = None):
        tree = default_tree(next(net.parameters()).device) if isinstance(net, Net) else DEFAULT_TREE["cuda"]
        for arg, val in (("gamma", gamma), ("max_batch_size", max_batch_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg}: expected an int >= 1, got {val!r}")
        depth = gamma if depth is None else depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
        topk, num_nodes = tree_options(depth, topk, num_nodes, default_topk=tree["topk"],
                                       default_nodes=tree["num_nodes"])
        if not isinstance(net, Net):
            raise ValueError(f"drafter: expected an eagle Net, got {type(net).__name__}")
        self.net = net.eval()
        self.topk, self.depth, self.num_nodes = topk, depth, num_nodes
        self.max_batch_size = max_batch_size
        self.feature_layers = tuple(net.config.feature_layers)
        self.tree = True
        p = next(net.layers.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = net.config
        empty = dict(size=(max_batch_size, cfg.num_heads, 0, cfg.head_dim), dtype=self.dtype, device=self.device)
        self.cache = [(torch.zeros(**empty), torch.zeros(**empty)) for _ in net.layers]  # per layer K, V
        self.rows: dict[int, _Row] = {}
        self.root_f: torch.Tensor | None = None  # [max_batch_size, F] each row's last feature
        self.len_t: torch.Tensor | None = None  # [max_batch_size] committed pairs in the cache
        # each row's queue of committed pairs not yet run: features [max_batch_size, Q, F], tokens, count
        self.pend_f: torch.Tensor | None = None
        self.pend_t: torch.Tensor | None = None
        self.pend_n: torch.Tensor | None = None

    def bind(self, target) -> None:
        super().bind(target)
        model = target.model
        check_target(self.net.config, model)
        L = model.config.get_text_config().num_hidden_layers
        bad = [i for i in self.feature_layers if not 0 <= i < L]
        if bad:
            raise ValueError(f"drafter: feature_layers {bad} do not exist in a target with {L} layers")
        if self.net.target_embed is not model.get_input_embeddings() and not torch.equal(
                self.net.target_embed.weight, model.get_input_embeddings().weight):
            raise ValueError("drafter: this eagle net shares the embedding of another target model")
        # the generic runner verifies chains only: draft the single most likely path there
        self.tree = target.supports_tree

    def max_verify_tokens(self, gamma: int) -> int:
        return self.num_nodes + 1

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """Each layer's K/V over the target's window (see `grown_kv_specs`) and the queue of a verify window's
        features `[max_batch_size, T (twice that without static shapes), F]` with each row's root feature."""
        specs = grown_kv_specs("eagle", self.net.attentions(), self.max_batch_size,
                               max_length + num_verify_tokens, self.dtype, static=static)
        width, queue = self.net.feature_width, num_verify_tokens * (1 if static else 2)
        for name, shape in (("eagle.pend_f", (self.max_batch_size, queue, width)),
                            ("eagle.root_f", (self.max_batch_size, width))):
            specs[name] = BufferSpec(name, shape, self.dtype)
        return specs

    # ---- request lifecycle ---------------------------------------------------------------------------
    def begin(self, rows, prompts) -> None:
        for r in rows:
            if not 0 <= r < self.max_batch_size:
                raise ValueError(f"rows: row {r} outside max_batch_size {self.max_batch_size}")
            self.rows[r] = _Row()

    def release(self, rows) -> None:
        for r in rows:
            self.rows.pop(r, None)

    @torch.no_grad()
    def observe(self, rows, tokens, hidden, features) -> None:
        """The pairs of every row whose next token is now committed. After a prefill (tokens = the prompt) the
        pairs (f_i, x_i+1) of all but the last position run at once, all rows in one forward. After a round
        (tokens = the anchor and the accepted drafts) the previous root pair (its feature `root_f`, its token the
        anchor) and the accepted ones are queued on the device (`pend_f`, `pend_t`, `pend_n`): the next draft
        runs them with the new root pair in one forward. The last feature becomes the row's root."""
        dev = self.device
        counts = [int(t.shape[0]) for t in tokens]
        if min(counts, default=0) < 1:
            raise ValueError("eagle: observe needs at least one new position per row")
        fresh = [not self.rows.setdefault(r, _Row()).rooted for r in rows]
        if any(fresh) and not all(fresh):
            raise ValueError("eagle: observe of new and running requests together")
        feat = torch.cat([padded(features[layer]) for layer in self.feature_layers], -1).to(self.dtype)  # [B, M, F]
        tok = padded(tokens).to(dev)  # [B, M]
        B, M = tok.shape
        if self.root_f is None:
            with outside_inference():
                self.root_f = feat.new_zeros(self.max_batch_size, feat.shape[-1])
                self.len_t = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)
                self.pend_n = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)
        rows_t = self._index(rows, self.device)
        n = observed_counts(tokens, dev)
        i = torch.arange(M, device=dev)
        static = self._static_shapes()
        if fresh[0]:  # pairs (f_i, x_i+1), i < n - 1, causal among themselves, from position 0
            # static shapes: room for the target's whole window and one verify window's queue, allocated here,
            # outside any CUDA graph (a draft reads all of both); else as needed
            self._reserve(self.target.max_length + self.target.num_verify_tokens if static else M - 1)
            if static:
                self._reserve_pending(self.target.num_verify_tokens, feat.shape[-1])
            if M > 1:
                pos = i[None, :-1].expand(B, M - 1)
                ok = i[None, :-1, None] >= i[None, None, :-1]  # [1, M - 1, M - 1]
                _, kvs, _ = self._forward(rows_t, tok[:, 1:], feat[:, :-1], pos, ok.expand(B, -1, -1), 0)
                self._write(rows_t, pos, kvs)
            self.len_t[rows_t] = n - 1
            self.pend_n.index_fill_(0, rows_t, 0)  # (by value, as in `_draft`)
            for r, c in zip(rows, counts):
                self.rows[r].length, self.rows[r].pending = c - 1, 0
        else:  # queue the previous root (f, anchor), then (f_i, x_i+1) of the accepted drafts
            if not static:  # (static: every round drafts each row, emptying its queue, before it is observed)
                held = [self.rows[r].pending for r in rows]
                self._reserve_pending(max(held) + M, feat.shape[-1])  # rows are written at all M padded places
            at = (rows_t[:, None], self.pend_n[rows_t][:, None] + i)  # [B, M]: past each row's queue
            self.pend_f[at] = torch.cat([self.root_f[rows_t][:, None], feat[:, :-1]], 1)
            self.pend_t[at] = tok
            self.pend_n[rows_t] += n
            if not static:
                for r, c in zip(rows, counts):
                    self.rows[r].pending += c
        self.root_f[rows_t] = feat[torch.arange(B, device=dev), n - 1]
        for r in rows:
            self.rows[r].rooted = True

    def _reserve(self, need: int) -> None:
        """Cache room for `need` positions per row."""
        cap = self.cache[0][0].shape[2]
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)
        grown = []
        for k, v in self.cache:
            with outside_inference():
                k2 = k.new_zeros(k.shape[0], k.shape[1], new, k.shape[3])
                v2 = v.new_zeros(v.shape[0], v.shape[1], new, v.shape[3])
            k2[:, :, :cap], v2[:, :, :cap] = k, v
            grown.append((k2, v2))
        self.cache = grown

    def _reserve_pending(self, need: int, width: int) -> None:
        """Queue room for `need` pairs per row: the target's verify window (what one round commits) at first,
        so the width, and with it the draft's shapes, stays fixed while every round is drafted."""
        cap = 0 if self.pend_f is None else self.pend_f.shape[1]
        if need <= cap:
            return
        target = getattr(self, "target", None)
        new = max(need, 2 * cap, target.num_verify_tokens if target is not None else 8)
        with outside_inference():
            f = self.root_f.new_zeros(self.max_batch_size, new, width)
            t = torch.zeros(self.max_batch_size, new, dtype=torch.long, device=self.device)
        if cap:
            f[:, :cap], t[:, :cap] = self.pend_f, self.pend_t
        self.pend_f, self.pend_t = f, t

    # ---- drafting ------------------------------------------------------------------------------------
    def _forward(self, rows_t, tok, feat, positions, ok, span: int):
        """The net over pairs `(feat [B, M, F], tok [B, M])` at `positions [B, M]` of rows `rows_t [B]`, with the
        first `span` cached positions of each row then the M pairs as keys, visible as `ok [B, M, span + M]`
        says. -> (hidden `[B, M, d]`, the pairs' K/V per layer `[B, H, M, D]`, the cached K/V read per layer
        `[B, H, span, D]`)."""
        net = self.net
        past = [(k[rows_t, :, :span], v[rows_t, :, :span]) for k, v in self.cache]
        h, kvs = net.run(net.inputs(tok, net.fused(feat)), positions, _additive(ok, self.dtype), [[c] for c in past])
        return h, kvs, past

    def _write(self, rows_t, positions, kvs) -> None:
        """K/V per layer `[B, H, M, D]` into the cache at `positions [B, M]` of rows `rows_t`, one indexed copy
        per layer."""
        at = (rows_t[:, None], slice(None), positions)
        for (ck, cv), (k, v) in zip(self.cache, kvs):
            ck[at] = k.transpose(1, 2)
            cv[at] = v.transpose(1, 2)

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        if not rows:
            return DraftBlock.empty(0, self.device)
        self._check_rows(rows)
        rows = list(rows)
        anchors = torch.stack([c[-1] for c in contexts]).to(self.device)
        if self._static_shapes():
            return self._draft(None, self._index(rows, self.device), anchors, gamma, self.cache[0][0].shape[2],
                               self.pend_f.shape[1], sampling)
        # host bounds: the longest cache and queue among the rows
        span, queued = (max(x) for x in zip(*((self.rows[r].length, self.rows[r].pending) for r in rows)))
        return self._draft(rows, self._index(rows, self.device), anchors, gamma, span, queued, sampling)

    @torch.no_grad()
    def draft_step(self, rows, rows_t, slots_t, anchors, gamma, *, sampling=None, generator=None) -> DraftBlock:
        """`propose` as device work of fixed shapes (see `Drafter.draft_step`): the whole cache and queue."""
        self._check_rows(rows)
        return self._draft(None, rows_t, anchors, gamma, self.cache[0][0].shape[2], self.pend_f.shape[1], sampling)

    def _check_rows(self, rows) -> None:
        for r in rows:
            st = self.rows.get(r)
            if st is None or not st.rooted:
                raise RuntimeError(f"eagle: no target features observed for row {r}")
        if self.pend_f is None:  # (dynamic shapes) every row observed only its prompt: an empty queue
            self._reserve_pending(1, self.root_f.shape[-1])

    def _draft(self, rows, rows_t, anchors, gamma, span: int, queued: int, sampling) -> DraftBlock:
        """One forward over each row's queued pairs (the first `queued` of the queue, >= every row's count) and
        its root pair (`root_f`, anchor `[B]`), over the first `span` cached positions (>= every row's length);
        the queued pairs' K/V join the cache (committed pairs: kept whatever the round does), the root's stays
        in the round's scratch; then the tree. `rows` (host) are the rows whose host counts it keeps in step;
        None with static shapes, where a CUDA graph replays this without its Python: only device work then,
        on buffers sized beforehand (`observe`), and the host counts are not kept."""
        dev = self.device
        B, Q = rows_t.shape[0], queued
        lens, qn = self.len_t[rows_t], self.pend_n[rows_t]
        tok = torch.cat([self.pend_t[rows_t, :Q], anchors[:, None]], 1)  # [B, Q + 1]
        feat = torch.cat([self.pend_f[rows_t, :Q], self.root_f[rows_t][:, None]], 1)
        i = torch.arange(Q + 1, device=dev)
        positions = lens[:, None] + torch.where(i < Q, i, qn[:, None])  # the root right after the queue
        cached = torch.arange(span, device=dev)[None, None] < lens[:, None, None]  # [B, 1, span]
        # a queued pair sees the queue up to itself; the root sees the row's queue and itself
        block = torch.where(i[:, None] < Q, i[None, :] <= i[:, None], (i[None, :] < qn[:, None, None]) | (i == Q))
        ok = torch.cat([cached.expand(B, Q + 1, span), block.expand(B, Q + 1, Q + 1)], 2)
        if rows is not None:
            self._reserve(max(self.rows[r].length for r in rows) + Q)  # the queue lands at all Q places per row
        h, kvs, past = self._forward(rows_t, tok, feat, positions, ok, span)
        self._write(rows_t, positions[:, :Q], [(k[:, :, :Q], v[:, :, :Q]) for k, v in kvs])
        self.len_t[rows_t] = lens + qn
        # by value: a Python scalar assigned through a tensor index is a host tensor copied to the device, which a
        # CUDA-graph capture refuses
        self.pend_n.index_fill_(0, rows_t, 0)
        for r in rows or ():
            st = self.rows[r]
            st.length, st.pending = st.length + st.pending, 0
        seen = torch.cat([cached[:, 0], i[None, :Q] < qn[:, None]], 1)  # [B, span + Q]
        # the cache read and the queue as one key segment per layer: one copy per round, not two products per depth
        committed = [(torch.cat([ck, k[:, :, :Q]], 2), torch.cat([cv, v[:, :, :Q]], 2))
                     for (ck, cv), (k, v) in zip(past, kvs)]
        root_h = h[:, Q]
        return self._tree(root_h, self.net.lm_logits(root_h), committed, seen, lens + qn,
                          [(k[:, :, Q:], v[:, :, Q:]) for k, v in kvs], gamma, sampling)

    def _tree(self, root_h, root_logits, committed, seen, root_pos, root_kv, gamma, sampling) -> DraftBlock:
        """EAGLE-2's tree from the root step (`root_h [B, d]`, `root_logits [B, V]`) over the committed K/V, per
        layer `(k, v) [B, H, S, D]` of which row b sees the keys `seen [B, S]` marks, and the root's K/V `root_kv`
        per layer `[B, H, 1, D]` (at `root_pos [B]`), seen by every node."""
        net, dev = self.net, self.device
        B = root_h.shape[0]
        S0 = seen.shape[1]
        depth = max(1, min(self.depth, int(gamma)))
        tree = DynamicTree(log_scores(root_logits, sampling), self.topk if self.tree else 1)
        w = tree.k  # nodes expanded per depth: the newest depth always holds at least k candidates
        exp_h = root_h.new_zeros(B, 0, root_h.shape[-1])  # [B, expanded, d]: each expanded node's hidden
        # [B, E, E]: row i marks the expanded ancestors of expanded node i, filled depth by depth
        exp_anc = torch.zeros(B, (depth - 1) * w, (depth - 1) * w, dtype=torch.bool, device=dev)
        ids = torch.arange((depth - 1) * w, device=dev)
        own = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)  # each node sees itself
        # [B, w, depth - 1]: the nodes of depth d sit at root + d
        positions = (root_pos[:, None, None] + torch.arange(1, depth, device=dev)).expand(B, w, -1)
        # per layer the nodes attend to two K/V segments (`layers.attend`): the committed one, never copied per
        # depth, and the round's scratch (the root's K/V, then every expanded node's), grown by depth
        scratch = list(root_kv)
        ok_fixed = torch.cat([seen, seen.new_ones(B, 1)], 1)[:, None].expand(B, w, S0 + 1)  # committed keys, the root
        for d in range(1, depth):
            sel, src, tok = tree.frontier()
            n_exp = exp_h.shape[1]
            par_h = DynamicTree.parent_states(src, root_h[:, None], exp_h)
            # ancestors among expanded nodes: the parent's ancestors and the parent itself (past depth 1 every
            # frontier node's parent is an expanded node, src >= 0; at depth 1 there are none)
            if n_exp:
                at = src[..., None]
                anc = exp_anc[:, :, :n_exp].gather(1, at.expand(B, w, n_exp)) | (at == ids[:n_exp])
                exp_anc[:, n_exp:n_exp + w, :n_exp] = anc
            else:
                anc = exp_anc[:, :w, :0]
            ok = torch.cat([ok_fixed, anc, own], 2)
            h, kvs = net.run(net.inputs(tok, par_h), positions[..., d - 1], _additive(ok, self.dtype),
                             [[c, s_] for c, s_ in zip(committed, scratch)])
            scratch = [(torch.cat([sk, k_], 2), torch.cat([sv, v_], 2)) for (sk, sv), (k_, v_) in zip(scratch, kvs)]
            exp_h = torch.cat([exp_h, h], 1)
            tree.grow(sel, log_scores(net.lm_logits(h), sampling))  # [B, w, V]
        return tree.block(self.num_nodes, tree=self.tree)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, topk: int | None = None,
                 depth: int | None = None, num_nodes: int | None = None, **kwargs) -> EagleDrafter:
    """`specdec.wrap(model, drafter=DIR, topk=..., depth=gamma, num_nodes=...)`: `topk` children per
    expanded node and nodes expanded per depth, `depth` tree depth (capped by the round's gamma), `num_nodes`
    drafts kept after reranking (the verify window is num_nodes + 1). Unset, `topk` and `num_nodes` (at least
    `depth`) are the device's default tree (`DEFAULT_TREE`: 8 and 48 on a GPU, 2 and 16 on a CPU)."""
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: unknown option for the eagle drafter "
                         "(expected topk, depth, num_nodes)")
    return EagleDrafter(net, gamma=gamma, max_batch_size=max_batch_size, topk=topk, depth=depth,
                        num_nodes=num_nodes)
