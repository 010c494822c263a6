"""End to end: `specdec.wrap(model).generate` == transformers' own greedy `model.generate`, token for token.

Hybrid families (float64 tiny random models) through the hybrid runner, for every state strategy / commit
mode and every drafter kind: ngram, a draft model that is a noisy copy of the target (partial acceptance)
and the target itself as draft model (everything accepted). Any other causal LM (Llama, the Mamba-1 hybrid
Jamba, which has no adapter) through the generic runner. Bad input raises one ValueError naming the argument and
leaves every slot as it was; a drafter that fails mid-generation costs a plain decode round, never correctness.
"""

from __future__ import annotations

import itertools
import math
import pathlib

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, Memo, float64_everywhere, noisy_copy, tiny_model, torch_fallbacks

import specdec
from specdec import SpecConfig
from specdec.draft import DraftBlock, Drafter, NgramDrafter, factory, make_drafter, registry

GAMMA = 7
N = 17  # 1 token from prefill + 2 full rounds of GAMMA + 1: with everything accepted tau == GAMMA + 1 exactly
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
DRAFTERS = ("ngram", "noisy", "self")
PROMPTS = {  # repetitive prompts give the ngram drafter something to propose
    "rep4": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    "rep3": [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11],
    "plain": [3, 41, 17, 88, 9, 60, 23],
}
CASE_PROMPTS = {  # a list = one batched generate call with prompts of different lengths
    "ngram": ["rep4", "rep3"],
    "noisy": "rep4",
    "self": "plain",
}


FAMILY = "qwen3_5"  # the family of the single-family tests below


def _cases():
    """The full strategy x commit x drafter matrix for every family."""
    for family in FAMILIES:
        for (s, c), d in itertools.product(MODES, DRAFTERS):
            yield pytest.param(family, s, c, d, id=f"{family}-{s}-{c}-{d}")


class _Models:
    """Module-wide cache of models and of transformers' reference outputs (built on first use)."""

    def __init__(self):
        self.target = Memo(lambda family: tiny_model(family, seed=0))
        self.noisy_draft = Memo(lambda family: noisy_copy(self.target(family)))
        self.refs = {}

    def ref(self, model, prompt: list[int], max_new_tokens: int = N, eos="default", hybrid: bool = True):
        """transformers' greedy generate on `prompt` alone -> list of token ids (prompt included)."""
        key = (id(model), tuple(prompt), max_new_tokens, eos)
        if key not in self.refs:
            kw = {} if eos == "default" else {"eos_token_id": eos}
            ids = torch.tensor([prompt])
            if hybrid:
                with torch_fallbacks(), float64_everywhere():
                    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, **kw)
            else:
                out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, **kw)
            self.refs[key] = out[0].tolist()
        return self.refs[key]


@pytest.fixture(scope="module")
def models():
    return _Models()


def _spec_generate(engine, prompts, hybrid: bool = True, **kw):
    if hybrid:
        with torch_fallbacks(), float64_everywhere():
            return engine.generate(prompts, **kw)
    return engine.generate(prompts, **kw)


def _assert_rows_match(out, refs: list[list[int]], pad: int):
    assert out.sequences.shape[0] == len(refs)
    assert out.sequences.shape[1] == max(len(r) for r in refs)
    for b, ref in enumerate(refs):
        row = out.sequences[b]
        assert row[:len(ref)].tolist() == ref, f"row {b} differs from transformers' greedy generate"
        assert bool((row[len(ref):] == pad).all()), f"row {b}: padding after the end is not the pad id"


def _assert_stats_sane(stats, gamma: int = GAMMA):
    assert 0 <= stats.accepted <= stats.proposed
    assert stats.rounds >= 1 and stats.tokens >= stats.rounds
    assert len(stats.per_position) <= gamma
    assert all(0.0 <= a <= 1.0 for a in stats.per_position)
    assert stats.drafter_failures == 0


# ---- 1. greedy identity, hybrid families -------------------------------------------------------------------


@pytest.mark.parametrize("family, strategy, commit, drafter", list(_cases()))
def test_greedy_identity_hybrid(models, family, strategy, commit, drafter):
    target = models.target(family)
    kw = dict(num_draft_tokens=GAMMA, strategy=strategy, commit=commit, max_batch_size=2)
    if drafter == "ngram":
        engine = specdec.wrap(target, drafter="ngram", **kw)
    else:
        draft_model = models.noisy_draft(family) if drafter == "noisy" else target
        engine = specdec.wrap(target, drafter="model", draft_model=draft_model, **kw)
    assert type(engine.runner).__name__ == "HybridRunner"
    names = CASE_PROMPTS[drafter]
    eos = None if drafter == "self" else "default"  # everything accepted: nothing may stop the rounds early
    if isinstance(names, list):
        prompts = [torch.tensor(PROMPTS[n]) for n in names]  # list of 1-D tensors of different lengths
    else:
        prompts = torch.tensor([PROMPTS[names]])  # [1, P]
        names = [names]
    refs = [models.ref(target, PROMPTS[n], eos=eos) for n in names]
    gen_kw = {} if eos == "default" else {"eos_token_id": None}
    out = _spec_generate(engine, prompts, max_new_tokens=N, **gen_kw)
    _assert_rows_match(out, refs, engine.pad_token_id)
    stats = out.stats
    _assert_stats_sane(stats)
    if drafter == "ngram":
        assert stats.proposed > 0 and stats.accepted > 0, stats.as_dict()
    elif drafter == "noisy":
        assert 0.0 < stats.alpha < 1.0, stats.as_dict()
    else:
        assert all(len(r) == len(PROMPTS[n]) + N for r, n in zip(refs, names))
        assert stats.alpha == 1.0 and stats.tau == GAMMA + 1, stats.as_dict()
        assert stats.per_position == [1.0] * GAMMA
    assert engine.runner.num_free == 2  # every slot came back


def test_batch_model_drafter_and_eos_cut(models):
    """A batch under the model drafter, stopped by an EOS id that greedy decode reaches in row 0: each row ends
    exactly where transformers' generate on that prompt alone would end."""
    family = FAMILY
    target = models.target(family)
    names = ["rep3", "plain"]
    full = [models.ref(target, PROMPTS[n], eos=None) for n in names]
    eos = full[0][len(PROMPTS[names[0]]) + 5]  # the 6th generated token of row 0
    expected = []
    for n, row in zip(names, full):
        gen = row[len(PROMPTS[n]):]
        cut = gen.index(eos) + 1 if eos in gen else len(gen)
        expected.append(PROMPTS[n] + gen[:cut])
    assert expected[0] == models.ref(target, PROMPTS[names[0]], eos=eos)  # transformers agrees on the cut
    engine = specdec.wrap(target, drafter="model", draft_model=models.noisy_draft(family), strategy="snapshot",
                          max_batch_size=2)
    out = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in names], max_new_tokens=N, eos_token_id=eos)
    _assert_rows_match(out, expected, engine.pad_token_id)
    assert len(expected[0]) < len(expected[1]) or expected[1][-1] == eos
    # the forms transformers' generation config takes (a tensor in a set of ints never matched: no stop)
    for form in (torch.tensor(eos), torch.tensor([eos]), [eos], (eos,), np.int64(eos)):
        again = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in names], max_new_tokens=N,
                               eos_token_id=form)
        assert torch.equal(again.sequences, out.sequences), f"eos_token_id as {type(form).__name__}: {form!r}"


class _OracleTree(Drafter):
    """A fixed-shape tree from the target's own greedy continuation `ref`: root -> [right, wrong], right ->
    [right], and with `rejected_child` that node -> [wrong]. Every round accepts two drafts; the last accepted
    node has a rejected child only with `rejected_child`."""

    name = "oracle-tree"

    def __init__(self, ref: list[int], vocab: int, rejected_child: bool):
        self.ref, self.vocab, self.rejected_child = ref, vocab, rejected_child
        self.tree = True

    def max_verify_tokens(self, gamma):
        return 5

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None):
        toks, parents = [], []
        for h in contexts.host:
            c1, c2 = self.ref[len(h)], self.ref[len(h) + 1]
            t = [c1, (c1 + 1) % self.vocab, c2] + ([(c2 + 1) % self.vocab] if self.rejected_child else [])
            toks.append(t)
            parents.append([-1, 0, 0, 1] + ([3] if self.rejected_child else []))
        dev = contexts.tensors[0].device
        return DraftBlock(torch.tensor(toks, device=dev), torch.full((len(rows),), len(toks[0]), device=dev),
                          parent=torch.tensor(parents, device=dev))


@pytest.mark.parametrize("rejected_child", [False, True])
def test_tree_stats_count_positions_by_depth(models, rejected_child):
    """Per-position acceptance of tree rounds counts depths, and a position only where a node stood: with a
    leaf accepted at depth 2 every round the stats have two positions, both 1.0 (not a third, rejected one);
    with a rejected child under it, a third position at 0.0."""
    target = models.target(FAMILY)
    prompt = PROMPTS["plain"]
    ref = models.ref(target, prompt, max_new_tokens=N + 4, eos=None)
    drafter = _OracleTree(ref, target.config.vocab_size, rejected_child)
    engine = specdec.wrap(target, drafter=drafter, max_batch_size=1)
    out = _spec_generate(engine, [torch.tensor(prompt)], max_new_tokens=N - 1, eos_token_id=None)
    _assert_rows_match(out, [ref[:len(prompt) + N - 1]], engine.pad_token_id)
    st = out.stats
    assert st.tau == 3.0 and st.accepted == 2 * st.rounds and st.proposed == (4 if rejected_child else 3) * st.rounds
    assert st.per_position == ([1.0, 1.0, 0.0] if rejected_child else [1.0, 1.0]), st.as_dict()


# ---- 2. generic path (no hybrid adapter) -------------------------------------------------------------------


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def _jamba():
    from transformers import JambaConfig, JambaForCausalLM
    torch.manual_seed(0)
    cfg = JambaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                      mamba_expand=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return JambaForCausalLM._from_config(cfg, dtype=torch.float64, experts_implementation="eager").eval()


@pytest.fixture(scope="module", params=["llama", "jamba"])
def generic_model(request):
    return {"llama": _llama, "jamba": _jamba}[request.param]()


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_greedy_identity_generic(models, generic_model, drafter):
    model = generic_model
    if drafter == "ngram":
        engine = specdec.wrap(model, drafter="ngram", num_draft_tokens=GAMMA, max_batch_size=2)
        names, eos, gen_kw = ["rep4", "rep3"], "default", {}
        prompts = [torch.tensor(PROMPTS[n]) for n in names]
    else:
        engine = specdec.wrap(model, drafter="model", draft_model=model, num_draft_tokens=GAMMA, max_batch_size=2)
        names, eos, gen_kw = ["plain"], None, {"eos_token_id": None}
        prompts = torch.tensor([PROMPTS["plain"]])
    assert type(engine.runner).__name__ == "GenericRunner"
    refs = [models.ref(model, PROMPTS[n], eos=eos, hybrid=False) for n in names]
    out = _spec_generate(engine, prompts, hybrid=False, max_new_tokens=N, **gen_kw)
    _assert_rows_match(out, refs, engine.pad_token_id)
    _assert_stats_sane(out.stats)
    if drafter == "ngram":
        assert out.stats.proposed > 0, out.stats.as_dict()
    else:
        assert out.stats.alpha == 1.0 and out.stats.tau == GAMMA + 1, out.stats.as_dict()
    assert engine.runner.num_free == 2


# ---- 2b. more requests than lanes: continuous batching ------------------------------------------------------


def _record_batches(engine):
    """Wrap the engine's round and admission: -> list of ("admit", k) / ("round", rows) events in order; the
    drafter's `propose` also checks that each row's device context equals its host history."""
    events = []
    round_, admit = engine._round, engine._admit

    def rec_round(active, *a, **k):
        events.append(("round", len(active)))
        return round_(active, *a, **k)

    def rec_admit(lanes, ids, reqs, *a, **k):
        events.append(("admit", len(ids)))
        return admit(lanes, ids, reqs, *a, **k)

    engine._round, engine._admit = rec_round, rec_admit
    propose = engine.drafter.propose

    def checked_propose(rows, contexts, *a, **k):  # a refilled lane shows the drafter its new request only
        for c, h in zip(contexts.tensors, contexts.host):
            assert c.tolist() == h, "the drafter's device context is not the request's history"
        return propose(rows, contexts, *a, **k)

    engine.drafter.propose = checked_propose
    return events


CONTINUOUS = ["rep4", "plain", "rep3", "plain", "rep4"]  # 5 requests through 2 lanes


@pytest.mark.parametrize("drafter, strategy, commit, static", [
    ("ngram", "replay", "eager", False), ("noisy", "replay", "lazy", True), ("noisy", "snapshot", "eager", False)])
def test_continuous_batching_hybrid(models, drafter, strategy, commit, static):
    """5 requests through max_batch_size 2: every row equals transformers' greedy generate on its prompt alone,
    a finished request's lane is refilled before the next round (the batch stays full while requests wait),
    and every slot and drafter row comes back."""
    target = models.target(FAMILY)
    kw = dict(drafter="ngram") if drafter == "ngram" else dict(drafter="model", draft_model=models.noisy_draft(FAMILY))
    engine = specdec.wrap(target, num_draft_tokens=GAMMA, strategy=strategy, commit=commit, static_shapes=static,
                          max_batch_size=2, **kw)
    events = _record_batches(engine)
    # different lengths per request (EOS = a token row 0 reaches early), so lanes free up at different rounds
    full = models.ref(target, PROMPTS["rep4"], eos=None)
    eos = full[len(PROMPTS["rep4"]) + 3]
    refs = [models.ref(target, PROMPTS[n], eos=eos) for n in CONTINUOUS]
    assert len({len(r) - len(PROMPTS[n]) for r, n in zip(refs, CONTINUOUS)}) > 1, "the rows should end apart"
    out = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in CONTINUOUS], max_new_tokens=N, eos_token_id=eos)
    _assert_rows_match(out, refs, engine.pad_token_id)
    _assert_stats_sane(out.stats)
    admitted = 0
    for kind, k in events:
        if kind == "admit":
            admitted += k
        else:
            assert k <= 2
            if admitted < len(CONTINUOUS):  # a request was waiting: the round ran with both lanes
                assert k == 2, events
    assert admitted == len(CONTINUOUS) and events[0] == ("admit", 2)
    rounds = [k for kind, k in events if kind == "round"]  # stats: rows per round = rounds / steps
    assert (out.stats.steps, out.stats.rounds) == (len(rounds), sum(rounds)), out.stats.as_dict()
    assert engine.runner.num_free == 2
    if drafter == "noisy":
        assert engine.drafter.runner.num_free == 2 and not engine.drafter.slot
    again = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in CONTINUOUS[:2]], max_new_tokens=N,
                           eos_token_id=eos)
    _assert_rows_match(again, refs[:2], engine.pad_token_id)


@pytest.mark.parametrize("kind, options", [("eagle", {}), ("mtp", {}), ("mtp", {"topk": 2}), ("dspark", {}),
                                           ("dspark", {"topk": 2})], ids=["eagle", "mtp", "mtp-tree", "dspark",
                                                                          "dspark-tree"])
def test_continuous_batching_trained_kinds(models, kind, options):
    """The drafters that keep per-row state (EAGLE's own KV by row, DSpark's context K/V, MTP's last hidden state)
    through refilled lanes: 5 requests through 2 lanes equal transformers' greedy generate per prompt."""
    target = models.target(FAMILY)
    torch.manual_seed(7)  # the untrained net the engine builds for the target
    engine = specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=GAMMA, max_batch_size=2, **options)
    events = _record_batches(engine)
    refs = [models.ref(target, PROMPTS[n], eos=None) for n in CONTINUOUS]
    out = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in CONTINUOUS], max_new_tokens=N, eos_token_id=None)
    _assert_rows_match(out, refs, engine.pad_token_id)
    assert sum(k for what, k in events if what == "admit") == len(CONTINUOUS)
    # a lane's stale drafter state would show as a failed drafter round (costing speed, not exactness)
    assert out.stats.drafter_failures == 0 and out.stats.proposed > 0, out.stats.as_dict()
    assert engine.runner.num_free == 2


def test_continuous_batching_interrupted(models):
    """A KeyboardInterrupt in the middle of a queued call (some requests done, some in flight, some waiting):
    every slot of the target and of the draft model comes back, and the next call is exact."""
    target = models.target(FAMILY)
    engine = specdec.wrap(target, drafter="model", draft_model=models.noisy_draft(FAMILY), num_draft_tokens=GAMMA,
                          max_batch_size=2)
    events = _record_batches(engine)
    propose, calls = engine.drafter.propose, [0]

    def interrupting(*a, **k):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return propose(*a, **k)

    engine.drafter.propose = interrupting
    with pytest.raises(KeyboardInterrupt):
        _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in CONTINUOUS], max_new_tokens=N)
    assert sum(k for kind, k in events if kind == "admit") > 2, "the interrupt should come after a refill"
    assert engine.runner.num_free == 2 and engine.drafter.runner.num_free == 2 and not engine.drafter.slot
    engine.drafter.propose = propose
    refs = [models.ref(target, PROMPTS[n], max_new_tokens=5) for n in CONTINUOUS]
    out = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in CONTINUOUS], max_new_tokens=5)
    _assert_rows_match(out, refs, engine.pad_token_id)



def test_continuous_batching_generic(models):
    model = _llama()
    engine = specdec.wrap(model, drafter="ngram", num_draft_tokens=GAMMA, max_batch_size=2)
    names = ["rep4", "rep3", "plain"]
    refs = [models.ref(model, PROMPTS[n], hybrid=False) for n in names]
    out = engine.generate([torch.tensor(PROMPTS[n]) for n in names], max_new_tokens=N)
    _assert_rows_match(out, refs, engine.pad_token_id)
    assert engine.runner.num_free == 2


# ---- 3. bad input ------------------------------------------------------------------------------------------


def _slot_state(engine):
    runners = [engine.runner] + ([engine.drafter.runner] if hasattr(engine.drafter, "runner") else [])
    snap = []
    for r in runners:
        snap.append(r.num_free)
        if type(r).__name__ == "HybridRunner":
            pool = r.state.pool
            snap += [pool.ssm.clone(), pool.conv.clone(), pool.seq_len.clone(), r.kv.lengths.clone()]
    return snap


def _assert_same_state(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else bool((a == b).all())
        else:
            assert a == b


def _bad_generate_calls(target, family):
    p = torch.tensor(PROMPTS["rep4"])
    wrong_vocab = tiny_model(family, seed=5, vocab_size=target.config.vocab_size + 32)
    return [
        ("drafter", lambda e: specdec.wrap(target, drafter="bogus")),
        ("strategy", lambda e: specdec.wrap(target, strategy="bogus")),
        ("commit", lambda e: specdec.wrap(target, commit="bogus")),
        ("draft_model", lambda e: specdec.wrap(target, drafter="model", draft_model=wrong_vocab)),
        ("max_ngrm", lambda e: specdec.wrap(target, drafter="ngram", max_ngrm=2)),
        ("topk", lambda e: specdec.wrap(target, drafter="model", draft_model=target, topk=2)),
        ("input_ids", lambda e: e.generate([torch.tensor([], dtype=torch.long)], max_new_tokens=4)),
        ("input_ids", lambda e: e.generate([p, torch.tensor([], dtype=torch.long)], max_new_tokens=4)),
        ("input_ids", lambda e: e.generate([], max_new_tokens=4)),
        ("max_new_tokens", lambda e: e.generate([p], max_new_tokens=e.max_length - p.numel() + 1)),
        ("max_new_tokens", lambda e: e.generate([p], max_new_tokens=0)),
        ("input_ids", lambda e: e.generate([torch.tensor([5, 6, target.config.vocab_size])], max_new_tokens=4)),
        ("input_ids", lambda e: e.generate([torch.tensor([5, -1, 7])], max_new_tokens=4)),
        ("eos_token_id", lambda e: e.generate([p], max_new_tokens=4, eos_token_id="2")),
        ("eos_token_id", lambda e: e.generate([p], max_new_tokens=4, eos_token_id=torch.tensor([2.0]))),
        ("model", lambda e: specdec.wrap("gpt2")),
        ("integer token ids", lambda e: e.generate(torch.tensor([[5.7, 6.2, 7.0]]), max_new_tokens=4)),
        ("integer token ids", lambda e: e.generate([[5, 6.5, 7]], max_new_tokens=4)),
    ]


@pytest.mark.parametrize("drafter", ["ngram", "noisy"])
def test_bad_input_raises_and_leaves_slots_untouched(models, drafter):
    family = FAMILY
    target = models.target(family)
    kw = dict(drafter="ngram") if drafter == "ngram" else dict(drafter="model", draft_model=models.noisy_draft(family))
    engine = specdec.wrap(target, num_draft_tokens=GAMMA, max_batch_size=2, max_length=40, **kw)
    prompt = torch.tensor([PROMPTS["rep4"]])
    first = _spec_generate(engine, prompt, max_new_tokens=N)
    _assert_rows_match(first, [models.ref(target, PROMPTS["rep4"])], engine.pad_token_id)
    before = _slot_state(engine)
    assert before[0] == 2
    for arg, call in _bad_generate_calls(target, family):
        with torch_fallbacks(), float64_everywhere():
            with pytest.raises(ValueError) as err:
                call(engine)
        assert arg in str(err.value), f"{arg}: message does not name it: {err.value}"
        _assert_same_state(before, _slot_state(engine))
    second = _spec_generate(engine, prompt, max_new_tokens=N)
    assert torch.equal(second.sequences, first.sequences)


def test_bad_input_generic():
    model = _llama()
    engine = specdec.wrap(model, max_batch_size=2, max_length=40)
    p = torch.tensor(PROMPTS["rep4"])
    first = engine.generate([p], max_new_tokens=8)
    for arg, call in [
        ("input_ids", lambda: engine.generate([p, torch.tensor([], dtype=torch.long)], max_new_tokens=4)),
        ("max_new_tokens", lambda: engine.generate([p], max_new_tokens=40)),
        ("input_ids", lambda: engine.generate([torch.tensor([5, 6, 96])], max_new_tokens=4)),
    ]:
        with pytest.raises(ValueError, match=arg):
            call()
        assert engine.runner.num_free == 2
    assert torch.equal(engine.generate([p], max_new_tokens=8).sequences, first.sequences)


@pytest.mark.parametrize("kind", ["mtp", "eagle", "dspark"])
def test_kind_without_weights_is_refused_at_wrap(models, kind, monkeypatch):
    """`drafter="mtp"` alone would be an untrained head (tau about 1, slower than plain decoding): one ValueError
    naming `drafter` and where weights come from, raised before any net, runner or cache is built."""
    target = models.target(FAMILY)
    built = []
    for owner, name in [(specdec.build, "make_runner"), (specdec.build.cpu_linear, "apply"),
                        (factory, "build_drafter_net"), (registry.kind_module(kind).Net, "from_target")]:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name,
                            lambda *a, _name=name, _real=real, **k: (built.append(_name), _real(*a, **k))[1])
    for call in (lambda: specdec.wrap(target, drafter=kind, num_draft_tokens=GAMMA, max_batch_size=2),
                 lambda: specdec.wrap(target, SpecConfig(drafter=kind)),
                 lambda: make_drafter(kind, target, gamma=GAMMA, max_batch_size=2, max_length=40)):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert msg == factory.no_weights_message(kind) and msg.startswith(f"drafter: {kind!r}"), msg
        assert f"drafter='path/to/dir', e.g. the embedded model's specdec/embedded/drafters/{kind}" in msg, msg
        assert "drafter='native' (the MTP layers of the target's own checkpoint)" in msg, msg
        assert "EAGLE-3 checkpoint (drafter='eagle', draft_model=DIR)" in msg and "untrained=True" in msg, msg
    assert built == [], f"built before the error: {built}"
    # the option is checked too: a bool, and only for a kind that has no weights given
    for kw in [dict(drafter=kind, untrained=1), dict(drafter="ngram", untrained=True),
               dict(drafter=None, untrained=True), dict(drafter="eagle", draft_model=target, untrained=True)]:
        with pytest.raises(ValueError, match="^untrained: "):
            specdec.wrap(target, **kw)
    assert built == [], f"built before the error: {built}"


@pytest.mark.parametrize("path", ["./no/such/drafter", "drafters/missing", pathlib.Path("no-such-dir")])
def test_a_drafter_path_that_does_not_exist_says_so(models, path):
    with pytest.raises(ValueError, match=r"^drafter: no such directory: '.*' \(a trained drafter directory"):
        specdec.wrap(models.target("qwen3_next"), drafter=path)


@pytest.mark.parametrize("kind", ["mtp", "eagle", "dspark"])
def test_untrained_option_builds_the_untrained_head(models, kind):
    """`untrained=True`: the net `build_drafter_net` sizes for the target (the same weights for the same seed), and
    greedy output still equals transformers' generate."""
    target = models.target(FAMILY)
    torch.manual_seed(5)
    engine = specdec.wrap(target, drafter=kind, untrained=True, num_draft_tokens=GAMMA, max_batch_size=2)
    assert engine.drafter.name == kind
    torch.manual_seed(5)
    expected = registry.own_state_dict(registry.build_drafter_net(kind, target))
    got = registry.own_state_dict(engine.drafter.net)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    prompts = [PROMPTS["rep4"], PROMPTS["plain"]]
    out = _spec_generate(engine, [torch.tensor(p) for p in prompts], max_new_tokens=N, eos_token_id=None)
    _assert_rows_match(out, [models.ref(target, p, eos=None) for p in prompts], engine.pad_token_id)
    assert out.stats.proposed > 0 and out.stats.drafter_failures == 0, out.stats.as_dict()


# ---- 4. a drafter that fails mid-generation ---------------------------------------------------------------


class FlakyDrafter(Drafter):
    """Ngram drafts, except: raises on the 2nd propose, returns a malformed block on the 4th."""

    name = "flaky"

    def __init__(self):
        self.inner = NgramDrafter()
        self.calls = 0

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("draft server went away")
        if self.calls == 4:
            return DraftBlock(torch.zeros(len(rows) + 1, 2, dtype=torch.long), torch.zeros(len(rows) + 1))
        return self.inner.propose(rows, contexts, gamma, sampling=sampling, generator=generator)


@pytest.mark.parametrize("where", ["hybrid", "generic"])
def test_failing_drafter_falls_back_to_plain_decode(models, where):
    if where == "hybrid":
        target, hybrid = models.target(FAMILY), True
        engine = specdec.wrap(target, drafter=FlakyDrafter(), strategy="replay", commit="lazy", max_batch_size=2)
    else:
        target, hybrid = _llama(), False
        engine = specdec.wrap(target, drafter=FlakyDrafter(), max_batch_size=2)
    names = ["rep4", "rep3"]
    refs = [models.ref(target, PROMPTS[n], hybrid=hybrid) for n in names]
    with pytest.warns(RuntimeWarning, match="plain decode") as record:
        out = _spec_generate(engine, [torch.tensor(PROMPTS[n]) for n in names], hybrid=hybrid, max_new_tokens=N)
    assert engine.drafter.calls >= 4
    assert out.stats.drafter_failures == 2
    assert sum(issubclass(w.category, RuntimeWarning) and "flaky" in str(w.message) for w in record) == 2
    _assert_rows_match(out, refs, engine.pad_token_id)
    assert out.stats.proposed > 0 and out.stats.accepted > 0
    assert engine.runner.num_free == 2
    assert not math.isnan(out.stats.tau)
