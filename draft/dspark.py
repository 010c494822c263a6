"""DSpark: a block drafter (DFlash backbone + low-rank Markov head + confidence head).

One round drafts the whole block `[anchor, MASK x (G-1)]` in ONE non-causal forward of a few small layers:
- the anchor is embedded with the target's own embedding, the other slots with a learned MASK embedding;
- every layer's attention sees (a) context K/V computed from the target's features at all committed
  positions (outputs of several target decoder layers, concatenated, `fc` to the drafter width, normed,
  then each layer's own K/V projections; cached per request, grown only by `observe`, so only committed
  positions ever enter it) and (b) the block itself, bidirectionally;
- output norm + the target's own lm_head (shared by reference, never saved) give base logits for all G
  slots at once: slot i (position anchor + i) scores the token at anchor + i + 1.
The Markov head then adds `W @ row(prev_i)`, a rank-`markov_rank` bigram term (`row` a free `[V, r]` table in
the reference recipe, `U @ E[prev]` through the target's embedding E with `markov_table=False`), where prev_i is
the anchor for i = 0 and draft i-1 after that, so drafts are chosen sequentially after the single forward
(greedy: argmax; sampling: drawn from `q_i = probs_from_logits(logits_i, sampling)`, returned).
The confidence head `sigmoid(w . [h_i; row(prev_i)])` (`confidence_markov=False`: `sigmoid(w . h_i)`) estimates
the probability that draft i is accepted given that the drafts before it were; with `confidence_threshold > 0`
the block is cut after the last draft whose cumulative estimate `prod_{j<=i} c_j` is still >= the threshold (at
least one draft is kept). That only decides how many drafts are verified, so the output stays lossless.

Training (`net.loss`): random anchors a per window (`Net.num_anchors`: the reference's density, 1 in 8
positions); context = target features at positions <= a-1 (the last `context_window` of them when set),
block = positions a .. a+G-1 (G = `block_size`), the Markov head teacher-forced with the true tokens
(prev_i = token a+i). The reference recipe (`Config`'s defaults, what every new drafter gets) scores slot i with
0.9 x L1(p_draft, p_target(a+i)) + 0.1 x CE(token a+i+1), slot k weighted exp(-k/4), plus the confidence head's
BCE against the soft acceptance 1 - TV. A saved drafter's config.json states every field, so one trained with
other values (the soft cross-entropy and hard-hit confidence target of the first drafters) keeps them. Reference
followed: DeepSpec
`deepspec/modeling/dspark/{loss.py, markov_head.py, common.py, qwen3/modeling.py}` and
`config/dspark/dspark_qwen3_8b.py`.

The drafter that runs a net in an engine, and its options: `draft/dspark_drafter.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import Block, RMSNorm, target_logits
from .registry import DraftConfig


def default_feature_layers(num_layers: int, count: int = 3) -> list[int]:
    """`count` decoder layers spread evenly over depth (first and last included), e.g. 36 -> [0, 17, 35]."""
    k = max(1, min(count, num_layers))
    if k == 1:
        return [num_layers - 1]
    return sorted({i * (num_layers - 1) // (k - 1) for i in range(k)})


def target_fingerprint(target, n: int = 8) -> list[float]:
    """RMS of `n` evenly spaced rows of the target's input embedding: tells one target's weights from
    another's (a drafter only fits the target it was distilled from), stable across dtypes."""
    w = target.get_input_embeddings().weight.detach()
    idx = torch.linspace(0, w.shape[0] - 1, min(n, w.shape[0])).round().long()
    return [round(float(x), 6) for x in w[idx].double().pow(2).mean(-1).sqrt().cpu()]


def _fingerprint_matches(a: list[float], b: list[float], rtol: float = 3e-2) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))


@dataclass
class Config(DraftConfig):
    """DSpark's fields. The defaults are the reference recipe (DeepSpec `config/dspark/dspark_qwen3_8b.py`,
    `deepspec/modeling/dspark/{loss.py, markov_head.py, qwen3/modeling.py}`) scaled to a CPU-trained drafter: what
    every new drafter gets (`for_target`). A saved drafter states every field in its config.json.

    Loss: `l1_weight` x L1(p_draft, p_target) (= 2 TV, which maps directly to acceptance; reference 0.9)
    + `hard_ce_weight` x CE against the window's next token (reference 0.1) + `soft_ce_weight` x soft CE against
    the target's distribution (the old loss; reference 0), slot k weighted exp(-k / `position_decay`)
    (reference 4; 0: uniform), + `confidence_weight` x the confidence head's BCE (reference alpha 1.0).
    `input_norm`: RMS-normalise the block input (anchor embedding, MASK embedding) so it enters the residual
    stream at the layers' scale (the target's raw embedding rows are far smaller). `qk_norm`: per-head RMSNorm
    of queries and keys (context keys included) before rotary, as the reference's attention.
    `anchor_density` > 0: training blocks per window = density x window length (reference 512 / 4096 =
    0.125); 0: `anchors_per_window`. `markov_table`: the Markov head is a free `[V, markov_rank]` table plus a
    `[markov_rank -> V]` projection (reference "vanilla", rank 256); False: rank `markov_rank` through the frozen
    embedding. `confidence_markov`: the confidence head reads [h; Markov row of the previous token] (reference);
    `confidence_soft`: its target is the soft acceptance 1 - TV(p_draft, p_target) (reference) instead of
    whether the argmaxes agree. `context_window` W > 0 (not in the reference, which trains on 4096-token windows and
    attends to every committed position, as 0 does here): a block attends to the last W committed positions only, in
    training and drafting alike (a sliding window, as Mistral's attention). Trained on windows of S tokens, a drafter
    never sees a context key more than S - block_size positions back; on longer prompts such keys only dilute its
    attention, so W = S - block_size keeps drafting within what training covered. At run time the drafter then keeps
    and reads only a ring of the last W positions (and a verify window) per request (`dspark_drafter.DSparkDrafter`),
    so a round's cost and the cache's memory do not grow with the context.
    """

    kind: str = "dspark"
    num_layers: int = 2  # target-sized layers (reference: 5 for a 36-layer target); see `for_target`
    block_size: int = 7  # G: slots per block = drafts per forward (anchor + G-1 MASK slots)
    markov_rank: int = 64  # markov_head.py VanillaMarkov (reference rank 256 at hidden 4096)
    anchors_per_window: int = 8  # training blocks per target window (when anchor_density is 0)
    confidence_weight: float = 1.0
    target_num_layers: int = 0
    target_fingerprint: list[float] = field(default_factory=list)
    l1_weight: float = 0.9  # loss.py: l1 / ce_loss_alpha
    hard_ce_weight: float = 0.1
    soft_ce_weight: float = 0.0
    position_decay: float = 4.0
    input_norm: bool = True  # anchor input at the layers' scale
    qk_norm: bool = True  # qwen3/modeling.py: q_norm / k_norm
    anchor_density: float = 0.125  # num_anchors 512 per max_length 4096
    markov_table: bool = True
    confidence_markov: bool = True  # confidence_head_with_markov
    confidence_soft: bool = True  # target 1 - TV (loss.py)
    context_window: int = 0

    def __post_init__(self):
        def positive_int(name, minimum=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"drafter: {name} expected an int >= {minimum}, got {v!r}")
        for name in ("num_layers", "block_size", "markov_rank", "anchors_per_window", "num_heads", "head_dim",
                     "intermediate_size"):
            positive_int(name)
        for name in ("target_hidden_size", "target_vocab_size", "target_num_layers", "context_window"):
            positive_int(name, 0)
        if (not isinstance(self.feature_layers, (list, tuple))
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.feature_layers)):
            raise ValueError(f"drafter: feature_layers expected a list of layer indices >= 0, "
                             f"got {self.feature_layers!r}")
        self.feature_layers = list(self.feature_layers)
        for name in ("confidence_weight", "l1_weight", "hard_ce_weight", "soft_ce_weight", "position_decay",
                     "anchor_density"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"drafter: {name} expected a number >= 0, got {v!r}")
        if not self.l1_weight + self.hard_ce_weight + self.soft_ce_weight > 0:
            raise ValueError("drafter: l1_weight, hard_ce_weight and soft_ce_weight are all 0 (no draft loss)")
        for name in ("input_norm", "qk_norm", "markov_table", "confidence_markov", "confidence_soft"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"drafter: {name} expected a bool, got {getattr(self, name)!r}")
        if not isinstance(self.target_fingerprint, (list, tuple)):
            raise ValueError(f"drafter: target_fingerprint expected a list, got {self.target_fingerprint!r}")
        self.target_fingerprint = [float(x) for x in self.target_fingerprint]

    @classmethod
    def for_target(cls, target, **overrides) -> "Config":
        """The reference recipe (the defaults) sized for `target`: layers as wide as the target's own (its
        attention heads of hidden / heads, its MLP width), `num_layers` of them (two by default: the most that
        trains to convergence within a CPU training run with a 256-wide target, bench/results/HISTORY.md; the
        reference's five are for a 36-layer target)."""
        tc = target.config.get_text_config()
        d = tc.hidden_size
        heads = int(getattr(tc, "num_attention_heads", 0) or 0)
        if heads < 1 or d % heads:
            heads = 4 if d % 4 == 0 else 1
        base = dict(target_model_type=target.config.model_type, target_hidden_size=d,
                    target_vocab_size=tc.vocab_size, target_num_layers=tc.num_hidden_layers,
                    feature_layers=default_feature_layers(tc.num_hidden_layers),
                    target_fingerprint=target_fingerprint(target), num_heads=heads, head_dim=d // heads,
                    intermediate_size=int(getattr(tc, "intermediate_size", 0) or 4 * d),
                    rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6) or 1e-6))
        base.update(overrides)
        return cls(**base)


class _HeadNormLinear(nn.Linear):
    """A bias-free projection `[..., in] -> [..., H * D]` followed by RMSNorm over each head's D channels
    (the reference's q_norm / k_norm; applied before rotary)."""

    def __init__(self, in_features: int, num_heads: int, head_dim: int, eps: float):
        super().__init__(in_features, num_heads * head_dim, bias=False)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.norm(y.unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2)


class Net(nn.Module):
    """The DSpark network. Shared target modules: `target_embed`, `target_lm_head` (not trained, not saved)."""

    def __init__(self, config: Config, target_embed: nn.Module, target_lm_head: nn.Module):
        super().__init__()
        self.config = config
        d = config.target_hidden_size
        self.target_embed = target_embed
        self.target_lm_head = target_lm_head
        r = config.markov_rank
        self.mask_embed = nn.Parameter(torch.randn(d) * 0.02)
        self.fc = nn.Linear(len(config.feature_layers) * d, d, bias=False)
        self.ctx_norm = RMSNorm(d, config.rms_norm_eps)
        if config.input_norm:
            self.in_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList([Block(config, d) for _ in range(config.num_layers)])
        if config.qk_norm:
            for layer in self.layers:
                layer.attn.q_proj = _HeadNormLinear(d, config.num_heads, config.head_dim, config.rms_norm_eps)
                layer.attn.k_proj = _HeadNormLinear(d, config.num_heads, config.head_dim, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.markov_table:
            self.markov_table = nn.Embedding(config.target_vocab_size, r)
        else:
            self.markov_u = nn.Linear(d, r, bias=False)
        self.markov_w = nn.Linear(r, config.target_vocab_size, bias=False)
        self.confidence = nn.Linear(d + (r if config.confidence_markov else 0), 1)
        with torch.no_grad():
            for name, m in self.named_modules():
                if isinstance(m, nn.Linear) and not name.startswith("target_"):
                    m.weight.normal_(0.0, 1.0 / math.sqrt(m.in_features))
            if config.markov_table:  # a zero projection: the bigram bias starts at 0 and grows from the data
                self.markov_table.weight.normal_(0.0, 1.0)
                self.markov_w.weight.zero_()
            else:
                self.markov_w.weight.normal_(0.0, 0.02)
            self.confidence.weight.zero_()
            self.confidence.bias.zero_()

    @classmethod
    def from_target(cls, target, config: Config) -> "Net":
        tc = target.config.get_text_config()
        if config.target_model_type and config.target_model_type != target.config.model_type:
            raise ValueError(f"drafter: trained for a {config.target_model_type!r} target, but this target is "
                             f"{target.config.model_type!r}")
        fp = config.target_fingerprint
        if fp and not _fingerprint_matches(fp, target_fingerprint(target)):
            raise ValueError("drafter: trained for another target (its embedding fingerprint does not match this "
                             "target's weights)")
        if not config.feature_layers:
            raise ValueError("drafter: feature_layers is empty (dspark needs target features)")
        bad = [i for i in config.feature_layers if i >= tc.num_hidden_layers]
        if bad:
            raise ValueError(f"drafter: feature_layers {bad} out of range for a target with "
                             f"{tc.num_hidden_layers} layers")
        emb, head = target.get_input_embeddings(), target.get_output_embeddings()
        if emb is None or head is None:
            raise ValueError("drafter: dspark needs a target with input embeddings and an lm_head")
        return cls(config, emb, head)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as e:  # shape mismatches: the weights belong to another config
            raise ValueError(f"drafter: weights do not match the dspark config ({e})") from None

    # ---- pieces ------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.target_embed.weight.detach())

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return target_logits(self.target_lm_head, h)

    def context(self, features: list[torch.Tensor]) -> torch.Tensor:
        """Target features (one `[..., S, d]` per feature layer, in config order) -> context states `[..., S, d]`."""
        return self.ctx_norm(self.fc(torch.cat(features, -1)))

    def context_visible(self, keys: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Which context keys a block sees: key positions `keys [S]`, blocks whose anchors sit at `ends [...]` ->
        `[..., S]` bool, true for keys before the anchor and, with `context_window` W > 0, at most W back."""
        ends = ends[..., None]
        ok = keys < ends
        if self.config.context_window:
            ok = ok & (keys >= ends - self.config.context_window)
        return ok

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K, V `[B, H, S, D]` of context states `[B, S, d]` at `positions [B, S]`."""
        return [layer.attn.kv(ctx, positions) for layer in self.layers]

    def block_hidden(self, anchors: torch.Tensor, positions: torch.Tensor, ctx_kv,
                     visible: torch.Tensor) -> torch.Tensor:
        """Blocks `[B, N*G]` (N blocks of G slots; `anchors [B, N]`) -> normed hidden states `[B, N*G, d]`.
        `visible` bool `[B, N*G or 1, S + N*G]` over [context keys, block keys]."""
        B, N = anchors.shape
        G = positions.shape[1] // N
        x = self.mask_embed.expand(B, N, G, -1).clone()
        x[:, :, 0] = self.embed(anchors)
        x = x.reshape(B, N * G, -1)
        if self.config.input_norm:
            x = self.in_norm(x)
        for layer, kv in zip(self.layers, ctx_kv):
            x, _ = layer(x, positions, visible, past=kv)
        return self.norm(x)

    def markov_row(self, prev: torch.Tensor) -> torch.Tensor:
        """The Markov head's rank-r row `[..., r]` of previous tokens `prev [...]`."""
        if self.config.markov_table:
            return self.markov_table(prev)
        return self.markov_u(self.embed(prev))

    def markov(self, prev: torch.Tensor) -> torch.Tensor:
        """Low-rank bigram logits `[..., V]` for previous tokens `prev [...]`."""
        return self.markov_w(self.markov_row(prev))

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Confidence logits `[...]` of hidden states `h [..., d]` whose previous tokens are `prev [...]`."""
        if self.config.confidence_markov:
            h = torch.cat([h, self.markov_row(prev).to(h.dtype)], -1)
        return self.confidence(h).squeeze(-1)

    def confidence_prob(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.confidence_logit(h, prev))

    # ---- training --------------------------------------------------------------------------------------
    def _blocks(self, batch, anchors: torch.Tensor):
        """Blocks at `anchors [B, N]` of `batch` -> (hidden [B, N, G, d], base logits [B, N, G, V] (no Markov
        term), true previous tokens [B, N, G], target logits [B, N, G, V], next tokens [B, N, G] (the window's
        token a+i+1; -1 past the window's end))."""
        G = self.config.block_size
        tokens = batch.tokens
        B, S = tokens.shape
        N = anchors.shape[1]
        dev = tokens.device
        ctx = self.context([batch.features[i] for i in self.config.feature_layers])
        ctx_pos = torch.arange(S, device=dev).expand(B, S)
        kv = self.context_kv(ctx, ctx_pos)
        slot = torch.arange(G, device=dev)
        pos = (anchors[:, :, None] + slot).reshape(B, N * G)  # [B, N*G]
        # context key j visible to block n iff j < anchor_n (and within the window); block keys only within the block
        ctx_ok = self.context_visible(torch.arange(S, device=dev), anchors)  # [B, N, S]
        ctx_ok = ctx_ok[:, :, None, :].expand(B, N, G, S).reshape(B, N * G, S)
        blk = torch.arange(N, device=dev).repeat_interleave(G)
        blk_ok = (blk[:, None] == blk[None, :]).expand(B, N * G, N * G)
        anchor_tok = tokens.gather(1, anchors)
        h = self.block_hidden(anchor_tok, pos, kv, torch.cat([ctx_ok, blk_ok], -1)).view(B, N, G, -1)
        prev = tokens.gather(1, pos).view(B, N, G)  # teacher forcing: prev_i = token a+i
        tgt = batch.logits.gather(1, pos[..., None].expand(B, N * G, batch.logits.shape[-1]))
        nxt = torch.cat([tokens, tokens.new_full((B, 1), -1)], 1).gather(1, pos + 1).view(B, N, G)
        return h, self.lm_head(h), prev, tgt.view(B, N, G, -1), nxt

    def _check_batch(self, batch):
        S = batch.tokens.shape[1]
        if S < self.config.block_size + 1:
            raise ValueError(f"seq_len: windows of {S} tokens are too short for dspark block_size "
                             f"{self.config.block_size} (need >= {self.config.block_size + 1})")
        return S - self.config.block_size  # anchors 1 .. S-G

    def num_anchors(self, seq_len: int) -> int:
        """Training blocks per window of `seq_len` tokens."""
        cfg = self.config
        n = round(cfg.anchor_density * seq_len) if cfg.anchor_density > 0 else cfg.anchors_per_window
        return max(1, min(n, seq_len - cfg.block_size))

    def objective(self, h, logits, prev, tgt, nxt) -> dict:
        """The training loss of blocks (shapes as `_blocks` returns, `logits` with the Markov term):
        `total` and its terms `l1`, `hard_ce`, `soft_ce`, `confidence`, each a weighted mean over slots with slot
        k weighted exp(-k / position_decay) (1 when it is 0); hard CE only where the next token is in the window."""
        cfg = self.config
        G = logits.shape[2]
        k = torch.arange(G, device=logits.device, dtype=torch.float32)
        w = torch.exp(-k / cfg.position_decay) if cfg.position_decay > 0 else torch.ones_like(k)
        dt = torch.promote_types(logits.dtype, torch.float32)  # at least float32, float64 kept
        w = w.to(dt).expand(logits.shape[:-1])  # [B, N, G]
        logp = logits.to(dt).log_softmax(-1)
        p_t = tgt.to(dt).softmax(-1)
        terms = {}
        l1 = (logp.exp() - p_t).abs().sum(-1)  # [B, N, G] = 2 TV
        terms["l1"] = (w * l1).sum() / w.sum()
        terms["soft_ce"] = (w * -(p_t * logp).sum(-1)).sum() / w.sum()
        valid = nxt >= 0
        wv = w * valid
        ce = -logp.gather(-1, nxt.clamp(min=0)[..., None]).squeeze(-1)
        terms["hard_ce"] = (wv * ce).sum() / wv.sum().clamp(min=1e-12)
        total = cfg.l1_weight * terms["l1"] + cfg.hard_ce_weight * terms["hard_ce"] + cfg.soft_ce_weight * terms["soft_ce"]
        # the confidence head reads detached states: truncation never trades draft quality for its own fit
        conf_logit = self.confidence_logit(h.detach(), prev).to(dt)
        if cfg.confidence_soft:
            target = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
            terms["confidence"] = (w * F.binary_cross_entropy_with_logits(conf_logit, target, reduction="none")).sum() \
                / w.sum()
        else:
            hit = (logits.argmax(-1) == tgt.argmax(-1)).to(dt)
            terms["confidence"] = F.binary_cross_entropy_with_logits(conf_logit, hit)
        if cfg.confidence_weight > 0:
            total = total + cfg.confidence_weight * terms["confidence"]
        terms["total"] = total
        return terms

    def loss(self, batch, *, anchors: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss (`objective`'s total) of `num_anchors(S)` random blocks per window, or of the
        blocks at `anchors [B, N]` (positions 1 .. S-G)."""
        n_anchor = self._check_batch(batch)
        B = batch.tokens.shape[0]
        dev = batch.tokens.device
        if anchors is None:
            N = self.num_anchors(batch.tokens.shape[1])
            anchors = torch.rand(B, n_anchor).argsort(-1)[:, :N].to(dev) + 1
        h, base, prev, tgt, nxt = self._blocks(batch, anchors)
        return self.objective(h, base + self.markov(prev), prev, tgt, nxt)["total"]

    @torch.no_grad()
    def evaluate(self, batch, max_anchors: int = 32) -> dict:
        """The training loss over evenly spaced anchors, and per-position greedy acceptance: draft i (chosen
        greedily, Markov head fed the drafter's own previous draft) equals the target's argmax, given drafts < i
        did. `tau` = 1 + sum_i prod_{j<=i} per_position[j] (expected tokens per verify with greedy acceptance). The
        context stays the window's own tokens, so this is exact when the windows are the target's greedy text."""
        n_anchor = self._check_batch(batch)
        B = batch.tokens.shape[0]
        N = min(max_anchors, n_anchor)
        dev = batch.tokens.device
        anchors = (torch.linspace(1, n_anchor, N, device=dev).round().long()).expand(B, N)
        h, base, true_prev, tgt, nxt = self._blocks(batch, anchors)
        logits = base + self.markov(true_prev)
        terms = self.objective(h, logits, true_prev, tgt, nxt)
        best = tgt.argmax(-1)  # [B, N, G]
        prev = batch.tokens.gather(1, anchors)
        alive = torch.ones(B, N, dtype=torch.bool, device=dev)
        reached, hits = [], []
        for i in range(self.config.block_size):
            d = (base[:, :, i] + self.markov(prev)).argmax(-1)
            ok = d == best[:, :, i]
            reached.append(int(alive.sum()))
            alive = alive & ok
            hits.append(int(alive.sum()))
            prev = d
        per_position = [hh / r if r else 0.0 for hh, r in zip(hits, reached)]
        tau, run = 1.0, 1.0
        for a in per_position:
            run *= a
            tau += run
        return {"loss": float(terms["total"]), "per_position": per_position, "tau": tau,
                **{name: float(v) for name, v in terms.items() if name != "total"}}

