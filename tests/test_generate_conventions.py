"""`generate` called as transformers' `model.generate(**tokenizer(...))` is called.

- A padded batch (left or right, from a real tokenizer, passed as keywords, whole, as its dict, or as a block whose
  pads are inferred from the pad id) gives every row the output of its unpadded prompt alone, which equals
  transformers' own greedy generate of that prompt; `sequences` keeps the prompt block as given, then the new tokens
  padded with the pad id, and `new_token_counts` / `finish_reasons` say where and why each row ends (checked against
  transformers' output with the same eos ids).
- Settings come from `generation_config=`, the call and the model's own `generation_config`, merged as transformers
  merges them: a model config with sampling defaults samples (the same tokens as the call asking for them with the
  same seed) unless the call says `do_sample=False`; lengths and eos ids from a config are honoured.
- The warnings transformers' `generate` logs for the same arguments are logged (captured from both).
- Bad arguments are one ValueError naming the argument, before any state is touched.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from tiny_models import float64_everywhere, greedy_reference, tiny_model, tiny_tokenizer, torch_fallbacks
from transformers import GenerationConfig

import specdec

FAMILY = "qwen3_5"
NEW = 9
TEXTS = ["def wrap(text, width=70):", "import re", "    return [line for line in lines]\n"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return tiny_model(FAMILY, seed=0, vocab_size=len(tok))


def _engine(target, **kw):
    return specdec.wrap(target, drafter="ngram", num_draft_tokens=3, max_batch_size=2, max_length=64, **kw)


def _gen(engine, *args, **kw):
    with torch_fallbacks(), float64_everywhere():
        return engine.generate(*args, **kw)


def _new_rows(out, start: int) -> list[list[int]]:
    """Each row's new tokens: `sequences[b, start:start + new_token_counts[b]]`."""
    return [out.sequences[b, start:start + n].tolist() for b, n in enumerate(out.new_token_counts)]


@contextlib.contextmanager
def _transformers_log():
    """The warnings transformers' loggers emit inside the block (their once-only cache cleared first)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    root = logging.getLogger("transformers")
    logging.Logger.warning_once.cache_clear()
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


# ---- padded batches ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("form", ["keywords", "whole", "dict", "lists"])
def test_padded_batch_rows_equal_their_unpadded_runs(target, tok, side, form):
    tok = copy.deepcopy(tok)
    tok.padding_side = side
    engine = _engine(target)
    prompts = [tok(t).input_ids for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(TEXTS)  # the batch needs padding
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    if form == "keywords":
        out = _gen(engine, **enc, max_new_tokens=NEW, eos_token_id=None)
    elif form == "whole":
        out = _gen(engine, enc, max_new_tokens=NEW, eos_token_id=None)
    elif form == "dict":
        out = _gen(engine, dict(enc), max_new_tokens=NEW, eos_token_id=None)
    else:  # a tokenizer's output without return_tensors: padded lists of ints
        listed = tok(TEXTS, padding=True)
        out = _gen(engine, listed["input_ids"], attention_mask=listed["attention_mask"], max_new_tokens=NEW,
                   eos_token_id=None)
    P = enc.input_ids.shape[1]
    assert out.sequences.shape == (len(TEXTS), P + NEW)
    assert torch.equal(out.sequences[:, :P], enc.input_ids)  # the prompt block as given, pads included
    assert out.new_token_counts == [NEW] * len(TEXTS) and out.finish_reasons == ["length"] * len(TEXTS)
    for b, (p, new) in enumerate(zip(prompts, _new_rows(out, P))):
        assert p + new == greedy_reference(target, p, NEW), f"row {b} ({side} padding) differs from its prompt alone"
    alone = _gen(engine, prompts[0], max_new_tokens=NEW, eos_token_id=None)  # one list of ints: one prompt
    assert alone.sequences.tolist() == [greedy_reference(target, prompts[0], NEW)]


def test_padding_inferred_from_the_pad_id_without_a_mask(target, tok):
    """transformers infers the mask of a block that holds the pad id (pad != eos); so does generate, where the pads
    are leading or trailing runs."""
    tok = copy.deepcopy(tok)
    tok.padding_side = "left"
    engine = _engine(target)
    enc = tok(TEXTS[:2], padding=True, return_tensors="pt")
    assert bool((enc.input_ids == tok.pad_token_id).any()) and tok.pad_token_id != tok.eos_token_id
    masked = _gen(engine, **enc, max_new_tokens=NEW, eos_token_id=None)
    inferred = _gen(engine, enc.input_ids, max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(masked.sequences, inferred.sequences)
    # the pad id inside a prompt is a token: nothing is inferred (with a warning)
    ids = torch.tensor([[5, 6, tok.pad_token_id, 7, 8]])
    with pytest.warns(UserWarning, match="pad_token_id 0 occurs inside prompt row 0"):
        out = _gen(engine, ids, max_new_tokens=NEW, eos_token_id=None)
    with torch_fallbacks(), float64_everywhere():  # transformers, told that every token is a prompt token
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              eos_token_id=None)
    assert torch.equal(out.sequences, ref)


def test_new_token_counts_and_finish_reasons_match_transformers(target):
    """Rows that stop on an eos id (several ids) and rows that reach the length, against transformers' own batched
    greedy output: the same new tokens, padded with the pad id after the eos."""
    engine = _engine(target)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11], [3, 41, 17, 88, 9, 60, 23]]
    free = [greedy_reference(target, p, NEW)[len(p):] for p in prompts]
    eos = [free[0][3], free[1][5]]  # row 0 stops at its 4th new token, row 1 at its 6th (or earlier)
    out = _gen(engine, torch.tensor(prompts), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=1)
    with torch_fallbacks(), float64_everywhere():
        ref = target.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=NEW, eos_token_id=eos,
                              pad_token_id=1, attention_mask=torch.ones(3, 7, dtype=torch.long))
    assert torch.equal(out.sequences, ref)
    for b, row in enumerate(free):
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        assert out.new_token_counts[b] == (stop or NEW)
        assert out.finish_reasons[b] == ("stop" if stop else "length")
    assert out.finish_reasons[:2] == ["stop", "stop"]


# ---- generation_config ---------------------------------------------------------------------------------------


def _with_config(target, **fields):
    """`target` (shared weights) with a generation_config of its own carrying `fields`."""
    model = copy.copy(target)
    model.generation_config = copy.deepcopy(target.generation_config)
    for k, v in fields.items():
        setattr(model.generation_config, k, v)
    return model


def test_model_generation_config_sampling_defaults(target):
    """A checkpoint that ships sampling defaults samples, as `model.generate` does: the same tokens as a call that
    asks for those settings with the same seed; `do_sample=False` in the call decodes greedily."""
    sampled = _with_config(target, do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    engine, plain = _engine(sampled), _engine(target)
    prompt = [[5, 6, 7, 8, 5, 6, 7]]
    runs = [_gen(engine, prompt, max_new_tokens=12, eos_token_id=None, seed=s).sequences for s in range(4)]
    asked = [_gen(plain, prompt, max_new_tokens=12, eos_token_id=None, seed=s, do_sample=True, temperature=0.7,
                  top_k=20, top_p=0.8).sequences for s in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(runs, asked))
    greedy = greedy_reference(target, prompt[0], 12)
    assert any(r[0].tolist() != greedy for r in runs), "sampling defaults decoded greedily"
    out = _gen(engine, prompt, max_new_tokens=12, eos_token_id=None, do_sample=False, seed=0)
    assert out.sequences[0].tolist() == greedy
    # an explicit generation_config over the model's, and the call's keywords over both
    cfg = GenerationConfig(do_sample=False, max_new_tokens=5)
    out = _gen(engine, prompt, generation_config=cfg, eos_token_id=None)
    assert out.sequences[0].tolist() == greedy[:7 + 5]
    out = _gen(engine, prompt, generation_config=cfg, max_new_tokens=6, eos_token_id=None)
    assert out.sequences[0].tolist() == greedy[:7 + 6]


def test_lengths_and_eos_from_the_model_config(target):
    free = greedy_reference(target, [5, 6, 7, 8, 5, 6, 7], 12)[7:]
    eos = [free[6], 2]
    stop = next(i + 1 for i, t in enumerate(free) if t in eos)  # <= 7
    model = _with_config(target, max_new_tokens=stop - 1 if stop > 1 else 1, eos_token_id=eos)
    engine = _engine(model)
    out = _gen(engine, [[5, 6, 7, 8, 5, 6, 7]])
    assert out.new_token_counts == [max(stop - 1, 1)]
    assert out.finish_reasons == ["length" if stop > 1 else "stop"]
    out = _gen(engine, [[5, 6, 7, 8, 5, 6, 7]], max_new_tokens=12)
    assert out.new_token_counts == [stop] and out.finish_reasons == ["stop"]
    # transformers' max_length: prompt block + new tokens
    out = _gen(engine, [[5, 6, 7, 8, 5, 6, 7]], max_length=10, eos_token_id=None)
    assert out.new_token_counts == [3]
    # a length from the model's config is cut to the engine's max_length; the call's is checked
    long = _engine(_with_config(target, max_new_tokens=None, max_length=10_000))
    assert _gen(long, [[5, 6, 7]], eos_token_id=None).new_token_counts == [long.max_length - 3]
    with pytest.raises(ValueError, match="max_new_tokens"):
        _gen(long, [[5, 6, 7]], max_new_tokens=long.max_length)


# ---- transformers' warnings --------------------------------------------------------------------------------


def _warnings_of(call) -> list[str]:
    with _transformers_log() as records, torch_fallbacks(), float64_everywhere():
        call()
    return records


@pytest.mark.parametrize("case", ["temperature without do_sample", "top_p without do_sample",
                                  "batch without mask, pad == eos", "batch without mask or pad"])
def test_transformers_warnings_are_given_too(target, case):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    model, kw = target, {}
    if case == "temperature without do_sample":
        kw = dict(temperature=0.5)
    elif case == "top_p without do_sample":
        kw = dict(top_p=0.9)
    elif case == "batch without mask, pad == eos":
        model = _with_config(target, pad_token_id=2, eos_token_id=2)
    else:
        model = _with_config(target, pad_token_id=None, eos_token_id=2)
    engine = _engine(model)
    theirs = _warnings_of(lambda: model.generate(ids, max_new_tokens=2, **kw))
    ours = _warnings_of(lambda: engine.generate(ids, max_new_tokens=2, **kw))
    relevant = [m for m in theirs if "flags are not valid" in m or "attention mask" in m]
    assert relevant, theirs
    for m in relevant:
        assert m in ours, f"transformers warned {m!r}; generate did not ({ours})"


def test_unsupported_flag_of_the_model_config_is_warned_about(target):
    engine = _engine(_with_config(target, repetition_penalty=1.2))
    with pytest.warns(UserWarning, match="repetition_penalty"):
        out = _gen(engine, [[5, 6, 7, 8]], max_new_tokens=4, eos_token_id=None)
    assert out.sequences[0].tolist() == greedy_reference(target, [5, 6, 7, 8], 4)


# ---- bad arguments ----------------------------------------------------------------------------------------


def test_bad_arguments_raise_before_any_state_is_touched(target, tok):
    engine = _engine(target)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    cases = [
        ("attention_mask", dict(input_ids=ids, attention_mask=torch.ones(2, 3, dtype=torch.long))),
        ("attention_mask", dict(input_ids=ids, attention_mask=torch.full((2, 4), 2))),
        ("attention_mask", dict(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))),
        ("input_ids", dict(input_ids=ids, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))),
        ("attention_mask", dict(input_ids={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                attention_mask=torch.ones_like(ids))),
        ("token_type_ids", dict(input_ids=ids, token_type_ids=torch.ones_like(ids))),
        ("position_ids", dict(input_ids={"input_ids": ids, "position_ids": ids})),
        ("num_beams", dict(input_ids=ids, num_beams=2)),
        ("repetition_penalty", dict(input_ids=ids, repetition_penalty=1.1)),
        ("generation_config", dict(input_ids=ids, generation_config=GenerationConfig(min_new_tokens=3))),
        ("generation_config", dict(input_ids=ids, generation_config={"do_sample": True})),
        ("frobnicate", dict(input_ids=ids, frobnicate=1)),
        ("max_length", dict(input_ids=ids, max_length=4)),
        ("max_new_tokens", dict(input_ids=ids, max_new_tokens="8")),
        ("top_p", dict(input_ids=ids, do_sample=True, top_p=1.5)),
        ("input_ids", dict(input_ids=[])),
    ]
    for arg, kw in cases:
        with pytest.raises(ValueError) as err:
            _gen(engine, **kw)
        assert arg in str(err.value), f"{arg}: the message does not name it: {err.value}"
        assert engine.runner.num_free == 2
    ok = _gen(engine, **tok(TEXTS[:2], padding=True, return_tensors="pt"), max_new_tokens=3)
    assert ok.sequences.shape[0] == 2 and engine.runner.num_free == 2
