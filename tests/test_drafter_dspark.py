"""The DSpark block drafter (`drafter="dspark"`): lossless in every strategy, trainable, saved and loaded.

1. Greedy identity: untrained and trained dspark drafters on float64 tiny kimi_linear and qwen3_next targets
   produce exactly transformers' `model.generate(do_sample=False)` (replay-eager, replay-lazy, snapshot), also
   when the confidence head truncates blocks (num_drafts varies between rounds).
2. Sampling: speculative sampling with dspark drafts (sampled from the drafter's own q, the Markov head making
   q of draft 1 depend on draft 0) follows the target's exact joint distribution of the first tokens
   (chi-square test), and the same test rejects drafts whose q is misreported.
3. Training: a few dozen distillation steps lower the validation loss and raise tau over the untrained net;
   a save / load round trip through `specdec.wrap(model, drafter=DIR)` gives identical drafts.
4. Errors: bad gamma / options, a drafter trained for another target, corrupt or mismatched files ->
   ValueError naming the argument.

The targets' lm_heads are scaled up (argmax, hence greedy decoding, is unchanged): a random tiny model's
near-uniform distributions carry almost no signal to distil from.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from assertions import chi2_critical, chi2_gof, count_samples
from tiny_models import exact_joint, float64_everywhere, generate_f64, greedy_reference, tiny_model, torch_fallbacks

import specdec
from specdec.draft import dspark, dspark_drafter
from specdec.draft.base import Contexts, Observation
from specdec.draft.registry import build_drafter_net, load_drafter, save_drafter
from specdec.cli.draft_train import train
from specdec.verify import SamplingParams

FAMILIES = ("kimi_linear", "qwen3_next")
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
GAMMA = 7
N = 24
LOGIT_SCALE = 30.0
PROMPTS = [[3, 41, 17, 88, 9, 60, 23], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 70]]
TRAIN = dict(steps=80, lr=4e-2, seq_len=48, batch_size=4, val_every=80, seed=0, progress=False)


def _target(family: str, seed: int = 0):
    model = tiny_model(family, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model


def _corpus(target, n_seq: int = 32, length: int = 64, seed: int = 5) -> torch.Tensor:
    """The target's own greedy continuations of random prompts, as one token stream."""
    prompts = torch.randint(3, target.config.vocab_size, (n_seq, 6), generator=torch.Generator().manual_seed(seed))
    out = specdec.wrap(target, drafter="ngram", max_batch_size=n_seq).generate(
        prompts, max_new_tokens=length - 6, eos_token_id=None)
    return out.sequences.reshape(-1)


class _Setup:
    """Module-wide targets and trained drafters (saved), built on first use."""

    def __init__(self, root):
        self.root = root
        self.targets, self.trained = {}, {}

    def target(self, family):
        if family not in self.targets:
            self.targets[family] = _target(family)
        return self.targets[family]

    def train(self, family):
        """-> (saved directory, trained net, history)."""
        if family not in self.trained:
            target = self.target(family)
            net, hist = train(target, _corpus(target), "dspark", **TRAIN)
            path = os.path.join(self.root, family)
            save_drafter(net, path)
            self.trained[family] = (path, net, hist)
        return self.trained[family]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _Setup(str(tmp_path_factory.mktemp("dspark")))


def _engine(setup, family, which, **kw):
    torch.manual_seed(0)  # untrained weights are reproducible
    drafter = "dspark" if which == "untrained" else setup.train(family)[0]
    return specdec.wrap(setup.target(family), drafter=drafter, untrained=which == "untrained", num_draft_tokens=GAMMA,
                        max_batch_size=2, **kw)


def _record_num_drafts(engine) -> list[int]:
    seen, propose = [], engine.drafter.propose

    def recording(*a, **k):
        block = propose(*a, **k)
        seen.extend(block.num_drafts.tolist())
        return block
    engine.drafter.propose = recording
    return seen


def _assert_identity(setup, family, out, engine):
    for b, p in enumerate(PROMPTS):
        ref = greedy_reference(setup.target(family), p, N)
        row = out.sequences[b]
        assert row[:len(ref)].tolist() == ref, f"row {b} differs from transformers' greedy"
        assert bool((row[len(ref):] == engine.pad_token_id).all())
    assert out.stats.drafter_failures == 0
    assert engine.runner.num_free == 2


# ---- 1. greedy identity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("which", ["untrained", "trained"])
@pytest.mark.parametrize("strategy, commit", MODES, ids=[f"{s}-{c}" for s, c in MODES])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(setup, family, strategy, commit, which, shape):
    engine = _engine(setup, family, which, strategy=strategy, commit=commit, topk=1 if shape == "chain" else 2)
    assert type(engine.drafter).__name__ == "DSparkDrafter" and engine.drafter.tree == (shape == "tree")
    num = _record_num_drafts(engine)
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    _assert_identity(setup, family, out, engine)
    stats = out.stats
    full = GAMMA if shape == "chain" else engine.drafter.num_nodes  # a tree of depth GAMMA fills its budget
    assert set(num) <= set(range(1, full + 1)) and max(num) == full  # threshold 0: never truncated
    if which == "trained":
        assert 0.0 < stats.alpha < 1.0 and stats.tau > 1.5, stats.as_dict()


@pytest.mark.parametrize("family, strategy, commit", [("qwen3_next", "replay", "eager"),
                                                      ("kimi_linear", "snapshot", "eager")])
def test_greedy_identity_confidence_truncation(setup, family, strategy, commit):
    """A threshold inside the range of the trained confidence head's cumulative estimates (the median of its
    estimate for the first two drafts, so some blocks keep one draft and others more) cuts blocks at different
    lengths; the output is still transformers' greedy decode."""
    probe = _engine(setup, family, "trained", strategy=strategy, commit=commit, topk=1)
    cum = []
    propose = probe.drafter.propose

    def recording(*a, **k):
        block = propose(*a, **k)
        conf = probe.drafter.last_confidence
        if conf.shape[1] > 1:  # the last round may draft one token
            cum.append(conf.cumprod(-1)[:, 1])
        return block
    probe.drafter.propose = recording
    generate_f64(probe, PROMPTS, max_new_tokens=N)
    threshold = float(torch.cat(cum).median())
    engine = _engine(setup, family, "trained", strategy=strategy, commit=commit, confidence_threshold=threshold)
    num = _record_num_drafts(engine)
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    _assert_identity(setup, family, out, engine)
    assert len(set(num)) > 1 and max(num) < GAMMA, (threshold, num)
    assert out.stats.proposed == sum(num)


# ---- 2. sampling ---------------------------------------------------------------------------------------------

V = 10
SAMPLE_PROMPT = [1, 3, 5, 7, 2, 4, 6, 0, 5, 3]
NEW = 3  # the first token comes from prefill, the next two from the first verify round (drafts 0 and 1)
BATCH = 100
SAMPLES = 2000
SAMPLING = dict(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def small():
    """A small-vocab target and an untrained dspark engine with a strong Markov head (q_1 depends on draft 0)."""
    target = tiny_model("qwen3_next", seed=0, vocab_size=V, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    engine = _small_engine(target)
    return target, engine


def _small_engine(target):
    torch.manual_seed(1)
    engine = specdec.wrap(target, drafter="dspark", untrained=True, num_draft_tokens=2, max_batch_size=BATCH,
                          max_length=64, topk=1)  # a chain: its drafts carry the distributions they were drawn from
    net = engine.drafter.net
    with torch.no_grad():  # Markov rows (a free table, entries ~N(0, 1)) -> bias logits of std ~3
        net.markov_w.weight.normal_(0.0, 3.0 / net.config.markov_rank ** 0.5,
                                    generator=torch.Generator().manual_seed(2))
    return engine


def _sample_counts(engine, n: int, seed: int):
    return count_samples(engine, n, seed, prompt=SAMPLE_PROMPT, vocab=V, new=NEW, batch=BATCH, **SAMPLING)


def test_sampled_tokens_follow_target(small):
    target, engine = small
    joint = exact_joint(target, SAMPLE_PROMPT, SamplingParams(do_sample=True, **SAMPLING), NEW)
    counts, totals = _sample_counts(engine, SAMPLES, seed=0)
    assert totals["drafter_failures"] == 0
    assert totals["proposed"] >= 2 * SAMPLES, totals  # gamma 2 in every first round
    assert 0.1 * totals["proposed"] < totals["accepted"] < 0.9 * totals["proposed"], totals
    stat, df = chi2_gof(counts, joint.flatten())
    crit = chi2_critical(df)
    print(f"dspark sampling: chi2 {stat:.1f} df {df} critical {crit:.1f} "
          f"alpha {totals['accepted'] / totals['proposed']:.3f}")
    assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f} (df {df})"


def test_misreported_q_is_detected(small):
    """Teeth: drafts sampled from q but reported as drawn from the uniform distribution bias the output."""
    target, engine = small
    joint = exact_joint(target, SAMPLE_PROMPT, SamplingParams(do_sample=True, **SAMPLING), NEW)
    propose = engine.drafter.propose

    def lying(*a, **k):
        block = propose(*a, **k)
        block.probs = torch.full_like(block.probs, 1.0 / V)
        return block
    engine.drafter.propose = lying
    try:
        counts, _ = _sample_counts(engine, SAMPLES // 2, seed=5000)
    finally:
        del engine.drafter.propose
    stat, df = chi2_gof(counts, joint.flatten())
    print(f"dspark misreported q: chi2 {stat:.1f} df {df} critical {chi2_critical(df):.1f}")
    assert stat > chi2_critical(df), f"chi2 {stat:.1f} <= critical {chi2_critical(df):.1f}"


def test_sampling_probs_are_the_sampled_distribution(small):
    """Each draft is drawn from the q it reports; q of draft 1 is `probs_from_logits(base_1 + markov(draft 0))`:
    across draws, `T * log q_1 - markov(draft 0)` is the same up to a constant (the block forward is shared)."""
    target, engine = small
    d = engine.drafter
    net = d.net
    ctxs = [torch.tensor(SAMPLE_PROMPT[:6]), torch.tensor(SAMPLE_PROMPT)]
    d.begin([0, 1], ctxs)
    for r, c in enumerate(ctxs):
        feats = {l: [torch.randn(c.numel() - 1, net.config.target_hidden_size, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(r))] for l in d.feature_layers}
        d.observe(Observation.of([r], [c[:-1]], features=feats))
    ctxs = Contexts.of(ctxs)
    T = 0.8
    params = SamplingParams(do_sample=True, temperature=T)
    blocks = [d.propose([0, 1], ctxs, 2, sampling=params, generator=torch.Generator().manual_seed(s))
              for s in range(12)]
    top_k = d.propose([0, 1], ctxs, 2, sampling=SamplingParams(do_sample=True, top_k=3),
                      generator=torch.Generator().manual_seed(0))
    greedy = d.propose([0, 1], ctxs, 2)
    d.release([0, 1])
    assert greedy.probs is None and greedy.tokens.shape == (2, 2)
    assert bool(((top_k.probs > 0).sum(-1) <= 3).all())
    for b in blocks:
        assert b.tokens.shape == (2, 2) and b.probs.shape == (2, 2, V)
        assert torch.allclose(b.probs.sum(-1), torch.ones(2, 2, dtype=b.probs.dtype))
        assert bool((b.probs.gather(-1, b.tokens[..., None]) > 0).all())
        assert torch.equal(b.probs[:, 0], blocks[0].probs[:, 0])  # q_0 depends on the anchor only
    first_drafts = {tuple(b.tokens[:, 0].tolist()) for b in blocks}
    assert len(first_drafts) > 1  # draft 0 varied, so q_1 was conditioned on different tokens
    with torch.no_grad():
        resid = torch.stack([T * b.probs[:, 1].log() - net.markov(b.tokens[:, 0]) for b in blocks])  # [S, 2, V]
    resid = resid - resid.mean(-1, keepdim=True)
    assert torch.allclose(resid, resid[:1].expand_as(resid), atol=1e-9)
    q1 = torch.stack([b.probs[:, 1] for b in blocks])
    assert not torch.allclose(q1, q1[:1].expand_as(q1))


# ---- 3. training, save / load ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_training_improves_and_round_trips(setup, family):
    path, net, hist = setup.train(family)
    first, last = hist["val"][0], hist["val"][-1]
    print(f"{family}: val loss {first['loss']:.3f} -> {last['loss']:.3f}, per_position {last['per_position']}")
    assert last["loss"] < first["loss"], (first, last)
    assert sum(last["per_position"]) > sum(first["per_position"]) + 1.0, (first, last)
    # the drafting terms of the loss (the confidence BCE against a soft target has a floor, its entropy): the
    # distance to the target's distributions (L1 = 2 TV) at least halves on held-out windows
    from specdec.draft.registry import target_batch
    from specdec.runner import make_runner
    target = setup.target(family)
    torch.manual_seed(TRAIN["seed"])
    untrained = build_drafter_net("dspark", target)  # what `train` started from
    ids = _corpus(target, n_seq=4, length=48, seed=6).view(4, 48)  # other prompts than training's
    with torch_fallbacks(), float64_everywhere():
        batch = target_batch(make_runner(target, max_batch_size=1, max_length=56, num_verify_tokens=1), ids,
                             net.config.feature_layers)
    before, after = untrained.evaluate(batch), net.evaluate(batch)
    print(f"{family}: held-out L1 {before['l1']:.3f} -> {after['l1']:.3f}, hard CE {before['hard_ce']:.3f} -> "
          f"{after['hard_ce']:.3f}")
    assert after["l1"] < 0.5 * before["l1"] and after["hard_ce"] < 0.5 * before["hard_ce"], (before, after)
    taus = {}
    for which in ("untrained", "trained"):
        out = generate_f64(_engine(setup, family, which), PROMPTS, max_new_tokens=N)
        taus[which] = out.stats.tau
    print(f"{family}: tau untrained {taus['untrained']:.2f} trained {taus['trained']:.2f}")
    assert taus["trained"] > taus["untrained"] + 0.5, taus

    # save / load: the loaded drafter proposes exactly what the trained one does
    target = setup.target(family)
    loaded = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2, topk=1).drafter
    assert isinstance(loaded, dspark_drafter.DSparkDrafter) and loaded.net is not net
    assert loaded.net.target_embed is target.get_input_embeddings()  # shared, not copied
    fresh = dspark_drafter.make_drafter(net, gamma=GAMMA, topk=1)  # chains: their probs and confidences compared too
    files = set(os.listdir(path))
    assert files == {"config.json", "model.safetensors"}
    from safetensors.torch import load_file
    assert not any(k.startswith("target_") for k in load_file(os.path.join(path, "model.safetensors")))
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randint(3, 96, (20,), generator=gen)
    feats = {l: [torch.randn(19, 64, dtype=torch.float64, generator=gen)] for l in fresh.feature_layers}
    blocks = []
    for d in (fresh, loaded):
        d.begin([0], [ctx])
        d.observe(Observation.of([0], [ctx[:-1]], features=feats))
        greedy = d.propose([0], Contexts.of([ctx]), GAMMA)
        sampled = d.propose([0], Contexts.of([ctx]), GAMMA, sampling=SamplingParams(do_sample=True),
                            generator=torch.Generator().manual_seed(0))
        blocks.append((greedy, sampled, d.last_confidence.clone()))
        d.release([0])
    (g0, s0, c0), (g1, s1, c1) = blocks
    assert torch.equal(g0.tokens, g1.tokens) and torch.equal(s0.tokens, s1.tokens)
    assert torch.equal(s0.probs, s1.probs) and torch.equal(c0, c1)


def test_evaluate_reports_per_position_acceptance(setup):
    path, net, hist = setup.train("qwen3_next")
    last = hist["val"][-1]
    assert len(last["per_position"]) == net.config.block_size
    assert all(0.0 <= a <= 1.0 for a in last["per_position"])


def test_observe_caches_only_committed_positions(setup):
    """The context cache grows by exactly what `observe` receives; a longer cache than the context rolls back."""
    engine = _engine(setup, "qwen3_next", "untrained")
    d = engine.drafter
    ctx = torch.tensor(PROMPTS[0])
    d.begin([0], [ctx])
    feats = lambda n: {l: [torch.zeros(n, 64, dtype=torch.float64)] for l in d.feature_layers}  # noqa: E731
    d.observe(Observation.of([0], [ctx[:4]], features=feats(4)))
    d.observe(Observation.of([0], [ctx[4:6]], features=feats(2)))
    assert d.length[0] == 6
    d.propose([0], Contexts.of([ctx]), GAMMA)  # 6 committed + anchor: consistent
    d.observe(Observation.of([0], [torch.tensor([1, 2, 3])], features=feats(3)))
    assert d.length[0] == 9
    d.propose([0], Contexts.of([ctx]), GAMMA)  # context says 6 committed: the 3 extra positions are dropped
    assert d.length[0] == 6
    with pytest.raises(ValueError, match="observed positions"):
        d.propose([0], Contexts.of([torch.cat([ctx, ctx])]), GAMMA)
    d.release([0])
    assert 0 not in d.length


# ---- 4. errors ---------------------------------------------------------------------------------------------


def test_bad_options_raise(setup):
    target = setup.target("qwen3_next")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        specdec.wrap(target, drafter="dspark", num_draft_tokens=0)
    net = build_drafter_net("dspark", target)
    for gamma in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="gamma"):
            dspark_drafter.make_drafter(net, gamma=gamma)
    for thr in (-0.1, 1.5, "high"):
        with pytest.raises(ValueError, match="confidence_threshold"):
            specdec.wrap(target, drafter="dspark", untrained=True, confidence_threshold=thr)
    with pytest.raises(ValueError, match="confidence_treshold"):
        specdec.wrap(target, drafter="dspark", untrained=True, confidence_treshold=0.5)
    with pytest.raises(ValueError, match="markov_rank"):
        build_drafter_net("dspark", target, markov_rank=0)
    with pytest.raises(ValueError, match="feature_layers"):
        build_drafter_net("dspark", target, feature_layers=[0, 9])
    with pytest.raises(ValueError, match="seq_len"):
        train(target, torch.arange(400) % 90 + 3, "dspark", steps=1, seq_len=6, batch_size=1, progress=False)


def test_drafter_for_another_target_raises(setup):
    path = setup.train("qwen3_next")[0]
    kimi = setup.target("kimi_linear")  # same hidden size and vocab, another model type
    with pytest.raises(ValueError, match="drafter: trained for a 'qwen3_next' target"):
        specdec.wrap(kimi, drafter=path)
    other = _target("qwen3_next", seed=7)  # same architecture, other weights
    with pytest.raises(ValueError, match="drafter: trained for another target"):
        specdec.wrap(other, drafter=path)
    bigger_vocab = tiny_model("qwen3_next", seed=0, vocab_size=128)
    with pytest.raises(ValueError, match="drafter: trained for a target with hidden size"):
        specdec.wrap(bigger_vocab, drafter=path)


def _copy(path, dst):
    os.makedirs(dst)
    for f in os.listdir(path):
        with open(os.path.join(path, f), "rb") as src, open(os.path.join(dst, f), "wb") as out:
            out.write(src.read())
    return dst


def test_bad_drafter_files_raise(setup, tmp_path):
    path = setup.train("qwen3_next")[0]
    target = setup.target("qwen3_next")
    bad_json = _copy(path, str(tmp_path / "bad_json"))
    with open(os.path.join(bad_json, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="drafter"):
        specdec.wrap(target, drafter=bad_json)
    bad_field = _copy(path, str(tmp_path / "bad_field"))
    cfg = json.load(open(os.path.join(bad_field, "config.json")))
    with open(os.path.join(bad_field, "config.json"), "w") as f:
        json.dump({**cfg, "block_size": "seven"}, f)
    with pytest.raises(ValueError, match="drafter: block_size"):
        specdec.wrap(target, drafter=bad_field)
    wrong_shape = _copy(path, str(tmp_path / "wrong_shape"))
    with open(os.path.join(wrong_shape, "config.json"), "w") as f:
        json.dump({**cfg, "markov_rank": 16}, f)
    with pytest.raises(ValueError, match="drafter: weights do not match"):
        specdec.wrap(target, drafter=wrong_shape)
    no_weights = _copy(path, str(tmp_path / "no_weights"))
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(ValueError, match="drafter"):
        specdec.wrap(target, drafter=no_weights)
    assert isinstance(load_drafter(path, target), dspark.Net)  # the intact directory still loads


def test_corrupt_weights_file_raises_value_error(setup, tmp_path):
    path = setup.train("qwen3_next")[0]
    corrupt = _copy(path, str(tmp_path / "corrupt"))
    with open(os.path.join(corrupt, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match="drafter"):
        specdec.wrap(setup.target("qwen3_next"), drafter=corrupt)


# ---- 5. the reference recipe (DeepSpec dspark: loss.py, markov_head.py, qwen3/modeling.py) -------------------


def test_new_drafters_get_the_reference_recipe(setup):
    """`Config.for_target` (every new drafter) is the reference recipe, and so are a bare Config's defaults: the
    recipe has one home."""
    target = setup.target("qwen3_next")
    cfg = dspark.Config.for_target(target)
    assert (cfg.l1_weight, cfg.hard_ce_weight, cfg.soft_ce_weight, cfg.position_decay) == (0.9, 0.1, 0.0, 4.0)
    assert cfg.input_norm and cfg.qk_norm and cfg.markov_table and cfg.confidence_markov and cfg.confidence_soft
    assert cfg.anchor_density == 512 / 4096
    tc = target.config
    assert cfg.intermediate_size == tc.intermediate_size and cfg.num_heads * cfg.head_dim == tc.hidden_size
    sized = {"target_model_type", "target_hidden_size", "target_vocab_size", "target_num_layers", "feature_layers",
             "target_fingerprint", "num_heads", "head_dim", "intermediate_size", "rms_norm_eps"}
    bare = dataclasses.asdict(dspark.Config())
    assert {k: v for k, v in dataclasses.asdict(cfg).items() if k not in sized} == \
        {k: v for k, v in bare.items() if k not in sized}
    net = build_drafter_net("dspark", target)
    assert net.num_anchors(128) == 16 and net.num_anchors(4096) == 512 - 0  # the reference's 512 per 4096
    # the Markov head: a free [V, r] table and an [r -> V] projection; the confidence head reads [h; row]
    V, r, d = tc.vocab_size, cfg.markov_rank, tc.hidden_size
    assert net.markov_table.weight.shape == (V, r) and net.markov_w.weight.shape == (V, r)
    assert net.confidence.weight.shape == (1, d + r)
    prev = torch.tensor([[3, 7], [11, 5]])
    with torch.no_grad():
        net.markov_w.weight.normal_(generator=torch.Generator().manual_seed(0))
        assert torch.allclose(net.markov(prev), net.markov_table.weight[prev] @ net.markov_w.weight.T)


def test_norms_are_present_and_used(setup):
    """input_norm: the block input is RMS-normalised (a scaled MASK embedding gives the same hidden states, a
    changed gain does); qk_norm: queries and keys are normed per head (scaled q/k projections change nothing).
    Without them (the old config) the same changes do change the hidden states."""
    target = setup.target("qwen3_next")
    gen = torch.Generator().manual_seed(1)
    B, S, G = 1, 12, 7
    d = target.config.hidden_size
    feats = {i: torch.randn(B, S, d, dtype=torch.float64, generator=gen) for i in range(4)}

    def hidden(net):
        ctx = net.context([feats[i] for i in net.config.feature_layers])
        kv = net.context_kv(ctx, torch.arange(S)[None])
        visible = torch.ones(B, G, S + G, dtype=torch.bool)
        with torch.no_grad():
            return net.block_hidden(torch.tensor([[5]]), S + torch.arange(G)[None], kv, visible)

    for norms in (True, False):
        torch.manual_seed(2)
        # eps 0: RMSNorm is then exactly scale-invariant (the target's eps would blur the comparison)
        net = build_drafter_net("dspark", target, input_norm=norms, qk_norm=norms, rms_norm_eps=0.0)
        assert hasattr(net, "in_norm") == norms
        assert all(isinstance(l.attn.q_proj, dspark._HeadNormLinear) == norms
                   and isinstance(l.attn.k_proj, dspark._HeadNormLinear) == norms for l in net.layers)
        h0 = hidden(net)
        with torch.no_grad():
            net.mask_embed.mul_(7.0)
            net.target_embed.weight.mul_(7.0)
        h1 = hidden(net)
        with torch.no_grad():
            net.mask_embed.div_(7.0)
            net.target_embed.weight.div_(7.0)
            for l in net.layers:
                l.attn.q_proj.weight.mul_(5.0)
                l.attn.k_proj.weight.mul_(3.0)
        h2 = hidden(net)
        same_input = torch.allclose(h0, h1, rtol=1e-9, atol=1e-9)
        same_qk = torch.allclose(h0, h2, rtol=1e-9, atol=1e-9)
        assert same_input == norms and same_qk == norms, (norms, same_input, same_qk)
        if norms:
            with torch.no_grad():
                net.in_norm.weight.mul_(2.0)
            assert not torch.allclose(hidden(net), h2)


def test_loss_equals_float64_recomputation(setup):
    """The reference loss: 0.9 x L1(p_draft, p_target) + 0.1 x CE(next token), slot k weighted exp(-k/4), plus
    1.0 x BCE of the confidence head (on [h; Markov row of the previous token]) against 1 - TV; recomputed here
    in float64 from the drafter's block logits, one slot at a time."""
    import math
    target = setup.target("qwen3_next")
    torch.manual_seed(3)
    net = build_drafter_net("dspark", target)
    with torch.no_grad():  # nonzero Markov and confidence heads, so every term matters
        g = torch.Generator().manual_seed(4)
        net.markov_w.weight.normal_(0.0, 0.5, generator=g)
        net.confidence.weight.normal_(0.0, 0.5, generator=g)
    ids = torch.randint(3, target.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
    from specdec.draft.registry import target_batch
    from specdec.runner import make_runner
    with torch_fallbacks(), float64_everywhere():
        runner = make_runner(target, max_batch_size=1, max_length=32, num_verify_tokens=1)
        batch = target_batch(runner, ids, net.config.feature_layers)
    G = net.config.block_size
    anchors = torch.tensor([[1, 5, 13], [2, 12, 13]])  # 13 = S - G: its last slot has no next token
    loss = net.loss(batch, anchors=anchors)
    with torch.no_grad():
        h, base, prev, tgt, _ = net._blocks(batch, anchors)
        logits = (base + net.markov(prev)).double()
        conf_logit = net.confidence(torch.cat([h, net.markov_table(prev)], -1)).squeeze(-1).double()
    l1_num = ce_num = conf_num = w_sum = ce_w = 0.0
    for b in range(2):
        for n in range(3):
            for k in range(G):
                w = math.exp(-k / 4.0)
                q = logits[b, n, k].softmax(-1)
                p = tgt[b, n, k].double().softmax(-1)
                l1 = float((q - p).abs().sum())
                a = 1.0 - 0.5 * l1
                c = float(conf_logit[b, n, k])
                bce = -(a * math.log(1 / (1 + math.exp(-c))) + (1 - a) * math.log(1 - 1 / (1 + math.exp(-c))))
                l1_num, conf_num, w_sum = l1_num + w * l1, conf_num + w * bce, w_sum + w
                t = int(anchors[b, n]) + k + 1
                if t < ids.shape[1]:
                    ce_num += w * -float(logits[b, n, k].log_softmax(-1)[ids[b, t]])
                    ce_w += w
    expect = 0.9 * l1_num / w_sum + 0.1 * ce_num / ce_w + 1.0 * conf_num / w_sum
    assert abs(float(loss) - expect) < 1e-9 * expect, (float(loss), expect)


def test_old_saved_drafter_loads_with_its_old_config_and_blocks():
    """tests/data/dspark_v1: a drafter saved before the recipe fields existed (its config.json now states every
    field, the recipe's with the values it was trained with), with the blocks, num_drafts and confidences that
    draft/dspark.py of commit d7af6c9 proposed on a float64 tiny kimi_linear target (lm_head x 30, seed 0) in greedy
    generation with confidence_threshold 0.4. It still loads with the old behaviour and proposes the same blocks."""
    path = os.path.join(os.path.dirname(__file__), "data", "dspark_v1")
    rec = json.load(open(os.path.join(path, "blocks.json")))
    saved = json.load(open(os.path.join(path, "config.json")))
    assert set(saved) == {f.name for f in dataclasses.fields(dspark.Config)}  # nothing left to the defaults
    target = _target("kimi_linear")
    net = load_drafter(path, target)
    cfg = net.config
    assert (cfg.soft_ce_weight, cfg.l1_weight, cfg.input_norm, cfg.qk_norm, cfg.markov_table,
            cfg.confidence_markov) == (1.0, 0.0, False, False, False, False)
    engine = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2,
                          confidence_threshold=rec["confidence_threshold"])
    blocks, propose = [], engine.drafter.propose

    def recording(*a, **k):
        block = propose(*a, **k)
        blocks.append((block, engine.drafter.last_confidence.clone()))
        return block
    engine.drafter.propose = recording
    out = generate_f64(engine, rec["prompts"], max_new_tokens=rec["max_new_tokens"])
    assert out.sequences.tolist() == rec["sequences"]
    assert len(blocks) == len(rec["blocks"])
    for (block, conf), old in zip(blocks, rec["blocks"]):
        assert block.tokens.tolist() == old["tokens"] and block.num_drafts.tolist() == old["num_drafts"]
        # the confidences were recorded on another CPU: its float64 GEMMs (MKL / oneDNN kernels chosen by
        # instruction set, AVX2 there, AVX-512 here) sum in another order, and the sharpened target amplifies the
        # last-bit differences along the prompt to about 1e-9; the blocks above are the same ids
        assert torch.allclose(conf.double(), torch.tensor(old["confidence"], dtype=torch.float64), rtol=1e-7,
                              atol=1e-9)


@pytest.mark.parametrize("window", [0, 5])
def test_drafts_equal_the_training_blocks(setup, window):
    """The drafter's greedy chain after `observe` equals the training path's (`Net._blocks` + the Markov head fed
    the drafter's own previous drafts, as `evaluate` runs it) at every anchor of a window, all weights random: the
    same context keys, positions and masks at inference as in training, with and without a context window."""
    from specdec.draft.registry import TargetBatch, own_state_dict
    target = setup.target("kimi_linear")
    gen = torch.Generator().manual_seed(4)
    S, d, V = 20, target.config.hidden_size, target.config.vocab_size
    tokens = torch.randint(3, V, (1, S), generator=gen)
    feats = {i: torch.randn(1, S, d, dtype=torch.float64, generator=gen)
             for i in range(target.config.num_hidden_layers)}
    batch = TargetBatch(tokens, torch.zeros(1, S, V, dtype=torch.float64), feats[0], feats)
    torch.manual_seed(6)
    net = build_drafter_net("dspark", target).double()
    with torch.no_grad():
        for p in own_state_dict(net).values():
            p.copy_(torch.randn_like(p) * 0.5)
        net.mask_embed.mul_(5.0)  # a larger MASK slot input: the later slots' drafts differ across anchors
    net.config.context_window = window

    def training_drafts(net, anchors):
        with torch.no_grad():
            _, base, _, _, _ = net._blocks(batch, anchors[None])
            prev, out = tokens[0, anchors], []
            for i in range(net.config.block_size):
                prev = (base[0, :, i] + net.markov(prev)).argmax(-1)
                out.append(prev)
        return torch.stack(out, 1)  # [N, G]

    def drafted(net, a):
        drafter = dspark_drafter.make_drafter(net, gamma=net.config.block_size, topk=1)
        ctx = tokens[0, :a + 1]
        drafter.begin([0], [ctx])
        drafter.observe(Observation.of([0], [ctx[:-1]],
                                       features={l: [feats[l][0, :a]] for l in drafter.feature_layers}))
        return drafter.propose([0], Contexts.of([ctx]), net.config.block_size).tokens[0]

    anchors = torch.arange(1, S - net.config.block_size + 1)
    want = training_drafts(net, anchors)
    got = torch.stack([drafted(net, int(a)) for a in anchors])
    assert torch.equal(got, want)
    assert len({tuple(r) for r in got.tolist()}) > 1


def test_context_window_hides_only_the_older_keys(setup):
    """With `context_window` W, a block's hidden states (float64) do not change when a context feature more than W
    positions before the anchor does, and do change when one inside the window does; without the window both
    change (the mask, not the data, hides them)."""
    from specdec.draft.registry import TargetBatch
    target = setup.target("kimi_linear")
    gen = torch.Generator().manual_seed(8)
    S, d, V, W, a = 24, target.config.hidden_size, target.config.vocab_size, 6, 16
    tokens = torch.randint(3, V, (1, S), generator=gen)
    feats = {i: torch.randn(1, S, d, dtype=torch.float64, generator=gen)
             for i in range(target.config.num_hidden_layers)}
    torch.manual_seed(2)
    net = build_drafter_net("dspark", target).double()

    def hidden(window, moved=None):
        f = {i: x.clone() for i, x in feats.items()}
        if moved is not None:
            for x in f.values():
                x[0, moved] += 1.0
        net.config.context_window = window
        batch = TargetBatch(tokens, torch.zeros(1, S, V, dtype=torch.float64), f[0], f)
        with torch.no_grad():
            return net._blocks(batch, torch.tensor([[a]]))[0]

    base = hidden(W)
    assert torch.equal(hidden(W, moved=a - W - 1), base)  # just outside the window
    assert not torch.allclose(hidden(W, moved=a - W), base)  # the oldest key inside it
    assert not torch.allclose(hidden(0, moved=a - W - 1), hidden(0))


@pytest.mark.parametrize("kind", ["dspark", "eagle"])
def test_rows_in_any_order_draft_as_alone(kind):
    """A drafter reads its caches as a view for consecutive rows (`tensors.run_of`) and gathers them otherwise:
    blocks of rows [0, 1, 2], [2, 0] and each row alone are the same per row (greedy: tokens)."""
    target = tiny_model("qwen3_next", seed=0, vocab_size=V, num_layers=2)
    torch.manual_seed(0)
    d = specdec.wrap(target, drafter=kind, untrained=True, max_length=64, max_batch_size=4).drafter
    net_layers = d.feature_layers
    ctxs = [torch.tensor(SAMPLE_PROMPT[:n]) for n in (6, 10, 8)]
    d.begin([0, 1, 2], ctxs)
    for r, c in enumerate(ctxs):
        gen = torch.Generator().manual_seed(r)
        feats = {l: [torch.randn(c.numel() - 1, target.config.hidden_size, dtype=torch.float64, generator=gen)]
                 for l in net_layers}
        hidden = [torch.randn(c.numel() - 1, target.config.hidden_size, dtype=torch.float64, generator=gen)]
        d.observe(Observation.of([r], [c[:-1]], hidden=hidden, features=feats))

    def block(rows):
        b = d.propose(rows, Contexts.of([ctxs[r] for r in rows]), 3)
        d.abort(rows)  # back to the committed state: the next call drafts from the same caches
        return {r: b.tokens[i].tolist() for i, r in enumerate(rows)}

    whole, reordered = block([0, 1, 2]), block([2, 0])
    alone = {r: block([r])[r] for r in range(3)}
    assert whole == alone and reordered == {r: alone[r] for r in (2, 0)}
