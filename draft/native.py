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

Training (the distillation loop of `draft/train.py`, kind `native`): `Net.loss` distils the target over a window: every
pair `(hidden[t], tokens[t+1])` predicts the target's distribution `logits[t+1]`, and `train_depth - 1` further
chained steps (teacher-forced tokens, the drafter's own `out`, the masks of drafting) follow; this fine-tunes
the checkpoint's layers in place.

The drafter that runs a net in an engine (its positions and cache): `draft/native_drafter.py`; writing a fine-tune
back into the checkpoint: `draft/native_export.py`.
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

from specdec.hf_compat import cache_arg, rotary_tables

from .layers import SharesTarget, soft_ce, target_logits
from .registry import DraftConfig

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


def decoder_stack(target):
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
        base = decoder_stack(target)
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
        self._cache_arg = cache_arg(layer)  # the keyword the decoder layer takes its KV cache under
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
        rope = rotary_tables(self.target_rotary, x, positions)
        x = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions,
                       **{self._cache_arg: cache})
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


def build(target, *, native_path: str | os.PathLike | None = None) -> Net:
    """The native net of `target` (its checkpoint's MTP layers)."""
    config = Config.for_target(target, native_path=os.fspath(native_path) if native_path else None)
    return Net.from_target(target, config)
