"""Acceptance rules vs independent references.

Greedy: a literal pure-python walk. Logits transform: transformers' own warpers. Sampling: chi-square
goodness of fit of the emitted tokens against the target distribution (fixed seeds, so the tests are
deterministic), plus teeth checks showing the same test rejects deliberately wrong rules.
"""

from __future__ import annotations


import pytest
import torch
from assertions import assert_close, chi2_critical, chi2_gof
from hypothesis import given
from hypothesis import strategies as st
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import specdec.verify.accept as accept_mod
from specdec.kernels.tree import VerifyTree
from specdec.verify import (SamplingParams, accept_chain_greedy, accept_chain_sampling, accept_round,
                            accept_tree_greedy, accept_tree_sampling, probs_from_logits)

N = 20_000  # independent requests per statistical test, one row each
V = 8

# ----------------------------------------------------------------------------------------------
# chi-square goodness of fit


def chi2_stat(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of token `samples` `[n]` against `probs` `[V]`."""
    return chi2_gof(torch.bincount(samples, minlength=probs.numel()), probs)


def fit(first: torch.Tensor, p1: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
        p2: torch.Tensor | None = None) -> tuple[float, float]:
    """`(statistic, critical value)` for `first` ~ `p1` `[V]` and, if given, second tokens ~ `p2[first]`.

    `pairs` = (first, second) tokens of the rows that emitted two tokens; groups are summed.
    """
    stat, df = chi2_stat(first, p1)
    if pairs is not None:
        a, b = pairs
        for tok in range(p2.shape[0]):
            sel = b[a == tok]
            if sel.numel() >= 100:
                s, d = chi2_stat(sel, p2[tok])
                stat, df = stat + s, df + d
    return stat, chi2_critical(df)


def test_wilson_hilferty_matches_tables():
    # chi-square upper 0.001 quantiles from standard tables
    for df, q in [(5, 20.515), (10, 29.588), (30, 59.703)]:
        assert abs(chi2_critical(df, 1e-3) - q) / q < 0.015


# ----------------------------------------------------------------------------------------------
# probs_from_logits vs transformers


@given(st.data())
def test_probs_from_logits_matches_transformers(data):
    v = data.draw(st.integers(1, 12), label="V")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    temperature = data.draw(st.sampled_from([1.0, 0.7, 0.3, 1.8]), label="temperature")
    top_k = data.draw(st.integers(0, v + 2), label="top_k")
    top_p = data.draw(st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.1]), label="top_p")
    ties = data.draw(st.booleans(), label="ties")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, v, generator=gen) * 3
    if ties:  # repeated values exercise top-k / top-p tie handling
        logits = logits.round()
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)

    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)

    got = probs_from_logits(logits, params)
    assert got.dtype == torch.float32
    assert_close(got, expected, exact=True, msg="probs vs transformers")
    # leading dims are batch dims
    assert_close(probs_from_logits(logits.view(7, 1, v), params), expected.view(7, 1, v), exact=True, msg="3-D")


def test_probs_from_logits_greedy_and_dtypes():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 1.0, 1.0]])
    greedy = probs_from_logits(logits, SamplingParams())
    assert torch.equal(greedy, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert probs_from_logits(logits.double(), SamplingParams(do_sample=True)).dtype == torch.float64
    half = probs_from_logits(logits.bfloat16(), SamplingParams(do_sample=True, top_k=2))
    assert half.dtype == torch.float32 and torch.allclose(half.sum(-1), torch.ones(2))
    # top-p keeps the smallest most-likely set reaching top_p: 0.6 + 0.3 >= 0.85
    probs = torch.tensor([0.6, 0.3, 0.1]).log()
    out = probs_from_logits(probs, SamplingParams(do_sample=True, top_p=0.85))
    assert_close(out, torch.tensor([2 / 3, 1 / 3, 0.0]), msg="top-p set")


# ----------------------------------------------------------------------------------------------
# greedy vs a pure-python walk


def py_argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda k: row[k])  # first index among ties, like torch


def py_tree_greedy(tokens: list[int], parent: list[int], logits: list[list[float]]) -> tuple[list[int], int]:
    node, path = 0, [0]
    while True:
        want = py_argmax(logits[node])
        nxt = next((j for j in range(len(parent)) if parent[j] == node and tokens[j] == want), None)
        if nxt is None:
            return path, want
        node = nxt
        path.append(node)


def tree_depth(parent: list[int]) -> int:
    depth = [0] * len(parent)
    for j in range(1, len(parent)):
        depth[j] = depth[parent[j]] + 1 if parent[j] >= 0 else 0
    return max(depth)


@given(st.data())
def test_chain_greedy_matches_python(data):
    b = data.draw(st.integers(1, 4), label="B")
    g = data.draw(st.integers(0, 5), label="G")
    v = data.draw(st.integers(2, 5), label="V")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    logits = torch.randint(-2, 3, (b, g + 1, v), generator=gen).float()  # small ints: ties on purpose
    best = logits.argmax(-1)[:, :g]
    drafts = torch.where(torch.rand(b, g, generator=gen) < 0.7, best, torch.randint(0, v, (b, g), generator=gen))
    capped = data.draw(st.booleans(), label="num_drafts")
    nd = torch.randint(0, g + 1, (b,), generator=gen) if capped else None

    acc = accept_chain_greedy(drafts, logits, num_drafts=nd)
    n, bonus = acc.num_accepted, acc.bonus
    assert torch.equal(acc.num_kept, n + 1) and acc.path.shape == acc.tokens.shape == (b, g + 1)
    for r in range(b):  # the record: the kept nodes 0..n, the emitted tokens (accepted drafts, then the bonus)
        assert acc.path[r].tolist() == list(range(int(n[r]) + 1)) + [-1] * (g - int(n[r]))
        assert acc.tokens[r, :int(n[r]) + 1].tolist() == drafts[r, :int(n[r])].tolist() + [int(bonus[r])]
    for r in range(b):
        lg = logits[r].tolist()
        limit = g if nd is None else int(nd[r])
        k = 0
        while k < limit and int(drafts[r, k]) == py_argmax(lg[k]):
            k += 1
        assert int(n[r]) == k and int(bonus[r]) == py_argmax(lg[k]), (r, k)
    # the chain is the tree rule on a chain-shaped tree
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long), drafts], 1)
    parent = torch.arange(-1, g).expand(b, g + 1).clone()
    if nd is not None:
        parent[torch.arange(g + 1) > nd[:, None]] = -1  # unproposed drafts become padding nodes
    tacc = accept_tree_greedy(tokens, parent, logits)
    path, tbonus = tacc.path, tacc.bonus
    assert torch.equal(tbonus, bonus)
    assert torch.equal(tacc.num_accepted, n) and torch.equal(tacc.num_kept, acc.num_kept)
    assert all(tacc.tokens[r, :int(n[r]) + 1].tolist() == acc.tokens[r, :int(n[r]) + 1].tolist() for r in range(b))
    assert torch.equal((path >= 0).sum(1) - 1, n)


@given(st.data())
def test_tree_greedy_matches_python(data):
    b = data.draw(st.integers(1, 3), label="B")
    t = data.draw(st.integers(1, 9), label="T")
    v = data.draw(st.integers(2, 4), label="V")
    per_row = data.draw(st.booleans(), label="per_row_parent")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    n_par = b if per_row else 1
    parents = [[-1] + [data.draw(st.integers(-1 if per_row else 0, i - 1)) for i in range(1, t)] for _ in range(n_par)]
    parent = torch.tensor(parents) if per_row else torch.tensor(parents[0])
    logits = torch.randint(-2, 3, (b, t, v), generator=gen).float()
    tokens = torch.randint(0, v, (b, t), generator=gen)
    for r in range(b):  # make matches likely: node j often carries its parent's argmax
        par = parents[r if per_row else 0]
        for j in range(1, t):
            if par[j] >= 0 and torch.rand(1, generator=gen).item() < 0.6:
                tokens[r, j] = logits[r, par[j]].argmax()

    acc = accept_tree_greedy(tokens, parent, logits)
    path, bonus = acc.path, acc.bonus
    acc = accept_round(tokens, VerifyTree.check(parent, b, t), num_drafts=None, logits=logits)  # the engine's: M = T
    fixed, fixed_bonus = acc.path, acc.bonus
    m = max(tree_depth(p) for p in parents) + 1
    assert path.shape == (b, m) and path.dtype == torch.long
    assert fixed.shape == (b, t)
    for r in range(b):
        ref_path, ref_bonus = py_tree_greedy(tokens[r].tolist(), parents[r if per_row else 0], logits[r].tolist())
        assert path[r].tolist() == ref_path + [-1] * (m - len(ref_path))
        assert fixed[r].tolist() == ref_path + [-1] * (t - len(ref_path))
        assert int(bonus[r]) == ref_bonus == int(fixed_bonus[r])


# ----------------------------------------------------------------------------------------------
# sampling: exact small cases and chain / tree consistency


def test_sampling_edge_cases():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(50, 4, 5, generator=gen).softmax(-1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 5), 1, generator=gen).view(50, 3)
    acc = accept_chain_sampling(drafts, p[:, :3], p, generator=gen)
    n, _ = acc.num_accepted, acc.bonus
    assert torch.equal(n, torch.full((50,), 3))  # q == p: every draft is accepted
    zero = p.clone()
    zero[:, 0].scatter_(-1, drafts[:, :1], 0.0)  # the first draft is impossible under the target
    acc = accept_chain_sampling(drafts, p[:, :3], zero, generator=gen)
    n, bonus = acc.num_accepted, acc.bonus
    assert torch.equal(n, torch.zeros(50, dtype=torch.long)) and not bool((bonus == drafts[:, 0]).any())
    acc = accept_chain_sampling(drafts, None, p, generator=gen, num_drafts=torch.zeros(50, dtype=torch.long))
    n, _ = acc.num_accepted, acc.bonus
    assert torch.equal(n, torch.zeros(50, dtype=torch.long))
    # G = 0 and a root-only tree: just the bonus
    acc = accept_chain_sampling(drafts[:, :0], None, p[:, :1], generator=gen)
    n, bonus = acc.num_accepted, acc.bonus
    assert n.shape == (50,) and bonus.shape == (50,) and not n.any()
    acc = accept_tree_sampling(drafts[:, :1], torch.tensor([-1]), None, p[:, :1], generator=gen)
    path, bonus = acc.path, acc.bonus
    assert torch.equal(path, torch.zeros(50, 1, dtype=torch.long))
    # low-precision inputs are computed in float32
    acc = accept_chain_sampling(drafts, p[:, :3].bfloat16(), p.bfloat16(), generator=gen)
    n, bonus = acc.num_accepted, acc.bonus
    assert n.dtype == torch.long and bonus.dtype == torch.long


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("capped", [False, True])
def test_chain_sampling_is_the_tree_rule_on_a_chain(deterministic, capped):
    b, g = 500, 4
    gen = torch.Generator().manual_seed(3)
    p = (torch.randn(b, g + 1, V, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(b, g, V, generator=gen) * 1.5).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(b, g)
    nd = torch.randint(0, g + 1, (b,), generator=gen) if capped else None
    dp = None if deterministic else q

    acc = accept_chain_sampling(drafts, dp, p, generator=torch.Generator().manual_seed(11), num_drafts=nd)
    n, bonus = acc.num_accepted, acc.bonus
    acc = accept_chain_sampling(drafts, dp, p, generator=torch.Generator().manual_seed(11), num_drafts=nd)
    n2, bonus2 = acc.num_accepted, acc.bonus
    assert torch.equal(n, n2) and torch.equal(bonus, bonus2)  # seeded runs reproduce

    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long), drafts], 1)
    parent = torch.arange(-1, g).expand(b, g + 1).clone()
    if nd is not None:
        parent[torch.arange(g + 1) > nd[:, None]] = -1
    tq = None if deterministic else torch.cat([torch.zeros(b, 1, V), q], 1)
    acc = accept_tree_sampling(tokens, parent, tq, p, generator=torch.Generator().manual_seed(11))
    path, tbonus = acc.path, acc.bonus
    assert torch.equal((path >= 0).sum(1) - 1, n)
    assert torch.equal(tbonus, bonus)
    assert 0 < n.float().mean() < g  # both accepts and rejections happen


# ----------------------------------------------------------------------------------------------
# sampling: statistical tests

CONFIGS = {
    "plain": SamplingParams(do_sample=True),
    "t0.7_top_p0.9": SamplingParams(do_sample=True, temperature=0.7, top_p=0.9),
    "top_k4": SamplingParams(do_sample=True, top_k=4),
}


def dists(gen: torch.Generator, params: SamplingParams, *lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft distributions `[*lead, V]`: related (so drafts get accepted), not equal."""
    base = torch.randn(*lead, V, generator=gen)
    p = probs_from_logits(0.8 * (base + torch.randn(*lead, V, generator=gen)), params)
    q = probs_from_logits(0.8 * (base + torch.randn(*lead, V, generator=gen)), params)
    assert bool(((p > 0).sum(-1) >= 3).all()), "degenerate test setup: target support below 3 tokens"
    return p, q


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, replacement=True, generator=gen).squeeze(-1)


def run_chain(seed: int, params: SamplingParams, *, deterministic: bool, wrong_q: bool = False):
    """Two-draft chains where the target / draft at position 1 depend on the first token.

    Returns `(statistic, critical value, fraction of rows emitting two tokens)`. `wrong_q` passes the
    draft distribution along with deterministic drafts (a bug the test must catch).
    """
    gen = torch.Generator().manual_seed(seed)
    (p1, q1), (p3, _) = dists(gen, params), dists(gen, params)
    p2, q2 = dists(gen, params, V)  # row a: next-token dists after token a
    if deterministic:  # fixed drafts: the target's second choice, so accepts and rejects both happen
        x1 = p1.topk(2).indices[1].expand(N)
        x2 = p2.topk(2, -1).indices[:, 1][x1]
    else:
        x1 = draw(q1.expand(N, V), gen)
        x2 = draw(q2[x1], gen)
    drafts = torch.stack([x1, x2], 1)
    target = torch.stack([p1.expand(N, V), p2[x1], p3.expand(N, V)], 1)
    dp = None if deterministic and not wrong_q else torch.stack([q1.expand(N, V), q2[x1]], 1)
    acc = accept_chain_sampling(drafts, dp, target, generator=torch.Generator().manual_seed(seed + 1))
    n, bonus = acc.num_accepted, acc.bonus
    first = torch.where(n >= 1, x1, bonus)
    two = n >= 1
    second = torch.where(n >= 2, x2, bonus)
    return *fit(first, p1, (first[two], second[two]), p2), two.float().mean().item()


# root with 3 children, each with 2 children: 2-3 siblings per node
TREE_PARENT = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])


def run_tree(seed: int, params: SamplingParams, *, deterministic: bool, wrong_q: bool = False):
    """Depth-2 trees; the target / draft at a depth-1 node depend on its token. Returns as `run_chain`."""
    gen = torch.Generator().manual_seed(seed)
    (p1, q1), (p3, _) = dists(gen, params), dists(gen, params)
    p2, q2 = dists(gen, params, V)
    t = TREE_PARENT.numel()
    tokens = torch.zeros(N, t, dtype=torch.long)
    if deterministic:  # fixed drafts: distinct top tokens of the draft model
        tokens[:, 1:4] = q1.topk(3).indices
        tokens[:, 4:] = q2.topk(2, -1).indices[tokens[:, 1:4]].reshape(N, 6)
    else:  # siblings drawn i.i.d. from the draft distribution
        tokens[:, 1:4] = torch.multinomial(q1.expand(N, V), 3, replacement=True, generator=gen)
        tokens[:, 4:] = torch.multinomial(q2[tokens[:, 1:4]].reshape(-1, V), 2, replacement=True,
                                          generator=gen).view(N, 6)
    mid = tokens[:, TREE_PARENT[4:]]  # tokens of the leaves' parents
    target = torch.cat([p1.expand(N, 1, V), p2[tokens[:, 1:4]], p3.expand(N, 6, V)], 1)
    dp = None
    if not deterministic or wrong_q:
        dp = torch.cat([torch.zeros(N, 1, V), q1.expand(N, 3, V), q2[mid]], 1)
    gen_accept = torch.Generator().manual_seed(seed + 1)
    acc = accept_tree_sampling(tokens, TREE_PARENT, dp, target, generator=gen_accept)
    path, bonus = acc.path, acc.bonus
    assert path.shape == (N, 3)
    rows = torch.arange(N)
    tok_at = [torch.where(path[:, k] >= 0, tokens[rows, path[:, k].clamp_min(0)], bonus) for k in (1, 2)]
    first, second = tok_at
    two = path[:, 1] >= 0
    return *fit(first, p1, (first[two], second[two]), p2), two.float().mean().item()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("run, seed, most", [(run_chain, 100, 0.98), (run_tree, 200, 0.99)], ids=["chain", "tree"])
def test_sampling_follows_target(config, deterministic, run, seed, most):
    """Chains and depth-2 trees: the emitted pair of tokens follows the target (chi-square), with both branches of
    the first step exercised (the first draft / a depth-1 node accepted, or not)."""
    stat, crit, two = run(seed, CONFIGS[config], deterministic=deterministic)
    assert 0.05 < two < most, f"one branch barely exercised: {two:.3f} of rows accept at depth 1"
    assert stat < crit, f"chi-square {stat:.1f} >= critical {crit:.1f}"


def test_teeth_resampling_from_p_instead_of_the_residual(monkeypatch):
    monkeypatch.setattr(accept_mod, "_residual", lambda p, q: p)
    for run in (run_chain, run_tree):
        stat, crit, _ = run(300, CONFIGS["plain"], deterministic=False)
        assert stat > crit, f"{run.__name__}: wrong rule passed, chi-square {stat:.1f} < {crit:.1f}"


def test_teeth_deterministic_drafts_passed_with_q():
    # (The converse, sampled drafts passed as deterministic, is lossless: accept x with p(x), else
    # resample from p without x is exact for any proposal, only less efficient.)
    for run in (run_chain, run_tree):
        stat, crit, _ = run(400, CONFIGS["t0.7_top_p0.9"], deterministic=True, wrong_q=True)
        assert stat > crit, f"{run.__name__}: wrong rule passed, chi-square {stat:.1f} < {crit:.1f}"


def test_teeth_accepting_without_the_ratio(monkeypatch):
    # accept whenever the target allows the token at all: emitted tokens drift toward q
    monkeypatch.setattr(accept_mod, "_accept", lambda u, p_x, q_x: p_x > 0)
    stat, crit, _ = run_chain(500, CONFIGS["plain"], deterministic=False)
    assert stat > crit, f"wrong rule passed, chi-square {stat:.1f} < {crit:.1f}"


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(do_sample=True, temperature=0.0), "temperature: expected a finite value > 0"),
    (dict(do_sample=True, temperature=-1.0), "temperature: expected a finite value > 0"),
    (dict(top_k=-1), "top_k: expected an int >= 0"),
    (dict(top_p=0.0), "top_p: expected 0 < top_p <= 1"),
    (dict(top_p=1.5), "top_p: expected 0 < top_p <= 1"),
    (dict(do_sample=1), "do_sample: expected a bool"),
])
def test_sampling_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_ignores_temperature():
    SamplingParams(do_sample=False, temperature=0.0)


def test_probs_from_logits_errors():
    with pytest.raises(ValueError, match="logits: expected a floating tensor"):
        probs_from_logits(torch.zeros(2, 3, dtype=torch.long), SamplingParams())
    with pytest.raises(ValueError, match="params: expected SamplingParams"):
        probs_from_logits(torch.zeros(2, 3), {"do_sample": True})


def _chain_inputs(b=2, g=3, v=5):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, v, (b, g), generator=gen), torch.rand(b, g, v, generator=gen).softmax(-1),
            torch.rand(b, g + 1, v, generator=gen).softmax(-1))


@pytest.mark.parametrize("case, match", [
    ("target_short", r"target_probs: expected a floating tensor \[B, G\+1, V\] = \[2, 4, V\]"),
    ("draft_probs_shape", r"draft_probs: expected a floating tensor \[B, G, V\] = \[2, 3, 5\]"),
    ("float_tokens", r"draft_tokens: expected an integer tensor \[B, G\]"),
    ("token_range", r"draft_tokens: token 7 at \(1, 2\) is outside the vocabulary \[0, 5\)"),
    ("num_drafts_range", r"num_drafts: expected values in \[0, G\] = \[0, 3\]"),
    ("num_drafts_shape", r"num_drafts: expected an integer tensor \[B\] = \[2\]"),
    ("generator", r"generator: expected a torch.Generator or None"),
])
def test_chain_errors(case, match):
    drafts, q, p = _chain_inputs()
    kw: dict = {"generator": torch.Generator().manual_seed(0)}
    if case == "target_short":
        p = p[:, :3]
    elif case == "draft_probs_shape":
        q = q[:, :, :4]
    elif case == "float_tokens":
        drafts = drafts.float()
    elif case == "token_range":
        drafts[1, 2] = 7
    elif case == "num_drafts_range":
        kw["num_drafts"] = torch.tensor([1, 4])
    elif case == "num_drafts_shape":
        kw["num_drafts"] = torch.tensor([1])
    elif case == "generator":
        kw["generator"] = 0
    state = kw["generator"].get_state() if isinstance(kw["generator"], torch.Generator) else None
    with pytest.raises(ValueError, match=match):
        accept_chain_sampling(drafts, q, p, **kw)
    if state is not None:  # raised before any random draw
        assert torch.equal(kw["generator"].get_state(), state)
    if case not in ("draft_probs_shape", "generator"):
        greedy_kw = {k: w for k, w in kw.items() if k == "num_drafts"}
        with pytest.raises(ValueError, match=match.replace("target_probs", "target_logits")):
            accept_chain_greedy(drafts, p, **greedy_kw)


def test_padding_drafts_beyond_num_drafts_may_hold_anything():
    drafts, q, p = _chain_inputs()
    drafts[:, 2] = -1
    acc = accept_chain_greedy(drafts, p, num_drafts=torch.tensor([2, 1]))
    n, _ = acc.num_accepted, acc.bonus
    assert bool((n <= torch.tensor([2, 1])).all())


@pytest.mark.parametrize("parent, match", [
    ([-1, 0, 2, 1], r"parent: not topological; expected -1 <= parent\[i\] < i"),
    ([-1, 0, 3, 1], r"parent: not topological"),
    ([0, 0, 1, 1], r"parent: node 0 is the root and must have parent -1"),
    ([-1, 0, -2, 1], r"parent: not topological"),
    ([-1, 0, 1], r"parent: expected an integer tensor \[T\] = \[4\] or \[B, T\] = \[2, 4\]"),
])
def test_tree_parent_errors(parent, match):
    tokens = torch.zeros(2, 4, dtype=torch.long)
    p = torch.full((2, 4, 3), 1 / 3)
    with pytest.raises(ValueError, match=match):
        accept_tree_greedy(tokens, torch.tensor(parent), p)
    with pytest.raises(ValueError, match=match):
        accept_tree_sampling(tokens, torch.tensor(parent), None, p)


def test_tree_shape_errors():
    tokens = torch.zeros(2, 4, dtype=torch.long)
    parent = torch.tensor([-1, 0, 0, 1])
    p = torch.full((2, 4, 3), 1 / 3)
    with pytest.raises(ValueError, match=r"target_probs: expected a floating tensor \[B, T, V\] = \[2, 4, V\]"):
        accept_tree_sampling(tokens, parent, None, p[:, :3])
    with pytest.raises(ValueError, match=r"draft_probs: expected a floating tensor \[B, T, V\] = \[2, 4, 3\]"):
        accept_tree_sampling(tokens, parent, p[:1], p)
    with pytest.raises(ValueError, match=r"tokens: token 3 at \(0, 2\) is outside the vocabulary \[0, 3\)"):
        accept_tree_greedy(tokens.index_put((torch.tensor([0]), torch.tensor([2])), torch.tensor(3)), parent, p)
    with pytest.raises(ValueError, match=r"tokens: expected an integer tensor \[B, T\] with T >= 1"):
        accept_tree_greedy(tokens[:, :0], parent[:0], p[:, :0])
