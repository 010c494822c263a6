"""`wrap(model, prefix_cache=...)`: a conversation's next turn starts from the cached state of its prefix, and its
output is the output without the cache, token for token (float64; greedy, and sampling with a fixed seed), on
Kimi-Linear, Qwen3-Next and a Mamba2 hybrid (Nemotron-H), for every state strategy and ngram, eagle (tree), mtp and
dspark drafters. The conversations hit at a prompt's end (mid-interval), at a finished request's end and at a track
boundary inside an earlier reply. A hypothesis property runs random conversations with random budgets (eviction)
and interleaved requests, greedy or sampled with a seed: outputs as without the cache, no entry changed after it
was written, no slot leaked."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from assertions import max_rel_err
from tiny_models import float64_everywhere, generate_f64, greedy_reference, tiny_model, torch_fallbacks

import specdec
import test_generic_families as generic
from specdec.kv_cache import feature_key
from specdec.prefix_cache import PrefixCache, Entry
from specdec.runner import HybridRunner

pytestmark = pytest.mark.usefixtures("one_thread")

INTERVAL = 8
NEW = 10
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
DRAFTERS = {"ngram": {}, "eagle": dict(untrained=True, topk=2, num_nodes=6), "mtp": dict(untrained=True),
            "dspark": dict(untrained=True)}


@functools.cache
def target(family: str):
    return generic.tiny(family) if family == "nemotron_h" else tiny_model(family)


def engine(family, drafter, mode, **kw):
    strategy, commit = mode
    model = target(family)
    torch.manual_seed(0)  # the same untrained head in every engine: the same drafts, so sampled tokens compare too
    return specdec.wrap(model, drafter=drafter, strategy=strategy, commit=commit, max_batch_size=2,
                        max_length=160, num_draft_tokens=3, **DRAFTERS[drafter], **kw)


def conversation(seed: int) -> list[tuple[str, list[int]]]:
    """Turns `(expected hit, prompt)`: a first prompt of 11 tokens (its end is mid-interval), the whole first
    exchange continued (a hit at the first request's end), the first prompt with another continuation (a hit at its
    end), and the first reply cut after 18 tokens and continued (a hit at the track boundary 16)."""
    g = torch.Generator().manual_seed(seed)
    toks = lambda n: torch.randint(3, 90, (n,), generator=g).tolist()  # noqa: E731
    first = toks(11)
    return [("none", first), ("request end", None), ("prompt end", first + toks(4)), ("track boundary", None)], toks


def run_conversation(eng, conv_seed, **kw) -> tuple[list[list[int]], list[int]]:
    """The conversation's outputs (`conversation`, the continued turns built from this engine's own outputs) and
    the cached tokens of each turn."""
    turns, toks = conversation(conv_seed)
    outs, cached, first_out = [], [], None
    for kind, prompt in turns:
        if kind == "request end":
            prompt = first_out + toks(5)
        elif kind == "track boundary":
            prompt = first_out[:18] + toks(3)
        out = generate_f64(eng, [prompt], max_new_tokens=NEW, **kw)
        seq = out.sequences[0].tolist()
        first_out = seq if first_out is None else first_out
        outs.append(seq)
        cached.append(out.stats.cached_tokens)
    return outs, cached


@pytest.mark.parametrize("model, tp", [("kimi_linear", False), ("kimi_linear", True), ("qwen3_next", True),
                                       ("mamba", False)])
def test_prefix_cache_refusal_is_wraps_own_check(model, tp):
    """`build.prefix_cache_refusal` (which `specdec serve` asks to leave its default cache off) says what `wrap`
    does with `prefix_cache=True`: None where it builds past the check, else its error, word for word."""
    from specdec.build import prefix_cache_refusal

    m = generic.tiny(model) if model == "mamba" else target(model)
    why = prefix_cache_refusal(m, tp=tp)
    kw = dict(prefix_cache=True, max_length=64, **({"tp_group": object()} if tp else {}))
    try:
        specdec.wrap(m, **kw)
        err = None
    except ValueError as e:
        err = str(e)
    if why is None:  # past the cache's check: built, or refused later for something else (the fake group)
        assert err is None or "prefix_cache" not in err, err
    else:
        assert err == why


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next", "nemotron_h"])
def test_greedy_equals_no_cache(family, drafter, mode):
    plain = engine(family, drafter, mode)
    cached_eng = engine(family, drafter, mode, prefix_cache=True, track_interval=INTERVAL)
    want, none = run_conversation(plain, 0)
    got, cached = run_conversation(cached_eng, 0)
    assert got == want
    assert none == [0, 0, 0, 0]
    # what each turn reused: nothing, the first request's committed end (prompt 11 + 9 new, the last new token being
    # the uncommitted anchor; or + 10 when the last round accepted it as a draft past max_new_tokens), the first
    # prompt's end, and the first reply's track boundary 16 (the cut is at 18)
    assert cached[0] == 0 and cached[1] in (20, 21) and cached[2:] == [11, 16], cached
    for seq in got:  # and the outputs are transformers' greedy decode
        prompt = seq[:-NEW]
        assert seq[len(prompt):] == greedy_reference(target(family), prompt, NEW)[len(prompt):]


def test_a_path_cap_keeps_the_output_and_thins_the_entries():
    """With at most 2 entries per path the conversation's outputs are those of no cache, and the cache thinned
    entries (every page still held by exactly its holders)."""
    plain = engine("qwen3_next", "eagle", MODES[0])
    capped = engine("qwen3_next", "eagle", MODES[0], prefix_cache=True, track_interval=INTERVAL, states_per_path=2)
    want, _ = run_conversation(plain, 0)
    got, cached = run_conversation(capped, 0)
    assert got == want and cached[0] == 0 and sum(cached) > 0
    assert capped.prefix_cache.stats["thinned"] > 0
    check_page_holders(capped)


@pytest.mark.parametrize("bad", [1, 0, True, 2.0, "4"])
def test_a_bad_states_per_path_is_refused(bad):
    with pytest.raises(ValueError, match=r"states_per_path: expected None \(no cap\) or an int >= 2, got"):
        specdec.SpecConfig(states_per_path=bad)


def test_sampling_with_a_seed_equals_no_cache():
    plain = engine("kimi_linear", "eagle", MODES[0])
    cached_eng = engine("kimi_linear", "eagle", MODES[0], prefix_cache=True, track_interval=INTERVAL)
    kw = dict(do_sample=True, temperature=1.0, seed=5)
    want, _ = run_conversation(plain, 1, **kw)
    got, cached = run_conversation(cached_eng, 1, **kw)
    assert got == want and cached[1] > 0


def test_a_prompt_with_no_cached_prefix_runs_as_without():
    plain = engine("qwen3_next", "ngram", MODES[0])
    eng = engine("qwen3_next", "ngram", MODES[0], prefix_cache=True)
    for prompt in ([4, 5, 6, 7, 8], [9, 10, 11, 12]):  # no common first token: no hit
        out = generate_f64(eng, [prompt], max_new_tokens=NEW)
        assert out.stats.cached_tokens == 0 and out.stats.prompt_tokens == len(prompt)
        assert torch.equal(out.sequences, generate_f64(plain, [prompt], max_new_tokens=NEW).sequences)


def test_bad_budgets_and_targets_are_one_clear_error():
    model = target("kimi_linear")
    with pytest.raises(ValueError, match=r"prefix_cache: a budget of 100 B is smaller than one entry \(.* "
                                         r"recurrent state .*\); give at least \d+ bytes"):
        specdec.wrap(model, prefix_cache=100)
    with pytest.raises(ValueError, match=r"prefix_cache: expected False, True or a byte budget"):
        specdec.wrap(model, prefix_cache=-5)
    with pytest.raises(ValueError, match=r"track_interval: expected None or an int >= 1"):
        specdec.wrap(model, prefix_cache=True, track_interval=0)
    for option in (dict(track_interval=64), dict(states_per_path=4)):  # options of the cache, without one
        with pytest.raises(ValueError, match=rf"{next(iter(option))}: an option of the prefix cache; give "
                                             r"prefix_cache=True"):
            specdec.wrap(model, **option)
    with pytest.raises(ValueError, match=r"prefix_cache: needs a hybrid target"):
        specdec.wrap(generic.tiny("mamba"), prefix_cache=True)
    with pytest.raises(ValueError, match=r"track_interval: 1 with num_draft_tokens 3: .* track_interval >= 2"):
        specdec.wrap(model, prefix_cache=True, track_interval=1, num_draft_tokens=3)


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
@pytest.mark.parametrize("stop", ["length", "eos"])
def test_the_end_entry_is_at_the_returned_tokens(mode, stop):
    """The draft model is the target itself, so every draft is accepted and the last round's drafts run past the
    end (max_new_tokens with static shapes, whose rounds draft gamma whatever is left; or an eos id among them). The
    next turn, built from the returned sequence, finds an entry holding every returned token but at most the last
    one, and its output is the output without the cache."""
    family = "qwen3_next"
    model = target(family)
    kw = dict(drafter="model", draft_model=model, strategy=mode[0], commit=mode[1], max_batch_size=2,
              max_length=160, num_draft_tokens=3, static_shapes=stop == "length")
    plain = specdec.wrap(model, **kw)
    eng = specdec.wrap(model, prefix_cache=True, track_interval=64, **kw)
    prompt = [5, 9, 12, 40, 41, 42, 43, 7, 8]
    free = greedy_reference(model, prompt, 12)[len(prompt):]
    gen = dict(max_new_tokens=7) if stop == "length" else dict(max_new_tokens=12, eos_token_id=free[6])
    out = generate_f64(eng, [prompt], **gen) if stop == "length" else _gen_eos(eng, prompt, gen)
    seq = out.sequences[0].tolist()
    assert seq == prompt + free[:7] and out.stats.accepted == out.stats.proposed  # the drafts ran past the end
    ends = sorted(e.length for _, e in eng.prefix_cache.entries())
    assert ends[-1] in (len(seq) - 1, len(seq)), ends
    turn = seq + [17, 18]
    got = generate_f64(eng, [turn], max_new_tokens=NEW)
    assert got.stats.cached_tokens >= len(seq) - 1
    assert torch.equal(got.sequences, generate_f64(plain, [turn], max_new_tokens=NEW).sequences)


def _gen_eos(eng, prompt, gen):
    with torch_fallbacks(), float64_everywhere():
        return eng.generate([torch.tensor(prompt)], **gen)


def _entry(n: int, nbytes_each: int = 8) -> Entry:
    return Entry(n, torch.zeros(nbytes_each // 8, dtype=torch.float64), torch.zeros(0), [], {})


def test_eviction_is_least_recently_used_and_never_touches_a_pinned_entry():
    cache = PrefixCache(budget=3 * 64)
    a = cache.insert([1, 2], lambda: _entry(2, 64))
    b = cache.insert([1, 3], lambda: _entry(2, 64))
    c = cache.insert([1, 2, 4], lambda: _entry(3, 64))
    assert cache.match([1, 2, 4, 9], 3) is c and cache.match([1, 2, 5], 2) is a  # deepest entry within the limit
    assert cache.match([1, 2, 4], 2) is a  # c holds 3 tokens: more than the limit
    with cache.pinned([b]):  # b is the least recently used, but pinned
        d = cache.insert([7], lambda: _entry(1, 64))
    held = {id(e) for _, e in cache.entries()}
    assert id(b) in held and id(d) in held and cache.bytes <= cache.budget
    assert cache.stats["evicted"] == 1 and id(c) not in held  # c (used before a) went
    assert cache.insert([8], lambda: _entry(1, 4 * 64)) is None and cache.stats["skipped"] == 1  # over the budget
    assert cache.insert([1, 2], lambda: pytest.fail("an entry is written once")) is a


def _tensors(e: Entry) -> list[torch.Tensor]:
    """The entry's tensors, its KV and features read through its shared pages (a write into one of them shows
    here)."""
    kv = [x for key in (e.owner.store if e.owner is not None else {}) for x in e.read(key)]
    return [e.conv, e.ssm, *kv]


def check_page_holders(eng) -> None:
    """Each KV page's refcount is the slots holding it plus the cache's entries holding it; free if and only if
    nothing holds it (an independent count over the slots' and the entries' page lists)."""
    table = eng.runner.kv.pages[False]
    count = [0] * table.num_pages
    for row in table.held:
        for p in row:
            count[p] += 1
    for _, e in eng.prefix_cache.entries():
        for p in e.pages:
            count[p] += 1
    assert table.refs == count, "a page's refcount is not its holders"
    assert sorted(table.free) == [p for p, c in enumerate(count) if c == 0], "free is not 'held by nothing'"


def _snapshot(cache: PrefixCache) -> dict:
    """Each entry (kept alive here, so that its id is not reused) with copies of its tensors."""
    return {id(e): (e, [t.clone() for t in _tensors(e)]) for _, e in cache.entries()}


def _unchanged(cache: PrefixCache, seen: dict) -> None:
    for _, e in cache.entries():
        if id(e) in seen:
            assert all(torch.equal(x, y) for x, y in zip(_tensors(e), seen[id(e)][1])), \
                "an entry changed after it was written"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_conversations_budgets_and_interleaving(data):
    mode = data.draw(st.sampled_from(MODES), label="mode")
    drafter = data.draw(st.sampled_from(["ngram", "eagle"]), label="drafter")
    budget = data.draw(st.sampled_from([60_000, 150_000, 10**9]), label="budget")  # small ones evict
    sampled = data.draw(st.booleans(), label="sampled")  # greedy, or sampling with a seed
    plain = _engines(drafter, mode)
    eng = engine("kimi_linear", drafter, mode, prefix_cache=budget, track_interval=4)
    pool = eng.runner.state.pool
    pieces = [data.draw(st.lists(st.integers(3, 90), min_size=2, max_size=9), label=f"piece{i}") for i in range(3)]
    seen = {}
    for turn in range(data.draw(st.integers(2, 4), label="turns")):
        # a batch of 1-3 prompts, each some pieces concatenated: shared prefixes, interleaved in one call
        prompts = [sum((pieces[i] for i in data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3),
                                                        label=f"turn{turn}.{j}")), [])
                   for j in range(data.draw(st.integers(1, 3), label=f"batch{turn}"))]
        kw = dict(do_sample=True, temperature=1.0, seed=turn) if sampled else {}
        want = generate_f64(plain, prompts, max_new_tokens=6, **kw).sequences
        got = generate_f64(eng, prompts, max_new_tokens=6, **kw).sequences
        assert torch.equal(got, want)
        _unchanged(eng.prefix_cache, seen)
        check_page_holders(eng)
        seen.update({k: v for k, v in _snapshot(eng.prefix_cache).items() if k not in seen})
        assert pool.num_free == pool.cfg.max_requests, "a slot leaked"
        assert eng.prefix_cache.bytes <= budget
        pieces.append(got[0].tolist()[-4:])  # later turns may reuse an output


@functools.cache
def _engines(drafter, mode):
    """The engine without a cache, one per setting across the property's examples (it keeps nothing between calls;
    each example makes its own cached engine)."""
    return engine("kimi_linear", drafter, mode)


def test_a_fault_mid_round_leaves_the_cache_and_engine_consistent(monkeypatch):
    plain = engine("qwen3_next", "eagle", MODES[1])
    eng = engine("qwen3_next", "eagle", MODES[1], prefix_cache=True, track_interval=INTERVAL)
    first = generate_f64(eng, [[5, 9, 12, 40, 41, 42, 43, 7, 8]], max_new_tokens=NEW).sequences[0].tolist()
    seen = _snapshot(eng.prefix_cache)
    assert seen
    calls = {"n": 0}
    real = eng.runner.kv.advance

    def flaky(*a, **k):  # the third commit of the next call raises, after the state strategy committed
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(*a, **k)
    monkeypatch.setattr(eng.runner.kv, "advance", flaky)
    prompt = first + [60, 61]
    with pytest.raises(RuntimeError, match="injected"):
        generate_f64(eng, [prompt], max_new_tokens=NEW)
    monkeypatch.setattr(eng.runner.kv, "advance", real)
    _unchanged(eng.prefix_cache, seen)
    pool = eng.runner.state.pool
    assert pool.num_free == pool.cfg.max_requests
    out = generate_f64(eng, [prompt], max_new_tokens=NEW)
    assert out.stats.cached_tokens > 0
    assert torch.equal(out.sequences, generate_f64(plain, [prompt], max_new_tokens=NEW).sequences)


def test_teeth_a_changed_entry_is_caught():
    """The property's immutability check fails when a written entry changes."""
    eng = engine("kimi_linear", "ngram", MODES[0], prefix_cache=True)
    generate_f64(eng, [[5, 6, 7, 8, 9]], max_new_tokens=4)
    seen = _snapshot(eng.prefix_cache)
    _, e = eng.prefix_cache.entries()[0]
    e.ssm.view(-1)[0] += 1
    with pytest.raises(AssertionError, match="an entry changed"):
        _unchanged(eng.prefix_cache, seen)


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_static_shapes_equal_no_cache(drafter):
    """With static shapes (the padded rounds CUDA graphs capture; eagle drafts inside the device step) the cache
    serves the same conversation, token for token."""
    plain = engine("kimi_linear", drafter, MODES[0], static_shapes=True)
    cached_eng = engine("kimi_linear", drafter, MODES[0], static_shapes=True, prefix_cache=True,
                        track_interval=INTERVAL)
    want, _ = run_conversation(plain, 2)
    got, cached = run_conversation(cached_eng, 2)
    assert got == want and cached[0] == 0 and cached[1] >= 20 and cached[2:] == [11, 16], cached


def _key(node) -> list[int]:
    out = []
    while node.parent is not None:
        out = list(node.edge) + out
        node = node.parent
    return out


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_an_entry_at_every_boundary_holds_the_state_of_its_prefix(mode):
    """Entries at every multiple of the interval (inside the prompt, from prefill segments; in the reply, from the
    rounds' track copies), at the prompt's end and at the request's end; each holds the state, conv window and KV
    entries that a fresh prefill of its tokens gives (float64)."""
    eng = engine("qwen3_next", "eagle", mode, prefix_cache=True, track_interval=4)
    prompt = list(range(5, 19))  # 14 tokens: boundaries 4, 8, 12 inside it
    generate_f64(eng, [prompt], max_new_tokens=13)
    entries = {e.length: (node, e) for node, e in eng.prefix_cache.entries()}
    end = max(entries)
    assert end >= 14 + 12 and set(range(4, end + 1, 4)) | {14, end} == set(entries), sorted(entries)
    fresh = HybridRunner(target("qwen3_next"), strategy="snapshot", max_batch_size=1, max_length=64)
    for n, (node, e) in sorted(entries.items()):
        s = fresh.alloc(1)[0]
        with torch_fallbacks(), float64_everywhere():
            out = fresh.prefill(s, torch.tensor(_key(node)), capture=eng.drafter.feature_layers)
        pool = fresh.state.pool
        assert max_rel_err(e.ssm, pool.ssm[:, s]) < 1e-10 and max_rel_err(e.conv, pool.conv[:, s]) < 1e-10, n
        features = {feature_key("hidden"): out.hidden[0], **{feature_key(i): x[0] for i, x in out.captured.items()}}
        assert set(features) | set(fresh.kv.store) == set(e.owner.store)  # every KV layer and observed feature
        for key in e.owner.store:
            ts = e.read(key)
            held = fresh.kv.read(key, torch.tensor([s]), n) if key in fresh.kv.store else [features[key][None, None]]
            assert all(max_rel_err(t, x[0]) < 1e-10 for t, x in zip(ts, held)), (n, key)
        fresh.release([s])


def test_a_budget_past_the_free_memory_is_refused_at_wrap():
    """The budget counts in the wrap's memory check (the cache fills up to it as requests finish)."""
    with pytest.raises(specdec.memory.InsufficientMemoryError,
                       match=r"max_batch_size, max_length, prefix_cache: wrap with .*prefix_cache=1000000000000000 "
                             r"needs .*\(.*, prefix cache 909\.5 TiB\), but only .* is free "
                             r".*lower .* or prefix_cache"):
        specdec.wrap(target("kimi_linear"), prefix_cache=10**15)


def test_an_entry_shares_its_full_pages_and_copies_the_rest():
    """A 37-token prompt's entry holds its two full KV pages (shared with the slot it came from) and a copy of the
    last 5 tokens; a slot restored from it shares the two pages and writes the 5 into a page of its own; the KV it
    reads is the entry's; evicting every entry frees every page."""
    eng = engine("qwen3_next", "ngram", MODES[0], prefix_cache=True, track_interval=64)
    prompt = list(range(5, 5 + 37))
    generate_f64(eng, [prompt], max_new_tokens=4)
    e = next(e for _, e in eng.prefix_cache.entries() if e.length == 37)
    page = eng.runner.kv.page_size
    assert len(e.pages) == 37 // page and all(t.shape[0] == 37 % page for ts in e.tail.values() for t in ts)
    mem = eng.memory()
    assert mem["shared"] > 0 and mem["evictable"] > eng.prefix_cache.bytes
    r, table = eng.runner, eng.runner.kv.pages[False]
    s = r.alloc(1)[0]
    r.reserve([s], [60])
    with torch_fallbacks(), float64_everywhere():
        r.slots.restore(e, s)
    assert table.held[s][:len(e.pages)] == e.pages and table.held[s][len(e.pages)] not in e.pages
    assert all(table.refs[p] >= 2 for p in e.pages)
    for layer in r.kv.store:
        got = r.kv.read(layer, torch.tensor([s]), 37)
        assert all(torch.equal(a[0], b) for a, b in zip(got, e.read(layer)))
    r.release([s])
    check_page_holders(eng)
    while eng.prefix_cache.evict_one():
        pass
    assert table.num_free == table.num_pages and eng.memory()["shared"] == 0


def test_agent_loop_edits_find_the_boundary_before_them():
    """An agent loop at small scale: a 700-token conversation, then the conversation edited at 100, 200, ... 600
    tokens, each a new request: each starts from the boundary at most one track interval before its edit (the
    entries share their KV pages, so the cache holds them all and a request's pages evict only what they need), with
    the output of an engine without the cache."""
    kw = dict(drafter="ngram", max_batch_size=1, max_length=800, num_draft_tokens=3)  # pages for one request
    plain = specdec.wrap(target("qwen3_next"), **kw)
    eng = specdec.wrap(target("qwen3_next"), prefix_cache=True, track_interval=16, **kw)
    g = torch.Generator().manual_seed(3)
    conv = torch.randint(3, 90, (700,), generator=g).tolist()
    generate_f64(eng, [conv], max_new_tokens=4)
    for edit in range(100, 700, 100):
        prompt = conv[:edit] + [7, 8, 9]
        got = generate_f64(eng, [prompt], max_new_tokens=NEW)
        assert edit - 16 <= got.stats.cached_tokens <= edit, (edit, got.stats.cached_tokens)
        assert torch.equal(got.sequences, generate_f64(plain, [prompt], max_new_tokens=NEW).sequences)
        check_page_holders(eng)
