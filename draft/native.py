"""`drafter="native"`: the multi-token-prediction (MTP) layers a published checkpoint ships, as a chain drafter.

Qwen3-Next, Qwen3.5 and Qwen3.5-MoE checkpoints store them under `mtp.*` (transformers ignores those keys on
load: `_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`); Bailing-Hybrid (Ling) stores its NextN layers after
the decoder, as `model.layers.{num_hidden_layers + i}.*` (also ignored on load). They are read here from the
model's safetensors files (`model.config._name_or_path`, or `native_path=`).

One step, for a pair of the target's final normed hidden state `h_t [B, T, d]` and the next token `x_{t+1}`:

    x = fc(concat(norm_e(emb(x_{t+1})), norm_h(h_t)))     # [2d] -> [d], no bias; embedding first
    x = decoder_layer(x)                                  # one full-attention layer, its own KV, position t
    out = norm(x)                                         # logits = lm_head(out); out is the next step's h

`emb` and `lm_head` are the target's own (shared). The decoder layer is the family's own transformers class
(`Qwen3NextDecoderLayer`, `Qwen3_5DecoderLayer`, `Qwen3_5MoeDecoderLayer`, `BailingHybridDecoderLayer`: MoE or
dense MLP as the checkpoint's tensors say), built from the target's config as a full-attention layer and loaded
through transformers' own checkpoint conversion (fused experts, Ling's `attention.dense` -> `self_attn.o_proj`).
The norms are the target's final-norm class (Qwen: zero-centred `x * (1 + w)`; Ling: `x * w`).

Tensor names. Qwen: `mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.layers.0.*`, `mtp.norm.weight`. Ling: `model.layers.{L}.eh_proj.weight`, `.enorm.weight` (embedding),
`.hnorm.weight` (hidden), `.final_layernorm.weight`, the decoder layer's own tensors, and a `shared_head`
(the target's lm_head, not read). References followed: vLLM `vllm/model_executor/models/qwen3_next_mtp.py`
(`Qwen3NextMultiTokenPredictor.forward`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `cat([embeds,
hidden])`, `fc`, the layer, `norm`; `load_weights` maps `mtp.` -> `model.`), `qwen3_5_mtp.py` (the same for
Qwen3.5 / Qwen3.5-MoE, `mtp_num_hidden_layers`), `bailing_moe_v3_mtp.py` (`enorm`, `hnorm`, `eh_proj`, the
MLA layer with MoE, `final_layernorm`; layers `num_hidden_layers ..`, `num_nextn_predict_layers`), SGLang
`python/sglang/srt/models/qwen3_next_mtp.py`, and transformers' `modeling_bailing_hybrid.py`
(`num_mtp_layers` = `num_nextn_predict_layers`, stored after the decoder and skipped on load).

Positions and cache (as vLLM's MTP proposer runs these models). The pair `(h_t, x_{t+1})` sits at position t.
Committed pairs (a target hidden state and the token after it, the anchor included) keep their K/V in the
drafter's own `KVCache` (per request row, rollback by length); the anchor's pair (the last committed hidden
state, the anchor) sits at p = committed tokens - 1 and gives draft 1. Draft step k >= 2 feeds step k-1's
`out` and draft k-1 at position p + k - 1; those K/V are dropped when the block is done, so nothing of a
round survives it. Every step runs the first MTP layer (the published checkpoints ship one).

Shipping a fine-tune: `write_mtp(net, DIR)` (command line: `python -m specdec native-export --target DIR
--drafter TRAINED [--out NEW]`) writes the net's weights back into a checkpoint under the same names, so the
checkpoint's own `drafter="native"` is the fine-tuned one.

Training (the distillation loop of `draft/train.py`, kind `native`): `Net.loss` distils the target over a window: every
pair `(hidden[t], tokens[t+1])` predicts the target's distribution `logits[t+1]`, and `train_depth - 1` further
chained steps (teacher-forced tokens, the drafter's own `out`, the masks of drafting) follow; this fine-tunes
the checkpoint's layers in place.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import BufferSpec, DraftBlock, Drafter
from .layers import SharesTarget, pick_draft, soft_ce, target_logits
from .registry import DraftConfig, check_target

QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
FAMILIES = QWEN + ("bailing_hybrid",)
# checkpoint names of the head around the decoder layer -> ours
QWEN_HEAD = {"fc.weight": "fc.weight", "pre_fc_norm_embedding.weight": "emb_norm.weight",
             "pre_fc_norm_hidden.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
LING_HEAD = {"eh_proj.weight": "fc.weight", "enorm.weight": "emb_norm.weight", "hnorm.weight": "hidden_norm.weight",
             "final_layernorm.weight": "norm.weight"}


@dataclass
class Config(DraftConfig):
    kind: str = "native"
    native_path: str = ""  # the checkpoint whose MTP layers the net was read from
    train_depth: int = 2  # chained steps per position in `loss` (1: the next-next token only)
    depth_decay: float = 0.8  # loss weight of step k: depth_decay ** (k - 1)
    eval_depth: int = 4  # drafts per chain measured by `evaluate`

    @classmethod
    def for_target(cls, target, **overrides) -> "Config":
        path = overrides.pop("native_path", None) or getattr(target.config, "_name_or_path", "") or ""
        return super().for_target(target, native_path=str(path), **overrides)


# ---- the checkpoint ------------------------------------------------------------------------------------
def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (its index's shards, else every `*.safetensors`)."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"native_path: {path!r} is not a checkpoint directory (the MTP layers are read from the "
                         f"model's safetensors files; pass native_path= when the model was not loaded from one)")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"native_path: no safetensors files in {path!r}")
    return [os.path.join(path, n) for n in names]


def mtp_prefix(target) -> str:
    """Where the family keeps its MTP layers in the checkpoint."""
    family = target.config.model_type
    if family not in FAMILIES:
        raise ValueError(f"drafter: native MTP layers are known for {', '.join(FAMILIES)}; model_type {family!r} "
                         f"ships none")
    if family == "bailing_hybrid":
        return f"model.layers.{target.config.get_text_config().num_hidden_layers}."
    return "mtp."


def read_mtp_tensors(files: list[str], prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` in `files`, keyed without it (only those tensors are read)."""
    from safetensors import safe_open
    out = {}
    for path in files:
        with safe_open(path, "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key)
    return out


def split_mtp_tensors(target, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """-> (head tensors in our names, the first MTP decoder layer's tensors in checkpoint names)."""
    if target.config.model_type == "bailing_hybrid":
        head = {LING_HEAD[k]: v for k, v in tensors.items() if k in LING_HEAD}
        layer = {k: v for k, v in tensors.items()
                 if k not in LING_HEAD and not k.startswith(("shared_head.", "embed_tokens."))}
        return head, layer
    head = {QWEN_HEAD[k]: v for k, v in tensors.items() if k in QWEN_HEAD}
    layer = {k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")}
    return head, layer


@contextlib.contextmanager
def _quiet_transformers():
    """transformers reports the carrier's (intentionally) missing embedding / lm_head: not the user's concern."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def decoder_layer(target, tensors: dict[str, torch.Tensor], *, where: str) -> nn.Module:
    """The family's own decoder layer as a full-attention layer (index 0), loaded from its checkpoint tensors
    `tensors` (names as stored) through transformers' own loading and key conversion: a one-layer model of the
    target's class is built from the tensors and its layer taken. MoE or dense MLP as the tensors say."""
    from transformers import AutoModelForCausalLM
    tc = target.config.get_text_config()
    sparse = any(".experts." in k or k.startswith("mlp.gate.") for k in tensors)
    cfg = copy.deepcopy(tc)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    cfg.vocab_size = 2  # the one-layer model's embedding and head are never used
    cfg.pad_token_id = None
    if hasattr(cfg, "mlp_only_layers"):  # Qwen3-Next: MoE unless the layer is listed here
        cfg.mlp_only_layers = [] if sparse else [0]
        cfg.decoder_sparse_step = 1
    if hasattr(cfg, "mlp_layer_types"):  # Bailing-Hybrid
        cfg.mlp_layer_types = ["sparse" if sparse else "dense"]
    if getattr(cfg, "num_mtp_layers", None) is not None:
        cfg.num_mtp_layers = 0
    cls = AutoModelForCausalLM._model_mapping[type(cfg)]
    w = target.get_input_embeddings().weight
    options = {}
    for name in ("attn", "experts"):
        impl = getattr(tc, f"_{name}_implementation", None)
        if impl is not None:
            options[f"{name}_implementation"] = impl
    with _quiet_transformers():
        carrier, info = cls.from_pretrained(None, config=cfg, state_dict={f"model.layers.0.{k}": v
                                                                           for k, v in tensors.items()},
                                            dtype=w.dtype, output_loading_info=True, **options)
    missing = sorted(k for k in info["missing_keys"] if k.startswith("model.layers.0."))
    unexpected = sorted(info["unexpected_keys"])
    if missing or unexpected:
        raise ValueError(f"drafter: the MTP decoder layer in {where} does not match a {type(carrier).__name__} "
                         f"layer (missing {missing[:4]}, unexpected {unexpected[:4]})")
    return carrier.model.layers[0].to(w.device)


def _base(target):
    """The decoder stack holding `embed_tokens`, `rotary_emb` and `norm` (a VL model's `language_model`)."""
    base = target.model
    return getattr(base, "language_model", base)


# ---- the net -------------------------------------------------------------------------------------------
class Net(SharesTarget):
    """The checkpoint's MTP head. Shared target modules are attributes named `target_*` (not saved, not trained)."""

    def __init__(self, config: Config, target, head: dict[str, torch.Tensor], layer: nn.Module):
        super().__init__()
        for name in ("train_depth", "eval_depth"):
            if getattr(config, name) < 1:
                raise ValueError(f"drafter: native {name} must be >= 1, got {getattr(config, name)}")
        self.config = config
        base = _base(target)
        d = target.config.get_text_config().hidden_size
        eps = target.config.get_text_config().rms_norm_eps
        norm_cls = type(base.norm)  # the family's RMSNorm (Qwen: zero-centred weight)
        self.target_embed = base.embed_tokens
        self.target_lm_head = target.lm_head
        self.target_rotary = base.rotary_emb
        self.emb_norm = norm_cls(d, eps=eps)
        self.hidden_norm = norm_cls(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = layer
        self.norm = norm_cls(d, eps=eps)
        w = target.get_input_embeddings().weight
        for mod in (self.emb_norm, self.hidden_norm, self.fc, self.norm):
            mod.to(device=w.device, dtype=w.dtype)
        expected = {n: tuple(p.shape) for n, p in self.named_parameters() if n.split(".")[0] in
                    ("emb_norm", "hidden_norm", "fc", "norm")}
        got = {n: tuple(t.shape) for n, t in head.items()}
        if got != expected:
            raise ValueError(f"drafter: the MTP head in {config.native_path} does not match this target "
                             f"(tensors {sorted(got.items())[:4]}, expected {sorted(expected.items())[:4]})")
        with torch.no_grad():
            for n, t in head.items():
                self.get_parameter(n).copy_(t)

    @classmethod
    def from_target(cls, target, config: Config) -> "Net":
        """Read the MTP layers of `target`'s checkpoint (`config.native_path`); ValueError naming the files
        searched when they hold none."""
        prefix = mtp_prefix(target)
        files = checkpoint_files(config.native_path) if config.native_path else []
        if not files:
            raise ValueError("native_path: the model has no checkpoint path (config._name_or_path is empty); "
                             "pass native_path= the directory of its safetensors files")
        tensors = read_mtp_tensors(files, prefix)
        if not tensors:
            raise ValueError(f"drafter: native found no MTP weights ('{prefix}*') in "
                             f"{', '.join(files)}: this checkpoint ships no MTP layers")
        head, layer_tensors = split_mtp_tensors(target, tensors)
        names = LING_HEAD if target.config.model_type == "bailing_hybrid" else QWEN_HEAD
        missing = sorted(k for k, v in names.items() if v not in head)
        if missing or not layer_tensors:
            raise ValueError(f"drafter: the MTP weights in {', '.join(files)} are incomplete (missing "
                             f"{[prefix + k for k in missing] or [prefix + 'layers.0.*']})")
        layer = decoder_layer(target, layer_tensors, where=", ".join(files))
        return cls(config, target, head, layer)

    # The shared target modules belong to the target: `.to()` / `.double()` / `.train()` leave them as they are.
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.target_embed
        return F.embedding(tokens, emb.weight.detach(), emb.padding_idx).to(self.dtype)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return target_logits(self.target_lm_head, x)

    def step(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, *,
             cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens `[B, T]`, h `[B, T, d]` at `positions [B, T]`; `mask` additive `[B, 1, T, S]` over the
        cache's keys (S = T without a cache) -> (logits `[B, T, V]`, out `[B, T, d]`: the next step's h)."""
        x = self.fc(torch.cat([self.emb_norm(self.embed(tokens)), self.hidden_norm(h.to(self.dtype))], -1))
        rope = self.target_rotary(x, positions)
        x = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions, cache=cache)
        x = x[0] if isinstance(x, tuple) else x
        out = self.norm(x)
        return self.lm_head(out), out

    # ---- training ----------------------------------------------------------------------------------
    def _unroll(self, batch, depth: int):
        """Teacher-forced chains over a window of pairs `(h, tokens[t+1])` at positions t = 0..S-2. Step 1 feeds
        the target's `hidden[t]`; step k feeds step k-1's `out` at t-1 and is the k-th draft of the chain rooted
        at r = t-k+1: it sees the committed pairs <= r and the chain's own draft pairs (step i at r+i-1), as in
        drafting. -> per step (logits `[B, S-1, V]`, valid positions `[S-1]` bool: t >= k-1)."""
        tokens = batch.tokens.to(self.fc.weight.device)
        B, S = tokens.shape
        if S < 3:
            raise ValueError(f"batch: windows of {S} tokens are too short for the native drafter (need >= 3)")
        T = S - 1
        t = torch.arange(T, device=tokens.device)
        pos = t[None].expand(B, T)
        h = batch.hidden[:, :T].to(device=tokens.device, dtype=self.dtype)
        cache, outs = _StepKeys(), []
        for k in range(1, depth + 1):
            blocks = [t[None, :] <= (t[:, None] - (k - 1))]
            blocks += [t[None, :] == (t[:, None] - (k - i)) for i in range(2, k + 1)]
            ok = torch.cat(blocks, 1)  # [T, k * T]: keys of step 1 | step 2 | ... | step k
            mask = torch.zeros(ok.shape, dtype=self.dtype, device=ok.device).masked_fill(
                ~ok, torch.finfo(self.dtype).min)
            logits, out = self.step(tokens[:, 1:], h, pos, mask[None, None].expand(B, 1, T, k * T), cache=cache)
            outs.append((logits, t >= k - 1))
            h = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)  # step k's out at t-1 feeds step k+1 at t
        return outs

    def loss(self, batch) -> torch.Tensor:
        """Soft cross-entropy of each step's drafts against the target's distributions `logits[t+1]`, step k
        weighted `depth_decay ** (k-1)`."""
        target = batch.logits[:, 1:].to(self.fc.weight.device)
        terms = [(self.config.depth_decay ** k, soft_ce(logits[:, valid], target[:, valid]))
                 for k, (logits, valid) in enumerate(self._unroll(batch, self.config.train_depth))]
        return sum(w * x for w, x in terms) / sum(w for w, _ in terms)

    @torch.no_grad()
    def evaluate(self, batch) -> dict:
        """`loss` as in training; greedy `per_position[i]`: how often draft i of a chain is the target's argmax
        given drafts < i were (teacher forced, chains rooted at every position)."""
        outs = self._unroll(batch, max(self.config.eval_depth, self.config.train_depth))
        target = batch.logits[:, 1:].to(self.fc.weight.device)
        terms = [(self.config.depth_decay ** k, float(soft_ce(logits[:, valid], target[:, valid])))
                 for k, (logits, valid) in enumerate(outs[:self.config.train_depth])]
        best = target.argmax(-1)  # [B, T]
        T, K = best.shape[1], len(outs)
        starts = T - (K - 1)  # chains rooted at r = 0 .. starts-1 have all K steps in the window
        alive = torch.ones(best.shape[0], max(starts, 0), dtype=torch.bool, device=best.device)
        per_position = []
        for k, (logits, _) in enumerate(outs):
            if starts <= 0:
                break
            hit = (logits.argmax(-1) == best)[:, k:k + starts]  # step k+1 of the chain rooted at r sits at r+k
            reached = int(alive.sum())
            alive = alive & hit
            per_position.append(int(alive.sum()) / reached if reached else 0.0)
        return {"loss": sum(w * x for w, x in terms) / sum(w for w, _ in terms), "per_position": per_position}


class _StepKeys:
    """The transformers `Cache` surface for a training unroll: each step's `update` appends its keys and values
    (every position of the window) after the earlier steps' and returns them all."""

    def __init__(self):
        self.kv = None

    def update(self, key, value, *args, **kwargs):
        self.kv = (key, value) if self.kv is None else (torch.cat([self.kv[0], key], 2),
                                                        torch.cat([self.kv[1], value], 2))
        return self.kv

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


# ---- drafter -----------------------------------------------------------------------------------------
class NativeDrafter(Drafter):
    """Chain drafts from a `Net` with its own KV cache over committed pairs (see the module docstring)."""

    name = "native"

    def __init__(self, net: Net, *, gamma: int = 7, max_batch_size: int = 8):
        for arg, val in (("num_draft_tokens", gamma), ("max_batch_size", max_batch_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg}: expected an int >= 1, got {val!r}")
        if not isinstance(net, Net):
            raise ValueError(f"drafter: expected a native Net, got {type(net).__name__}")
        self.net, self.gamma, self.max_batch_size = net.eval(), gamma, max_batch_size
        self.kv = None
        self.length: dict[int, int] = {}  # committed pairs in the cache, per row
        self.pending: dict[int, list[torch.Tensor]] = {}  # target hidden states `[n, d]` not yet run

    def bind(self, target) -> None:
        from specdec.kv_cache import KVCache  # the runner's rollback cache, used here for the drafter's own K/V
        model = target.model
        check_target(self.net.config, model)
        if self.net.target_embed is not _base(model).embed_tokens:
            raise ValueError("drafter: this native net was read for another target model")
        super().bind(target)
        self.kv = KVCache(self.max_batch_size, self._room(target.max_length, target.gamma),
                          device=self.net.fc.weight.device)

    def _room(self, max_length: int, gamma: int) -> int:
        """Cache positions per row beside a target of `max_length` tokens drafting `gamma` per round."""
        return max_length + 2 * max(self.gamma, gamma) + 2

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """The KV cache of its one decoder layer (`specdec.kv_cache.KVCache`, a row per request row)."""
        from specdec.adapters import kv_dims
        from specdec.kv_cache import kv_specs
        return {f"native.{name}": spec for name, spec in kv_specs(
            self.max_batch_size, self._room(max_length, gamma), {0: kv_dims(self.net.layer)},
            self.net.fc.weight.dtype).items()}

    def begin(self, rows, prompts) -> None:
        for r in rows:
            if not 0 <= r < self.max_batch_size:
                raise ValueError(f"rows: row {r} outside max_batch_size {self.max_batch_size}")
            self.kv.reset(r)
            self.length[r], self.pending[r] = 0, []

    def release(self, rows) -> None:
        for r in rows:
            self.length.pop(r, None)
            self.pending.pop(r, None)
            if self.kv is not None:
                self.kv.reset(r)

    def abort(self, rows) -> None:
        if self.kv is not None:
            self.kv.abort()

    def observe(self, rows, tokens, hidden, features) -> None:
        for r, hs in zip(rows, hidden):
            if hs.shape[0]:
                self.pending.setdefault(r, []).append(hs.detach())

    def _catch_up(self, rows, contexts, rows_t) -> torch.Tensor:
        """Run the queued committed pairs of every row (the anchor's pair last) into the cache.
        -> (logits `[B, V]`, out `[B, d]`) of each row's anchor pair."""
        net, kv = self.net, self.kv
        hs, toks, counts = [], [], []
        for r, ctx in zip(rows, contexts):
            queued = self.pending.get(r)
            if not queued:
                raise RuntimeError(f"native: no target hidden states observed for row {r}")
            h = torch.cat(queued) if len(queued) > 1 else queued[0]
            tk = ctx[self.length[r] + 1:]
            if tk.shape[0] != h.shape[0]:
                raise RuntimeError(f"native: row {r} is out of step ({self.length[r]} cached + {h.shape[0]} queued "
                                   f"pairs for a context of {ctx.shape[0]} tokens)")
            hs.append(h)
            toks.append(tk)
            counts.append(h.shape[0])
        B, M = len(rows), max(counts)
        dev = rows_t.device
        hpad = hs[0].new_zeros(B, M, hs[0].shape[-1])
        tpad = torch.zeros(B, M, dtype=torch.long, device=dev)
        for b in range(B):
            hpad[b, :counts[b]] = hs[b]
            tpad[b, :counts[b]] = toks[b].to(dev)
        kv.begin(rows_t, M, host_slots=rows)  # a chain: pair i sees the committed pairs and pairs <= i
        try:
            logits, out = net.step(tpad, hpad, kv.positions(), kv.attention_mask(net.dtype), cache=kv)
        except BaseException:
            kv.abort()
            raise
        n = torch.tensor(counts, dtype=torch.long, device=dev)
        kv.commit(torch.arange(M, device=dev).expand(B, M), n, host_counts=counts)  # padding stays past the length
        for r, c in zip(rows, counts):
            self.length[r] += c
            self.pending[r] = []
        last = torch.arange(B, device=dev), n - 1
        return logits[last], out[last]

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        dev = self.net.fc.weight.device
        gamma = min(int(gamma), self.gamma)
        if not rows or gamma < 1:
            return DraftBlock.empty(len(rows), dev)
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        logits, h = self._catch_up(rows, contexts, rows_t)
        sample = sampling is not None and sampling.do_sample
        toks, qs, steps = [], [], 0
        try:
            for k in range(gamma):
                if k:  # the draft pair (previous out, previous draft) at the next position; dropped below
                    self.kv.begin(rows_t, 1, host_slots=rows)
                    lg, out = self.net.step(toks[-1][:, None], h[:, None], self.kv.positions(),
                                            self.kv.attention_mask(self.net.dtype), cache=self.kv)
                    self.kv.commit(torch.zeros(len(rows), 1, dtype=torch.long, device=dev),
                                   torch.ones(len(rows), dtype=torch.long, device=dev), host_counts=[1] * len(rows))
                    steps += 1
                    logits, h = lg[:, 0], out[:, 0]
                nxt, q = pick_draft(logits, sampling, generator)
                if sample:
                    qs.append(q)
                toks.append(nxt)
        finally:
            self.kv.abort()
            if steps:  # forget the draft pairs: the cache holds committed pairs only
                self.kv.lengths[rows_t] -= steps
                self.kv.advance_bound(rows, [-steps] * len(rows))
        return DraftBlock(torch.stack(toks, 1), torch.full((len(rows),), gamma, dtype=torch.long, device=dev),
                          torch.stack(qs, 1) if sample else None)


# ---- writing a fine-tune back ---------------------------------------------------------------------------
def checkpoint_tensors(net: Net, target) -> dict[str, torch.Tensor]:
    """The net's own weights under the checkpoint's names (the inverse of `split_mtp_tensors`), checked by reading
    the layer back through `decoder_layer` (a layer whose stored form differs from its modules', such as fused
    experts, is refused)."""
    prefix = mtp_prefix(target)
    names = LING_HEAD if target.config.model_type == "bailing_hybrid" else QWEN_HEAD
    ours = {v: k for k, v in names.items()}
    layer_prefix = "" if target.config.model_type == "bailing_hybrid" else "layers.0."
    layer = {k: v.detach().cpu() for k, v in net.layer.state_dict().items()}
    back = decoder_layer(target, layer, where="the fine-tuned net").state_dict()
    if back.keys() != layer.keys() or any(not torch.equal(back[k].cpu(), v.to(back[k].dtype))
                                          for k, v in layer.items()):
        raise ValueError("write_mtp: this MTP layer's stored form differs from its modules (fused experts?); "
                         "only layers whose tensors round-trip can be written back")
    out = {prefix + ours[n]: p.detach().cpu() for n, p in net.named_parameters() if n in ours}
    out.update({prefix + layer_prefix + k: v for k, v in layer.items()})
    return out


def write_mtp(net: Net, target, path: str) -> list[str]:
    """Replace the MTP tensors in the checkpoint directory `path` (the file(s) holding them, in their stored dtype)
    with `net`'s weights. -> the files written."""
    from safetensors.torch import load_file, save_file
    files = checkpoint_files(path)
    new = checkpoint_tensors(net, target)
    prefix = mtp_prefix(target)
    holding = [f for f in files if any(k.startswith(prefix) for k in _keys(f))]
    if not holding:
        raise ValueError(f"write_mtp: no MTP tensors ('{prefix}*') in {', '.join(files)} to replace")
    written = []
    for f in holding:
        state = load_file(f)
        stored = {k: v for k, v in state.items() if k.startswith(prefix)}
        missing = sorted(set(stored) - set(new))
        if missing:
            raise ValueError(f"write_mtp: {f} holds MTP tensors the net has none for: {missing[:4]}")
        for k, v in stored.items():
            if v.shape != new[k].shape:
                raise ValueError(f"write_mtp: {k} is {list(v.shape)} in {f}, {list(new[k].shape)} in the net")
            state[k] = new[k].to(v.dtype).contiguous()
        save_file(state, f + ".tmp", metadata={"format": "pt"})
        os.replace(f + ".tmp", f)
        written.append(f)
    stored = set().union(*(set(k for k in _keys(f) if k.startswith(prefix)) for f in holding))
    if stored != set(new):
        raise ValueError(f"write_mtp: the net has tensors the checkpoint does not: {sorted(set(new) - stored)[:4]}")
    return written


def _keys(file: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(file, "pt") as f:
        return list(f.keys())


def build(target, *, native_path: str | os.PathLike | None = None) -> Net:
    """The native net of `target` (its checkpoint's MTP layers)."""
    config = Config.for_target(target, native_path=os.fspath(native_path) if native_path else None)
    return Net.from_target(target, config)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, **kwargs) -> NativeDrafter:
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: unknown option for the native drafter (expected native_path)")
    return NativeDrafter(net, gamma=gamma, max_batch_size=max_batch_size)
