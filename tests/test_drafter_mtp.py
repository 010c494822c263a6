"""Frozen-KV MTP drafter (`drafter="mtp"`): a query-only head over the target's own KV cache.

1. The drafter's inference path (keys/values read from the target's cache, one query at seq_len - 1) equals
   its training path (keys/values recomputed from the captured layer input, causal) and never writes the cache.
2. Greedy identity: untrained and trained mtp drafters on float64 tiny Kimi-Linear (MLA) and Qwen3-Next
   (GQA + RoPE) targets give transformers' own greedy `generate`, for every state strategy / commit mode.
3. Sampling: the first tokens of speculative sampling with mtp drafts follow the target's exact joint
   distribution (chi-square), and the same test rejects a drafter that misreports its draft distribution.
4. Training: a short distillation run lowers the validation loss and raises tau; save / load round-trips.
5. Errors: another target, a directory that is not a drafter, gamma < 1, a target without a hybrid adapter.

The targets' logits are scaled up (`LOGIT_SCALE`) so that their distributions are far from uniform; training
data are the target's own samples (a random tiny model has no language to learn from a text file).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from assertions import chi2_critical, chi2_gof, count_samples
from tiny_models import (exact_joint, float64_everywhere, generate_f64, greedy_reference, tiny_config, tiny_model,
                         torch_fallbacks)

import specdec
from specdec.draft import mtp_drafter as mtp
from specdec.draft.base import Contexts, Observation
from specdec.draft.registry import build_drafter_net, load_drafter, own_state_dict, save_drafter, target_batch
from specdec.cli.draft_train import train
from specdec.runner import make_runner
from specdec.verify import SamplingParams

FAMILIES = ("kimi_linear", "qwen3_next")
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
LOGIT_SCALE = 4.0
GAMMA = 5
N = 17
PROMPTS = [[3, 41, 17, 88, 9, 60, 23], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]  # one batch, different lengths
TRAIN = dict(steps=60, lr=1e-2, seq_len=64, batch_size=8, val_every=60, seed=0)


def sharpened(family: str, seed: int = 0, **kw):
    model = tiny_model(family, seed=seed, **kw)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model


def self_samples(model, n_seq: int = 16, length: int = 128, seed: int = 0) -> torch.Tensor:
    """Training tokens: the target's own sampled continuations of short random prompts, concatenated."""
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (n_seq, 4), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    with torch.no_grad(), torch_fallbacks(), float64_everywhere():
        out = model.generate(prompts, do_sample=True, max_new_tokens=length, eos_token_id=None, pad_token_id=0)
    return out.flatten()


@pytest.fixture(scope="module")
def targets():
    return {f: sharpened(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def trained(targets, tmp_path_factory):
    """family -> (net, saved directory, training history)."""
    out = {}
    for family, target in targets.items():
        ids = self_samples(target)
        net, hist = train(target, ids, "mtp", progress=False, **TRAIN)
        path = str(tmp_path_factory.mktemp(f"mtp_{family}"))
        save_drafter(net, path)
        out[family] = (net, path, hist)
    return out


@pytest.fixture(scope="module")
def refs(targets):
    return lambda family, prompt, max_new_tokens=N: greedy_reference(targets[family], prompt, max_new_tokens)


# ---- 1. inference path == training path --------------------------------------------------------------------


MAMBA2 = ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1")


@pytest.mark.parametrize("family", FAMILIES + ("qwen3_5",) + MAMBA2)
def test_cache_reads_match_training_path(targets, family):
    """Two requests of different lengths in one batch: drafting from the target's cache (padded, masked) gives
    the logits the training path computes at the same positions, for two chained steps; the cache is untouched.
    (Kimi: MLA latents expanded by the target's kv_b_proj; Qwen3-Next / Qwen3.5: roped GQA keys, their own
    rotary embeddings; the Mamba2 hybrids (tests/test_mamba2_adapters.py's models, multipliers away from 1):
    plain keys, roped or not (Nemotron-H), Falcon-H1's key and attention-input multipliers.)"""
    if family in MAMBA2:
        import test_mamba2_adapters
        target = test_mamba2_adapters.tiny(family)
    else:
        target = targets[family] if family in targets else sharpened(family)
    torch.manual_seed(1)
    net = build_drafter_net("mtp", target)
    last = max(i for i, t in enumerate(target.config.layer_types) if t in ("full_attention", "attention", "hybrid"))
    assert net.config.attn_layer == last and net.config.feature_layers == [last - 1]
    assert not any(k.startswith("target_") for k in own_state_dict(net))
    seq = torch.tensor([[7, 30, 2, 55, 61, 9, 14, 88, 23, 5, 40, 71, 12, 3]])
    # float64 throughout: transformers' modules take some steps in float32 (Qwen3.5's eager attention its
    # softmax, whose rounding depends on the row length: a 5-token and a 14-token prefill differ in the 7th digit)
    with float64_everywhere():
        runner = make_runner(target, max_batch_size=2, max_length=32, num_verify_tokens=4)
        batch = target_batch(runner, seq, net.config.feature_layers)
        S = seq.shape[1]
        idx = torch.arange(S)
        ctx = net.context_from_batch(batch.tokens, batch.features)
        logits0, h1 = net.step(seq[:, (idx + 1).clamp(max=S - 1)], batch.hidden, ctx)
        logits1, _ = net.step(seq[:, (idx + 2).clamp(max=S - 1)], h1, ctx)

        lengths = [5, 9]  # committed tokens per request; the anchor is token `length`
        slots = runner.alloc(2)
        hs = [runner.prefill(s, seq[0, :n]).hidden[0, -1] for s, n in zip(slots, lengths)]
        before = [b.clone() for bufs in runner.kv.store.values() for b in bufs] + [runner.kv.lengths.clone()]
        slots_t = torch.tensor(slots)
        ctx_c = net.context_from_cache(runner.kv, slots_t, max(lengths))
        # the static span (the whole cache, as CUDA-graph rounds read it): keys past each row's length are masked
        ctx_s = net.context_from_cache(runner.kv, slots_t, runner.kv.max_length)
        with torch.no_grad():
            anchors = torch.tensor([[seq[0, n]] for n in lengths])
            c0, g1 = net.step(anchors, torch.stack(hs)[:, None], ctx_c)
            c1, _ = net.step(torch.tensor([[seq[0, n + 1]] for n in lengths]), g1, ctx_c)
            s0, _ = net.step(anchors, torch.stack(hs)[:, None], ctx_s)
            tokens, probs = net.draft(anchors[:, 0], torch.stack(hs), ctx_c, 3)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(c0[b, 0], logits0[0, n - 1], rtol=0, atol=1e-10)
        torch.testing.assert_close(c1[b, 0], logits1[0, n - 1], rtol=0, atol=1e-10)
        torch.testing.assert_close(s0[b, 0], logits0[0, n - 1], rtol=0, atol=1e-10)
        assert int(tokens[b, 0]) == int(c0[b, 0].argmax())
    assert probs is None and tokens.shape == (2, 3)
    after = [b for bufs in runner.kv.store.values() for b in bufs] + [runner.kv.lengths]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "the drafter wrote the target's cache"
    runner.release(slots)


# ---- 2. greedy identity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["untrained", "trained"])
@pytest.mark.parametrize("strategy, commit", MODES, ids=[f"{s}-{c}" for s, c in MODES])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(targets, trained, refs, family, strategy, commit, weights):
    target = targets[family]
    torch.manual_seed(0)
    drafter = "mtp" if weights == "untrained" else trained[family][1]
    engine = specdec.wrap(target, drafter=drafter, untrained=weights == "untrained", num_draft_tokens=GAMMA,
                          strategy=strategy, commit=commit, max_batch_size=2)
    assert type(engine.drafter).__name__ == "MTPDrafter"
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    for b, p in enumerate(PROMPTS):
        ref = refs(family, p)
        row = out.sequences[b].tolist()
        assert row[:len(ref)] == ref, f"row {b} differs from transformers' greedy generate"
        assert all(x == engine.pad_token_id for x in row[len(ref):])
    s = out.stats
    assert s.drafter_failures == 0 and s.proposed > 0
    if weights == "trained":
        assert 0 < s.accepted < s.proposed, s.as_dict()
    assert engine.runner.num_free == 2 and not engine.drafter.ready


# ---- 3. sampling follows the target -------------------------------------------------------------------------

SAMPLE_V = 8
SAMPLE_PROMPT = [1, 3, 5, 7, 2, 4, 6, 0, 5, 3]
NEW = 3  # the first token comes from prefill, the next two from a round with 2 mtp drafts
BATCH = 100


def sample_counts(engine, n: int, seed: int, **params):
    return count_samples(engine, n, seed, prompt=SAMPLE_PROMPT, vocab=SAMPLE_V, new=NEW, batch=BATCH, **params)


@pytest.fixture(scope="module")
def sampling_engine():
    target = sharpened("qwen3_next", vocab_size=SAMPLE_V, num_layers=2)
    torch.manual_seed(3)
    # a chain (topk 1): its drafts carry the distributions they were drawn from (trees: tests/test_draft_tree.py)
    return target, specdec.wrap(target, drafter="mtp", untrained=True, num_draft_tokens=2, max_batch_size=BATCH,
                                max_length=32, topk=1)


SAMPLE_PARAMS = dict(temperature=0.7)


def test_sampling_follows_target(sampling_engine):
    target, engine = sampling_engine
    joint = exact_joint(target, SAMPLE_PROMPT, SamplingParams(do_sample=True, **SAMPLE_PARAMS), NEW)
    n = 2000
    counts, totals = sample_counts(engine, n, seed=0, **SAMPLE_PARAMS)
    assert totals["drafter_failures"] == 0 and totals["proposed"] >= 2 * n, totals
    assert 0.2 * totals["proposed"] < totals["accepted"] < 0.8 * totals["proposed"], totals
    stat, df = chi2_gof(counts, joint)
    print(f"mtp sampling: chi2 {stat:.1f} df {df} critical {chi2_critical(df):.1f} "
          f"alpha {totals['accepted'] / totals['proposed']:.3f}")
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= critical {chi2_critical(df):.1f} (df {df})"


def test_sampling_detects_wrong_draft_distribution(sampling_engine, monkeypatch):
    """Teeth: drafts sampled from q_1, q_2 but returned with q_2, q_1 (a chaining bug) bias the output.
    (Returning no q at all would not: one-hot acceptance of a drawn token is lossless, only slower.)"""
    target, engine = sampling_engine
    joint = exact_joint(target, SAMPLE_PROMPT, SamplingParams(do_sample=True, **SAMPLE_PARAMS), NEW)
    inner = engine.drafter.propose

    def swapped_probs(*a, **kw):
        block = inner(*a, **kw)
        block.probs = block.probs.flip(1)
        return block

    monkeypatch.setattr(engine.drafter, "propose", swapped_probs)
    counts, _ = sample_counts(engine, 2000, seed=50, **SAMPLE_PARAMS)
    stat, df = chi2_gof(counts, joint)
    print(f"mtp swapped q: chi2 {stat:.1f} df {df} critical {chi2_critical(df):.1f}")
    assert stat > chi2_critical(df), f"wrong q not detected: chi2 {stat:.1f} <= {chi2_critical(df):.1f}"


# ---- 4. training, save / load -------------------------------------------------------------------------------


def test_training_lowers_loss_and_raises_tau(targets, trained):
    family = "qwen3_next"
    target = targets[family]
    _, path, hist = trained[family]
    first, last = hist["val"][0], hist["val"][-1]
    assert len(hist["train_loss"]) == TRAIN["steps"]
    taus = {}
    for name, drafter in (("untrained", "mtp"), ("trained", path)):
        torch.manual_seed(0)
        engine = specdec.wrap(target, drafter=drafter, untrained=name == "untrained", num_draft_tokens=4,
                              max_batch_size=2)
        out = generate_f64(engine, PROMPTS, max_new_tokens=40)
        assert out.stats.drafter_failures == 0
        taus[name] = out.stats.tau
    print(f"mtp {family}: val loss {first['loss']:.4f} -> {last['loss']:.4f}, per_position "
          f"{[round(x, 3) for x in first['per_position']]} -> {[round(x, 3) for x in last['per_position']]}, "
          f"tau {taus['untrained']:.3f} -> {taus['trained']:.3f}")
    assert last["loss"] < first["loss"] - 0.1
    assert last["per_position"][0] > first["per_position"][0] + 0.3
    assert taus["trained"] > taus["untrained"] + 0.4


def test_save_load_round_trip(targets, trained):
    family = "qwen3_next"
    target = targets[family]
    net, path, _ = trained[family]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["kind"] == "mtp"
    from safetensors.torch import load_file
    assert not any(k.startswith("target_") for k in load_file(os.path.join(path, "model.safetensors")))
    # chains (topk 1), whose sampled drafts carry their distributions
    engine = specdec.wrap(target, drafter=path, num_draft_tokens=4, max_batch_size=2, topk=1)
    loaded = engine.drafter
    assert loaded.net is not net and loaded.net.target_embed is target.model.embed_tokens
    mine = mtp.make_drafter(net, gamma=4, topk=1)
    mine.bind(engine.target)
    slots = engine.runner.alloc(2)
    engine.lane_slots = slots
    try:
        contexts = []
        for b, (s, p) in enumerate(zip(slots, PROMPTS)):
            out = engine.runner.prefill(s, torch.tensor(p))
            anchor = int(out.logits[0, -1].argmax())
            for d in (loaded, mine):
                d.begin([b], [torch.tensor(p)])
                d.observe(Observation.of([b], [torch.tensor(p)], [out.hidden[0]]))
            contexts.append(torch.tensor(p + [anchor]))
        contexts = Contexts.of(contexts)
        a = loaded.propose([0, 1], contexts, 4)
        b = mine.propose([0, 1], contexts, 4)
        assert a.probs is None and torch.equal(a.tokens, b.tokens) and torch.equal(a.num_drafts, b.num_drafts)
        sampling = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95)
        a = loaded.propose([0, 1], contexts, 4, sampling=sampling, generator=torch.Generator().manual_seed(5))
        b = mine.propose([0, 1], contexts, 4, sampling=sampling, generator=torch.Generator().manual_seed(5))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)
        assert a.probs.shape == (2, 4, target.config.vocab_size)
        assert torch.allclose(a.probs.sum(-1), torch.ones(2, 4, dtype=a.probs.dtype))
    finally:
        engine.runner.release(slots)


# ---- 5. errors ----------------------------------------------------------------------------------------------


def _model_from(cfg):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, experts_implementation="eager",
                                            attn_implementation="eager").eval()


def test_errors(targets, trained, tmp_path):
    target = targets["qwen3_next"]
    _, path, _ = trained["qwen3_next"]
    wider = tiny_config("qwen3_next")
    wider.hidden_size = 96
    other_targets = [_model_from(wider), tiny_model("qwen3_next", vocab_size=128)]
    for other in other_targets:
        with pytest.raises(ValueError, match="drafter") as err:
            specdec.wrap(other, drafter=path)
        assert "hidden size" in str(err.value)
    with pytest.raises(ValueError, match="drafter.*full-attention"):  # same sizes, other layer layout
        load_drafter(path, tiny_model("qwen3_next", num_layers=2))
    with pytest.raises(ValueError, match="drafter.*config.json"):
        specdec.wrap(target, drafter=str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="drafter.*not a drafter config"):
        specdec.wrap(target, drafter=str(tmp_path))
    for gamma in (0, -2):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            specdec.wrap(target, drafter="mtp", num_draft_tokens=gamma)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        mtp.make_drafter(trained["qwen3_next"][0], gamma=0)
    with pytest.raises(ValueError, match="drafter"):
        mtp.make_drafter(trained["qwen3_next"][0], gamma=2, bogus=1)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="drafter.*hybrid"):
        specdec.wrap(llama, drafter="mtp", untrained=True)


def test_loss_chains_as_many_steps_as_it_drafts(targets):
    """By default the loss chains gamma = 7 steps per position, step k weighted 0.8**k (recomputed here in float64
    from each chained step's logits against the target's distribution k+1 positions on); a config saved with
    train_depth=2 keeps its 2."""
    from specdec.draft.mtp import Config
    from specdec.draft.registry import target_batch
    from specdec.runner import make_runner
    target = targets["qwen3_next"]
    torch.manual_seed(0)
    net = build_drafter_net("mtp", target)
    assert net.config.train_depth == 7 and net.config.eval_depth == 7 and Config(train_depth=2).train_depth == 2
    S = 12
    ids = torch.randint(3, target.config.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    with torch_fallbacks(), float64_everywhere():
        runner = make_runner(target, max_batch_size=1, max_length=32, num_verify_tokens=1)
        batch = target_batch(runner, ids, net.config.feature_layers)
        with torch.no_grad():
            loss = float(net.loss(batch))
            chain = net._chain(batch, 7)
    assert len(chain) == 7
    num = den = 0.0
    for k, logits in enumerate(chain):
        n = S - 1 - k
        p = batch.logits[:, 1 + k:].double().softmax(-1)
        ce = -(p * logits[:, :n].double().log_softmax(-1)).sum(-1).mean()
        num, den = num + 0.8 ** k * float(ce), den + 0.8 ** k
    assert abs(loss - num / den) < 1e-9 * num / den
