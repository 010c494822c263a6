"""EAGLE-3 drafter (`drafter="eagle"`): dynamic trees verified as trees, lossless for greedy and sampling.

1. Greedy identity: untrained and trained eagle heads on float64 tiny Kimi-Linear / Qwen3-Next targets give
   exactly transformers' greedy `generate` for every state strategy, with branching trees in the rounds.
2. Sampling: spec sampling with eagle trees follows the target's exact joint distribution of the first
   tokens (chi-square), and a wrong tree rule run through the same engine is detected.
3. Tree state: after every tree round the committed linear-attention state (ssm + conv) equals a plain
   prefill of the committed tokens; the tree state stack is allocated once per engine.
4. Training: a few dozen distillation steps lower the validation loss and raise tau; a save / load round
   trip through `specdec.wrap(model, drafter=DIR)` drafts identically.
5. Errors: bad tree options, gamma, a drafter trained for another target.

Tiny ops gain nothing from threads and oversubscribed threads cost a lot, so the module runs on one thread.
"""

from __future__ import annotations


import pytest
import torch
from assertions import chi2_critical, chi2_gof, count_samples, max_rel_err
from tiny_models import (Memo, assert_greedy, exact_joint, float64_everywhere, generate_f64, greedy_reference,
                         tiny_model, torch_fallbacks)

import specdec
import specdec.verify.accept as accept_mod
from specdec.kernels.tree import tree_stack_slots
from specdec.kernels.dispatch import uses_triton
from specdec.draft.registry import build_drafter_net, save_drafter
from specdec.draft.base import Contexts, Observation
from specdec.draft.eagle import Net
from specdec.draft.eagle_drafter import EagleDrafter, make_drafter
from specdec.runner import HybridRunner
from specdec.verify import Acceptance, SamplingParams

RIGHT_TREE_RULE = accept_mod._tree_sampling

FAMILIES = ("kimi_linear", "qwen3_next")
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
TREE = dict(topk=3, depth=4, num_nodes=10)
GAMMA = 4
N = 20
PROMPTS = [[3, 41, 17, 88, 9, 60, 23], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 50, 12]]
TRAIN = dict(steps=60, lr=3e-3, seq_len=32, batch_size=4, val_every=30, progress=False)


def _train_ids(vocab: int, n: int = 3000, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


class _Setup:
    """Module-wide targets and untrained / trained nets (saved to disk), each built on first use."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.trained, self.hist = {}, {}
        self.target = Memo(lambda family: tiny_model(family, seed=0))
        self.untrained_net = Memo(self._untrained_net)
        self.trained_dir = Memo(self._trained_dir)

    def _untrained_net(self, family):
        torch.manual_seed(11)
        return build_drafter_net("eagle", self.target(family))

    def _trained_dir(self, family):
        from specdec.cli.draft_train import train
        target = self.target(family)
        torch.manual_seed(11)
        start = build_drafter_net("eagle", target)
        net, hist = train(target, _train_ids(target.config.vocab_size), "eagle", net=start, **TRAIN)
        out = self.tmp / f"eagle-{family}"
        save_drafter(net, str(out))
        self.trained[family], self.hist[family] = net, hist
        return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _Setup(tmp_path_factory.mktemp("eagle"))


class _Recorder:
    """Wraps an engine's drafter: keeps every block, and calls `after_round(engine, rows)` after each commit."""

    def __init__(self, engine, after_round=None):
        self.engine, self.blocks, self.after_round = engine, [], after_round
        d = engine.drafter
        self.propose, self.observe = d.propose, d.observe
        d.propose, d.observe = self._propose, self._observe
        self.observed: dict[int, list[int]] = {}
        self.calls = 0

    def _propose(self, *a, **kw):
        block = self.propose(*a, **kw)
        self.blocks.append(block)
        return block

    def _observe(self, obs):
        self.observe(obs)
        for r, t in zip(obs.rows, obs.tokens):
            self.observed.setdefault(r, []).extend(t.tolist())
        self.calls += 1
        if self.after_round is not None and self.blocks:
            self.after_round(self, obs.rows)


def _branching(blocks) -> int:
    """Rounds whose tree is not a chain (some node's parent is not the node before it)."""
    n = 0
    for b in blocks:
        assert b.parent is not None and b.probs is None
        p = b.parent
        assert bool((p[:, 0] == -1).all())
        assert bool((p[:, 1:] < torch.arange(1, p.shape[1])).all()), "parents must come before children"
        n += int(bool((p[:, 1:] != torch.arange(p.shape[1] - 1)).any()))
    return n


# ---- 1. greedy identity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("trained", [False, True], ids=["untrained", "trained"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(setup, family, trained):
    target = setup.target(family)
    refs = [greedy_reference(setup.target(family), p, N) for p in PROMPTS]
    for strategy, commit in MODES:
        kw = dict(num_draft_tokens=GAMMA, strategy=strategy, commit=commit, max_batch_size=2, **TREE)
        if trained:  # through the saved directory
            engine = specdec.wrap(target, drafter=str(setup.trained_dir(family)), **kw)
        else:  # the untrained net the engine builds itself
            torch.manual_seed(11)
            engine = specdec.wrap(target, drafter="eagle", untrained=True, **kw)
        assert isinstance(engine.drafter, EagleDrafter) and engine.drafter.max_verify_tokens(GAMMA) == 11
        rec = _Recorder(engine)
        out = generate_f64(engine, PROMPTS, max_new_tokens=N)
        for b, ref in enumerate(refs):
            assert out.sequences[b, :len(ref)].tolist() == ref, f"{family} {strategy}-{commit}: row {b} differs"
        st = out.stats
        assert st.drafter_failures == 0 and st.rounds >= 1
        assert _branching(rec.blocks) == len(rec.blocks), "every round should verify a branching tree"
        assert all(b.tokens.shape[1] <= 10 for b in rec.blocks) and rec.blocks[0].tokens.shape == (2, 10)
        assert engine.runner.num_free == 2 and not engine.drafter.rows
        print(f"{family} {'trained' if trained else 'untrained'} {strategy}-{commit}: tau {st.tau:.3f} "
              f"rounds {st.rounds} timings {({k: round(v, 2) for k, v in st.timings.items()})}")


def test_default_tree_follows_the_device(setup):
    """Unset tree options take the device's default tree: a narrow one on a CPU, EAGLE-2's size on a GPU; the
    default tree's rounds stay exact (transformers' greedy generate) and verify that many nodes."""
    from specdec.draft.eagle_drafter import DEFAULT_TREE, default_tree
    assert default_tree(torch.device("cpu")) == DEFAULT_TREE["cpu"] == dict(topk=2, num_nodes=16)
    assert default_tree(torch.device("cuda", 0)) == DEFAULT_TREE["cuda"] == dict(topk=8, num_nodes=48)
    net = setup.untrained_net("kimi_linear")
    d = make_drafter(net, gamma=7, max_batch_size=2)
    assert (d.topk, d.num_nodes, d.max_verify_tokens(7)) == (2, 16, 17)
    assert make_drafter(net, gamma=20, max_batch_size=2).num_nodes == 20  # never fewer nodes than depth
    assert make_drafter(net, gamma=7, max_batch_size=2, topk=5).num_nodes == 16
    target = setup.target("kimi_linear")
    engine = specdec.wrap(target, drafter=make_drafter(net, gamma=GAMMA, max_batch_size=2), num_draft_tokens=GAMMA,
                          max_batch_size=2)
    rec = _Recorder(engine)
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    assert_greedy(out, target, PROMPTS, N)
    # depth GAMMA with top-2 children: 2 candidates at depth 1, then 4 per depth, the best 16 kept
    assert rec.blocks[0].tokens.shape == (2, min(16, 2 + 4 * (GAMMA - 1))) and _branching(rec.blocks) > 0


def test_generic_target_gets_chains(setup):
    """A target without a hybrid adapter verifies chains only: the eagle drafter sends its best path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    ref = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=N, eos_token_id=None)[0]
    torch.manual_seed(3)
    engine = specdec.wrap(model, drafter="eagle", untrained=True, num_draft_tokens=GAMMA, max_batch_size=1, **TREE)
    rec = _Recorder(engine)
    out = engine.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=N, eos_token_id=None)
    assert out.sequences[0].tolist() == ref.tolist()
    assert out.stats.drafter_failures == 0
    assert rec.blocks and all(b.parent is None and b.tokens.shape[1] <= GAMMA for b in rec.blocks)


# ---- 2. sampling -------------------------------------------------------------------------------------------

V = 8
NEW = 3
BATCH = 100
NSAMP = 2000
SPROMPT = [1, 3, 5, 7, 2, 4, 6, 0, 5, 3]
SAMPLE_TREE = dict(topk=2, depth=2, num_nodes=3)


@pytest.fixture(scope="module")
def small():
    target = tiny_model("qwen3_next", seed=0, vocab_size=V, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # sharper than a random model's near-uniform logits
    torch.manual_seed(5)
    net = build_drafter_net("eagle", target)
    engine = specdec.wrap(target, drafter=make_drafter(net, gamma=2, max_batch_size=BATCH, **SAMPLE_TREE),
                          num_draft_tokens=2, max_batch_size=BATCH, max_length=32)
    return target, engine


def _sample_counts(engine, params: dict, n: int, seed: int):
    rec = _Recorder(engine)
    try:
        counts, totals = count_samples(engine, n, seed, prompt=SPROMPT, vocab=V, new=NEW, batch=BATCH,
                                       stats=("proposed", "accepted", "rounds", "drafter_failures"), **params)
    finally:
        engine.drafter.propose, engine.drafter.observe = rec.propose, rec.observe
    totals["branching"] = _branching(rec.blocks)
    return counts, totals


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)],
                         ids=["temperature=1", "temperature=0.7,top_p=0.9"])
def test_sampling_follows_target(small, setting):
    target, engine = small
    joint = exact_joint(target, SPROMPT, SamplingParams(do_sample=True, **setting), NEW)
    counts, totals = _sample_counts(engine, setting, NSAMP, seed=100 if setting["temperature"] == 1.0 else 300)
    assert totals["drafter_failures"] == 0 and totals["branching"] >= 1
    assert 0.1 * totals["rounds"] < totals["accepted"] < 0.9 * totals["rounds"], totals  # drafts accepted and rejected
    stat, df = chi2_gof(counts, joint)
    crit = chi2_critical(df)
    print(f"eagle sampling {setting}: chi2 {stat:.1f} df {df} critical {crit:.1f} "
          f"accepted drafts per round {totals['accepted'] / totals['rounds']:.3f}")
    assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f} (df {df})"


def _bonus_from_p(tokens, tree, draft_probs, target_probs, generator):
    """Wrong: the right walk down the tree, but the bonus is drawn from p at the last accepted node, ignoring
    the rejected siblings (no residual)."""
    path = RIGHT_TREE_RULE(tokens, tree, draft_probs, target_probs, generator).path
    last = path.gather(1, ((path >= 0).sum(1) - 1)[:, None])[:, 0]
    p = target_probs[torch.arange(tokens.shape[0]), last].double()
    return Acceptance.tree(path, torch.multinomial(p, 1, generator=generator)[:, 0], tokens)


def test_wrong_tree_rule_is_detected(small, monkeypatch):
    target, engine = small
    setting = dict(temperature=1.0)
    joint = exact_joint(target, SPROMPT, SamplingParams(do_sample=True, **setting), NEW)
    monkeypatch.setattr(accept_mod, "_tree_sampling", _bonus_from_p)  # the rule the engine's `accept_round` runs
    counts, _ = _sample_counts(engine, setting, NSAMP, seed=100)
    stat, df = chi2_gof(counts, joint)
    crit = chi2_critical(df)
    print(f"eagle wrong tree rule: chi2 {stat:.1f} df {df} critical {crit:.1f}")
    assert stat > crit


# ---- 3. tree state ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, commit", MODES)
def test_tree_rounds_commit_plain_decode_state(setup, strategy, commit):
    family = "qwen3_next"
    target = setup.target(family)
    engine = specdec.wrap(target, drafter=str(setup.trained_dir(family)), num_draft_tokens=GAMMA, strategy=strategy,
                          commit=commit, max_batch_size=2, **TREE)
    paths, snaps, ptrs = [], [], set()
    commit_fn = engine.runner.commit

    def record_commit(acc, **kw):  # the round's acceptance record, a tree round's path (the KV cache holds its tree)
        paths.append(None if engine.runner.kv.tree is None else acc.path[:, :acc.num_kept.max()].clone())
        commit_fn(acc, **kw)
        if strategy == "replay":
            nodes = engine.runner.state.tree_stack
            ptrs.add(None if nodes is None else nodes.data_ptr())

    engine.runner.commit = record_commit

    def after_round(rec, rows):
        state = engine.runner.state
        ssm, conv = state.committed_ssm(), state.pool.conv
        for r in rows:
            s = engine.lane_slots[r]
            snaps.append((list(rec.observed[r]), ssm[:, s].clone(), conv[:, s].clone(), int(state.committed_len(
                torch.tensor([s]))[0])))

    _Recorder(engine, after_round)
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    assert [out.sequences[b, :len(p) + N].tolist() for b, p in enumerate(PROMPTS)] == [greedy_reference(setup.target(family), p, N)
                                                                                      for p in PROMPTS]
    assert all(p is not None for p in paths), "every round commits a tree path"
    deep = sum(int(((p >= 0).sum(1) >= 3).sum()) for p in paths)  # a depth-2 node is never index 2 in these trees
    assert deep >= 1, "no round accepted a path through the tree"
    if strategy == "replay":
        nodes = engine.runner.state.tree_stack
        assert len(ptrs) == 1, "the tree state stack was reallocated"
        if uses_triton(engine.runner.state.pool.ssm):  # the Triton tree kernel reloads parents from the stack
            assert nodes.dim() == 5 and nodes.shape[1] == tree_stack_slots(TREE["num_nodes"] + 1)
            assert nodes.shape[2:] == engine.runner.state.pool.ssm.shape[2:]  # one layer: [rows, T, H, K, V]
        else:  # the chunk form needs none
            assert nodes is None
    with torch_fallbacks(), float64_everywhere():
        fresh = HybridRunner(target, strategy="snapshot", max_batch_size=1, max_length=64, num_verify_tokens=1)
        for tokens, ssm, conv, length in snaps[::3]:
            assert length == len(tokens)
            slot = fresh.alloc(1)[0]
            fresh.prefill(slot, torch.tensor(tokens))
            assert max_rel_err(ssm, fresh.state.pool.ssm[:, slot]) < 1e-10
            assert max_rel_err(conv, fresh.state.pool.conv[:, slot]) < 1e-10
            fresh.release([slot])


def test_tree_steps_match_training_unroll(setup):
    """Drafting (cached committed positions, scratch tree nodes with ancestor masks) computes exactly what
    training's unrolled steps compute: the root's scores are step 1 at the root position, a depth-d node's
    scores are step d+1 with the node's path as the next tokens. Siblings do not see each other."""
    from specdec.draft.registry import TargetBatch
    from specdec.runner import make_runner
    family = "qwen3_next"
    target, net = setup.target(family), setup.untrained_net(family)
    layers = net.config.feature_layers
    gen = torch.Generator().manual_seed(4)
    P = 9  # committed tokens seen by the target; the anchor is token P
    ids = torch.randint(3, target.config.vocab_size, (P + 4,), generator=gen)
    with torch_fallbacks(), float64_everywhere():
        runner = make_runner(target, max_batch_size=1, max_length=32, num_verify_tokens=1)
        slot = runner.alloc(1)[0]
        pre = runner.prefill(slot, ids[:P], capture=layers)

    def unrolled(next_tokens):
        """Step logits `[[V] per position] per step` with tokens P+1.. replaced by `next_tokens`."""
        tokens = ids.clone()
        tokens[P + 1:P + 1 + len(next_tokens)] = torch.tensor(next_tokens)
        S = tokens.numel()
        feats = {i: torch.cat([pre.captured[i], pre.captured[i].new_zeros(1, S - P, pre.captured[i].shape[-1])], 1)
                 for i in layers}  # positions >= P never reach the steps compared below
        batch = TargetBatch(tokens[None], torch.zeros(1, S, target.config.vocab_size, dtype=torch.float64), None,
                            feats)
        with torch.no_grad():
            outs, _ = net._unroll(batch)
        return [logits[0] for logits, _ in outs]

    for topk, depth in [(1, 3), (2, 2)]:
        drafter = make_drafter(net, gamma=depth, max_batch_size=1, topk=topk, depth=depth, num_nodes=topk * 3)
        seen = []
        drafter.net.lm_logits = lambda h, f=Net.lm_logits.__get__(drafter.net): seen.append(f(h)) or seen[-1]
        try:
            drafter.begin([0], [ids[:P]])
            drafter.observe(Observation.of([0], [ids[:P]], [pre.hidden[0]], {i: [pre.captured[i][0]] for i in layers}))
            block = drafter.propose([0], Contexts.of([ids[:P + 1]]), depth)
        finally:
            del drafter.net.lm_logits
        root = seen[0][0]
        assert max_rel_err(root, unrolled([])[0][P - 1]) < 1e-12
        if topk == 1:  # a chain: node d's scores = step d+1 at position P-1+d along the drafted path
            path = block.tokens[0].tolist()
            assert path[0] == int(root.argmax())
            for d in range(1, depth):
                ref = unrolled(path[:d])[d][P - 1 + d]
                assert max_rel_err(seen[d][0, 0], ref) < 1e-12, f"depth {d}"
                assert path[d] == int(ref.argmax())
        else:  # both depth-1 siblings expanded side by side, each as if it were the only continuation
            firsts = root.topk(2).indices.tolist()
            assert block.tokens[0, :2].tolist() == firsts
            for j, tok in enumerate(firsts):
                assert max_rel_err(seen[1][0, j], unrolled([tok])[1][P]) < 1e-12, f"sibling {j}"


# ---- 4. training, save / load -----------------------------------------------------------------------------


def _tau(engine) -> float:
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    return out.stats.tau


def test_training_time_test_unrolls_seven_steps(setup):
    """The default unrolls the reference's 7 training-time-test steps (EAGLE-3; SpecForge's ttt_length 7): step k
    is valid from position k-1 on, and the loss weighs step k by 0.8**k (recomputed here in float64 from each
    step's logits); a config saved with ttt_steps=2 keeps its 3 steps."""
    from specdec.draft.eagle import Config
    from specdec.draft.registry import TargetBatch
    target, net = setup.target("qwen3_next"), setup.untrained_net("qwen3_next")
    assert net.config.ttt_steps + 1 == 7 and Config(ttt_steps=2).ttt_steps == 2
    S, V, d = 12, target.config.vocab_size, target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    dt = next(net.fuse.parameters()).dtype
    batch = TargetBatch(torch.randint(3, V, (2, S), generator=g), torch.randn(2, S, V, generator=g).to(dt), None,
                        {i: torch.randn(2, S, d, generator=g).to(dt) for i in net.config.feature_layers})
    with torch.no_grad():
        outs, _ = net._unroll(batch)
        loss = float(net.loss(batch))
    assert [int(valid.sum()) for _, valid in outs] == [S - 1 - k for k in range(7)]
    p = batch.logits[:, 1:].double().softmax(-1)
    num = den = 0.0
    for k, (logits, valid) in enumerate(outs):
        ce = -(p[:, valid] * logits[:, valid].double().log_softmax(-1)).sum(-1).mean()
        num, den = num + 0.8 ** k * float(ce), den + 0.8 ** k
    assert abs(loss - num / den) < 1e-5 * abs(num / den)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_improves_and_round_trips(setup, family):
    target = setup.target(family)
    path = setup.trained_dir(family)
    hist = setup.hist[family]
    first, last = hist["val"][0], hist["val"][-1]
    assert last["loss"] < first["loss"] - 5e-3, (first, last)
    assert last["per_position"][0] > first["per_position"][0]
    # saved: own weights only, no shared target modules
    from safetensors.torch import load_file
    saved = load_file(str(path / "model.safetensors"))
    assert saved and not any(k.startswith("target_") for k in saved)
    kw = dict(num_draft_tokens=GAMMA, max_batch_size=2, **TREE)
    before = specdec.wrap(target, drafter=make_drafter(setup.untrained_net(family), gamma=GAMMA, max_batch_size=2,
                                                       **TREE), **kw)
    trained_net = setup.trained[family]
    direct = specdec.wrap(target, drafter=make_drafter(trained_net, gamma=GAMMA, max_batch_size=2, **TREE), **kw)
    loaded = specdec.wrap(target, drafter=str(path), **kw)
    assert loaded.drafter.net is not trained_net
    assert loaded.drafter.net.target_embed is target.get_input_embeddings()
    recs = [_Recorder(e) for e in (direct, loaded)]
    tau0, tau1, tau_loaded = _tau(before), _tau(direct), _tau(loaded)
    assert len(recs[0].blocks) == len(recs[1].blocks)
    for a, b in zip(recs[0].blocks, recs[1].blocks):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parent, b.parent)
    assert tau1 == tau_loaded
    print(f"{family}: val loss {first['loss']:.4f} -> {last['loss']:.4f}, per-position {first['per_position']} -> "
          f"{last['per_position']}, tau (tree) untrained {tau0:.3f} trained {tau1:.3f}")
    assert tau1 > tau0 + 0.15, (tau0, tau1)


# ---- 5. errors ---------------------------------------------------------------------------------------------


def test_errors_name_the_argument(setup):
    target = setup.target("qwen3_next")
    net = setup.untrained_net("qwen3_next")
    for arg, kw in [("num_nodes", dict(num_nodes=0)), ("num_nodes", dict(num_nodes=3, depth=4)),
                    ("num_nodes", dict(num_nodes=5)),  # depth defaults to gamma = 7
                    ("depth", dict(depth=0)), ("topk", dict(topk=0)), ("gamma", dict(gamma=0)),
                    ("gamma", dict(gamma=1.5)), ("bogus", dict(bogus=1))]:
        args = dict(gamma=7, max_batch_size=2)
        args.update(kw)
        with pytest.raises(ValueError, match=arg):
            make_drafter(net, **args)
    with pytest.raises(ValueError, match="num_nodes"):
        specdec.wrap(target, drafter="eagle", untrained=True, num_draft_tokens=4, num_nodes=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        specdec.wrap(target, drafter="eagle", num_draft_tokens=0)
    # a drafter trained for another target: through a directory and as an instance
    other = tiny_model("qwen3_next", seed=1, vocab_size=64)
    with pytest.raises(ValueError, match="drafter"):
        specdec.wrap(other, drafter=str(setup.trained_dir("qwen3_next")))
    with pytest.raises(ValueError, match="drafter"):
        specdec.wrap(other, drafter=make_drafter(net, gamma=4, max_batch_size=2, **TREE), num_draft_tokens=4)
    same_dims = tiny_model("qwen3_next", seed=1)  # same sizes, different weights: the shared embedding is wrong
    with pytest.raises(ValueError, match="drafter"):
        specdec.wrap(same_dims, drafter=make_drafter(net, gamma=4, max_batch_size=2, **TREE), num_draft_tokens=4)
    assert isinstance(net, Net)
