"""EAGLE-3 style drafter: fused low / mid / high target features, one decoder layer with its own KV cache,
the target's embedding and lm_head (shared), and a dynamic draft tree verified as a tree.

Net. The target's decoder-layer outputs at `feature_layers` are fused, `fuse(concat(f_low, f_mid, f_high))`
(`[3d] -> [d]`). The drafter's input at committed position t pairs the fused feature at t with the next
token: `x_t = fc(concat(emb_norm(emb(x_{t+1})), feat_norm(fused_t)))`, runs through `num_layers` decoder
blocks (`layers.Block`, rotary positions t) and `norm`, and the target's `lm_head` scores token t+2.
Past the last committed position there are no target features: a draft step feeds the drafter's own
hidden output (the last block's output, before `norm`) of its parent step in place of the fused feature
(EAGLE-3), and training unrolls that "training-time test" for `ttt_steps` extra steps.

The drafter that runs a net in an engine (its cache, and the round it drafts): `draft/eagle_drafter.py`; the tree a
draft grows from a root step over the drafter's cache: `Net.draft_tree`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import DraftBlock
from .layers import Block, KVRoom, RMSNorm, soft_ce, target_logits
from .registry import DraftConfig, TargetBatch
from .tree import DynamicTree, log_scores


@dataclass
class Config(DraftConfig):
    kind: str = "eagle"
    # Training-time test: steps beyond the first that feed the drafter's own hidden state. The reference
    # (EAGLE-3; SpecForge's ttt_length = 7) unrolls 7 steps in all, so 6 extra; drafters saved with fewer keep
    # theirs (the field is in their config.json).
    ttt_steps: int = 6
    ttt_decay: float = 0.8  # loss weight of step k is ttt_decay ** k (the reference's 0.8 ** k)
    # A sliding window (Mistral's): a query at position p attends to keys at positions p - W + 1 .. p only, in
    # training and drafting alike; 0 attends to every earlier position (the reference). A head trained on windows
    # of S tokens never met a key more than S - 1 back, and on longer contexts such keys only dilute its attention;
    # with W the drafter keeps and reads a ring of W positions per request (`eagle_drafter.EagleDrafter`), so a
    # round's cost and the cache's memory stop growing with the context. The drafter's `context_window` option
    # overrides it.
    context_window: int = 0

    def __post_init__(self):
        W = self.context_window
        if isinstance(W, bool) or not isinstance(W, int) or W < 0:
            raise ValueError(f"drafter: context_window expected an int >= 0 (0: no window), got {W!r}")

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

    @staticmethod
    def in_window(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
        """Which keys at positions `keys` a query at positions `queries` attends to under a sliding window of
        `window` >= 1 positions, broadcast together -> bool, `queries - keys < window` (the causal side is the
        caller's)."""
        return queries - keys < window

    def attentions(self) -> list[nn.Module]:
        """Each layer's attention (`num_heads` or `num_kv` K/V heads, `head_dim`): what the drafter's cache holds."""
        return [b.attn for b in self.layers]

    def inputs(self, tokens: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """Layer input from the next tokens `[B, T]` and a fused target feature or own hidden `[B, T, d]`."""
        return self.fc(torch.cat([self.emb_norm(self.embed(tokens)), self.feat_norm(feat)], -1))

    @property
    def caches_from_inputs(self) -> bool:
        """Whether `input_kv` gives all the K/V the drafter caches: one layer (EAGLE-3's), whose K/V at a position are
        a function of that position's input alone (a second layer's would need the first's attention output), run
        by this class's `run` (a subclass with layers of its own is False unless it overrides this and `input_kv`, as
        `eagle3_format.Net` does)."""
        return len(self.layers) == 1 and type(self).run is Net.run

    def input_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's K, V `[B, H, T, D]` of its input `x [B, T, d]` (`inputs`) at `positions [B, T]`: the
        ops `run` makes them with, without the layer's attention or MLP."""
        layer = self.layers[0]
        return layer.attn.kv(layer.attn_norm(x), positions)

    def run(self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, past=None):
        """Decoder blocks over `x [B, T, d]` at `positions [B, T]`; `visible` bool `[B or 1, T, S + T]` over the
        past keys then x's own (None: all); `past` per layer a `(k, v)` pair `[B, H, S, D]` or a `layers.KVRoom`,
        or None -> (hidden `[B, T, d]`, new (k, v) per layer `[B, H, T, D]`)."""
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, visible, None if past is None else past[i])
            kvs.append(kv)
        return x, kvs

    # ---- drafting ------------------------------------------------------------------------------------
    def draft_tree(self, root_h, root_logits, rooms, seen, root_pos, depth: int, sampling, *, topk: int,
                   num_nodes: int, tree: bool = True, key_pos=None, window: int = 0) -> DraftBlock:
        """EAGLE-2's tree (`tree.DynamicTree`) of `depth` levels, `topk` children per expanded node, its best
        `num_nodes` kept (`tree` False: a chain, one child per node), from the root step (`root_h [B, d]`,
        `root_logits [B, V]`) over each layer's room (`eagle_drafter.EagleDrafter._rooms`: K/V `[B, H, L, D]`, the
        drafter's cache read for the round) whose first S keys are the committed ones, of which row b sees
        those `seen [B, S]` marks, and whose key S is the root's (at `root_pos [B]`), seen by every node; the
        nodes' K/V go after it, depth by depth. With a context `window` W, `key_pos [B, S]` are the committed keys'
        positions, and a node at `root_pos + d` sees only the keys, the root and ancestors fewer than W back."""
        dev = root_h.device
        B = root_h.shape[0]
        S0 = seen.shape[1]
        dyn = DynamicTree(log_scores(root_logits, sampling), topk if tree else 1)
        w = dyn.k  # nodes expanded per depth: the newest depth always holds at least k candidates
        exp_h = root_h.new_zeros(B, 0, root_h.shape[-1])  # [B, expanded, d]: each expanded node's hidden
        # [B, E, E]: row i marks the expanded ancestors of expanded node i, filled depth by depth
        exp_anc = torch.zeros(B, (depth - 1) * w, (depth - 1) * w, dtype=torch.bool, device=dev)
        ids = torch.arange((depth - 1) * w, device=dev)
        own = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)  # each node sees itself
        # [B, w, depth - 1]: the nodes of depth d sit at root + d
        positions = (root_pos[:, None, None] + torch.arange(1, depth, device=dev)).expand(B, w, -1)
        ok_fixed = torch.cat([seen, seen.new_ones(B, 1)], 1)[:, None].expand(B, w, S0 + 1)  # committed keys, the root
        if key_pos is not None:  # [B, depth - 1, S0 + 1]: the same per depth, within the window of its nodes
            at = torch.arange(1, depth, device=dev)
            near = seen[:, None] & self.in_window((root_pos[:, None] + at)[..., None], key_pos[:, None], window)
            ok_fixed = torch.cat([near, (at < window)[None, :, None].expand(B, depth - 1, 1)], 2)
        for d in range(1, depth):
            sel, src, tok = dyn.frontier()
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
            fixed = ok_fixed
            if key_pos is not None:
                fixed = ok_fixed[:, d - 1, None].expand(B, w, S0 + 1)
                if d > window:  # ancestors W or more back (expanded node e sits at depth e // w + 1)
                    anc = anc & (d - (ids[:n_exp] // w + 1) < window)
            ok = torch.cat([fixed, anc, own], 2)
            # the nodes' K/V go into the rooms after the committed keys, the root and the nodes before them
            h, _ = self.run(self.inputs(tok, par_h), positions[..., d - 1], ok,
                            [KVRoom(k, v, S0 + 1 + n_exp) for k, v in rooms])
            exp_h = torch.cat([exp_h, h], 1)
            dyn.grow(sel, log_scores(self.lm_logits(h), sampling))  # [B, w, V]
        return dyn.block(num_nodes, tree=tree)

    # ---- training ------------------------------------------------------------------------------------
    def _unroll(self, batch: TargetBatch):
        """Teacher-forced steps 1..1+ttt_steps over a batch. Step 1 at position t sees the fused target
        feature at t and token t+1; step k sees its own step k-1 hidden at t-1 (valid for t >= k-1), the
        step-1 keys at positions <= t-k+1 and the step-i keys at t-k+i, as a depth k-1 tree node does; with a
        `context_window` W, only those at positions > t - W.
        -> per step (draft logits `[B, S-1, V]`, valid positions `[S-1]` bool); targets `[B, S-1, V]`."""
        cfg = self.config
        tokens = batch.tokens
        B, S = tokens.shape
        if S < 2:
            raise ValueError(f"batch: need windows of >= 2 tokens, got {S}")
        T = S - 1
        feats = torch.cat([batch.features[i][:, :-1] for i in cfg.feature_layers], -1)
        nxt = tokens[:, 1:]
        dev = feats.device
        positions = torch.arange(T, device=dev).expand(B, T)
        t = torch.arange(T, device=dev)
        outs, past, feat = [], None, self.fused(feats)
        for k in range(1, cfg.ttt_steps + 2):
            x = self.inputs(nxt, feat)
            # visibility of query t over keys [step 1 | step 2 | ... | step k], each T long
            blocks = [t[None, :] <= (t[:, None] - (k - 1))]
            blocks += [t[None, :] == (t[:, None] - (k - i)) for i in range(2, k + 1)]
            if cfg.context_window:  # every block's key t' sits at position t', as the query at t
                near = self.in_window(t[:, None], t[None, :], cfg.context_window)
                blocks = [b & near for b in blocks]
            h, kvs = self.run(x, positions, torch.cat(blocks, 1)[None], past)
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
