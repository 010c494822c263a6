"""The eagle drafter's catch-up over a prompt (`EagleDrafter._catch_up`): a one-layer net makes the cache's K/V alone.

1. A one-layer net (EAGLE-3's shape: our own, float32, and a published EAGLE-3 checkpoint's head,
   `eagle3_format.Net`, float64) observing two prompts of different lengths, each longer than one chunk of pairs,
   runs no attention: its cache equals an independent forward of the whole net over each prompt (one `Net.run`
   call with causal visibility, no drafter; the dtype's tolerance), and the cache, root features and lengths
   equal, bitwise, those the full chunked forward leaves (`caches_from_inputs` off: attention and MLP over every
   pair). The proposes that follow (the prompt's, then two rounds whose observes queue a few kept positions) give
   bitwise the same draft logits at every step and the same drafts, as a tree (top-2, 6 nodes) and as a chain
   (top-1: one path).
2. Nets whose keys need an attention output keep the full forward: a two-layer net.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from assertions import assert_close
from test_eagle3_format import write_eagle3
from tiny_models import tiny_model

import specdec.draft.eagle_drafter as eagle_drafter
from specdec.draft import eagle3_format
from specdec.draft.base import Contexts, Observation
from specdec.draft.eagle import Net
from specdec.draft.registry import build_drafter_net

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16  # pairs per chunk: the prompts below span a few chunks at a tiny model's cost
LENGTHS = {2: 2 * CHUNK + 7, 0: 3 * CHUNK + 5}  # row -> prompt length (rows out of order, lengths unequal)
GAMMA = 3


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3_next", seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(a float64 target, the head of a SpecForge-format EAGLE-3 checkpoint written for it)."""
    target64 = tiny_model("qwen3_5", seed=0)
    path = write_eagle3(tmp_path_factory.mktemp("eagle3"), target64)
    return target64, eagle3_format.load(path, target64)


def _net(target, num_layers: int = 1) -> Net:
    torch.manual_seed(11)
    net = build_drafter_net("eagle", target, num_layers=num_layers)
    assert next(net.parameters()).dtype == torch.float32 and len(net.layers) == num_layers
    return net


def _prompts(target, net):
    """Per row (`LENGTHS`): random tokens `[n]` and, per feature layer, random target features `[n, d]` in the
    net's dtype."""
    gen = torch.Generator().manual_seed(5)
    d, V = target.config.hidden_size, target.config.vocab_size
    tokens = {r: torch.randint(3, V, (n,), generator=gen) for r, n in LENGTHS.items()}
    dtype = next(net.parameters()).dtype
    feats = {r: {l: torch.randn(n, d, generator=gen).to(dtype) for l in net.config.feature_layers}
             for r, n in LENGTHS.items()}
    return tokens, feats


def _observe_all(drafter, rows, tokens, feats) -> None:
    drafter.observe(Observation.of(rows, [tokens[r] for r in rows], [feats[r][drafter.feature_layers[0]] for r in rows],
                                   {l: [feats[r][l] for r in rows] for l in drafter.feature_layers}))


def _run(net, tokens, feats, sdpa, *, topk: int, num_nodes: int):
    """A fresh drafter over `net` observes the prompts (chunks of `CHUNK` pairs), proposes, then twice observes a
    round's kept positions (the anchor and 0-2 more committed tokens, random features) and proposes again.
    -> (cache, root features and lengths right after the prompt's observe; SDPA calls in that observe; every
    `lm_logits` output of the proposes in order; every block's tokens, counts and parents)."""
    drafter = eagle_drafter.make_drafter(net, gamma=GAMMA, max_batch_size=3, topk=topk, num_nodes=num_nodes)
    rows = list(LENGTHS)
    drafter.begin(rows, [tokens[r] for r in rows])
    logits, lm = [], net.lm_logits

    def recording(h):
        out = lm(h)
        logits.append(out.clone())
        return out
    net.lm_logits = recording
    try:
        before = sdpa[0]
        _observe_all(drafter, rows, tokens, feats)
        attention_calls = sdpa[0] - before
        state = ([(k.clone(), v.clone()) for k, v in drafter.cache], drafter.root_f.clone(), drafter.len_t.clone())
        history = {r: tokens[r].clone() for r in rows}
        blocks = []
        gen = torch.Generator().manual_seed(9)
        for round_ in range(3):
            anchors = {r: torch.randint(3, net.config.target_vocab_size, (1,), generator=gen) for r in rows}
            block = drafter.propose(rows, Contexts.of([torch.cat([history[r], anchors[r]]) for r in rows]), GAMMA)
            blocks.append((block.tokens.clone(), block.num_drafts.clone(), block.parent.clone()))
            if round_ == 2:
                break
            V, d = net.config.target_vocab_size, net.config.target_hidden_size
            kept = {r: torch.cat([anchors[r], torch.randint(3, V, (b + round_,), generator=gen)])
                    for b, r in enumerate(rows)}
            kept_f = {r: {l: torch.randn(len(kept[r]), d, generator=gen) for l in drafter.feature_layers}
                      for r in rows}
            _observe_all(drafter, rows, kept, kept_f)
            history = {r: torch.cat([history[r], kept[r]]) for r in rows}
    finally:
        del net.lm_logits
    return state, attention_calls, logits, blocks


@pytest.fixture
def sdpa(monkeypatch) -> list[int]:
    """`[calls]`: every attention call of the test (every drafter attention goes through
    `scaled_dot_product_attention`), counted; the drafter's chunks `CHUNK` pairs."""
    real, calls = F.scaled_dot_product_attention, [0]

    def spy(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(eagle_drafter, "QUERY_CHUNK", CHUNK)
    return calls


def _full_forward_kv(net, tokens, feats, row):
    """The whole net over a row's prompt pairs in one `Net.run` call with causal visibility (no drafter, no
    chunks): its only layer's K, V `[H, n - 1, D]`."""
    t, f = tokens[row], torch.cat([feats[row][l] for l in net.config.feature_layers], -1)
    n = t.shape[0] - 1
    i = torch.arange(n)
    with torch.no_grad():
        x = net.inputs(t[None, 1:], net.fused(f[None, :-1]))
        _, kvs = net.run(x, i[None], (i[None, :] <= i[:, None])[None])
    return kvs[0][0][0], kvs[0][1][0]


@pytest.mark.parametrize("shape", ["tree", "chain"])
@pytest.mark.parametrize("kind", ["own", "published"])
def test_one_layer_catch_up_equals_the_full_forward(target, published, sdpa, monkeypatch, shape, kind):
    """See 1: the K/V-only catch-up against the full forward (its own drafter, the same net) and against one
    independent `Net.run` over each prompt."""
    if kind == "published":
        target, net = published
        assert isinstance(net, eagle3_format.Net) and len(net.layers) == 1
    else:
        net = _net(target)
    dtype = next(net.parameters()).dtype
    assert net.caches_from_inputs
    topk, nodes = (2, 6) if shape == "tree" else (1, GAMMA)
    tokens, feats = _prompts(target, net)
    (cache, root_f, len_t), calls, logits, blocks = _run(net, tokens, feats, sdpa, topk=topk, num_nodes=nodes)
    assert calls == 0, "a one-layer catch-up ran attention"
    for r, length in LENGTHS.items():
        n = length - 1
        k, v = _full_forward_kv(net, tokens, feats, r)
        assert_close(cache[0][0][r, :, :n], k, dtype=dtype, msg=f"row {r} keys against one forward")
        assert_close(cache[0][1][r, :, :n], v, dtype=dtype, msg=f"row {r} values against one forward")

    monkeypatch.setattr(type(net), "caches_from_inputs", property(lambda self: False))
    (cache1, root_f1, len_t1), calls1, logits1, blocks1 = _run(net, tokens, feats, sdpa, topk=topk, num_nodes=nodes)
    assert calls1 > 0  # the full forward's attention ran
    assert_close(cache[0][0], cache1[0][0], exact=True, msg="keys")
    assert_close(cache[0][1], cache1[0][1], exact=True, msg="values")
    assert_close(root_f, root_f1, exact=True, msg="root features")
    assert torch.equal(len_t, len_t1) and [int(len_t[r]) for r in LENGTHS] == [n - 1 for n in LENGTHS.values()]
    assert len(logits) == len(logits1) == 3 * GAMMA  # the root and each depth, three proposes
    for j, (a, e) in enumerate(zip(logits, logits1)):
        assert_close(a, e, exact=True, msg=f"draft logits {j}")
    for j, ((t, n, p), (t1, n1, p1)) in enumerate(zip(blocks, blocks1)):
        assert torch.equal(t, t1) and torch.equal(n, n1), f"propose {j}: drafts"
        assert torch.equal(p, p1), f"propose {j}: parents"
        if shape == "chain":  # topk 1: one child per node, each draft's parent the one before it
            assert torch.equal(p, torch.arange(-1, GAMMA).expand_as(p)), f"propose {j}: not a chain"


def test_nets_whose_keys_need_attention_keep_the_full_forward(target, sdpa):
    """See 2: a two-layer net runs attention in its catch-up."""
    net = _net(target, num_layers=2)
    assert not net.caches_from_inputs
    tokens, feats = _prompts(target, net)
    _, calls, _, blocks = _run(net, tokens, feats, sdpa, topk=2, num_nodes=6)
    assert calls > 0 and blocks[0][0].shape[1] > 0
