"""Draft trees of the heads (`draft/tree.py`): EAGLE-2's dynamic tree, drafted by mtp and dspark as well as eagle.

1. `DynamicTree` equals a plain-Python construction of EAGLE-2's tree (per row: expand the top-k of the newest
   depth by cumulative score, keep the best `num_nodes` of all candidates) on random score tables.
2. Every node of an mtp tree is among the top-k of the head's own chain step run along the node's root path
   (single-query steps, fed the parent's block output), and every node of a dspark tree among the top-k of the
   block's logits of its slot plus the Markov term of its parent; a tree fed the wrong parent states fails.
3. Greedy identity with transformers' `generate` for the tree (`topk=2`) and the chain (the default), both heads;
   sampling through trees follows the target's exact joint distribution (chi-square).
4. The default shape, and the options refused with one clear error.
"""

from __future__ import annotations

import random

import pytest
import torch
from assertions import chi2_critical, chi2_gof, count_samples
from tiny_models import assert_greedy, exact_joint, generate_f64, tiny_model

import specdec
from specdec.draft import tree as tree_mod
from specdec.draft.tree import DynamicTree, log_scores
from specdec.verify import SamplingParams


# ---- 1. the tree against a plain construction ----------------------------------------------------------------


def reference_tree(scores_of, V: int, k: int, depth: int, num_nodes: int):
    """One row, lists only. `scores_of(path) -> [V]` log-probs of the token after `path` (a tuple of tokens).
    -> (tokens, parents over [anchor, tokens...]) as EAGLE-2 builds them."""
    cands = []  # (score, path, parent candidate id or -1), in creation order

    def top(path, base):
        s = scores_of(path)
        order = sorted(range(V), key=lambda t: (-s[t], t))[:k]
        return [(base + s[t], path + (t,)) for t in order]

    newest = []
    for sc, p in top((), 0.0):
        cands.append((sc, p, -1))
        newest.append(len(cands) - 1)
    for _ in range(1, depth):
        expand = sorted(newest, key=lambda i: (-cands[i][0], i))[:k]
        newest = []
        for i in expand:
            for sc, p in top(cands[i][1], cands[i][0]):
                cands.append((sc, p, i))
                newest.append(len(cands) - 1)
    keep = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))[:num_nodes])
    at = {c: j + 1 for j, c in enumerate(keep)}
    return [cands[c][1][-1] for c in keep], [-1] + [0 if cands[c][2] < 0 else at[cands[c][2]] for c in keep]


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_tree_matches_plain_construction(seed):
    rng = random.Random(seed)
    B, V = 3, 11
    k, depth = rng.choice([(2, 4), (3, 3), (4, 5), (1, 6)])
    num_nodes = rng.randint(depth, k * depth + 3)
    tables = [{} for _ in range(B)]

    def scores_of(b, path):  # a fixed random distribution per (row, path): the "drafter"
        if path not in tables[b]:
            g = torch.Generator().manual_seed(hash((seed, b, path)) % 2 ** 31)
            tables[b][path] = torch.randn(V, generator=g, dtype=torch.float64).mul(3).log_softmax(-1)
        return tables[b][path]

    paths = [[()] for _ in range(B)]  # per row: the path of every candidate, by candidate id
    tree = DynamicTree(torch.stack([scores_of(b, ()) for b in range(B)]), k)
    for b in range(B):
        paths[b] = [(int(t),) for t in tree.tok[0][b]]
    for _ in range(1, depth):
        sel, src, tok = tree.frontier()
        scores = torch.stack([torch.stack([scores_of(b, paths[b][int(c)]) for c in sel[b]]) for b in range(B)])
        tree.grow(sel, scores)
        new = tree.tok[-1]
        for b in range(B):
            w = sel.shape[1]
            paths[b] += [paths[b][int(sel[b, i // k])] + (int(new[b, i]),) for i in range(w * k)]
    block = tree.block(num_nodes)
    for b in range(B):
        tokens, parents = reference_tree(lambda p: scores_of(b, p).tolist(), V, k, depth, num_nodes)
        assert block.tokens[b].tolist() == tokens
        assert block.parent[b].tolist() == parents
    assert block.num_drafts.tolist() == [len(tokens)] * B


# ---- 2. nodes follow the heads --------------------------------------------------------------------------------

PROMPT = [3, 41, 17, 88, 9, 60, 23, 5, 6, 7, 8, 5]


def _paths(parent: list[int]) -> list[list[int]]:
    """Node j (1-based over drafts) -> its draft indices from depth 1 down to itself."""
    out = [[]]
    for j in range(1, len(parent)):
        out.append(out[parent[j]] + [j])
    return out


def _mtp_engine(family, batch):
    target = tiny_model(family, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    torch.manual_seed(0)
    engine = specdec.wrap(target, drafter="mtp", untrained=True, num_draft_tokens=4, topk=2, num_nodes=12,
                          max_batch_size=batch)
    with torch.no_grad():  # a head whose steps depend on the state fed in as much as on the token
        engine.drafter.net.hidden_norm.weight.mul_(20.0)
    return engine


def _mtp_trees(engine, prompts):
    """Generate; -> every `draft_tree` call of the rounds: (anchors, h, ctx, depth, block)."""
    net, seen = engine.drafter.net, []

    def record(anchors, h, ctx, depth, **kw):
        block = type(net).draft_tree(net, anchors, h, ctx, depth, **kw)
        seen.append((anchors, h, ctx, depth, block))
        return block
    net.draft_tree = record
    try:
        generate_f64(engine, prompts, max_new_tokens=6)
    finally:
        del net.draft_tree
    return seen


def _mtp_check(net, anchors, h, ctx, block, k) -> tuple[int, int]:
    """-> (nodes checked, nodes not among the top-k of the chain head's step along their root path)."""
    from specdec.draft.mtp import KVContext
    checked = bad = 0
    with torch.no_grad():
        for b in range(anchors.shape[0]):
            row = (lambda t: None if t is None else t[b:b + 1])  # noqa: E731
            one = KVContext(row(ctx.keys), row(ctx.values), row(ctx.visible),
                            None if ctx.rope is None else tuple(r[b:b + 1] for r in ctx.rope),
                            None if ctx.latent is None else (row(ctx.latent[0]), ctx.latent[1]))
            toks, parent = block.tokens[b].tolist(), block.parent[b].tolist()
            for path in _paths(parent)[1:]:
                tok, x, ok = anchors[b].view(1, 1), h[b].view(1, 1, -1), True
                for j in path:  # single-query steps of the chain head along the node's root path
                    logits, x = net.step(tok, x, one)
                    ok &= toks[j - 1] in logits[0, 0].topk(k).indices.tolist()
                    tok = torch.tensor([[toks[j - 1]]])
                checked, bad = checked + 1, bad + (not ok)
    return checked, bad


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next"])
def test_mtp_tree_nodes_follow_the_chain_head(family):
    engine = _mtp_engine(family, 2)
    seen = _mtp_trees(engine, [PROMPT, PROMPT[:7]])
    checked = 0
    for anchors, h, ctx, _, block in seen:
        n, bad = _mtp_check(engine.drafter.net, anchors, h, ctx, block, 2)
        assert bad == 0
        checked += n
    assert checked > 10


def test_mtp_tree_fed_the_wrong_parent_state_fails():
    """Teeth: a tree whose nodes are all expanded from the anchor's block output (not their parents') fails
    the check above."""
    engine = _mtp_engine("kimi_linear", 1)
    net = engine.drafter.net
    anchors, h, ctx, depth, _ = _mtp_trees(engine, [PROMPT])[0]
    real_step, root = net.step, {}

    def step_from_root(tok, x, c):  # the first call is the anchor's step; later ones reuse its output
        out = real_step(tok, root["x"].expand_as(x) if "x" in root else x, c)
        root.setdefault("x", out[1])
        return out
    net.step = step_from_root
    try:
        with torch.no_grad():
            wrong = type(net).draft_tree(net, anchors, h, ctx, depth, topk=2, num_nodes=12)
    finally:
        del net.step
    assert _mtp_check(net, anchors, h, ctx, wrong, 2)[1] > 0


def test_dspark_tree_nodes_follow_block_logits_and_markov_head():
    target = tiny_model("kimi_linear", seed=0)
    torch.manual_seed(0)
    d = specdec.wrap(target, drafter="dspark", untrained=True, num_draft_tokens=5, topk=3, num_nodes=10,
                     max_batch_size=2).drafter
    net = d.net
    with torch.no_grad():  # a Markov term strong enough to reorder the block's own logits
        net.markov_w.weight.normal_(0.0, 3.0 / net.config.markov_rank ** 0.5,
                                    generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, net.config.target_vocab_size, dtype=torch.float64, generator=g)
    anchors = torch.tensor([4, 9])

    def bad_nodes(block) -> int:
        """Nodes not among the top-3 of `base[slot] + markov(parent's token)` somewhere on their root path."""
        bad = 0
        for b in range(2):
            toks, parent = block.tokens[b].tolist(), block.parent[b].tolist()
            assert len(toks) == 10 and all(-1 <= p < i for i, p in enumerate(parent))
            for path in _paths(parent)[1:]:
                prev, ok = int(anchors[b]), True
                for depth, j in enumerate(path):
                    ok &= toks[j - 1] in (base[b, depth] + net.markov(torch.tensor(prev))).topk(3).indices.tolist()
                    prev = toks[j - 1]
                bad += not ok
        return bad

    with torch.no_grad():
        assert bad_nodes(d._tree(base, anchors, 5, None)) == 0
        # teeth: the Markov term of the anchor at every depth (not the parent's token) fails the check
        wrong = DynamicTree(log_scores(base[:, 0] + net.markov(anchors)), 3)
        for i in range(1, 5):
            sel, _, tok = wrong.frontier()
            wrong.grow(sel, log_scores(base[:, i, None] + net.markov(anchors)[:, None]).expand(-1, sel.shape[1], -1))
        assert bad_nodes(wrong.block(10)) > 0


# ---- 3. lossless ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_greedy_identity(kind, shape):
    target = tiny_model("kimi_linear", seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    torch.manual_seed(0)
    opts = dict(topk=2) if shape == "tree" else {}
    engine = specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=4, max_batch_size=2, **opts)
    assert engine.drafter.tree == (shape == "tree")
    prompts = [PROMPT, PROMPT[:7]]
    out = generate_f64(engine, prompts, max_new_tokens=12)
    assert_greedy(out, target, prompts, 12, f"{kind} {shape}: ")
    assert out.stats.proposed > 0


V, NEW, BATCH = 8, 3, 100
SAMPLE_PROMPT = [1, 3, 5, 7, 2, 4, 6, 0, 5, 3]


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_tree_sampling_follows_target(kind):
    target = tiny_model("qwen3_next", seed=0, vocab_size=V, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    torch.manual_seed(3)
    engine = specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=2, topk=2, num_nodes=4,
                          max_batch_size=BATCH, max_length=32)
    assert engine.drafter.tree
    params = dict(temperature=0.7)
    joint = exact_joint(target, SAMPLE_PROMPT, SamplingParams(do_sample=True, **params), NEW)
    counts, totals = count_samples(engine, 20 * BATCH, 0, prompt=SAMPLE_PROMPT, vocab=V, new=NEW, batch=BATCH,
                                   **params)
    assert totals["accepted"] > 0 and totals["drafter_failures"] == 0
    stat, df = chi2_gof(counts, joint.flatten())
    assert stat < chi2_critical(df), f"{kind} tree: chi2 {stat:.1f} >= critical {chi2_critical(df):.1f} (df {df})"


# ---- 4. shapes and options ------------------------------------------------------------------------------------


def test_default_shape_is_the_chain():
    assert tree_mod.tree_options(7, None, None) == (1, 16)
    assert tree_mod.tree_options(7, 2, None) == (2, 16)
    assert tree_mod.tree_options(20, 2, None) == (2, 20)  # a budget holds a tree of gamma's depth
    assert tree_mod.tree_options(7, 4, 30) == (4, 30)
    target = tiny_model("kimi_linear", seed=0)
    for kind in ("mtp", "dspark"):
        c = specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=5).drafter
        assert (c.topk, c.tree, c.max_verify_tokens(5)) == (1, False, 6)
        d = specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=5, topk=2).drafter
        assert (d.topk, d.num_nodes, d.tree, d.max_verify_tokens(5)) == (2, 16, True, 17)
    # dspark's confidence threshold cuts a chain: a tree with it is refused
    assert not specdec.wrap(target, drafter="dspark", untrained=True, confidence_threshold=0.5).drafter.tree
    with pytest.raises(ValueError, match="topk"):
        specdec.wrap(target, drafter="dspark", untrained=True, confidence_threshold=0.5, topk=2)


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
@pytest.mark.parametrize("opts, match", [(dict(topk=0), "topk"), (dict(topk=True), "topk"),
                                         (dict(num_nodes=3), "num_nodes"), (dict(num_nodes=2.5), "num_nodes"),
                                         (dict(depth=3), "depth")])
def test_bad_shape_options_raise(kind, opts, match):
    target = tiny_model("kimi_linear", seed=0)
    with pytest.raises(ValueError, match=match):
        specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=5, **opts)


def test_tree_stays_closed_with_nonfinite_scores():
    """NaN / inf draft logits (a broken drafter) still give a tree closed under ancestors: `log_scores` maps them
    into [-inf, 0], so no node is kept without its parent."""
    g = torch.Generator().manual_seed(0)
    B, V, k, nodes = 3, 6, 2, 7
    logits = torch.randn(B, V, generator=g)
    logits[0, 1], logits[1] = float("nan"), float("inf")
    tree = DynamicTree(log_scores(logits), k)
    for d in range(3):
        sel, _, _ = tree.frontier()
        step = torch.randn(B, sel.shape[1], V, generator=g)
        step[0, 0], step[2, :, d] = float("nan"), float("-inf")
        tree.grow(sel, log_scores(step))
    parent = tree.block(nodes).parent
    assert (parent[:, 0] == -1).all()
    assert ((parent[:, 1:] >= 0) & (parent[:, 1:] < torch.arange(1, nodes + 1))).all(), parent
