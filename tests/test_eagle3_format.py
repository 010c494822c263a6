"""EAGLE-3 checkpoints in the SpecForge / SGLang format (`LlamaForCausalLMEagle3` config, `fc`, `midlayer.*`,
`norm`, `lm_head` over a reduced draft vocabulary, `d2t` / `t2d`) load as our eagle drafter.

1. Both spellings load it (`drafter="eagle", draft_model=DIR` and `drafter=DIR`).
2. The first tree level equals an independent float64 recomputation from the saved tensors (plain torch ops:
   the target's layer outputs from transformers' own forward, fc, the midlayer, norm, lm_head, and the draft
   vocabulary mapped by `draft id + d2t[draft id]`): the top-k target ids in order; every draft is a target id
   of the draft vocabulary.
3. Greedy output equals transformers' own greedy `generate`.
4. A d2t that maps two draft ids onto one target id, a t2d that disagrees, a missing tensor and a target of
   another size are refused naming the file.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import assert_greedy, float64_everywhere, generate_f64, tiny_model, torch_fallbacks

import specdec
from specdec.draft.base import Contexts, Observation

FAMILY = "qwen3_5"  # conftest's `target`
D, H, HKV, HD, INTER, V, DRAFT_V = 64, 4, 2, 16, 96, 96, 40
LAYERS = [0, 1, 2]  # the target layers whose outputs are fused (eagle_aux_hidden_state_layer_ids)
PROMPT = [3, 41, 17, 88, 9, 60, 23, 5, 40]


def write_eagle3(path, target, *, seed: int = 0, **edits):
    """A SpecForge-format EAGLE-3 checkpoint for `target` in `path`: config.json and model.safetensors with the
    published tensor names; the draft vocabulary is a random subset of DRAFT_V target ids (d2t, t2d)."""
    g = torch.Generator().manual_seed(seed)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
              "intermediate_size": INTER, "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": HD,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
              "hidden_act": "silu", "max_position_embeddings": 2048, "vocab_size": V, "draft_vocab_size": DRAFT_V,
              "tie_word_embeddings": False, "torch_dtype": "float64",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}
    keep = torch.randperm(V, generator=g)[:DRAFT_V].sort().values  # target ids of the draft vocabulary

    def w(*shape, scale=0.1):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    tensors = {"fc.weight": w(D, 3 * D), "midlayer.input_layernorm.weight": 1 + w(D),
               "midlayer.hidden_norm.weight": 1 + w(D), "midlayer.self_attn.q_proj.weight": w(H * HD, 2 * D),
               "midlayer.self_attn.k_proj.weight": w(HKV * HD, 2 * D),
               "midlayer.self_attn.v_proj.weight": w(HKV * HD, 2 * D), "midlayer.self_attn.o_proj.weight": w(D, H * HD),
               "midlayer.post_attention_layernorm.weight": 1 + w(D), "midlayer.mlp.gate_proj.weight": w(INTER, D),
               "midlayer.mlp.up_proj.weight": w(INTER, D), "midlayer.mlp.down_proj.weight": w(D, INTER),
               "norm.weight": 1 + w(D), "lm_head.weight": w(DRAFT_V, D, scale=1.0),
               "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
               "d2t": keep - torch.arange(DRAFT_V), "t2d": t2d}
    for k, v in edits.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def ckpt(target, tmp_path_factory):
    return write_eagle3(str(tmp_path_factory.mktemp("eagle3")), target)


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_root_logits(target, path, prompt, anchor):
    """Draft scores `[V]` (target ids; -inf outside the draft vocabulary) after `prompt` and its anchor, in plain
    float64 ops from the saved tensors: pairs (fused features at t, token t+1) at positions t, causal."""
    W = load_file(os.path.join(path, "model.safetensors"))
    ids = torch.tensor([prompt])
    with torch_fallbacks(), float64_everywhere():
        hs = target(ids, output_hidden_states=True).hidden_states  # hs[i + 1]: output of decoder layer i
    feats = torch.cat([hs[i + 1][0] for i in LAYERS], -1)
    T = feats.shape[0]
    h = feats @ W["fc.weight"].T
    emb = target.get_input_embeddings().weight[torch.tensor(prompt[1:] + [anchor])]
    x = torch.cat([rms(emb, W["midlayer.input_layernorm.weight"]), rms(h, W["midlayer.hidden_norm.weight"])], -1)
    q = (x @ W["midlayer.self_attn.q_proj.weight"].T).view(T, H, HD)
    k = (x @ W["midlayer.self_attn.k_proj.weight"].T).view(T, HKV, HD)
    v = (x @ W["midlayer.self_attn.v_proj.weight"].T).view(T, HKV, HD)
    # Llama's default rotary frequencies, computed in float32 (transformers and SGLang both do)
    inv = (1.0 / 10000.0 ** (torch.arange(0, HD, 2, dtype=torch.int64).to(torch.float32) / HD)).double()
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rotate(t):
        return t * cos + torch.cat([-t[..., HD // 2:], t[..., :HD // 2]], -1) * sin

    q, k = rotate(q), rotate(k).repeat_interleave(H // HKV, 1)
    s = torch.einsum("thd,shd->hts", q, k) * HD ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v.repeat_interleave(H // HKV, 1)).reshape(T, H * HD)
    h = h + o @ W["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, W["midlayer.post_attention_layernorm.weight"])
    out = h + (torch.nn.functional.silu(m @ W["midlayer.mlp.gate_proj.weight"].T) *
               (m @ W["midlayer.mlp.up_proj.weight"].T)) @ W["midlayer.mlp.down_proj.weight"].T
    draft = rms(out[-1], W["norm.weight"]) @ W["lm_head.weight"].T  # [DRAFT_V]
    full = torch.full((V,), float("-inf"), dtype=torch.float64)
    full[torch.arange(DRAFT_V) + W["d2t"]] = draft  # draft id + d2t[draft id] = target id
    return full, W["t2d"]


def test_loads_both_spellings_and_first_level_matches(target, ckpt):
    topk = 4
    for spelling in (dict(drafter="eagle", draft_model=ckpt), dict(drafter=ckpt)):
        # depth 2 with every candidate kept (4 + 16 nodes): the anchor's 4 children are the first 4 nodes
        engine = specdec.wrap(target, num_draft_tokens=2, max_batch_size=1, topk=topk, num_nodes=20, **spelling)
        drafter = engine.drafter
        assert type(drafter).__name__ == "EagleDrafter" and drafter.feature_layers == tuple(LAYERS)
    prompt = torch.tensor(PROMPT)
    with torch_fallbacks(), float64_everywhere():
        anchor = int(target(prompt[None]).logits[0, -1].argmax())
        slots = engine.runner.alloc(1)
        engine.lane_slots = slots
        try:
            out = engine.runner.prefill(slots[0], prompt, capture=tuple(LAYERS))
            drafter.begin([0], [prompt])
            drafter.observe(Observation.of([0], [prompt], [out.hidden[0]], {i: [out.captured[i][0]] for i in LAYERS}))
            block = drafter.propose([0], Contexts.of([torch.tensor(PROMPT + [anchor])]), 2)
        finally:
            drafter.release([0])
            engine.runner.release(slots)
        # the net's own scores of the same pairs, through the interface the eagle drafter calls
        net = drafter.net
        feats = torch.cat([out.captured[i] for i in LAYERS], -1)
        T = feats.shape[1]
        causal = torch.ones(1, T, T, dtype=torch.bool).tril()
        h, _ = net.run(net.inputs(torch.tensor([PROMPT[1:] + [anchor]]), net.fused(feats)), torch.arange(T)[None],
                       causal)
        mine = net.lm_logits(h)[0, -1]
    ref, t2d = reference_root_logits(target, ckpt, PROMPT, anchor)  # its float32 rotary frequencies stay float32
    assert torch.equal(torch.isfinite(mine), t2d)  # scores at the draft vocabulary's target ids only
    torch.testing.assert_close(mine[t2d], ref[t2d], rtol=0, atol=1e-12)
    first = block.tokens[0, :topk]
    assert block.parent[0, 1:topk + 1].tolist() == [0] * topk  # the anchor's children come first
    assert first.tolist() == ref.topk(topk).indices.tolist()
    assert bool(t2d[block.tokens[0]].all()), "a draft outside the draft vocabulary"


def llama_target():
    """A dense target (the generic runner: the tree's most likely path verified as a chain)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=INTER, num_hidden_layers=4,
                                        num_attention_heads=H, num_key_value_heads=HKV, pad_token_id=0,
                                        attn_implementation="eager")).double().eval()


@pytest.mark.parametrize("spelling", ["draft_model", "directory", "generic"])
def test_greedy_identity(target, ckpt, spelling, tmp_path):
    kw = dict(drafter="eagle", draft_model=ckpt) if spelling == "draft_model" else dict(drafter=ckpt)
    if spelling == "generic":
        target = llama_target()
        kw = dict(drafter=write_eagle3(str(tmp_path), target))
    engine = specdec.wrap(target, num_draft_tokens=3, max_batch_size=2, topk=3, num_nodes=8, **kw)
    prompts = [PROMPT, PROMPT[2:]]
    out = generate_f64(engine, prompts, max_new_tokens=6)
    assert_greedy(out, target, prompts, 6)
    assert out.stats.drafter_failures == 0 and out.stats.proposed > 0


def test_errors(target, tmp_path):
    file = str(tmp_path / "{}" / "model.safetensors")
    twice = torch.zeros(DRAFT_V, dtype=torch.long)  # every draft id onto target id = draft id ... then one repeat
    twice[1] = -1
    t2d_wrong = torch.zeros(V, dtype=torch.bool)
    t2d_wrong[:DRAFT_V] = True
    cases = {"d2t": dict(d2t=twice), "t2d": dict(t2d=t2d_wrong), "midlayer": {"midlayer.mlp.up_proj.weight": None}}
    for name, edits in cases.items():
        path = write_eagle3(str(tmp_path / name), target, **edits)
        with pytest.raises(ValueError, match=f"draft_model.*{name}") as err:
            specdec.wrap(target, drafter="eagle", draft_model=path)
        assert file.format(name) in str(err.value)
    path = write_eagle3(str(tmp_path / "other"), target)
    with pytest.raises(ValueError, match="draft_model.*vocab"):
        specdec.wrap(tiny_model(FAMILY, vocab_size=128), drafter=path)
    with pytest.raises(ValueError, match="draft_model.*not an EAGLE-3"):
        specdec.wrap(target, drafter="eagle", draft_model=str(tmp_path))
