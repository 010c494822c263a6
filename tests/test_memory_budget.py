"""`wrap(model, memory=bytes | fraction)`: one byte budget, the KV pages get what the other buffers leave, and
`max_length` is a cap per request rather than a reservation per lane.

- 64 prompts of ~300 tokens run at once with `max_batch_size=64, max_length=16384, memory=96 MiB` (a reservation of
  max_length per lane would need about 640 MiB of KV), each row the output of its prompt alone.
- A budget whose pages hold two requests' worst cases runs four prompts two at a time (admission waits for pages;
  nothing fails mid-generation), with the output of an engine without a budget.
- `engine.memory()` accounts every byte of the budget; too small a budget, or a bad option, is one clear error.
Oracles: the engine without a budget (pages for max_length in every slot) and single-prompt runs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import float64_everywhere, tiny_model, torch_fallbacks

import specdec
from specdec.memory import InsufficientMemoryError

MiB = 1 << 20


def _prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` different windows of `length` tokens of a standard-library module's source."""
    import argparse
    ids = tokenizer(inspect.getsource(argparse))["input_ids"]
    step = (len(ids) - length) // n
    return [ids[i * step:i * step + length] for i in range(n)]


def _max_batch(engine) -> list[int]:
    """Records the rows of every round `engine` runs (its `_round`)."""
    rows, inner = [], engine._round
    engine._round = lambda active, *a, **k: (rows.append(len(active)), inner(active, *a, **k))[1]
    return rows


@pytest.mark.usefixtures("one_thread")
def test_64_long_prompts_at_once_in_96_mib(embedded):
    model, model_dir, _ = embedded
    from transformers import AutoTokenizer
    prompts = _prompts(AutoTokenizer.from_pretrained(model_dir), 64, 300)
    engine = specdec.wrap(model, drafter="ngram", max_batch_size=64, max_length=16384, memory=96 * MiB)
    mem = engine.memory()
    assert mem["budget"] <= 96 * MiB and mem["free"] > 0
    rows = _max_batch(engine)
    out = engine.generate([torch.tensor(p) for p in prompts], max_new_tokens=4, eos_token_id=None)
    assert rows[0] == 64, f"the first round ran {rows[0]} requests, not all 64"
    alone = specdec.wrap(model, drafter="ngram", max_batch_size=1, max_length=400)
    for b, p in enumerate(prompts):
        one = alone.generate([torch.tensor(p)], max_new_tokens=4, eos_token_id=None)
        assert out.sequences[b, :len(p) + 4].tolist() == one.sequences[0].tolist(), f"row {b}"


def test_admission_waits_for_pages():
    """Pages for two requests' worst cases: four prompts run two at a time, with the output of no budget."""
    target = tiny_model("qwen3_next")
    kw = dict(drafter="ngram", num_draft_tokens=3, max_batch_size=4, max_length=64)
    plain = specdec.wrap(target, **kw)
    probe = specdec.wrap(target, memory=1 << 30, **kw)
    plan = probe.memory_plan
    kv = plan.parts["KV cache"]
    page = probe.runner.kv.page_size * specdec.kv_cache.token_bytes(kv)
    rest = plan.total - sum(s.nbytes for s in specdec.kv_cache.page_specs(kv).values())
    worst = 20 + 12 + probe.target.num_verify_tokens  # prompt + new tokens + a verify window
    pages = max(2 * -(-worst // probe.runner.kv.page_size), -(-probe.runner.kv.max_length // 16))
    engine = specdec.wrap(target, memory=rest + (pages + 1) * page, **kw)
    assert engine.runner.kv.num_pages == pages
    prompts = [torch.arange(5 + i, 25 + i) % 90 + 3 for i in range(4)]
    rows = _max_batch(engine)
    with torch_fallbacks(), float64_everywhere():
        got = engine.generate(prompts, max_new_tokens=12, eos_token_id=None)
        want = plain.generate(prompts, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(got.sequences, want.sequences)
    fit = pages // -(-worst // engine.runner.kv.page_size)
    assert max(rows) == min(fit, 4) < 4, rows
    mem = engine.memory()
    assert mem["used"] + mem["free"] == mem["budget"] and mem["shared"] == 0
    assert mem["free"] == pages * page  # every page back in the pool
    assert engine.runner.kv.pages[False].num_free == pages


def test_bad_budgets_are_one_clear_error():
    target = tiny_model("qwen3_next")
    with pytest.raises(InsufficientMemoryError, match=r"memory: .* one request at max_length \(\d+ tokens\) needs"):
        specdec.wrap(target, max_length=64, memory=1000)
    with pytest.raises(InsufficientMemoryError, match=r"memory: a budget of .* exceeds the .* free"):
        specdec.wrap(target, max_length=64, memory=1 << 60)
    for bad in (0, -5, 1.5, 0.0, True, "1GiB"):
        with pytest.raises(ValueError, match=r"memory: expected None, a byte budget"):
            specdec.wrap(target, memory=bad)
    engine = specdec.wrap(target, max_length=64, memory=0.01)  # a share of the free memory
    assert engine.memory()["budget"] > 0
