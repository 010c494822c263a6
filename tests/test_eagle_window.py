"""The eagle drafter's context window: with `context_window` W a query at position p attends to keys at positions
p - W + 1 .. p only, so the drafter keeps each row's K/V in a ring of W slots and a round reads that ring, never the
whole context.

1. Drafts equal an independent computation through the net (float64, a tiny target): for every node, one `Net.run`
   over the row's whole committed sequence of pairs, the root pair and the node's path from the root, with the
   causal and windowed visibility as a dense mask (no drafter, no cache, no ring), and EAGLE-2's tree built from
   those logits. One batch holds rows shorter than W, longer than W and several rings long, a prompt longer than
   the ring (observed through its last ring only) and a row that joins later; some rounds draft only some rows, so
   the others' queues of committed pairs outgrow a round's (and the ring, at the smallest W). Chains and trees, a
   one-layer and a two-layer net, a window smaller than the tree's depth and one larger.
2. Without a window the drafts are today's: pinned tokens and parents (`TODAYS`), and, bitwise, the same draft
   logits and drafts as with a window longer than every context (where the window's masks and ring writes change
   nothing).
3. Cost and memory: a propose past the ring runs the same ops on the same shapes at any context; the cache never
   outgrows the ring, and `memory_specs` is what it allocates, with static and dynamic shapes.
4. In the engine (`specdec.wrap(..., context_window=W)`): the static draft step drafts what the dynamic path does,
   round for round, and the greedy output equals transformers' greedy generate.
5. The shipped eagle drafter of the embedded model carries a window; in float32 its drafts equal the reference's
   at contexts past its ring.
6. Training sees the same window: a step-1 draft at position t equals the net run over the pairs of its window
   alone (at their own positions), and a window longer than the batch's windows leaves the loss bitwise unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch
from assertions import RecordedOps, assert_close, max_rel_err
from tiny_models import assert_greedy, generate_f64, tiny_model

import specdec
from specdec.draft import eagle_drafter
from specdec.draft.base import Contexts, Observation
from specdec.draft.registry import build_drafter_net, own_state_dict, save_drafter
from specdec.draft.tree import DynamicTree, log_scores

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "specdec", "embedded")
GAMMA = 4


@pytest.fixture(scope="module")
def target():
    return tiny_model("kimi_linear", seed=0)


def _random_net(target, num_layers: int = 1, seed: int = 6, **config):
    """A float64 eagle net for `target` with random weights large enough that drafts vary with the context."""
    torch.manual_seed(seed)
    net = build_drafter_net("eagle", target, num_layers=num_layers, **config).double()
    with torch.no_grad():
        for p in own_state_dict(net).values():
            p.add_(torch.randn_like(p) * 0.3)
    return net


# ---- the independent computation -------------------------------------------------------------------------
@torch.no_grad()
def reference(net, feats: torch.Tensor, nxt: torch.Tensor, W: int, depth: int, topk: int, num_nodes: int):
    """One row's draft through the net alone. `feats [n, F]`: the concatenated target features of its n committed
    positions; `nxt [n]`: the token after each (the last: the anchor), so the pairs at positions 0 .. n - 1 are the
    committed ones then the root. Every node's hidden is the last of one `Net.run` over those pairs and the node's
    path from the root (each step's token with its parent's hidden), at positions 0 .. n - 1 + depth, visibility
    causal and, with W, windowed (a dense mask). -> (block, root logits `[V]`, per further depth the expanded
    nodes' logits `[w, V]`)."""
    x0 = net.inputs(nxt[None], net.fused(feats[None]))  # [1, n, d]

    def last_hidden(x):
        i = torch.arange(x.shape[1])
        ok = i[:, None] >= i[None, :]
        if W:
            ok &= i[:, None] - i[None, :] < W
        h, _ = net.run(x, i[None], ok[None])
        return h[0, -1]

    root_h = last_hidden(x0)
    root_logits = net.lm_logits(root_h)
    tree = DynamicTree(log_scores(root_logits[None]), topk)
    paths, hidden, per_depth = [], [], []
    for _ in range(1, depth):
        sel, src, tok = tree.frontier()
        logits = []
        for j in range(sel.shape[1]):
            s = int(src[0, j])
            parent_h = root_h if s < 0 else hidden[s]
            path = x0.new_zeros(0, x0.shape[-1]) if s < 0 else paths[s]
            path = torch.cat([path, net.inputs(tok[:, j:j + 1], parent_h[None, None])[0]])
            h = last_hidden(torch.cat([x0, path[None]], 1))
            paths.append(path)
            hidden.append(h)
            logits.append(net.lm_logits(h))
        per_depth.append(torch.stack(logits))
        tree.grow(sel, log_scores(per_depth[-1][None]))
    return tree.block(num_nodes), root_logits, per_depth


class Rows:
    """Request rows fed to a drafter as an engine does: a stream of random tokens and features per row, observed in
    pieces (a prompt, then rounds that start with the anchor the propose before was given)."""

    def __init__(self, drafter, lengths: list[int], seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.drafter, self.net = drafter, drafter.net
        d, V = self.net.config.target_hidden_size, self.net.config.target_vocab_size
        n = max(lengths) + 64
        self.tokens = [torch.randint(3, V, (n,), generator=gen) for _ in lengths]
        self.feats = [{l: torch.randn(n, d, generator=gen, dtype=torch.float64) for l in drafter.feature_layers}
                      for _ in lengths]
        self.have = [0] * len(lengths)

    def observe(self, counts: dict[int, int]) -> None:
        rows = sorted(counts)
        fresh = [r for r in rows if self.have[r] == 0]
        if fresh:
            self.drafter.begin(fresh, [self.tokens[r][:counts[r]] for r in fresh])
        span = [(self.have[r], self.have[r] + counts[r]) for r in rows]
        self.drafter.observe(Observation.of(
            rows, [self.tokens[r][a:b] for r, (a, b) in zip(rows, span)],
            [self.feats[r][self.drafter.feature_layers[0]][a:b] for r, (a, b) in zip(rows, span)],
            {l: [self.feats[r][l][a:b] for r, (a, b) in zip(rows, span)] for l in self.drafter.feature_layers}))
        for r, (_, b) in zip(rows, span):
            self.have[r] = b

    def propose(self, rows: list[int]):
        """-> (block, every draft-logit output of the drafter in order: the root's `[B, V]`, then one `[B, w, V]`
        per further depth)."""
        seen, net = [], self.net
        net.lm_logits = lambda h, _f=type(net).lm_logits: seen.append(_f(net, h)) or seen[-1]
        try:
            block = self.drafter.propose(rows, Contexts.of([self.tokens[r][:self.have[r] + 1] for r in rows]), GAMMA)
        finally:
            del net.lm_logits
        return block, seen

    def reference(self, r: int, W: int):
        n = self.have[r]
        feats = torch.cat([self.feats[r][l][:n] for l in self.drafter.feature_layers], -1)
        return reference(self.net, feats, self.tokens[r][1:n + 1], W, GAMMA, self.drafter.topk,
                         self.drafter.num_nodes)


def check_against_reference(rows: Rows, drafted: list[int], block, logits, W: int) -> None:
    """Each drafted row's block and draft logits against its reference (float64 tolerance: the same sums in
    another order and grouping)."""
    for b, r in enumerate(drafted):
        want, root, per_depth = rows.reference(r, W)
        assert_close(logits[0][b], root, msg=f"row {r} at {rows.have[r]}: root logits")
        for d, ref in enumerate(per_depth):
            assert_close(logits[1 + d][b], ref, msg=f"row {r} at {rows.have[r]}: depth {d + 1} logits")
        assert torch.equal(block.tokens[b], want.tokens[0]), f"row {r} at {rows.have[r]}: drafts"
        assert torch.equal(block.parent[b], want.parent[0]), f"row {r} at {rows.have[r]}: parents"


# rows 0-2 start together (prompts shorter than W, past W, past the ring); row 3 joins after the first round
PROMPTS = {0: 2, 1: 9, 2: 40}
LATE = (3, 13)


def _schedule(rows: Rows, check, rounds: int = 9, seed: int = 2) -> None:
    """The prompts, then `rounds` rounds of 1..GAMMA + 1 kept positions per row; every third round drafts only the
    even rows (the odd ones' queues grow over two rounds). `check(drafted, block, logits)` after every propose."""
    gen = torch.Generator().manual_seed(seed)
    rows.observe(dict(PROMPTS))
    live = sorted(PROMPTS)
    for k in range(rounds):
        drafted = [r for r in live if k % 3 != 2 or r % 2 == 0]
        block, logits = rows.propose(drafted)
        check(drafted, block, logits)
        rows.observe({r: int(torch.randint(1, GAMMA + 2, (1,), generator=gen)) for r in live})
        if k == 0:  # a fresh row observes in a call of its own
            rows.observe({LATE[0]: LATE[1]})
            live.append(LATE[0])


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("W", [2, 7])
@pytest.mark.parametrize("topk, num_nodes", [(1, GAMMA), (2, 7)], ids=["chain", "tree"])
def test_drafts_equal_the_windowed_net(target, monkeypatch, layers, W, topk, num_nodes):
    """See 1 (W 2, below the tree's depth: the deeper nodes see neither the committed keys nor the root nor their
    farther ancestors, and the queue outgrows the ring). A prompt's pairs run 8 at a time (a few chunks per
    prompt, each over the keys of its window)."""
    monkeypatch.setattr(eagle_drafter, "QUERY_CHUNK", 8)
    net = _random_net(target, layers)
    drafter = eagle_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=4, topk=topk, num_nodes=num_nodes,
                                         context_window=W)
    rows = Rows(drafter, [60] * 4, seed=1)
    checked = []

    def check(drafted, block, logits):
        check_against_reference(rows, drafted, block, logits, W)
        checked.append([rows.have[r] for r in drafted])

    _schedule(rows, check)
    assert len(checked) == 9 and max(max(c) for c in checked) > 6 * W
    assert drafter.cache[0][0].shape[2] == W  # wrapped, never grown past the ring
    assert min(map(min, checked)) == PROMPTS[0] <= W  # a row checked at its prompt of 2, at most W


def test_no_window_drafts_are_todays(target):
    """See 2: without a window, a schedule of rounds drafts, as a tree, the pinned tokens and parents (`TODAYS`)."""
    net = _random_net(target)
    drafter = eagle_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=4, topk=2, num_nodes=7)
    assert drafter.window == 0
    rows = Rows(drafter, [60] * 4, seed=1)
    got = []
    _schedule(rows, lambda drafted, block, logits: got.append((block.tokens.tolist(), block.parent.tolist())),
              rounds=4)
    assert got == TODAYS


# the tokens and parents per propose that `test_no_window_drafts_are_todays`'s schedule drafts without a window,
# pinned: any change to the windowless drafts shows here
TODAYS = [
    ([[31, 68, 9, 19, 4, 71, 65],
      [47, 79, 68, 37, 79, 15, 41],
      [9, 49, 6, 79, 64, 62, 28]],
     [[-1, 0, 0, 1, 1, 2, 2, 3],
      [-1, 0, 0, 1, 1, 2, 2, 4],
      [-1, 0, 0, 1, 1, 2, 2, 3]]),
    ([[81, 94, 9, 1, 4, 1, 15],
      [63, 77, 93, 95, 31, 81, 24],
      [74, 39, 73, 61, 88, 50, 8],
      [73, 37, 4, 30, 4, 57, 9]],
     [[-1, 0, 0, 1, 1, 2, 2, 5],
      [-1, 0, 0, 1, 1, 2, 2, 3],
      [-1, 0, 0, 1, 1, 2, 2, 3],
      [-1, 0, 0, 1, 1, 2, 2, 4]]),
    ([[47, 35, 6, 76, 35, 80, 35],
      [17, 35, 50, 81, 80, 50, 7]],
     [[-1, 0, 0, 1, 1, 2, 2, 5],
      [-1, 0, 0, 1, 1, 2, 2, 4]]),
    ([[95, 93, 6, 86, 61, 15, 47],
      [92, 31, 36, 64, 13, 58, 70],
      [36, 1, 50, 33, 41, 81, 26],
      [23, 44, 74, 54, 2, 30, 49]],
     [[-1, 0, 0, 1, 1, 2, 2, 3],
      [-1, 0, 0, 1, 1, 2, 2, 3],
      [-1, 0, 0, 1, 1, 2, 2, 4],
      [-1, 0, 0, 1, 1, 2, 2, 5]]),
]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_window_past_every_context_changes_nothing(target, tmp_path, static):
    """See 2, through `specdec.wrap` (float64): with a window longer than every context, every draft logit and
    every round's drafts are bitwise those without one, on the dynamic path (which then leaves the window's masks
    out) and the static draft step (which masks and writes its ring every round)."""
    path = str(tmp_path / "eagle")
    save_drafter(_random_net(target), path)
    prompts = [[5, 6, 7, 8] * 10, [11, 12, 13] * 9 + [4]]
    seen = {}
    for W in (0, 1000):
        engine = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2, max_length=96,
                              static_shapes=static, topk=2, num_nodes=7, context_window=W)
        d = engine.drafter
        rec = seen[W] = []
        net = d.net
        net.lm_logits = lambda h, _f=type(net).lm_logits, _n=net, _r=rec: _r.append(_f(_n, h)) or _r[-1]
        name = "draft_step" if static else "propose"
        inner = getattr(d, name)

        def recording(rows, *a, _inner=inner, _rec=rec, **k):
            block = _inner(rows, *a, **k)
            _rec.append((block.tokens[:len(rows)].clone(), block.parent[:len(rows)].clone()))
            return block

        setattr(d, name, recording)
        out = generate_f64(engine, prompts, max_new_tokens=24)
        assert_greedy(out, target, prompts, 24)
        if W:
            assert d.window == W and (d.cache[0][0].shape[2] == 96 + engine.target.num_verify_tokens or not static)
    assert len(seen[0]) == len(seen[1000]) > 10
    for a, b in zip(seen[0], seen[1000]):
        if isinstance(a, tuple):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "drafts"
        else:
            assert_close(b, a, exact=True, msg="draft logits")


def test_a_round_costs_the_same_at_any_context(target):
    """See 3: past the ring, a propose drafts with the same ops on the same shapes whatever the context; without a
    window the span grows with the context (the control). Recorded: the drafting (`_draft`), after one round's
    observe."""
    def ops_at(W, length):
        drafter = eagle_drafter.make_drafter(_random_net(target), gamma=GAMMA, max_batch_size=1, topk=2,
                                             num_nodes=7, context_window=W)
        rows = Rows(drafter, [length + 8], seed=4)
        rows.observe({0: length})
        rows.propose([0])
        rows.observe({0: 3})
        rec, inner = RecordedOps(), drafter._draft

        def recorded(*a, **k):
            with rec:
                return inner(*a, **k)
        drafter._draft = recorded
        rows.propose([0])
        assert rec.ops
        return rec.ops

    assert ops_at(7, 30) == ops_at(7, 90)
    assert ops_at(0, 30) != ops_at(0, 90)


def test_memory_specs_are_what_the_cache_allocates(target, tmp_path):
    """See 3: the engine's plan (`memory_specs`) holds the ring with either shapes, and the buffers allocated after a
    generate far past it are exactly those specs; without a window the static cache is the whole max_length."""
    path = str(tmp_path / "eagle")
    save_drafter(_random_net(target), path)
    for W in (7, 0):
        for static in (False, True):
            engine = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2, max_length=96,
                                  static_shapes=static, topk=2, num_nodes=7, context_window=W)
            d = engine.drafter
            generate_f64(engine, [[5, 6, 7] * 12, [9, 4] * 20], max_new_tokens=20)
            nvt = engine.target.num_verify_tokens
            specs = d.memory_specs(max_length=96, num_verify_tokens=nvt, gamma=GAMMA, static=static)
            got = {n: tuple(b.shape) for i, (k, v) in enumerate(d.cache) for n, b in
                   ((f"eagle.{i}.k", k), (f"eagle.{i}.v", v))}
            kv = {n: tuple(s.shape) for n, s in specs.items() if n in got}
            assert set(kv) == set(got)
            if W or static:
                assert kv == got
                assert all(s[2] == (W or 96 + nvt) for s in got.values())
            else:  # grown by doubling: within the conservative bound
                assert all(s[2] <= kv[n][2] for n, s in got.items())


@pytest.mark.parametrize("shape", [dict(topk=1, num_nodes=GAMMA), dict(topk=2, num_nodes=7)], ids=["chain", "tree"])
def test_engine_static_step_drafts_what_the_dynamic_path_drafts(target, tmp_path, shape):
    """See 4: through `specdec.wrap` (float64, prompts several rings long), every round's drafts of the static
    draft step equal those of the dynamic path (`propose`, checked against the reference above) where both draft
    the same shape (all but the last rounds, where the dynamic path drafts only the tokens still wanted); the greedy
    output of either is transformers' own."""
    path = str(tmp_path / "eagle")
    save_drafter(_random_net(target), path)
    prompts = [[5, 6, 7, 8] * 10, [11, 12, 13] * 9 + [4]]
    blocks = {}
    for static in (False, True):
        engine = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2, max_length=96,
                              static_shapes=static, context_window=7, **shape)
        d = engine.drafter
        name = "draft_step" if static else "propose"
        inner, rec = getattr(d, name), []

        def recording(rows, *a, _inner=inner, _rec=rec, **k):
            block = _inner(rows, *a, **k)
            B = len(rows)
            _rec.append((block.tokens[:B].tolist(), block.parent[:B].tolist()))
            return block

        setattr(d, name, recording)
        out = generate_f64(engine, prompts, max_new_tokens=24)
        assert out.stats.drafter_failures == 0
        assert_greedy(out, target, prompts, 24)
        blocks[static] = rec
        assert d.cache[0][0].shape[2] == 7
    dynamic, static = blocks[False], blocks[True]
    assert len(dynamic) == len(static)
    # the dynamic path drafts fewer where the last rounds need fewer tokens; the static step drafts its full shape
    same = [j for j, (a, b) in enumerate(zip(dynamic, static)) if len(a[0][0]) == len(b[0][0])]
    assert len(same) >= len(dynamic) - 3 >= 5, (len(same), len(dynamic))
    assert [dynamic[j] for j in same] == [static[j] for j in same]


def test_bad_window_is_refused(target):
    net = _random_net(target)
    for bad in (-1, 2.5, True, "512"):
        with pytest.raises(ValueError, match="context_window"):
            eagle_drafter.make_drafter(net, context_window=bad)
    with pytest.raises(ValueError, match="context_window"):
        build_drafter_net("eagle", target, context_window=-3)


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(EMBEDDED, dtype=torch.float32).eval()


def test_embedded_drafter_equals_the_windowed_net(embedded):
    """See 5: the shipped eagle drafter (float32, its configured window W), one batch of rows shorter than W and
    past it, the longest prompt observed through its last ring only: every draft logit equals the reference's to
    float32 summation-order error, and so do the trees."""
    from specdec.draft.registry import load_drafter
    net = load_drafter(os.path.join(EMBEDDED, "drafters", "eagle"), embedded)
    W = net.config.context_window
    assert W > 0
    drafter = eagle_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=3, topk=2, num_nodes=7)
    assert drafter.window == W
    lengths = [W // 2, W + 100, 2 * W + 300]
    rows = Rows(drafter, lengths, seed=5)
    for f in rows.feats:  # float32 features
        for l in f:
            f[l] = f[l].float()
    rows.observe({r: n - 6 for r, n in enumerate(lengths)})
    for k in range(3):
        block, logits = rows.propose([0, 1, 2])
        for b in range(3):
            n = rows.have[b]
            feats = torch.cat([rows.feats[b][l][:n] for l in drafter.feature_layers], -1)
            want, root, per_depth = reference(net, feats, rows.tokens[b][1:n + 1], W, GAMMA, 2, 7)
            # float32 sums in another order and grouping: within 1e-5 of the largest logit (as dspark's check)
            assert max_rel_err(logits[0][b], root) <= 1e-5, f"row {b} at {n}: root logits"
            for d, ref in enumerate(per_depth):
                assert max_rel_err(logits[1 + d][b], ref) <= 1e-5, f"row {b} at {n}: depth {d + 1}"
            assert torch.equal(block.tokens[b], want.tokens[0]) and torch.equal(block.parent[b], want.parent[0])
        rows.observe({r: 1 + (r + k) % (GAMMA + 1) for r in range(3)})
    assert drafter.cache[0][0].shape[2] == W < lengths[1]


def test_training_reads_the_same_window(target):
    """See 6, in float64 on random target outputs: step 1 of `_unroll` (every later step sees keys of step 1 too, so
    its window is the drafter's) against one `Net.run` per position over the window's pairs alone."""
    from specdec.draft.registry import TargetBatch
    W, S = 5, 16
    gen = torch.Generator().manual_seed(3)
    d, V = target.config.hidden_size, target.config.vocab_size
    net = _random_net(target, ttt_steps=2, context_window=W)
    batch = TargetBatch(torch.randint(3, V, (2, S), generator=gen),
                        torch.randn(2, S, V, generator=gen, dtype=torch.float64),
                        torch.randn(2, S, d, generator=gen, dtype=torch.float64),
                        {l: torch.randn(2, S, d, generator=gen, dtype=torch.float64)
                         for l in net.config.feature_layers})
    with torch.no_grad():
        outs, _ = net._unroll(batch)
        feats = torch.cat([batch.features[l] for l in net.config.feature_layers], -1)
        x = net.inputs(batch.tokens[:, 1:], net.fused(feats[:, :-1]))  # [2, S - 1, d]: pair t at position t
        for t in range(S - 1):
            lo = max(0, t - W + 1)
            i = torch.arange(lo, t + 1)
            h, _ = net.run(x[:, lo:t + 1], i[None].expand(2, -1), (i[:, None] >= i[None, :])[None])
            assert_close(outs[0][0][:, t], net.lm_logits(h[:, -1]), msg=f"step 1 at {t}")
        loss = {}
        for w in (0, S):
            net.config.context_window = w
            loss[w] = net.loss(batch)
    assert_close(loss[S], loss[0], exact=True, msg="a window past every batch window")
