"""`drafter="native"`: the MTP layers a checkpoint ships (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: `mtp.*`; Bailing-Hybrid: the NextN
layer after the decoder), read from the model's safetensors files.

1. The first two drafts' distributions equal an independent float64 recomputation of the MTP forward from the
   saved tensors: the head (pre-fc norms, fc over [embedding, hidden], final norm, the target's lm_head) in plain
   torch ops; the Qwen decoder layer (gated attention with partial RoPE and q/k norms, MoE or dense MLP) in plain
   torch ops too; Bailing's MLA + MoE layer as transformers' own layer, loaded by transformers' own
   `from_pretrained` into a model one layer deeper (the checkpoint's NextN layer is then an ordinary layer).
2. Greedy output equals transformers' own greedy `generate`.
3. Training (`kind="native"`): the distillation loss (two chained steps) equals a float64 recomputation from the
   same reference forward, a few optimizer steps lower it, and the fine-tuned layers save and load.
   `write_mtp` writes a fine-tune back into the checkpoint's `mtp.*` tensors (command line: `specdec native-export`).
4. Errors: a checkpoint without MTP tensors names the file it searched; a model without a checkpoint path asks
   for `native_path`; a family without MTP layers is named; unknown options are named.
5. A trained model (tests/data/qwen35_native, bench/native_finetune.sh): lossless, and its fine-tuned MTP layer
   accepts drafts (tau > 1.5 at gamma 7).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import (assert_greedy, float64_everywhere, generate_f64, save_with_mtp, tiny_config, tiny_model,
                         torch_fallbacks)

import specdec
from specdec.draft.base import Contexts, Observation
from specdec.draft.registry import build_drafter_net, own_state_dict, save_drafter, target_batch
from specdec.runner import make_runner
from specdec.verify import SamplingParams

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "bailing_hybrid")
PROMPT = [3, 41, 17, 88, 9, 60, 23, 5, 40]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (model reloaded from its directory, directory), each saved at its first use (a family that the
    installed transformers lacks fails its own tests only)."""
    class Saved(dict):
        def __missing__(self, family):
            path = str(tmp_path_factory.mktemp(f"native_{family}"))
            self[family] = (save_with_mtp(path, family), path)
            return self[family]
    return Saved()


# ---- the independent recomputation ---------------------------------------------------------------------------


def rms(x, w, eps, centred):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if centred else w)


def swiglu(x, W, pre):
    return (torch.nn.functional.silu(x @ W[pre + "gate_proj.weight"].T) * (x @ W[pre + "up_proj.weight"].T)) \
        @ W[pre + "down_proj.weight"].T


def qwen_layer(W, x, cfg):
    """The Qwen3-Next / Qwen3.5 full-attention decoder layer over `x [T, d]` (positions 0..T-1, causal), from its
    checkpoint tensors `W` in plain float64 ops."""
    T = x.shape[0]
    H, Hk, Dh, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    a = rms(x, W["input_layernorm.weight"], eps, True)
    qg = (a @ W["self_attn.q_proj.weight"].T).view(T, H, 2 * Dh)  # per head [query | output gate]
    q, gate = qg[..., :Dh], qg[..., Dh:]
    q = rms(q, W["self_attn.q_norm.weight"], eps, True)
    k = rms((a @ W["self_attn.k_proj.weight"].T).view(T, Hk, Dh), W["self_attn.k_norm.weight"], eps, True)
    v = (a @ W["self_attn.v_proj.weight"].T).view(T, Hk, Dh)
    rope = cfg.rope_parameters
    rd = int(Dh * rope["partial_rotary_factor"])  # RoPE on the first rd channels of each head
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rotate(t):
        r, rest = t[..., :rd], t[..., rd:]
        half = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = torch.einsum("thd,shd->hts", q, k) * Dh ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, H * Dh) * torch.sigmoid(gate.reshape(T, H * Dh))
    x = x + o @ W["self_attn.o_proj.weight"].T
    m = rms(x, W["post_attention_layernorm.weight"], eps, True)
    if "mlp.gate.weight" not in W:
        return x + swiglu(m, W, "mlp.")
    probs = (m @ W["mlp.gate.weight"].T).softmax(-1)
    top, idx = probs.topk(cfg.num_experts_per_tok, -1)
    if getattr(cfg, "norm_topk_prob", None) is not False:  # Qwen3.5-MoE always renormalizes the top-k
        top = top / top.sum(-1, keepdim=True)
    routed = torch.stack([sum(top[t, j] * swiglu(m[t], W, f"mlp.experts.{int(idx[t, j])}.")
                              for j in range(idx.shape[1])) for t in range(T)])
    shared = swiglu(m, W, "mlp.shared_expert.") * torch.sigmoid(m @ W["mlp.shared_expert_gate.weight"].T)
    return x + routed + shared


def bailing_layer(path, x):
    """Bailing's NextN decoder layer (MLA + MoE) as transformers' own layer: a model one layer deeper, loaded by
    transformers from the checkpoint, holds the NextN tensors as its last layer."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config("bailing_hybrid", num_layers=5)
    cfg.layer_types = ["linear_attention"] * 3 + ["full_attention"] * 2
    cfg.mlp_layer_types = ["dense"] + ["sparse"] * 4
    cfg.num_mtp_layers = 0
    deep = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float64, attn_implementation="eager",
                                                experts_implementation="eager").double().eval()
    T = x.shape[0]
    pos = torch.arange(T)[None]
    mask = torch.zeros(T, T, dtype=torch.float64).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                              torch.finfo(torch.float64).min)
    out = deep.model.layers[4](x[None], position_embeddings=deep.model.rotary_emb(x[None], pos),
                               attention_mask=mask[None, None], position_ids=pos)
    return (out[0] if isinstance(out, tuple) else out)[0]


def reference_logits(family, model, path, tokens, hidden):
    """MTP logits `[T, V]` and outputs `[T, d]` of the pairs `(hidden[t], tokens[t])` at positions 0..T-1."""
    W = load_file(os.path.join(path, "model.safetensors"))
    cfg = model.config
    eps = cfg.rms_norm_eps
    emb = W["model.word_embeddings.weight" if family == "bailing_hybrid" else "model.embed_tokens.weight"][tokens]
    if family == "bailing_hybrid":
        pre = f"model.layers.{cfg.num_hidden_layers}."
        fc, ne, nh, nf, centred = "eh_proj", "enorm", "hnorm", "final_layernorm", False
    else:
        pre, fc, ne, nh, nf, centred = "mtp.", "fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", True
    x = torch.cat([rms(emb, W[pre + ne + ".weight"], eps, centred), rms(hidden, W[pre + nh + ".weight"], eps, centred)],
                  -1) @ W[pre + fc + ".weight"].T
    if family == "bailing_hybrid":
        x = bailing_layer(path, x)
    else:
        x = qwen_layer({k[len("mtp.layers.0."):]: v for k, v in W.items() if k.startswith("mtp.layers.0.")}, x, cfg)
    out = rms(x, W[pre + nf + ".weight"], eps, centred)
    return out @ W["lm_head.weight"].T, out


# ---- 1. first drafts == recomputation ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_first_drafts_match_recomputation(saved, family):
    model, path = saved[family]
    engine = specdec.wrap(model, drafter="native", num_draft_tokens=2, max_batch_size=1)
    drafter = engine.drafter
    assert type(drafter).__name__ == "NativeDrafter"
    prompt = torch.tensor(PROMPT)
    with torch_fallbacks(), float64_everywhere():
        hidden = model.model(prompt[None]).last_hidden_state[0]  # the target's final normed hidden states
        anchor = int(model(prompt[None]).logits[0, -1].argmax())
        slots = engine.runner.alloc(1)
        engine.lane_slots = slots
        try:
            out = engine.runner.prefill(slots[0], prompt)
            ctx = torch.tensor(PROMPT + [anchor])
            drafter.begin([0], [prompt])
            drafter.observe(Observation.of([0], [prompt], [out.hidden[0]]))
            block = drafter.propose([0], Contexts.of([ctx]), 2, sampling=SamplingParams(do_sample=True),
                                    generator=torch.Generator().manual_seed(0))
        finally:
            drafter.release([0])
            engine.runner.release(slots)
        # step 1: the prompt's pairs (hidden[t], token t+1), the anchor last; step 2: (step 1's out, its draft)
        logits, mtp_out = reference_logits(family, model, path, ctx[1:], hidden)
        d1 = int(block.tokens[0, 0])
        logits2, _ = reference_logits(family, model, path, torch.cat([ctx[1:], torch.tensor([d1])]),
                                      torch.cat([hidden, mtp_out[-1:]]))
    torch.testing.assert_close(block.probs[0, 0], logits[-1].softmax(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(block.probs[0, 1], logits2[-1].softmax(-1), rtol=0, atol=1e-12)
    assert drafter.kv.lengths[0] == 0 and not drafter.pending  # released


# ---- 2. lossless ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(saved, family):
    model, _ = saved[family]
    engine = specdec.wrap(model, drafter="native", num_draft_tokens=3, max_batch_size=2)
    prompts = [PROMPT, PROMPT[3:]]
    out = generate_f64(engine, prompts, max_new_tokens=6)
    assert_greedy(out, model, prompts, 6)
    assert out.stats.drafter_failures == 0 and out.stats.proposed > 0


def test_greedy_identity_with_accepted_drafts(tmp_path):
    """After a short fine-tune on the target's own samples (vocabulary 8) drafts are accepted, rows accept
    different numbers of them, and the drafter's cache catches up by different counts per row."""
    from specdec.draft.native_drafter import make_drafter
    from specdec.draft.train import train
    model = save_with_mtp(str(tmp_path), "qwen3_next", vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # far from uniform: something to learn
    torch.manual_seed(0)
    with torch.no_grad(), torch_fallbacks(), float64_everywhere():
        ids = model.generate(torch.randint(3, 8, (4, 3), generator=torch.Generator().manual_seed(0)), do_sample=True,
                             max_new_tokens=64, eos_token_id=None, pad_token_id=0).flatten()
    net, _ = train(model, ids, "native", runner_factory=make_runner, steps=12, lr=2e-2, seq_len=24, batch_size=4,
                   val_every=12, progress=False)
    engine = specdec.wrap(model, drafter=make_drafter(net, gamma=3, max_batch_size=2), num_draft_tokens=3,
                          max_batch_size=2)
    prompts = [[1, 3, 5, 7, 2, 4, 6], [5, 6, 7, 5, 6]]
    out = generate_f64(engine, prompts, max_new_tokens=16)
    assert_greedy(out, model, prompts, 16)
    print(f"native after 12 steps: {out.stats.as_dict()}")
    assert out.stats.drafter_failures == 0 and 0 < out.stats.accepted < out.stats.proposed, out.stats.as_dict()


# ---- 3. training ---------------------------------------------------------------------------------------------


def soft_ce(logits, target):
    return -(target.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def test_training_loss_matches_recomputation_and_decreases(saved, tmp_path):
    family = "qwen3_5"
    model, path = saved[family]
    net = build_drafter_net("native", model)
    assert net.config.kind == "native" and net.config.train_depth == 2 and net.config.native_path == path
    seq = torch.tensor([[7, 30, 2, 55, 61, 9, 14, 88, 23, 5]])
    T = seq.shape[1] - 1
    with torch_fallbacks(), float64_everywhere():
        runner = make_runner(model, max_batch_size=1, max_length=32, num_verify_tokens=1)
        batch = target_batch(runner, seq)
        loss = net.loss(batch)
        # step 1: pair t = (hidden[t], token t+1); step 2 at t: the chain rooted at t-1 sees the pairs <= t-1 and
        # its own draft pair (step 1's out at t-1, token t+1) at position t
        hidden, tokens = batch.hidden[0], seq[0]
        logits1, out1 = reference_logits(family, model, path, tokens[1:], hidden[:T])
        logits2 = torch.stack([reference_logits(family, model, path, tokens[1:t + 2],
                                                torch.cat([hidden[:t], out1[t - 1:t]]))[0][-1] for t in range(1, T)])
        target = batch.logits[0, 1:]
        ref = (soft_ce(logits1, target) + 0.8 * soft_ce(logits2, target[1:])) / 1.8
        torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
        params = [p for n, p in net.named_parameters() if not n.startswith("target_")]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        losses = []
        for _ in range(4):
            loss = net.loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        after = net.loss(batch).item()
        entropy = float((soft_ce(target, target) + 0.8 * soft_ce(target[1:], target[1:])) / 1.8)  # loss - KL
    kl = [x - entropy for x in losses + [after]]
    print(f"native KL to the target over the steps {[round(x, 4) for x in kl]}")
    assert all(b < a for a, b in zip(kl, kl[1:])) and kl[-1] < 0.8 * kl[0]
    assert all(p.grad is None for p in model.parameters()), "the target's weights were trained"
    save_drafter(net, str(tmp_path))
    engine = specdec.wrap(model, drafter=str(tmp_path), num_draft_tokens=2)
    loaded = own_state_dict(engine.drafter.net)
    assert type(engine.drafter).__name__ == "NativeDrafter"
    assert loaded.keys() == own_state_dict(net).keys()
    assert all(torch.equal(loaded[k], v) for k, v in own_state_dict(net).items())


def test_write_mtp_round_trip(tmp_path):
    """`write_mtp` puts a (changed) net's weights back under the checkpoint's names: the checkpoint's own native
    net then equals it; the other tensors are untouched."""
    from specdec.draft.native_export import write_mtp
    model = save_with_mtp(str(tmp_path), "qwen3_5")
    file = os.path.join(str(tmp_path), "model.safetensors")
    before = load_file(file)
    net = build_drafter_net("native", model)
    with torch.no_grad():
        for p in own_state_dict(net).values():
            p.add_(0.01)
    assert write_mtp(net, model, str(tmp_path)) == [file]
    after = load_file(file)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("mtp."))
    assert all(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("mtp."))
    again = own_state_dict(build_drafter_net("native", model))
    assert all(torch.equal(again[k], v) for k, v in own_state_dict(net).items())


def test_native_export_command(tmp_path, capsys):
    """`specdec native-export --target DIR --drafter TRAINED --out NEW`: NEW is DIR with the trained net's weights
    in its MTP tensors (read with float32 precision, as the command loads the target), DIR is left as it was; a
    drafter directory that does not load is an argument error."""
    from transformers import AutoModelForCausalLM

    from specdec.cli import main
    target, trained, copy = (str(tmp_path / d) for d in ("target", "trained", "copy"))
    model = save_with_mtp(target, "qwen3_5")
    before = load_file(os.path.join(target, "model.safetensors"))
    net = build_drafter_net("native", model)
    with torch.no_grad():
        for p in own_state_dict(net).values():
            p.add_(0.01)
    save_drafter(net, trained)
    assert main(["native-export", "--target", target, "--drafter", trained, "--out", copy]) == 0
    assert capsys.readouterr().out.strip() == f'{{"written": ["{os.path.join(copy, "model.safetensors")}"]}}'
    source = load_file(os.path.join(target, "model.safetensors"))
    after = load_file(os.path.join(copy, "model.safetensors"))
    assert all(torch.equal(source[k], v) for k, v in before.items())
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("mtp."))
    exported = own_state_dict(build_drafter_net("native", AutoModelForCausalLM.from_pretrained(copy,
                                                                                               dtype=torch.float64)))
    for k, v in own_state_dict(net).items():
        torch.testing.assert_close(exported[k], v, rtol=1e-6, atol=1e-7)
    assert main(["native-export", "--target", target, "--drafter", str(tmp_path / "nowhere")]) == 2
    assert "argument --drafter" in capsys.readouterr().err


# ---- 4. errors -----------------------------------------------------------------------------------------------


def test_errors(saved, tmp_path):
    bare = save_with_mtp(str(tmp_path), "qwen3_5", mtp=False)
    file = os.path.join(str(tmp_path), "model.safetensors")
    with pytest.raises(ValueError, match="no MTP weights") as err:
        specdec.wrap(bare, drafter="native")
    assert file in str(err.value)
    model, path = saved["qwen3_5"]
    engine = specdec.wrap(bare, drafter="native", native_path=path, num_draft_tokens=2)  # another checkpoint's
    assert engine.drafter.net.config.native_path == path
    with pytest.raises(ValueError, match="native_path"):
        specdec.wrap(tiny_model("qwen3_5"), drafter="native")  # built in memory: no checkpoint path
    with pytest.raises(ValueError, match="native_path"):
        specdec.wrap(model, drafter="native", native_path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="kimi_linear"):
        specdec.wrap(tiny_model("kimi_linear"), drafter="native")
    with pytest.raises(ValueError, match="bogus"):
        specdec.wrap(model, drafter="native", bogus=1)


# ---- 5. a trained model: tests/data/qwen35_native (bench/native_finetune.sh) -------------------------------------

SHIPPED = os.path.join(os.path.dirname(__file__), "data", "qwen35_native")
CODE_PROMPTS = ["import os\nimport sys\n\n\ndef main(argv=None):\n    ",
                "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        ",
                "    def __repr__(self):\n        return '<%s %r>' % (self.__class__.__name__, "]


def test_shipped_qwen35_native_is_lossless_and_accepts():
    """The shipped tiny Qwen3.5 (trained on the stdlib, its MTP layer fine-tuned with `--drafter native`): greedy
    output with `drafter="native"` equals transformers' own greedy `generate`, and tau (tokens per verify round,
    gamma 7) on these fixed prompts is above 1.5 (deterministic: greedy on the shipped weights, float64)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float64, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    assert model.config.model_type == "qwen3_5_text"
    prompts = [tok(p)["input_ids"] for p in CODE_PROMPTS]
    engine = specdec.wrap(model, drafter="native", num_draft_tokens=7, max_batch_size=len(prompts))
    assert type(engine.drafter).__name__ == "NativeDrafter"
    new = 32
    out = generate_f64(engine, prompts, max_new_tokens=new)
    assert_greedy(out, model, prompts, new)
    stats = out.stats.as_dict()
    print(f"shipped qwen35 native: {stats}")
    assert out.stats.drafter_failures == 0
    assert out.stats.tau > 1.5, stats
