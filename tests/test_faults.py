"""Faults: a misbehaving drafter or a failing round never breaks the engine.

- A chaos drafter (good blocks, exceptions and every kind of malformed block, in random order) over 2,000+
  verify rounds with random batch sizes and prompt lengths: no `generate` raises, every output equals the
  target's own greedy decode, every bad block is counted and named in its warning, no slot leaks.
- One fault injected at a random point of a random round (a target layer, acceptance, the state commit, the
  KV commit, the drafter's observe, a streamer; RuntimeError or KeyboardInterrupt): the call raises
  it, every slot comes back, and the next call on the same engine equals a fresh engine's.
- Non-finite target logits: one FloatingPointError naming the target, the request row and the position;
  nothing committed; the engine serves the next call.
All of it for replay eager, replay lazy and snapshot, on a tiny float64 Qwen3.5.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import re
import warnings

import pytest
import torch
from tiny_models import generate_f64, greedy_reference

import specdec
import specdec.round
from specdec.draft import DraftBlock, Drafter, ModelDrafter, NgramDrafter

FAMILY = "qwen3_5"  # conftest's `target`
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
MODE_IDS = ["replay-eager", "replay-lazy", "snapshot"]
GAMMA = 5
N = 16  # reference length; calls ask for up to N new tokens (no EOS stop), so references are prefixes
ROUNDS = 2000  # chaos rounds over all modes (per request row, as SpecStats counts them)
MAX_BATCH = 6


@pytest.fixture(scope="module")
def prompts(target):
    """Six prompts of 2..14 tokens (half repetitive, for the ngram drafter) and their greedy continuations."""
    rng = random.Random(17)
    V = target.config.vocab_size
    out = []
    for i in range(6):
        n = rng.randint(2, 14)
        if i % 2:
            unit = [rng.randrange(3, V) for _ in range(rng.randint(2, 4))]
            p = (unit * 8)[:n]
        else:
            p = [rng.randrange(3, V) for _ in range(n)]
        out.append(p)
    return {tuple(p): greedy_reference(target, p, N) for p in out}


def _wrap(target, mode, drafter="ngram", **kw):
    strategy, commit = mode
    kw.setdefault("max_batch_size", MAX_BATCH)
    return specdec.wrap(target, drafter=drafter, num_draft_tokens=GAMMA, strategy=strategy, commit=commit, **kw)


def _assert_greedy(out, batch, refs, new: int, pad: int):
    for b, p in enumerate(batch):
        want = refs[tuple(p)][:len(p) + new]
        row = out.sequences[b].tolist()
        assert row[:len(want)] == want, f"row {b} differs from the target's greedy decode"
        assert all(x == pad for x in row[len(want):])


def _stats(out) -> dict:
    d = out.stats.as_dict()
    d.pop("timings")
    return d


def _idle(engine):
    """No round open anywhere, every slot free."""
    r = engine.runner
    assert r.state._round is None and r.kv.slots is None
    assert r.num_free == MAX_BATCH


# ---- 1. chaos drafter ----------------------------------------------------------------------------------------

# what the warning of each bad block must name
BAD = {
    "raise": r"RuntimeError: chaos: draft server went away",
    "not_block": r"returned tuple, expected a DraftBlock",
    "tokens_1d": r"tokens: expected a tensor \[B, G\]",
    "tokens_float": r"tokens: expected dtype torch.int64, got torch.float",
    "tokens_int32": r"tokens: expected dtype torch.int64, got torch.int32",
    "tokens_device": r"tokens: expected a tensor on cpu, got meta",
    "batch_size": r"tokens: expected shape \[\d+, \d+\], got",
    "num_shape": r"num_drafts: expected shape",
    "num_dtype": r"num_drafts: expected dtype torch.int64",
    "id_high": r"tokens: ids outside \[0, vocab\)",
    "id_negative": r"tokens: ids outside \[0, vocab\)",
    "id_in_padding": r"tokens: ids outside \[0, vocab\)",
    "num_high": r"num_drafts: outside \[0, G\]",
    "num_negative": r"num_drafts: outside \[0, G\]",
    "parent_width": r"parent: expected shape",
    "parent_dtype": r"parent: expected dtype torch.int64",
    "parent_not_before": r"parent: not topological",
    "parent_below_minus_1": r"parent: not topological",
    "parent_root": r"parent: not topological .*the root, node 0, -1",
    "tree_budget": r"exceeds the node budget",
    "probs_nan": r"probs: not finite",
    "probs_inf": r"probs: not finite",
    "probs_negative": r"probs: negative",
    "probs_sum": r"probs: rows do not sum to 1",
    "probs_zero_at_draft": r"probs: a draft token has probability 0",
    "probs_logits": r"probs: negative.*do not sum to 1",
    "probs_shape": r"probs: expected shape",
    "probs_dtype": r"probs: expected a floating dtype",
}
GOOD = ["oracle", "oracle", "oracle_probs", "ngram", "random", "empty", "too_long", "tree", "tree", "tree_padded"]


class ChaosDrafter(Drafter):
    """Proposes, in random order, good blocks (the target's own greedy continuation, partly corrupted; ngram;
    random; empty; longer than gamma; trees) and every kind of bad block in `BAD`. `refs[row]` is the
    greedy reference of each row of the running call; `expected` collects the patterns of the bad blocks."""

    name = "chaos"

    def __init__(self, vocab: int, seed: int):
        self.V, self.rng, self.gen = vocab, random.Random(seed), torch.Generator().manual_seed(seed)
        self.ngram = NgramDrafter()
        self.refs: dict[int, list[int]] = {}
        self.expected: list[str] = []
        self.bag: list[str] = []
        self.kinds_seen: set[str] = set()

    def bind(self, target):
        super().bind(target)
        self.budget = target.num_verify_tokens - 1  # tree drafts per round

    def _kind(self) -> str:
        if not self.bag:  # every kind once per cycle, in random order
            self.bag = GOOD + list(BAD)
            self.rng.shuffle(self.bag)
        return self.bag.pop()

    def _oracle(self, rows, contexts, gamma, *, exact_len=None, corrupt=0.5):
        rng, drafts = self.rng, []
        for r, c in zip(rows, contexts.tensors):
            g = exact_len or rng.randint(1, gamma)
            d = self.refs[r][c.shape[0]:c.shape[0] + g]
            d += [rng.randrange(self.V) for _ in range(g - len(d))]
            if rng.random() < corrupt:
                i = rng.randrange(g)
                d[i] = (d[i] + rng.randrange(1, self.V)) % self.V
            drafts.append(d)
        return DraftBlock.from_lists(drafts, contexts.tensors[0].device)

    def _probs(self, block):
        B, G = block.tokens.shape
        return torch.randn(B, G, self.V, dtype=torch.float64, generator=self.gen).softmax(-1)

    def _tree(self, rows, contexts, G, padded=False):
        """`G` drafts per row: each node's parent is a random earlier node, its token the greedy one at that
        depth (or a random one); with `padded`, some nodes are unused padding (parent -1)."""
        rng = self.rng
        B = len(rows)
        parent = torch.full((B, 1 + G), -1, dtype=torch.long)
        tokens = torch.zeros(B, G, dtype=torch.long)
        for i, (r, c) in enumerate(zip(rows, contexts.tensors)):
            depth = [0]
            for j in range(1, G + 1):
                if padded and rng.random() < 0.3:
                    depth.append(0)
                    continue
                par = rng.choice([k for k in range(j) if k == 0 or int(parent[i, k]) >= 0])
                parent[i, j] = par
                depth.append(depth[par] + 1)
                at = c.shape[0] + depth[par]
                good = at < len(self.refs[r]) and rng.random() < 0.7
                tokens[i, j - 1] = self.refs[r][at] if good else rng.randrange(self.V)
        return DraftBlock(tokens, torch.full((B,), G, dtype=torch.long), None, parent)

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None):
        kind = self._kind()
        self.kinds_seen.add(kind)
        rng, B, V = self.rng, len(rows), self.V
        if kind in BAD:
            self.expected.append(BAD[kind])
        if kind == "oracle":
            return self._oracle(rows, contexts, gamma)
        if kind == "oracle_probs":
            block = self._oracle(rows, contexts, gamma)
            block.probs = self._probs(block)
            return block
        if kind == "ngram":
            return self.ngram.propose(rows, contexts, gamma)
        if kind == "random":
            return DraftBlock.from_lists([[rng.randrange(V) for _ in range(gamma)] for _ in rows], "cpu")
        if kind == "empty":
            return DraftBlock.empty(B, "cpu")
        if kind == "too_long":  # a valid chain longer than gamma: cut to gamma drafts
            return self._oracle(rows, contexts, gamma, exact_len=gamma + 3)
        if kind in ("tree", "tree_padded"):
            return self._tree(rows, contexts, rng.randint(1, self.budget), padded=kind == "tree_padded")
        if kind == "raise":
            raise RuntimeError("chaos: draft server went away")
        G = rng.randint(1, gamma)
        block = self._oracle(rows, contexts, gamma, exact_len=G)
        t, num = block.tokens, block.num_drafts
        row, col = rng.randrange(B), rng.randrange(G)
        if kind == "not_block":
            return (t, num)
        if kind == "tokens_1d":
            return DraftBlock(t[0], num)
        if kind == "tokens_float":
            return DraftBlock(t.float(), num)
        if kind == "tokens_int32":
            return DraftBlock(t.int(), num)
        if kind == "tokens_device":
            return DraftBlock(t.to("meta"), num)
        if kind == "batch_size":
            return DraftBlock(torch.cat([t, t[:1]]), torch.cat([num, num[:1]]))
        if kind == "num_shape":
            return DraftBlock(t, torch.cat([num, num[:1]]))
        if kind == "num_dtype":
            return DraftBlock(t, num.float())
        if kind in ("id_high", "id_negative"):
            t[row, col] = V + rng.randrange(5) if kind == "id_high" else -1 - rng.randrange(5)
            return block
        if kind == "id_in_padding":  # an unused column past every row's num_drafts
            return DraftBlock(torch.cat([t, torch.full((B, 1), V + 1)], 1), num)
        if kind in ("num_high", "num_negative"):
            num[row] = G + 1 + rng.randrange(3) if kind == "num_high" else -1
            return block
        if kind.startswith("parent") or kind == "tree_budget":
            tree = self._tree(rows, contexts, self.budget + 1 if kind == "tree_budget" else G)
            p = tree.parent
            if kind == "parent_width":
                tree.parent = p[:, 1:]
            elif kind == "parent_dtype":
                tree.parent = p.int()
            elif kind == "parent_not_before":
                p[row, col + 1] = rng.randint(col + 1, G)
            elif kind == "parent_below_minus_1":
                p[row, col + 1] = -2
            elif kind == "parent_root":
                p[row, 0] = 0
            return tree
        q = self._probs(block)
        if kind == "probs_nan":
            q[row, col, rng.randrange(V)] = math.nan
        elif kind == "probs_inf":
            q[row, col, rng.randrange(V)] = math.inf
        elif kind == "probs_negative":
            q[row, col, rng.randrange(V)] = -1e-3
        elif kind == "probs_sum":
            q[row, col] *= 1.5
        elif kind == "probs_zero_at_draft":
            q[row, col, t[row, col]] = 0.0
            q[row, col] /= q[row, col].sum()
        elif kind == "probs_logits":
            q = torch.randn(B, G, V, dtype=torch.float64, generator=self.gen) - 5
        elif kind == "probs_shape":
            q = q[..., :-1]
        elif kind == "probs_dtype":
            q = (q > 0.5).long()
        else:
            raise AssertionError(kind)
        block.probs = q
        return block


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_chaos_drafter(target, prompts, mode):
    """Greedy calls until this mode has ceil(ROUNDS / modes) rounds (all modes together: >= ROUNDS), plus a
    sampled call every tenth call (its output follows the target's distribution; here: it does not raise)."""
    rng = random.Random(MODES.index(mode))
    drafter = ChaosDrafter(target.config.vocab_size, seed=100 + MODES.index(mode))
    engine = _wrap(target, mode, drafter=drafter)
    free = engine.runner.num_free
    pool = list(prompts)
    want = math.ceil(ROUNDS / len(MODES))
    rounds = failures = calls = 0
    while rounds < want:
        calls += 1
        batch = [list(rng.choice(pool)) for _ in range(rng.randint(1, MAX_BATCH))]
        new = rng.randint(6, N)
        drafter.refs = {b: prompts[tuple(p)] for b, p in enumerate(batch)}
        drafter.expected = []
        sample = calls % 10 == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate_f64(engine, batch, max_new_tokens=new, do_sample=sample, seed=calls)
        assert engine.runner.num_free == free, "a slot leaked"
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert out.stats.drafter_failures == len(drafter.expected) == len(msgs), (msgs, drafter.expected)
        for m, pattern in zip(msgs, drafter.expected):
            assert "drafter chaos failed" in m and "plain decode" in m and re.search(pattern, m), (m, pattern)
        failures += out.stats.drafter_failures
        if sample:
            assert out.sequences.shape[1] == max(len(p) for p in batch) + new
            continue
        _assert_greedy(out, batch, prompts, new, engine.pad_token_id)
        rounds += out.stats.rounds
    _idle(engine)
    assert drafter.kinds_seen == set(GOOD) | set(BAD)
    assert failures > 0 and rounds >= want


# ---- 2. a fault at a random point of a random round -----------------------------------------------------------


@contextlib.contextmanager
def _fault(obj, name: str, at: int, exc: BaseException):
    """`obj.name` raises `exc` on its `at`-th call (and only then)."""
    orig = getattr(obj, name)
    own = name in vars(obj)
    calls = [0]

    def wrapper(*a, **kw):
        calls[0] += 1
        if calls[0] == at:
            raise exc
        return orig(*a, **kw)

    setattr(obj, name, wrapper)
    try:
        yield calls
    finally:
        if own:
            setattr(obj, name, orig)
        else:
            delattr(obj, name)


class _Streamer:
    def __init__(self):
        self.tokens, self.ended = [], 0

    def put(self, x):
        self.tokens += x.tolist()

    def end(self):
        self.ended += 1


POINTS = ["layer", "accept", "state_commit", "kv_commit", "drafter_observe", "streamer"]


def _fault_site(engine, target, point, rng, B):
    """(object, attribute, the least number of calls a 12-token generate of B rows makes to it)."""
    if point == "layer":  # any decoder layer, linear or attention: raise inside the forward, mid-round
        return target.model.layers[rng.randrange(len(target.model.layers))].mlp, "forward", B + 2
    if point == "accept":
        return specdec.round, "accept_round", 2
    if point == "state_commit":
        return engine.runner.state, "keep", 2  # the runner commits through the unchecked entry
    if point == "kv_commit":  # after the state strategy committed: a half-committed round
        return engine.runner.kv, "advance", B + 2
    if point == "drafter_observe":
        return engine.drafter, "observe", B + 2
    if point == "streamer":
        return _Streamer(), "put", 4


@pytest.fixture(scope="module")
def fresh_after(target, prompts):
    """The call made after every fault, on a fresh engine per mode: output and counters."""
    cache = {}

    def get(mode):
        if mode not in cache:
            batch = [list(p) for p in itertools.islice(prompts, 3)]
            engine = _wrap(target, mode)
            out = generate_f64(engine, batch, max_new_tokens=12)
            _assert_greedy(out, batch, prompts, 12, engine.pad_token_id)
            cache[mode] = (batch, out)
        return cache[mode]
    return get


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_fault_in_a_round_leaves_engine_usable(target, prompts, fresh_after, mode, point):
    rng = random.Random(f"{mode}-{point}")
    engine = _wrap(target, mode)
    pool = list(prompts)
    B = 1 if point == "streamer" else rng.randint(1, 3)
    batch = [list(rng.choice(pool)) for _ in range(B)]
    exc = rng.choice([RuntimeError("injected fault"), KeyboardInterrupt()])
    obj, name, least = _fault_site(engine, target, point, rng, B)
    streamer = obj if point == "streamer" else None
    with _fault(obj, name, rng.randint(1, least), exc) as calls:
        with pytest.raises(type(exc)) as err:
            generate_f64(engine, batch, max_new_tokens=12, streamer=streamer)
    assert err.value is exc and calls[0] >= 1
    if streamer is not None:
        assert streamer.ended == 1
    _idle(engine)
    after, fresh = fresh_after(mode)
    out = generate_f64(engine, after, max_new_tokens=12)
    assert torch.equal(out.sequences, fresh.sequences)
    assert _stats(out) == _stats(fresh)


@pytest.mark.parametrize("exc", [RuntimeError("draft commit failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_model_drafter_left_mid_round(target, prompts, exc):
    """The draft model's own runner fails between its verify and its commit, leaving its round open. A
    RuntimeError is a drafter failure: plain decode, output unchanged, and the drafter's round is aborted
    (`Drafter.abort`). A KeyboardInterrupt ends the call; the next call equals a fresh engine's, drafter
    included (an open draft round would make every later draft fail)."""
    batch = [list(p) for p in itertools.islice(prompts, 2)]
    kw = dict(drafter="model", draft_model=target, max_batch_size=MAX_BATCH)
    engine = _wrap(target, ("replay", "lazy"), **kw)
    draft = engine.drafter.runner
    with _fault(draft.state, "keep", 2, exc):
        if isinstance(exc, RuntimeError):
            with pytest.warns(RuntimeWarning, match="drafter model failed .*draft commit failed"):
                out = generate_f64(engine, batch, max_new_tokens=N)
            assert out.stats.drafter_failures == 1  # aborted and re-prefilled: the next rounds draft again
            _assert_greedy(out, batch, prompts, N, engine.pad_token_id)
        else:
            with pytest.raises(KeyboardInterrupt):
                generate_f64(engine, batch, max_new_tokens=N)
    assert draft.state._round is None and draft.kv.slots is None and draft.num_free == MAX_BATCH
    _idle(engine)
    out = generate_f64(engine, batch, max_new_tokens=N)
    fresh = generate_f64(_wrap(target, ("replay", "lazy"), **kw), batch, max_new_tokens=N)
    assert torch.equal(out.sequences, fresh.sequences) and _stats(out) == _stats(fresh)
    assert out.stats.drafter_failures == 0


# ---- 3. non-finite target logits ----------------------------------------------------------------------------


def _committed(engine, slots):
    st = engine.runner.state
    return [st.committed_ssm().clone(), st.pool.conv.clone(), st.committed_len(torch.tensor(slots)),
            engine.runner.kv.lengths.clone()]


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_nonfinite_logits(target, prompts, fresh_after, mode, sample):
    """NaN / inf written into one verify round's logits (random round, row and window position): one
    FloatingPointError naming the target, the request row and the sequence position, raised before anything of
    that round is committed; the next call equals a fresh engine's."""
    rng = random.Random(f"nan-{mode}-{sample}")
    engine = _wrap(target, mode)
    batch = [list(p) for p in rng.sample(list(prompts), 3)]
    hit = rng.randint(len(batch) + 1, len(batch) + 2)  # lm_head call: one per prompt (prefill), then rounds
    seen = {}

    def hook(module, args, logits):
        seen["calls"] = seen.get("calls", 0) + 1
        if seen["calls"] != hit:
            return
        r = engine.runner
        slots = r.kv.slots.tolist()
        i, t = rng.randrange(logits.shape[0]), rng.randrange(logits.shape[1])
        logits[i, t, rng.randrange(logits.shape[2])] = rng.choice([math.nan, math.inf, -math.inf])
        seen["row"] = engine.lane_slots.index(slots[i])
        seen["position"] = int(r.kv.lengths[slots[i]]) + t  # a chain: depth t after the anchor
        seen["slots"] = slots
        seen["state"] = _committed(engine, slots)

    handle = target.lm_head.register_forward_hook(hook)
    try:
        with pytest.raises(FloatingPointError) as err:
            generate_f64(engine, batch, max_new_tokens=12, do_sample=sample, seed=3)
    finally:
        handle.remove()
    msg = str(err.value)
    assert f"target {type(target).__name__}" in msg and "non-finite logits" in msg
    assert f"request row {seen['row']} at position {seen['position']} " in msg, (msg, seen)
    # nothing of that round was committed: the released slots hold the state from before it (lazy mode folds
    # its pending records on release, which is the committed state it had)
    st = engine.runner.state
    slots = seen["slots"]
    after = [st.pool.ssm, st.pool.conv, st.pool.seq_len[torch.tensor(slots)], engine.runner.kv.lengths]
    for a, b in zip(after, seen["state"]):
        assert torch.equal(a, b)
    _idle(engine)
    after, fresh = fresh_after(mode)
    out = generate_f64(engine, after, max_new_tokens=12)
    assert torch.equal(out.sequences, fresh.sequences) and _stats(out) == _stats(fresh)
    if sample:  # and sampling works again too: the same draws as a fresh engine's
        out = generate_f64(engine, after, max_new_tokens=12, do_sample=True, seed=5)
        fresh = generate_f64(_wrap(target, mode), after, max_new_tokens=12, do_sample=True, seed=5)
        assert torch.equal(out.sequences, fresh.sequences)


def test_nonfinite_prefill_logits(target, prompts):
    engine = _wrap(target, ("replay", "lazy"))
    batch = [list(p) for p in itertools.islice(prompts, 2)]

    calls = []

    def hook(module, args, logits):  # the first head call is the prefill: the last logits of both prompts
        calls.append(logits.shape)
        if len(calls) == 1:
            assert logits.shape[:2] == (2, 1), logits.shape
            logits[1, -1, 0] = math.nan

    assert len(batch[0]) != len(batch[1])
    handle = target.lm_head.register_forward_hook(hook)
    try:
        with pytest.raises(FloatingPointError, match=rf"request row 1 at position {len(batch[1]) - 1} \(prefill\)"):
            generate_f64(engine, batch, max_new_tokens=4)
    finally:
        handle.remove()
    _idle(engine)
    _assert_greedy(generate_f64(engine, batch, max_new_tokens=N), batch, prompts, N, engine.pad_token_id)
