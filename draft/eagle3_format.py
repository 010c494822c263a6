"""EAGLE-3 drafters published in the SpecForge / SGLang format, loaded as our eagle drafter (`draft/eagle.py`'s
`Net`, run by `draft/eagle_drafter.py`).

    specdec.wrap(model, drafter="eagle", draft_model=DIR)   # or drafter=DIR

A directory whose `config.json` names the `LlamaForCausalLMEagle3` architecture (a Llama config with
`num_hidden_layers: 1`, `draft_vocab_size`, optionally `eagle_config.eagle_aux_hidden_state_layer_ids`), and
safetensors with the published tensor names:

    fc.weight                        [d, 3 * d_target]   fuses the three target features
    midlayer.input_layernorm.weight  [d]                 RMSNorm of the token embedding
    midlayer.hidden_norm.weight      [d]                 RMSNorm of the fused feature (or own hidden)
    midlayer.self_attn.{q,k,v}_proj  [heads * head_dim, 2 * d]   over concat(embedding, hidden)
    midlayer.self_attn.o_proj        [d, heads * head_dim]
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj   the Llama MLP block
    norm.weight [d], lm_head.weight [draft_vocab, d]
    d2t [draft_vocab] int64: target id = draft id + d2t[draft id];  t2d [vocab] bool: in the draft vocabulary
    embed_tokens.weight (a copy of the target's embedding; the target's own is used, as SGLang does)

One step (SGLang `llama_eagle3.py`, `LlamaForCausalLMEagle3` / its `LlamaDecoderLayer.forward`; SpecForge
`specforge/modeling/draft/llama3_eagle.py`):

    h   = fc(concat(f_low, f_mid, f_high))   (a draft step past the committed ones: the parent's own `out`)
    a   = attn(concat(input_layernorm(emb(x)), hidden_norm(h)))      # rotary positions, GQA, own KV
    h   = h + a;  out = h + mlp(post_attention_layernorm(h))         # `out` feeds the next draft step
    logits = lm_head(norm(out))                                      # over the draft vocabulary

The draft scores are placed at their target ids (`draft id + d2t[draft id]`, SGLang's `hot_token_id`) in a
target-vocabulary row whose other entries are -inf, so the eagle drafter's tree (top-k, cumulative
log-probabilities, reranking) works on target ids unchanged, and never proposes a token outside the draft
vocabulary. Target features: SGLang captures the inputs of layers `[2, L // 2, L - 3]` by default, or of
`id + 1` for each configured `eagle_aux_hidden_state_layer_ids` (`set_eagle3_layers_to_capture`), i.e. the
outputs of layers `[1, L // 2 - 1, L - 4]` or of the configured ids: our runner's captured layer outputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import eagle, eagle_drafter
from .layers import attend
from .native import checkpoint_files

ARCHITECTURES = ("LlamaForCausalLMEagle3",)


def is_eagle3_dir(path) -> bool:
    """Whether `path` is a directory with a SpecForge / SGLang EAGLE-3 `config.json`."""
    cfg = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(cfg):
        return False
    try:
        with open(cfg) as f:
            raw = json.load(f)
    except (ValueError, OSError):
        return False
    return isinstance(raw, dict) and any(a in ARCHITECTURES for a in raw.get("architectures") or [])


@dataclass
class Config(eagle.Config):
    """`num_heads` counts the key/value heads (what the drafter's cache keeps); queries have
    `num_attention_heads`."""

    kind: str = "eagle3"
    num_attention_heads: int = 4
    draft_vocab_size: int = 0
    path: str = ""


class Attention(nn.Module):
    """Llama attention over `concat(embedding, hidden)` `[B, T, 2d]` with rotary positions and GQA."""

    def __init__(self, lc):
        super().__init__()
        self.num_heads, self.num_kv = lc.num_attention_heads, lc.num_key_value_heads
        self.head_dim = getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads
        d = lc.hidden_size
        self.q_proj = nn.Linear(2 * d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * d, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * d, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def kv(self, x, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[B, Hkv, T, D]` of x `[B, T, 2d]` with rope (cos, sin) `[B, T, D]` of its positions."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv, self.head_dim).transpose(1, 2)
        return _rotated(k, rope), v

    def forward(self, x, rope, visible, past):
        """x `[B, T, 2d]`, rope (cos, sin) of the positions, `visible` bool `[B or 1, T, S + T]` (None: all), past
        None, (k, v) `[B, Hkv, S, D]` or a `layers.KVRoom` (`layers.attend`) -> (out `[B, T, d]`, (k, v) of x
        `[B, Hkv, T, D]`)."""
        B, T, _ = x.shape
        q = _rotated(self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2), rope)
        k, v = self.kv(x, rope)
        out = attend(q, k, v, past, visible, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


def _rotated(x: torch.Tensor, rope) -> torch.Tensor:
    """x `[B, H, T, D]` rotated by rope (cos, sin) `[B, T, D]`: transformers' Llama `apply_rotary_pos_emb`, one
    tensor at a time (the same ops, so the same values)."""
    from transformers.models.llama.modeling_llama import rotate_half
    cos, sin = rope
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class MidLayer(nn.Module):
    """SGLang's / SpecForge's `midlayer` (tensor names as published)."""

    def __init__(self, lc):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        d, eps = lc.hidden_size, lc.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.self_attn = Attention(lc)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(lc)


class Net(eagle.Net):
    """The published EAGLE-3 head behind our eagle `Net`'s interface (`fused`, `inputs`, `run`, `lm_logits`).
    Shared target modules are attributes named `target_*`."""

    def __init__(self, config: Config, target, lc):
        nn.Module.__init__(self)
        self.config = config
        d, V = lc.hidden_size, config.target_vocab_size
        self.target_embed = target.get_input_embeddings()
        self.fc = nn.Linear(3 * config.target_hidden_size, d, bias=False)
        self.layers = nn.ModuleList([MidLayer(lc)])
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        self.norm = LlamaRMSNorm(d, eps=lc.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(lc)
        self.register_buffer("target_ids", torch.arange(config.draft_vocab_size), persistent=False)
        self.vocab_size = V

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., 3 * d_target]` -> `[..., d]` (`fc`)."""
        return self.fc(features)

    @property
    def feature_width(self) -> int:
        return self.fc.in_features

    def attentions(self) -> list[nn.Module]:
        return [b.self_attn for b in self.layers]

    def inputs(self, tokens: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """`concat(emb(tokens), feat)` `[B, T, 2d]`: the layer normalizes each half itself (and keeps `feat` as
        its residual)."""
        return torch.cat([self.embed(tokens).to(feat.dtype), feat], -1)

    @property
    def caches_from_inputs(self) -> bool:
        """True: its one layer's K/V at a position come from that position's input alone (`input_kv`)."""
        return True

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """The attention's input `[B, T, 2d]` of `x` from `inputs`: each half normalized."""
        layer = self.layers[0]
        e, h = x.chunk(2, -1)
        return torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], -1)

    def input_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K, V `[B, Hkv, T, D]` of `x [B, T, 2d]` (`inputs`) at `positions [B, T]`: `run`'s ops,
        without its attention or MLP."""
        h = x.chunk(2, -1)[1]
        return self.layers[0].self_attn.kv(self._attn_input(x), self.rotary(h, positions))

    def run(self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, past=None):
        """`x [B, T, 2d]` from `inputs`, positions `[B, T]`, bool `visible` (as `eagle.Net.run`), `past` per layer
        (k, v), a `layers.KVRoom` or None -> (out `[B, T, d]`, new (k, v) per layer)."""
        layer = self.layers[0]
        h = x.chunk(2, -1)[1]
        a, kv = layer.self_attn(self._attn_input(x), self.rotary(h, positions), visible,
                                None if past is None else past[0])
        h = h + a
        return h + layer.mlp(layer.post_attention_layernorm(h)), [kv]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft scores of `h [..., d]` at their target ids `[..., V]` (-inf outside the draft vocabulary)."""
        draft = self.lm_head(self.norm(h))
        full = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.target_ids] = draft
        return full

    def loss(self, batch):
        raise ValueError("drafter: EAGLE-3 checkpoints in the SpecForge format are loaded for inference only")

    evaluate = loss


def _feature_layers(lc, num_layers: int, where: str) -> list[int]:
    ids = (getattr(lc, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = list(ids) if ids else [1, num_layers // 2 - 1, num_layers - 4]  # SGLang's default capture
    bad = [i for i in layers if not 0 <= int(i) < num_layers]
    if len(layers) != 3 or bad:
        raise ValueError(f"draft_model: {where} captures target layers {layers}, which a target with {num_layers} "
                         f"layers does not have (EAGLE-3 fuses three)")
    return [int(i) for i in layers]


def load(path, target) -> Net:
    """The EAGLE-3 drafter in directory `path` for `target`; ValueError naming the file for anything that does
    not match."""
    from safetensors import safe_open
    from transformers import LlamaConfig
    path = os.fspath(path)
    if not is_eagle3_dir(path):
        raise ValueError(f"draft_model: {path!r} is not an EAGLE-3 checkpoint (a directory whose config.json names "
                         f"{ARCHITECTURES[0]})")
    cfg_file = os.path.join(path, "config.json")
    lc = LlamaConfig.from_pretrained(path)
    tc = target.config.get_text_config()
    if lc.vocab_size != tc.vocab_size or lc.hidden_size != tc.hidden_size:
        raise ValueError(f"draft_model: {cfg_file} is for a target with vocab {lc.vocab_size} and hidden size "
                         f"{lc.hidden_size}; this target has {tc.vocab_size} and {tc.hidden_size}")
    if getattr(lc, "num_hidden_layers", 1) != 1:
        raise ValueError(f"draft_model: {cfg_file} has {lc.num_hidden_layers} layers; the EAGLE-3 format has one "
                         f"(midlayer)")
    draft_vocab = int(getattr(lc, "draft_vocab_size", None) or lc.vocab_size)
    files = checkpoint_files(path)
    state = {}
    for f in files:
        with safe_open(f, "pt") as h:
            state.update({k: h.get_tensor(k) for k in h.keys()})
    where = ", ".join(files)
    config = Config.for_target(target, feature_layers=_feature_layers(lc, tc.num_hidden_layers, cfg_file),
                               num_heads=lc.num_key_value_heads, num_attention_heads=lc.num_attention_heads,
                               head_dim=getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads,
                               intermediate_size=lc.intermediate_size, rms_norm_eps=lc.rms_norm_eps,
                               draft_vocab_size=draft_vocab, path=path)
    net = Net(config, target, lc)
    ref = target.get_input_embeddings().weight
    for name, mod in net.named_children():  # the rotary frequencies stay float32, as in transformers' Llama
        if name != "target_embed":
            mod.to(device=ref.device, dtype=None if name == "rotary" else ref.dtype)
    # our eagle drafter reads `net.layers`; the checkpoint calls that one layer `midlayer`
    own = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
           for k, v in net.state_dict().items() if not k.startswith("target_")}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"draft_model: {where} lacks EAGLE-3 tensors {missing[:4]}")
    wrong = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in own.items() if state[k].shape != v.shape]
    if wrong:
        raise ValueError(f"draft_model: {where} has tensors of other shapes than its config says: {wrong[:3]}")
    unknown = sorted(set(state) - set(own) - {"d2t", "t2d", "embed_tokens.weight"})
    if unknown:
        raise ValueError(f"draft_model: {where} has tensors the EAGLE-3 format does not: {unknown[:4]}")
    net.target_ids = _target_ids(state, draft_vocab, tc.vocab_size, where)
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])
    net.target_ids = net.target_ids.to(ref.device)
    return net.eval()


def _target_ids(state: dict, draft_vocab: int, vocab: int, where: str) -> torch.Tensor:
    """`[draft_vocab]` target id of each draft id (`d + d2t[d]`), checked against `t2d` when present."""
    if "d2t" not in state:
        if draft_vocab != vocab:
            raise ValueError(f"draft_model: {where} has a draft vocabulary of {draft_vocab} but no d2t map")
        return torch.arange(vocab)
    d2t = state["d2t"].long()
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"draft_model: d2t in {where} has shape {list(d2t.shape)}, expected [{draft_vocab}]")
    ids = torch.arange(draft_vocab) + d2t
    if bool(((ids < 0) | (ids >= vocab)).any()) or ids.unique().numel() != draft_vocab:
        raise ValueError(f"draft_model: d2t in {where} maps draft ids outside [0, {vocab}) or twice onto one id")
    if "t2d" in state:
        t2d = state["t2d"].bool()
        if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not bool(t2d[ids].all()):
            raise ValueError(f"draft_model: t2d in {where} does not mark exactly the target ids of d2t")
    return ids


def make_drafter(path, target, *, gamma: int = 7, max_batch_size: int = 8,
                 **options) -> eagle_drafter.EagleDrafter:
    """Our eagle drafter (tree options `topk`, `depth`, `num_nodes`) on the EAGLE-3 checkpoint in `path`."""
    return eagle_drafter.make_drafter(load(path, target), gamma=gamma, max_batch_size=max_batch_size, **options)
