"""Static shapes: the verify step of every round has the same shapes within a batch bucket.

`wrap(model, static_shapes=True)` pads the batch with null-slot rows to a bucket (1, 2, 4, ..., max_batch_size),
the drafts to gamma (a tree to its node budget) and reads the KV cache as a static view with a mask: what
CUDA graphs need. Checked here on CPU, in float64 on tiny random models of transformers' own classes:
- greedy output equals transformers' own greedy `generate` (chains and trees, every strategy), and so does plain
  decoding through the engine (`drafter=None`), whose verify steps are `[Bk, 1]`;
- every aten op of the verify step and of the commit step, with the shapes of its tensor arguments, is the same
  in every round of a bucket (and the dynamic path, as a control, is not); so is the draft step of a drafter that
  drafts inside the device step (eagle, and mtp and dspark as chains and trees), which reads nothing back to the
  host;
- what cannot be honoured is refused at `wrap`: `cuda_graph=True` off CUDA, with lazy commit, static shapes on
  the generic path, flash-attention variants on the hybrid runner; a near-miss engine option is named a typo.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from tiny_models import assert_greedy, generate_f64, greedy_reference, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import specdec
from specdec.draft.factory import TRAINED_KINDS
from specdec.config import SpecConfig
from specdec.build import _buckets
from specdec.kernels import dispatch

GAMMA = 4
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11], [3, 41, 17, 88, 9]]
NEW = 14
TREE = dict(topk=2, depth=3, num_nodes=6)


@pytest.fixture(scope="module")
def targets():
    return {f: tiny_model(f, seed=0) for f in ("qwen3_5", "kimi_linear")}


def _signature(args, kwargs) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor))


class _Shapes(TorchDispatchMode):
    """Records every aten op as (name, shapes and dtypes of its tensor arguments). A call of one of the
    package's kernels (`specdec.kernels.dispatch`) is recorded as one entry, the kernel's launch: on CPU its torch
    reference stands in for the Triton kernel and loops over rows and tokens on the host, as the kernel's grid
    and masks do on the device."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func), _signature(args, kwargs)))
        return func(*args, **kwargs)

    def kernel(self, name: str, fn):
        def launch(*args, **kwargs):
            self.ops.append((f"kernel {name}", _signature(args, kwargs)))
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return launch


def _record(engine, monkeypatch) -> dict[str, list]:
    """Per round, the bucket and the op/shape sequence of the verify step and of the commit step."""
    rec = defaultdict(list)
    current: list[_Shapes] = []
    pick = dispatch.pick
    monkeypatch.setattr(dispatch, "pick", lambda name, *t: current[-1].kernel(name, pick(name, *t)) if current
                        else pick(name, *t))
    for name in ("_draft_step", "_verify_step", "_commit_step"):
        inner = getattr(engine.round_step, name[1:])

        def wrapped(step, *a, _inner=inner, _name=name, **k):
            with _Shapes() as mode:
                current.append(mode)
                try:
                    out = _inner(step, *a, **k)
                finally:
                    current.pop()
            rec[_name].append((step.ids.shape[0], mode.ops))
            return out

        setattr(engine.round_step, name[1:], wrapped)
    return rec


def _wrap(target, drafter: str, **kw):
    """`drafter`: a drafter name, or "mtp_tree" / "dspark_tree" (the heads drafting trees); eagle and the trees
    take `TREE`. The trained kinds are untrained nets here."""
    if drafter.endswith("_tree"):
        return specdec.wrap(target, drafter=drafter[:-5], untrained=True, **kw,
                            **{k: v for k, v in TREE.items() if k != "depth"})
    if drafter in TRAINED_KINDS:
        kw["untrained"] = True
    return specdec.wrap(target, drafter=drafter, **kw, **(TREE if drafter == "eagle" else {}))


@pytest.mark.parametrize("family, drafter, mode", [
    ("qwen3_5", "ngram", ("replay", "eager")),
    ("qwen3_5", "ngram", ("replay", "lazy")),
    ("qwen3_5", "ngram", ("snapshot", "eager")),
    ("qwen3_5", "self", ("replay", "eager")),
    ("qwen3_5", "eagle", ("replay", "eager")),
    ("kimi_linear", "ngram", ("replay", "eager")),
    ("kimi_linear", "eagle", ("snapshot", "eager")),
    ("qwen3_5", "mtp", ("snapshot", "eager")),
    ("qwen3_5", "mtp_tree", ("replay", "lazy")),
    ("kimi_linear", "mtp", ("replay", "eager")),
    ("kimi_linear", "mtp_tree", ("replay", "eager")),
    ("qwen3_5", "dspark", ("replay", "eager")),
    ("kimi_linear", "dspark_tree", ("snapshot", "eager")),
])
def test_static_greedy_identity(targets, family, drafter, mode):
    """Three requests (bucket 4, one null-slot row), rows finishing at different rounds (buckets shrink):
    every row equals transformers' greedy generate."""
    target = targets[family]
    kw = dict(num_draft_tokens=GAMMA, strategy=mode[0], commit=mode[1], max_batch_size=4, max_length=64,
              static_shapes=True)
    if drafter == "self":
        engine = specdec.wrap(target, drafter="model", draft_model=target, **kw)
    else:
        engine = _wrap(target, drafter, **kw)
    out = generate_f64(engine, PROMPTS, max_new_tokens=NEW)
    assert_greedy(out, target, PROMPTS, NEW)
    assert engine.runner.num_free == 4


@pytest.mark.parametrize("drafter", [None, "none"])
def test_plain_decoding_static(targets, drafter):
    """`drafter=None` (or "none"): plain decoding through the same engine, with static shapes every verify step is
    `[Bk, 1]` (the anchor alone, not padded to gamma); the output equals transformers' greedy generate and the
    ngram drafter's speculative output, token for token."""
    target = targets["qwen3_5"]
    kw = dict(num_draft_tokens=GAMMA, max_batch_size=4, max_length=64, static_shapes=True)
    plain = specdec.wrap(target, drafter=drafter, **kw)
    assert plain.config.plain and plain.config.gamma_for(4) == 0
    shapes = []
    inner = plain.round_step.verify_step

    def verify(step, *a, **k):
        shapes.append(tuple(step.ids.shape))
        return inner(step, *a, **k)

    plain.round_step.verify_step = verify
    out = generate_f64(plain, PROMPTS, max_new_tokens=NEW)
    spec = generate_f64(specdec.wrap(target, drafter="ngram", **kw), PROMPTS, max_new_tokens=NEW)
    assert {T for _, T in shapes} == {1} and {Bk for Bk, _ in shapes} <= {1, 2, 4}
    assert out.stats.proposed == 0 and out.stats.tau == 1.0
    assert plain.graph_counts == {"captured": 0, "eager": 0, "warm": 0}  # no cuda_graph here
    assert spec.stats.accepted > 0
    for b, p in enumerate(PROMPTS):
        ref = greedy_reference(target, p, NEW)
        assert out.sequences[b, :len(ref)].tolist() == ref, f"row {b}: plain decoding differs from transformers"
        assert spec.sequences[b, :len(ref)].tolist() == ref, f"row {b}: ngram differs from transformers"
    with pytest.raises(ValueError, match="max_ngram: not an option of drafter=None"):
        specdec.wrap(target, drafter=None, max_ngram=2)


# what reads a value back to the host (`.item()`, `bool(t)`, `.tolist()`) or sizes a tensor by its values
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique")


@pytest.mark.parametrize("family, drafter", [("qwen3_5", "ngram"), ("qwen3_5", "eagle"), ("kimi_linear", "eagle"),
                                             ("qwen3_5", "mtp"), ("qwen3_5", "mtp_tree"), ("kimi_linear", "mtp"),
                                             ("qwen3_5", "dspark"), ("qwen3_5", "dspark_tree")])
def test_shapes_stable_within_a_bucket(targets, family, drafter, monkeypatch):
    """Every round of a bucket (after an engine's first, warm-up round) runs the same ops on the same shapes, in
    the verify step and in the commit step, and in the draft step of a drafter that drafts inside the device
    step (eagle, mtp, dspark: every round, with no host read); a batch of 3 and a batch of 4 share bucket 4. Without static
    shapes (the control) they change."""
    target = targets[family]
    static_draft = drafter != "ngram"

    def rounds(static: bool, prompts):
        engine = _wrap(target, drafter, num_draft_tokens=GAMMA, max_batch_size=4, max_length=64,
                       static_shapes=static)
        rec = _record(engine, monkeypatch)
        generate_f64(engine, prompts, max_new_tokens=NEW)
        return rec

    steps = ("_draft_step", "_verify_step", "_commit_step") if static_draft else ("_verify_step", "_commit_step")
    if family == "kimi_linear":  # its sparse MoE layers (transformers' own) route tokens with host reads, so the
        steps = ("_draft_step",)  # verify step is data-dependent there: the draft step (over MLA latents) alone
    by_bucket = {step: defaultdict(set) for step in steps}
    for prompts in (PROMPTS, PROMPTS + [[7, 8, 9, 7, 8, 9, 7]]):
        rec = rounds(True, prompts)
        assert len(rec["_verify_step"]) == len(rec["_commit_step"]) >= 3
        assert len(rec["_draft_step"]) == (len(rec["_verify_step"]) if static_draft else 0)
        # the engine's first round is its warm-up (buffers allocated on first use), as before a graph capture
        for step in steps:
            for bucket, ops in rec[step][1:]:
                by_bucket[step][bucket].add(tuple(ops))
        for _, ops in rec["_draft_step"]:
            reads = sorted({name for name, _ in ops if name.startswith(HOST_READS)})
            assert not reads, f"the draft step reads back to the host: {reads}"
    assert 4 in by_bucket[steps[0]], "no round ran in bucket 4"
    for step, buckets in by_bucket.items():
        for bucket, seqs in buckets.items():
            assert len(seqs) == 1, f"{step}, bucket {bucket}: {len(seqs)} different op/shape sequences"

    control = rounds(False, PROMPTS)
    assert len({tuple(ops) for _, ops in control["_verify_step"]}) > 1, "the control run should change shapes"
    assert not control["_draft_step"], "the dynamic path drafts before the device step"


@pytest.mark.parametrize("drafter", ["eagle", "mtp", "mtp_tree", "dspark", "dspark_tree"])
def test_static_draft_step_drafts_what_propose_drafts(targets, drafter):
    """The static draft step (whole-cache spans, eagle's queue of committed pairs the same width every round)
    drafts the same blocks as the drafter's `propose` on the dynamic path, round for round, in float64: same
    tokens, same tree, for every real row (compared while both rounds draft the same depth: the dynamic path
    shortens its last drafts to the tokens still wanted). And since a CUDA graph replays the step without its
    Python, the step does device work only, on buffers that exist before it: no host value of the drafter
    changes across it and no buffer is replaced (`_host_state`; eagle's queue, run and emptied inside the step,
    is the case this guards)."""
    target = targets["qwen3_5"]
    blocks = {}
    # dspark's diagnostic `last_confidence` is the step's own output (under a replay: the captured output buffer,
    # rewritten by every replay), not state the next step reads
    outputs = {"last_confidence", "draft_step"}
    for static in (False, True):
        torch.manual_seed(0)  # the same untrained drafter both times
        engine = _wrap(target, drafter, num_draft_tokens=GAMMA, max_batch_size=4, max_length=64,
                       static_shapes=static)
        d, rec, changed = engine.drafter, [], []
        name = "draft_step" if static else "propose"
        inner = getattr(d, name)

        def recording(rows, *a, _inner=inner, **k):
            before = {n: _host_state(v) for n, v in vars(d).items() if n not in outputs}
            block = _inner(rows, *a, **k)
            after = {n: _host_state(v) for n, v in vars(d).items() if n not in outputs}
            changed.append(sorted(n for n in {*before, *after} if before.get(n) != after.get(n)))
            B = len(rows)
            gamma = a[3] if len(a) > 3 else a[1]
            rec.append((gamma, block.tokens[:B].tolist(), None if block.parent is None else
                        block.parent[:B].tolist()))
            return block

        setattr(d, name, recording)
        out = generate_f64(engine, PROMPTS, max_new_tokens=NEW)
        assert out.stats.drafter_failures == 0
        if static:
            assert len(changed) >= 3 and all(not c for c in changed), changed
        blocks[static] = rec
    dyn, sta = blocks[False], blocks[True]
    same_depth = 0
    for a, b in zip(dyn, sta):
        if a[0] != b[0]:
            break
        assert a == b, f"round {same_depth}: the static draft step drafted {b[1:]}, propose {a[1:]}"
        same_depth += 1
    assert same_depth >= 3, (len(dyn), len(sta))


def test_failing_draft_step_costs_only_its_drafts(targets):
    """A drafter whose static draft step raises: that round verifies the anchor alone (a warning, counted as a
    drafter failure) and the output still equals transformers' greedy generate."""
    target = targets["qwen3_5"]
    engine = _wrap(target, "mtp", num_draft_tokens=GAMMA, max_batch_size=4, max_length=64, static_shapes=True)
    inner, calls = engine.drafter.draft_step, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return inner(*a, **k)

    engine.drafter.draft_step = flaky
    with pytest.warns(RuntimeWarning, match="drafter mtp failed .RuntimeError: boom.; plain decode"):
        out = generate_f64(engine, PROMPTS, max_new_tokens=NEW)
    assert out.stats.drafter_failures == 1 and len(calls) > 2
    assert_greedy(out, target, PROMPTS, NEW)


def test_buckets():
    assert _buckets(1) == [1]
    assert _buckets(8) == [1, 2, 4, 8]
    assert _buckets(6) == [1, 2, 4, 6]


def test_refused_at_wrap(targets):
    target = targets["qwen3_5"]
    with pytest.raises(ValueError, match="cuda_graph: CUDA graphs need the model on a CUDA device, got cpu"):
        specdec.wrap(target, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph: needs commit='eager'"):
        specdec.wrap(target, cuda_graph=True, commit="lazy")
    with pytest.raises(ValueError, match=r"stratgy: not an engine option \(did you mean 'strategy'\?\)"):
        specdec.wrap(target, stratgy="lazy")
    with pytest.raises(TypeError, match="stratgy"):
        SpecConfig(stratgy="lazy")
    with pytest.raises(ValueError, match="strategy: given both in config and as a keyword"):
        specdec.wrap(target, SpecConfig(), strategy="snapshot")
    from transformers import LlamaConfig, LlamaForCausalLM
    generic = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match="static_shapes: needs a hybrid target; LlamaForCausalLM"):
        specdec.wrap(generic, static_shapes=True)
    flash = tiny_model("qwen3_5", seed=0)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="model: attn_implementation 'flash_attention_2' is not supported"):
        specdec.wrap(flash)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_sdpa_attention(targets, family):
    """The hybrid runner honours `attn_implementation='sdpa'` (the tree / padding mask passed as an additive
    mask): greedy identity with a tree drafter, against the eager-attention model's own generate."""
    sdpa = tiny_model(family, seed=0)
    sdpa.config._attn_implementation = "sdpa"
    engine = specdec.wrap(sdpa, drafter="eagle", untrained=True, num_draft_tokens=GAMMA, max_batch_size=3, **TREE)
    out = generate_f64(engine, PROMPTS, max_new_tokens=NEW)
    assert_greedy(out, targets[family], PROMPTS, NEW)


def _host_state(obj, depth: int = 0):
    """What a CUDA-graph replay of a step would not redo: every host value reachable from a drafter's attributes
    (ints, lists, dicts, slotted records), and which device buffer each tensor attribute is (its storage and
    shape: a replay keeps writing to the buffers it captured). Modules and bound views are identities."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.untyped_storage().data_ptr(), tuple(obj.shape))
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    if depth > 4 or isinstance(obj, torch.nn.Module) or callable(obj):
        return ("id", id(obj))
    if isinstance(obj, dict):
        return tuple(sorted((k, _host_state(v, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_host_state(v, depth + 1) for v in obj)
    slots = getattr(type(obj), "__slots__", None)
    if slots:
        return tuple(_host_state(getattr(obj, s, None), depth + 1) for s in slots)
    return ("id", id(obj))


def test_static_draft_without_draft_step_is_refused_at_class_definition():
    """A drafter that declares `static_draft` must define `draft_step` (the engine calls it inside the device step):
    the class is refused when it is defined, not at its first static round."""
    from specdec.draft import Drafter

    with pytest.raises(TypeError, match="Half sets static_draft but defines no draft_step"):
        class Half(Drafter):
            static_draft = True

            def propose(self, rows, contexts, gamma, *, sampling=None, generator=None):
                raise AssertionError("never called")
