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
drafter's KV cache. `observe` queues the target features of newly committed positions; `propose` runs
the queued positions together with the root pair (the last committed feature and the anchor, both final)
in one batched forward and appends their K/V. Tree nodes live in a per-round scratch K/V and see the
committed cache plus their own ancestors (ancestor mask), at positions `root + depth`; nothing of a
round survives it, so rollback is free.

Tree: EAGLE-2's dynamic tree (`tree.DynamicTree`): at every depth the `topk` best candidates of the newest
depth are expanded into their `topk` most likely children; the best `num_nodes` by cumulative draft
log-probability are kept, in topological order. The drafts are deterministic functions of the committed
history, so the block carries `probs=None` (one-hot q): recursive rejection over distinct siblings with
one-hot q is exactly sampling from the target, so this is lossless for sampling as well as greedy.

Static shapes (the CUDA-graph path): `observe` runs the pairs as soon as their next token is committed, and
`draft_step` runs the root pair and the tree over the whole cache without writing to it (`EagleDrafter`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import DraftBlock, Drafter, observed_counts
from .layers import Block, RMSNorm, soft_ce
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
        head = self.target_lm_head
        x = self.norm(h)
        if type(head) is nn.Linear:
            return F.linear(x, head.weight.detach(), None if head.bias is None else head.bias.detach())
        return head(x)

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., len(feature_layers) * d]` (concatenated in layer order) -> `[..., d]`."""
        return self.fuse(features)

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
        self.length = 0  # committed positions in the drafter's KV cache
        self.pending: list[torch.Tensor] = []  # target features `[n, F]` of committed positions not yet run
        self.rooted = False  # static shapes: the row's last feature is in `root_f`


# The default tree, by the device the drafter runs on. On a GPU a verify of 49 tokens costs about what one token
# does (weights are read once), so the tree is EAGLE-2's size (its reference runs 60-token trees of top-10
# children). On a CPU every node is target compute (bench/verify_cost.py: 49 nodes 2.55x a 1-token step, 13 nodes
# 1.69x), and a narrow tree wins: on the embedded model (bench/RESULTS.md, "EAGLE's default tree, by device") 16
# nodes of top-2 children ran 1.50-1.59x plain decoding at tau 4.86, 48 nodes of top-8 1.26-1.31x at tau 5.25.
DEFAULT_TREE = {"cuda": dict(topk=8, num_nodes=48), "cpu": dict(topk=2, num_nodes=16)}


def default_tree(device: torch.device) -> dict:
    """`{"topk", "num_nodes"}` of the default tree on `device` (a CPU's, or the accelerators' one)."""
    return DEFAULT_TREE["cpu" if torch.device(device).type == "cpu" else "cuda"]


class EagleDrafter(Drafter):
    """Dynamic-tree drafts from an EAGLE-3 `Net`; see the module docstring.

    With static shapes (the engine's CUDA-graph path) the committed pairs are run when they are known instead:
    `observe` runs every pair whose next token is committed (the previous round's root pair again, then the
    accepted ones) and keeps each row's last committed feature (`root_f`) and cached length (`len_t`) on the
    device, and `draft_step` runs the root pair and the tree over the whole cache, writing nothing that
    outlives the round (the root's K/V joins the nodes' scratch), so a CUDA graph can replay it."""

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
        self.root_f: torch.Tensor | None = None  # static shapes: [max_batch_size, F] each row's last feature
        self.len_t: torch.Tensor | None = None  # static shapes: [max_batch_size] committed pairs in the cache

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

    # ---- request lifecycle ---------------------------------------------------------------------------
    def begin(self, rows, prompts) -> None:
        for r in rows:
            if not 0 <= r < self.max_batch_size:
                raise ValueError(f"rows: row {r} outside max_batch_size {self.max_batch_size}")
            self.rows[r] = _Row()

    def release(self, rows) -> None:
        for r in rows:
            self.rows.pop(r, None)

    def observe(self, rows, tokens, hidden, features) -> None:
        if self._static_shapes():
            self._observe_static(rows, tokens, features)
            return
        for i, r in enumerate(rows):
            f = torch.cat([features[layer][i] for layer in self.feature_layers], -1)
            self.rows.setdefault(r, _Row()).pending.append(f.detach().to(self.dtype))

    @torch.no_grad()
    def _observe_static(self, rows, tokens, features) -> None:
        """Run the pairs of every row whose next token is now committed, all rows in one forward: after a prefill
        (tokens = the prompt) the pairs (f_i, x_i+1) of all but the last position; after a round (tokens = the
        anchor and the accepted drafts) first the previous root pair (its feature `root_f`, its token the
        anchor: `draft_step` ran it only for the round), then the accepted ones. The last feature becomes the
        row's root."""
        dev = self.device
        counts = [int(t.shape[0]) for t in tokens]
        if min(counts, default=0) < 1:
            raise ValueError("eagle: observe needs at least one new position per row")
        fresh = [not self.rows.setdefault(r, _Row()).rooted for r in rows]
        if any(fresh) and not all(fresh):
            raise ValueError("eagle: observe of new and running requests together")
        feat = torch.cat([torch.nn.utils.rnn.pad_sequence(features[layer], batch_first=True)
                          for layer in self.feature_layers], -1).to(self.dtype)  # [B, M, F]
        tok = torch.nn.utils.rnn.pad_sequence(list(tokens), batch_first=True).to(dev)  # [B, M]
        B, M = tok.shape
        if self.root_f is None:
            self.root_f = feat.new_zeros(self.max_batch_size, feat.shape[-1])
            self.len_t = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)
        rows_t = self.target.index(list(rows))
        if fresh[0]:  # pairs (f_i, x_i+1), i < n - 1
            pf, pt, m = feat[:, :-1], tok[:, 1:], [c - 1 for c in counts]
        else:  # the previous root (f, anchor), then (f_i, x_i+1) of the accepted drafts
            pf, pt, m = torch.cat([self.root_f[rows_t][:, None], feat[:, :-1]], 1), tok, counts
        held = [self.rows[r].length for r in rows]
        # a running row starts where its pairs end (`len_t`), a fresh one at 0; the counts come from the engine
        start = torch.zeros(B, dtype=torch.long, device=dev) if fresh[0] else self.len_t[rows_t]
        n = observed_counts(tokens, dev)
        if max(m) > 0:
            self._reserve(self.target.max_length + self.target.num_verify_tokens)
            self._run_pairs(rows_t, pt, pf, start, max(held))
        self.root_f[rows_t] = feat[torch.arange(B, device=dev), n - 1]
        self.len_t[rows_t] = start + (n - 1 if fresh[0] else n)
        for r, c in zip(rows, m):
            self.rows[r].length += c
            self.rows[r].rooted = True

    def _reserve(self, need: int) -> None:
        cap = self.cache[0][0].shape[2]
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)
        grown = []
        for k, v in self.cache:
            k2 = k.new_zeros(k.shape[0], k.shape[1], new, k.shape[3])
            v2 = v.new_zeros(v.shape[0], v.shape[1], new, v.shape[3])
            k2[:, :, :cap], v2[:, :, :cap] = k, v
            grown.append((k2, v2))
        self.cache = grown

    # ---- drafting ------------------------------------------------------------------------------------
    def _run_pairs(self, rows_t, tok, feat, start, span: int, *, write: bool = True):
        """Run pairs `(feat [B, M, F], tok [B, M])` at positions `start [B] + i` of rows `rows_t [B]` over the first
        `span` cached positions (>= every start; row b sees those < start[b]), causal among the M. -> hidden
        `[B, M, d]`, and with `write` False also the pairs' K/V per layer `[B, H, M, D]` (kept out of the cache)
        and the cached K/V it read per layer `[B, H, span, D]`. With `write`, every row's K/V land at all M
        positions from its start in one indexed copy per layer: past a row's count they hold padding beyond its
        committed length (never seen, overwritten by its next pairs)."""
        net, dev = self.net, self.device
        M = tok.shape[1]
        past = [[(k[rows_t, :, :span], v[rows_t, :, :span])] for k, v in self.cache]  # one segment per layer
        j = torch.arange(span + M, device=dev)
        i = torch.arange(M, device=dev)
        ok = torch.where(j[None, None, :] < span, j[None, None, :] < start[:, None, None],
                         (j[None, None, :] - span) <= i[None, :, None])  # [B, M, span + M]
        positions = start[:, None] + i[None]
        h, kvs = net.run(net.inputs(tok, net.fused(feat)), positions, _additive(ok, self.dtype), past)
        if not write:
            return h, kvs, [seg[0] for seg in past]
        at = (rows_t[:, None], slice(None), positions)  # [B, M] positions of each row
        for (ck, cv), (k, v) in zip(self.cache, kvs):
            ck[at] = k.transpose(1, 2)
            cv[at] = v.transpose(1, 2)
        return h

    def _catch_up(self, rows, contexts):
        """Run the queued committed positions and the root pair (last committed feature, anchor) of every row
        and append their K/V. -> (root hidden `[B, d]`, root logits `[B, V]`, committed lengths `[B]`, their
        maximum (a host int), `rows` as a device tensor). Lengths are kept on the host: nothing is read back."""
        net, dev = self.net, self.device
        B = len(rows)
        feats, toks, counts = [], [], []
        for r, ctx in zip(rows, contexts):
            st = self.rows.get(r)
            if st is None or not st.pending:
                raise RuntimeError(f"eagle: no target features observed for row {r}")
            f = torch.cat(st.pending) if len(st.pending) > 1 else st.pending[0]
            tk = ctx[st.length + 1:].to(dev)
            if tk.shape[0] != f.shape[0]:
                raise RuntimeError(f"eagle: row {r} is out of step ({st.length} cached + {f.shape[0]} queued "
                                   f"positions for a context of {ctx.shape[0]} tokens)")
            feats.append(f)
            toks.append(tk)
            counts.append(f.shape[0])
        M = max(counts)
        held = [self.rows[r].length for r in rows]
        lens, n, rows_t = torch.tensor([held, counts, rows], dtype=torch.long, device=dev)  # one copy
        fpad = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)  # [B, M, F], one op for every row
        tpad = torch.nn.utils.rnn.pad_sequence(toks, batch_first=True)  # [B, M]
        ends = [s + c for s, c in zip(held, counts)]
        self._reserve(max(held) + M)
        h = self._run_pairs(rows_t, tpad, fpad, lens, max(held))
        root_h = h[torch.arange(B, device=dev), n - 1]
        root_logits = net.lm_logits(root_h)
        for b, r in enumerate(rows):  # committed only once everything above succeeded
            st = self.rows[r]
            st.length += counts[b]
            st.pending = []
        return root_h, root_logits, lens + n, max(ends), rows_t

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        B = len(rows)
        if B == 0:
            return DraftBlock.empty(0, self.device)
        if self._static_shapes():
            return self.draft_step(rows, self.target.index(list(rows)),
                                   self.target.index(self.target.slots(list(rows))),
                                   torch.stack([c[-1] for c in contexts]).to(self.device), gamma, sampling=sampling)
        root_h, root_logits, lens, S0, rows_t = self._catch_up(rows, contexts)
        committed = [(ck[rows_t, :, :S0], cv[rows_t, :, :S0]) for ck, cv in self.cache]
        return self._tree(root_h, root_logits, committed, lens, None, gamma, sampling)

    @torch.no_grad()
    def draft_step(self, rows, rows_t, slots_t, anchors, gamma, *, sampling=None, generator=None) -> DraftBlock:
        """`propose` as device work of fixed shapes (see `Drafter.draft_step`), after `observe` ran the committed
        pairs: the root pair (`root_f`, anchor) over the whole cache, then the tree, its K/V in the round's
        scratch only."""
        for r in rows:
            st = self.rows.get(r)
            if st is None or not st.rooted:
                raise RuntimeError(f"eagle: no target features observed for row {r}")
        lens = self.len_t[rows_t]
        cap = self.cache[0][0].shape[2]
        root_h, root_kv, committed = self._run_pairs(rows_t, anchors[:, None], self.root_f[rows_t][:, None], lens,
                                                     cap, write=False)
        root_h = root_h[:, 0]
        return self._tree(root_h, self.net.lm_logits(root_h), committed, lens, root_kv, gamma, sampling)

    def _tree(self, root_h, root_logits, committed, seen_len, root_kv, gamma, sampling) -> DraftBlock:
        """EAGLE-2's tree from the root step (`root_h [B, d]`, `root_logits [B, V]`) over the `committed` K/V per
        layer `[B, H, S0, D]` (row b sees positions < `seen_len[b]`, the root's own position included when its K/V
        is cached) and, when not cached, the root's K/V `root_kv` per layer `[B, H, 1, D]`, seen by every node."""
        net, dev = self.net, self.device
        B = root_h.shape[0]
        S0 = committed[0][0].shape[2]
        depth = max(1, min(self.depth, int(gamma)))
        tree = DynamicTree(log_scores(root_logits, sampling), self.topk if self.tree else 1)
        seen = torch.arange(S0, device=dev)[None] < seen_len[:, None]  # [B, S0]
        root_pos = seen_len - 1 if root_kv is None else seen_len  # the root pair's position
        exp_h = root_h.new_zeros(B, 0, root_h.shape[-1])  # [B, expanded, d]: each expanded node's hidden
        exp_anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # [B, e, e]: expanded ancestors of each
        # per layer the nodes attend to two K/V segments (`layers.attend`): the committed cache, never copied per
        # depth, and the round's scratch (the root's K/V when not cached, then every expanded node's), grown by depth
        if root_kv is None:
            scratch = [(ck[:, :, :0], cv[:, :, :0]) for ck, cv in committed]
        else:
            scratch = list(root_kv)
        lead = torch.ones(B, 1, 0 if root_kv is None else 1, dtype=torch.bool, device=dev)  # the root's K/V
        for d in range(1, depth):
            sel, src, tok = tree.frontier()
            w, n_exp = sel.shape[1], exp_h.shape[1]
            par_h = DynamicTree.parent_states(src, root_h[:, None], exp_h)
            # ancestors among expanded nodes: the parent's ancestors and the parent itself
            if n_exp:
                anc = exp_anc.gather(1, src.clamp(min=0)[..., None].expand(B, w, n_exp))
                # the parent itself, by comparison: `F.one_hot` reads its indices back to check them
                anc = anc | (src.clamp(min=0)[..., None] == torch.arange(n_exp, device=dev))
                anc = anc & (src >= 0)[..., None]
            else:
                anc = torch.zeros(B, w, 0, dtype=torch.bool, device=dev)
            ok = torch.cat([seen[:, None].expand(B, w, S0), lead.expand(B, w, lead.shape[2]), anc,
                            torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)], 2)
            positions = (root_pos + d)[:, None].expand(B, w)
            h, kvs = net.run(net.inputs(tok, par_h), positions, _additive(ok, self.dtype),
                             [[c, s_] for c, s_ in zip(committed, scratch)])
            scratch = [(torch.cat([sk, k_], 2), torch.cat([sv, v_], 2)) for (sk, sv), (k_, v_) in zip(scratch, kvs)]
            grown = torch.zeros(B, n_exp + w, n_exp + w, dtype=torch.bool, device=dev)
            grown[:, :n_exp, :n_exp] = exp_anc
            grown[:, n_exp:, :n_exp] = anc
            exp_anc = grown
            exp_h = torch.cat([exp_h, h], 1)
            tree.grow(sel, log_scores(net.lm_logits(h), sampling))  # [B, w, V]
        return tree.block(self.num_nodes, tree=self.tree)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, topk: int | None = None,
                 depth: int | None = None, num_nodes: int | None = None, **kwargs) -> EagleDrafter:
    """`specdec.wrap(model, drafter="eagle" or DIR, topk=..., depth=gamma, num_nodes=...)`: `topk` children per
    expanded node and nodes expanded per depth, `depth` tree depth (capped by the round's gamma), `num_nodes`
    drafts kept after reranking (the verify window is num_nodes + 1). Unset, `topk` and `num_nodes` (at least
    `depth`) are the device's default tree (`DEFAULT_TREE`: 8 and 48 on a GPU, 2 and 16 on a CPU)."""
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: unknown option for the eagle drafter "
                         "(expected topk, depth, num_nodes)")
    return EagleDrafter(net, gamma=gamma, max_batch_size=max_batch_size, topk=topk, depth=depth,
                        num_nodes=num_nodes)
