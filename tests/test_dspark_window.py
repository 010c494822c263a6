"""The dspark drafter's context window at run time: with `context_window` W a block reads only the last W committed
positions (as in training), so the drafter keeps each row's context K/V in a ring of W + one verify window slots and
a round reads that ring, never the whole context.

1. Drafts equal the full-context computation through the net (the K/V of every committed position, and the
   training visibility `Net.context_visible` over them), for one batch of rows shorter than W, longer than W and
   longer than the ring, observed in a prompt-sized piece then round-sized ones (rows joining and leaving calls),
   after positions are dropped again, as chains and trees: float64 on a tiny target, and the embedded model's
   trained drafter (W = 504) in float32 at contexts past twice its ring.
2. Cost and memory: a propose runs the same ops on the same shapes at any context past the ring; the cache never
   outgrows the ring, and `memory_specs` is what it allocates, with static and dynamic shapes.
3. In the engine: every round's drafts equal those of the full cache (the ring switched off), on the dynamic
   path and the static draft step, and the greedy output equals transformers' greedy generate.
"""

from __future__ import annotations

import os

import pytest
import torch
from assertions import RecordedOps
from tiny_models import assert_greedy, generate_f64, tiny_model

import specdec
from specdec.draft import dspark_drafter
from specdec.draft.base import Contexts, Observation
from specdec.draft.registry import build_drafter_net, own_state_dict, save_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "specdec", "embedded")
GAMMA = 7


@pytest.fixture(scope="module")
def target():
    return tiny_model("kimi_linear", seed=0)


def _random_net(target, window: int, seed: int = 6):
    """A float64 dspark net for `target` with random weights (a large MASK input: later slots' drafts vary) and
    the context window `window`."""
    torch.manual_seed(seed)
    net = build_drafter_net("dspark", target, context_window=window).double()
    with torch.no_grad():
        for p in own_state_dict(net).values():
            p.copy_(torch.randn_like(p) * 0.5)
        net.mask_embed.mul_(5.0)
    return net


@torch.no_grad()
def full_context_logits(net, feats: list[torch.Tensor], anchor: torch.Tensor, gamma: int) -> torch.Tensor:
    """The block's base logits `[gamma, V]` (no Markov term) after one row's committed positions, computed from the
    K/V of all of them: `feats` one `[L, d]` per feature layer (config order), `anchor` a 0-d token."""
    L = feats[0].shape[0]
    G = max(gamma, net.config.block_size)
    kv = net.context_kv(net.context([f[None] for f in feats]), torch.arange(L)[None])  # per layer [1, H, L, D]
    ok = torch.cat([net.context_visible(torch.arange(L), torch.tensor([L])),
                    torch.ones(1, G, dtype=torch.bool)], 1)  # [1, L + G]
    h = net.block_hidden(anchor.view(1, 1), (L + torch.arange(G))[None], kv, ok[:, None])[:, :gamma]
    return net.lm_head(h)[0]


def chain_of(net, base: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Greedy chains `[B, gamma]` from base logits `[B, gamma, V]`, the Markov head fed each previous draft."""
    prev, out = anchors, []
    for i in range(base.shape[1]):
        prev = (base[:, i] + net.markov(prev)).argmax(-1)
        out.append(prev)
    return torch.stack(out, 1)


class Rows:
    """Request rows fed to a drafter as an engine does: random features and tokens per row, observed in pieces;
    `propose_and_reference` drafts for every row and computes the full-context reference."""

    def __init__(self, drafter, lengths: list[int], d: int, V: int, dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.drafter, self.net = drafter, drafter.net
        n = max(lengths) + 64
        self.tokens = [torch.randint(3, V, (n,), generator=gen) for _ in lengths]
        self.feats = [[torch.randn(n, d, generator=gen).to(dtype) for _ in drafter.feature_layers] for _ in lengths]
        self.have = [0] * len(lengths)
        drafter.begin(list(range(len(lengths))), [t[:1] for t in self.tokens])

    def observe(self, counts: dict[int, int]) -> None:
        rows = sorted(counts)
        span = [(self.have[r], self.have[r] + counts[r]) for r in rows]
        self.drafter.observe(Observation.of(
            rows, [self.tokens[r][a:b] for r, (a, b) in zip(rows, span)],
            features={l: [self.feats[r][j][a:b] for r, (a, b) in zip(rows, span)]
                      for j, l in enumerate(self.drafter.feature_layers)}))
        for r, (_, b) in zip(rows, span):
            self.have[r] = b

    def propose_and_reference(self, lengths: list[int] | None = None, gamma: int = GAMMA):
        """-> (block, the drafter's base logits `[B, gamma, V]`, the reference's): each row's context its first
        `lengths[r]` committed positions (default: all it observed) and an anchor."""
        lengths = self.have if lengths is None else lengths
        rows = list(range(len(lengths)))
        anchors = torch.stack([self.tokens[r][lengths[r]] for r in rows])
        seen = []
        net = self.net
        net.lm_head = lambda h, _head=type(net).lm_head: seen.append(_head(net, h)) or seen[-1]
        try:
            block = self.drafter.propose(rows, Contexts.of([self.tokens[r][:lengths[r] + 1] for r in rows]), gamma)
        finally:
            del net.lm_head
        self.have = list(lengths)
        ref = torch.stack([full_context_logits(net, [f[:lengths[r]] for f in self.feats[r]], anchors[r], gamma)
                           for r in rows])
        return block, seen[0], ref, anchors


def _schedule(rows: Rows, lengths: list[int], prompts: list[int], seed: int, check) -> None:
    """Observe each row's prompt in one call, then rounds of 1..`GAMMA + 1` positions for the rows still short
    of their length, calling `check()` after every round."""
    rows.observe({r: p for r, p in enumerate(prompts)})
    check()
    gen = torch.Generator().manual_seed(seed)
    while any(h < n for h, n in zip(rows.have, lengths)):
        counts = {r: min(n - h, int(torch.randint(1, GAMMA + 2, (1,), generator=gen)))
                  for r, (h, n) in enumerate(zip(rows.have, lengths)) if h < n}
        rows.observe(counts)
        check()


W = 6
LENGTHS = [3, 5, 23, 61]  # shorter than W, longer than W, longer than the chain's ring (W + 8), several rings long
PROMPTS = [2, 5, 4, 30]  # the last longer than the ring: observe projects only its last ring's worth


@pytest.mark.parametrize("topk", [1, 2])
def test_drafts_equal_the_full_context(target, topk):
    """float64: after every observe, a batch of rows of different lengths drafts from base logits equal to the
    full-context computation's (to 1e-12 relative: the ring holds the same keys in another order, so only the
    summation order differs), and the same chains, or trees (tokens and parents)."""
    net = _random_net(target, W)
    drafter = dspark_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=4, topk=topk)
    rows = Rows(drafter, LENGTHS, target.config.hidden_size, target.config.vocab_size, torch.float64, seed=1)
    ring = drafter._ring()
    assert ring == W + (GAMMA + 1 if topk == 1 else drafter.num_nodes + 1)
    checked = []

    def check():
        if min(rows.have) == 0:
            return
        block, got, ref, anchors = rows.propose_and_reference()
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 1e-12 * scale, f"rows at {rows.have}"
        if topk == 1:
            assert torch.equal(block.tokens, chain_of(net, ref, anchors))
        else:
            want = drafter._tree(ref, anchors, GAMMA, None)
            assert torch.equal(block.tokens, want.tokens) and torch.equal(block.parent, want.parent)
        checked.append(list(rows.have))

    _schedule(rows, LENGTHS, PROMPTS, seed=2, check=check)
    assert checked[-1] == LENGTHS and len(checked) >= 6
    assert drafter.k[0].shape[2] == ring  # wrapped, never grown past the ring


def test_dropped_positions_and_their_limit(target):
    """Positions observed past a row's context are dropped by the next propose: the drafts equal the full-context
    computation at the shorter context while the ring still holds its window; a drop the ring cannot serve (more
    than ring - W positions) raises instead of drafting from a short window."""
    net = _random_net(target, W)
    drafter = dspark_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=2)
    rows = Rows(drafter, [40, 40], target.config.hidden_size, target.config.vocab_size, torch.float64, seed=3)
    rows.observe({0: 30, 1: 30})
    rows.observe({0: 8, 1: 3})
    block, got, ref, anchors = rows.propose_and_reference([30, 33])  # drops 8 and 0 of row 0, 1
    assert (got - ref).abs().max() <= 1e-12 * ref.abs().max()
    assert torch.equal(block.tokens, chain_of(net, ref, anchors))
    assert drafter.length == {0: 30, 1: 33}
    rows.observe({0: 9})  # 39: the ring (14 slots) keeps 30 .. 38, and the window before 30 is gone
    with pytest.raises(ValueError, match="drops 9 observed positions"):
        drafter.propose([0], Contexts.of([rows.tokens[0][:31]]), GAMMA)


def test_a_round_costs_the_same_at_any_context(target):
    """Past the ring, a propose drafts with the same ops on the same shapes whatever the context (what it reads and
    computes is bounded by the ring); without a window the span grows with the context (the control). Recorded:
    the drafting (`_draft`), not the host's pick of each context's last token."""
    def ops_at(window, length):
        net = _random_net(target, window)
        drafter = dspark_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=1)
        rows = Rows(drafter, [length], target.config.hidden_size, target.config.vocab_size, torch.float64, seed=4)
        rows.observe({0: length})
        rec, inner = RecordedOps(), drafter._draft

        def recorded(*a, **k):
            with rec:
                return inner(*a, **k)
        drafter._draft = recorded
        drafter.propose([0], Contexts.of([rows.tokens[0][:length + 1]]), GAMMA)
        assert rec.ops
        return rec.ops

    assert ops_at(W, 3 * (W + GAMMA + 1)) == ops_at(W, 9 * (W + GAMMA + 1))
    assert ops_at(0, 40) != ops_at(0, 90)


def test_memory_specs_are_what_the_cache_allocates(target, tmp_path):
    """The engine's plan (`memory_specs`) holds the ring with either shapes, and the buffers allocated after a
    generate far past it are exactly those specs; without a window the static cache is the whole max_length."""
    for window in (W, 0):
        path = str(tmp_path / f"w{window}")
        save_drafter(_random_net(target, window), path)
        for static in (False, True):
            engine = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2, max_length=96,
                                  static_shapes=static)
            d = engine.drafter
            generate_f64(engine, [[5, 6, 7] * 12, [9, 4] * 20], max_new_tokens=20)
            nvt = engine.target.num_verify_tokens
            specs = d.memory_specs(max_length=96, num_verify_tokens=nvt, gamma=GAMMA, static=static)
            got = {n: tuple(b.shape) for i, (k, v) in enumerate(zip(d.k, d.v)) for n, b in
                   ((f"dspark.{i}.k", k), (f"dspark.{i}.v", v))}
            cap = W + nvt if window else 96 + nvt
            if window or static:
                assert {n: tuple(s.shape) for n, s in specs.items()} == got
                assert all(s[2] == cap for s in got.values())
            else:  # grown by doubling: within the conservative bound
                assert all(s[2] <= specs[n].shape[2] for n, s in got.items())


def _with_full_cache(drafter):
    """The drafter with its ring switched off: the cache holds every position, as before windows were read."""
    drafter._ring = lambda num_verify_tokens=None: None
    return drafter


@pytest.mark.parametrize("shape", [dict(topk=1), dict(topk=2, num_nodes=10)], ids=["chain", "tree"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_engine_rounds_draft_what_the_full_cache_drafts(target, tmp_path, static, shape):
    """Through `specdec.wrap` (float64, prompts several rings long): every round's drafts with the ring equal the
    drafts of the same engine reading its full cache, on the dynamic path (`propose`) and the static draft step;
    the greedy output is transformers' own."""
    path = str(tmp_path / "drafter")
    save_drafter(_random_net(target, W), path)
    prompts = [[5, 6, 7, 8] * 10, [11, 12, 13] * 9 + [4]]
    blocks = {}
    for full in (False, True):
        engine = specdec.wrap(target, drafter=path, num_draft_tokens=GAMMA, max_batch_size=2, max_length=96,
                              static_shapes=static, **shape)
        d = engine.drafter
        if full:
            _with_full_cache(d)
        name = "draft_step" if static else "propose"
        inner, rec = getattr(d, name), []

        def recording(rows, *a, _inner=inner, _rec=rec, **k):
            block = _inner(rows, *a, **k)
            B = len(rows)
            _rec.append((block.tokens[:B].tolist(), None if block.parent is None else block.parent[:B].tolist()))
            return block

        setattr(d, name, recording)
        out = generate_f64(engine, prompts, max_new_tokens=24)
        assert out.stats.drafter_failures == 0
        assert_greedy(out, target, prompts, 24)
        blocks[full] = rec
        if not full:
            assert d.k[0].shape[2] == W + engine.target.num_verify_tokens
    assert len(blocks[False]) >= 5 and blocks[False] == blocks[True]


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED, dtype=torch.float32).eval()
    return model


@pytest.mark.parametrize("topk", [1, 2])
def test_embedded_drafter_equals_the_full_context(embedded, topk):
    """The shipped dspark drafter (float32, W = 504), rows of 300, 700 and 1300 positions in one batch (the longest
    prompt observed through its last ring only): base logits equal the full-context computation's to float32
    summation-order error, and so do the chains and trees."""
    from specdec.draft.registry import load_drafter
    net = load_drafter(os.path.join(EMBEDDED, "drafters", "dspark"), embedded)
    assert net.config.context_window == 504
    drafter = dspark_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=3, topk=topk)
    lengths = [300, 700, 1300]
    tc = embedded.config.get_text_config()
    rows = Rows(drafter, lengths, tc.hidden_size, tc.vocab_size, torch.float32, seed=5)
    rows.observe({0: 290, 1: 690, 2: 1280})
    checks = 0
    while rows.have != lengths:
        rows.observe({r: min(n - h, 1 + (r + checks) % (GAMMA + 1)) for r, (h, n) in
                      enumerate(zip(rows.have, lengths)) if h < n})
        block, got, ref, anchors = rows.propose_and_reference()
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), f"rows at {rows.have}"
        if topk == 1:
            assert torch.equal(block.tokens, chain_of(net, ref, anchors))
        else:
            want = drafter._tree(ref, anchors, GAMMA, None)
            assert torch.equal(block.tokens, want.tokens) and torch.equal(block.parent, want.parent)
        checks += 1
    assert checks >= 3 and drafter.k[0].shape[2] == drafter._ring() < min(lengths[1:])
