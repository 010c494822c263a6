"""The online request loop (`SpecEngine.submit` / `step` / `start` / `stop`, `Request`): requests that arrive while
others run, differ in how they decode, are cancelled, or fail in a round each get what they would alone, and the
engine goes on serving. Oracles: transformers' greedy generate (`greedy_reference`) and the engine's own
`generate` of the same prompt alone, in float64."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading

import pytest
import torch

from tiny_models import float64_everywhere, generate_f64, greedy_reference, tiny_model, torch_fallbacks

import specdec

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12


@functools.cache
def target():
    return tiny_model("qwen3_next")


def engine(drafter="ngram", **kw):
    torch.manual_seed(0)  # the same untrained head in every engine
    options = dict(untrained=True, topk=2, num_nodes=6) if drafter == "eagle" else {}
    kw = {**dict(max_batch_size=3, max_length=128, num_draft_tokens=3), **options, **kw}
    return specdec.wrap(target(), drafter=drafter, **kw)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@contextlib.contextmanager
def f64():
    with torch_fallbacks(), float64_everywhere():
        yield


def run_until_idle(eng) -> int:
    steps = 0
    with f64():
        while eng.step():
            steps += 1
    return steps


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_requests_arriving_while_others_run_get_their_own_output(drafter):
    """Four requests on three lanes; two more arrive after some rounds: every output is transformers' greedy."""
    eng = engine(drafter)
    ps = prompts(6)
    first = [eng.submit(p, max_new_tokens=NEW, eos_token_id=None) for p in ps[:4]]
    with f64():
        for _ in range(3):
            eng.step()
    assert sum(r.status == "running" for r in first) == 3 and first[3].status == "waiting"
    later = [eng.submit(p, max_new_tokens=NEW, eos_token_id=None) for p in ps[4:]]
    run_until_idle(eng)
    for r, p in zip(first + later, ps):
        assert r.done and r.finish_reason == "length"
        assert p + r.result() == greedy_reference(target(), p, NEW)


def test_iterators_give_the_committed_tokens_in_order():
    """A request's iterator (and async iterator, from another thread's event loop) yields exactly its result, while
    the background loop runs it."""
    eng = engine()
    ps = prompts(2, seed=1)
    _run_loop_in_f64(eng)
    try:
        a = eng.submit(ps[0], max_new_tokens=NEW, eos_token_id=None)
        b = eng.submit(ps[1], max_new_tokens=NEW, eos_token_id=None)

        async def consume(r):
            return [t async for t in r]

        got_b = asyncio.run(consume(b))
        got_a = list(a)
    finally:
        eng.stop()
    assert got_a == a.result() and got_b == b.result()
    for r, p in zip((a, b), ps):
        assert p + r.result() == greedy_reference(target(), p, NEW)


def _run_loop_in_f64(eng) -> None:
    """`eng.start()` with the loop thread in float64 mode (the modes are per thread)."""
    serve = eng._serve

    def serve_f64():
        with f64():
            serve()
    eng._serve = serve_f64
    eng.start()


def test_cancel_frees_the_lane_keeps_what_was_committed_and_caches_it():
    """A request cancelled after some rounds ends 'cancelled' with a prefix of its full output; its lane and slot are
    free at the next step; with a prefix cache, its committed tokens are cached: a follow-up finds them."""
    eng = engine(prefix_cache=True, track_interval=8)
    p = prompts(1, seed=2)[0]
    full = greedy_reference(target(), p, 40)
    r = eng.submit(p, max_new_tokens=40, eos_token_id=None)
    with f64():
        eng.step()
        eng.step()
    r.cancel()
    with f64():
        assert not eng.step()  # nothing left: the request left at this step's start
    assert r.finish_reason == "cancelled" and 0 < len(r.out) < 40
    assert p + r.out == full[:len(p) + len(r.out)]
    assert eng.runner.num_free == eng.config.max_batch_size and eng.memory()["parts"]["KV cache"] >= 0
    follow = p + r.out + [7, 8]
    out = generate_f64(eng, [follow], max_new_tokens=4)
    assert out.stats.cached_tokens >= len(p) + len(r.out) - 1
    assert out.sequences[0].tolist() == greedy_reference(target(), follow, 4)


def test_a_waiting_request_cancelled_never_runs():
    eng = engine(max_batch_size=1)
    a, b = (eng.submit(p, max_new_tokens=4, eos_token_id=None) for p in prompts(2, seed=3))
    b.cancel()
    run_until_idle(eng)
    assert a.finish_reason == "length" and b.finish_reason == "cancelled" and b.out == []


def test_a_failing_round_fails_only_its_requests():
    """Two requests that decode differently (two seeds: two groups, two rounds a step); the target raises in one
    group's round. That request fails with the error, nothing of the round committed; the other's output equals its
    run alone; the engine serves the next requests."""
    eng = engine()
    ps = prompts(2, seed=4)
    kw = dict(max_new_tokens=NEW, do_sample=True, top_k=0)
    bad = eng.submit(ps[0], seed=1, eos_token_id=None, **kw)
    good = eng.submit(ps[1], seed=2, eos_token_id=None, **kw)
    boom = RuntimeError("injected")
    calls = {"n": 0}
    device_step = eng.round_step.device_step

    def failing(step, *a, **k):
        if eng.runner.slots.length(step.host_slots[0]) and bad.status == "running" and \
                eng.lane_slots[eng._lanes.req.index(bad)] in step.host_slots:
            calls["n"] += 1
            if calls["n"] == 2:
                raise boom
        return device_step(step, *a, **k)
    eng.round_step.device_step = failing
    run_until_idle(eng)
    eng.round_step.device_step = device_step
    assert bad.finish_reason == "error" and bad.error is boom
    with pytest.raises(RuntimeError, match="injected"):
        bad.result()
    alone = generate_f64(engine(), [ps[1]], seed=2, **kw).sequences[0].tolist()
    assert ps[1] + good.result() == alone
    assert eng.runner.num_free == eng.config.max_batch_size
    again = generate_f64(eng, [ps[0]], seed=1, **kw).sequences[0].tolist()
    assert again == generate_f64(engine(), [ps[0]], seed=1, **kw).sequences[0].tolist()


def test_generate_from_threads_while_the_loop_runs():
    """Three threads call generate while the background loop serves them: each gets its greedy output."""
    eng = engine()
    ps = prompts(3, seed=5)
    _run_loop_in_f64(eng)
    outs = {}

    def call(i):
        outs[i] = eng.generate([torch.tensor(ps[i])], max_new_tokens=NEW, eos_token_id=None).sequences[0].tolist()
    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        eng.stop()
    for i, p in enumerate(ps):
        assert outs[i] == greedy_reference(target(), p, NEW)


def test_submit_checks_its_prompt_before_queueing():
    eng = engine()
    with pytest.raises(ValueError, match="prompt: expected one prompt"):
        eng.submit([[5, 6], [7, 8]])
    with pytest.raises(ValueError, match="max_new_tokens: prompt .* exceeds max_length"):
        eng.submit(list(range(5, 60)), max_new_tokens=100)
    assert not eng.step()
