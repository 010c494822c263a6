"""Growing a trained drafter (`grown_state_dict`, `python -m specdec draft-train --init DIR --config
num_layers=N`): the grown net starts as the function of the smaller one.

Independent reference: the smaller net's own loss and validation figures on the same float64 target batch (the
grown net must reproduce them to 1e-12), with every weight of the smaller net random, so no zero weight hides a
path. Teeth: the same growth with random output projections in the new blocks changes them.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import float64_everywhere, tiny_model, torch_fallbacks

from specdec.draft.registry import build_drafter_net, grown_state_dict, own_state_dict, target_batch
from specdec.runner import make_runner

KINDS = ("mtp", "eagle", "dspark")


@pytest.fixture(scope="module")
def target_and_batch():
    target = tiny_model("kimi_linear", seed=3)
    ids = torch.randint(3, target.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch_fallbacks(), float64_everywhere():
        batch = target_batch(make_runner(target, max_batch_size=1, max_length=32, num_verify_tokens=1), ids,
                             list(range(target.config.num_hidden_layers)))
    return target, batch


def _figures(net, batch) -> list[float]:
    """The loss (fixed seed: dspark draws its anchors) and every number `evaluate` reports."""
    torch.manual_seed(11)
    with float64_everywhere():
        out = [float(net.loss(batch))]
        for v in net.evaluate(batch).values():
            out += [float(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, (int, float))]
    return out


def _random_small(kind, target):
    torch.manual_seed(5)
    small = build_drafter_net(kind, target, num_layers=1, intermediate_size=24)
    with torch.no_grad():
        for p in own_state_dict(small).values():
            p.copy_(torch.randn_like(p) * 0.3)
    return small


@pytest.mark.parametrize("kind", KINDS)
def test_grown_net_computes_the_smaller_one(target_and_batch, kind):
    target, batch = target_and_batch
    small = _random_small(kind, target)
    big = build_drafter_net(kind, target, num_layers=3, intermediate_size=40)
    state = grown_state_dict(own_state_dict(small), big)
    big.load_state_dict(state, strict=False)
    want, got = _figures(small, batch), _figures(big, batch)
    assert len(want) > 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=1e-12)
    # the new blocks are trainable: only their output projections start at zero
    new = {k: v for k, v in state.items() if k.startswith(("layers.1.", "layers.2."))}
    assert new and all(v.abs().sum() > 0 for k, v in new.items()
                       if not k.endswith(("o_proj.weight", "down_proj.weight")))
    # teeth: new blocks that add something change the function
    with torch.no_grad():
        for k, p in own_state_dict(big).items():
            if k.startswith("layers.2.") and k.endswith("o_proj.weight"):
                p.normal_(0.0, 0.3)
    assert max(abs(a - b) for a, b in zip(_figures(big, batch), want)) > 1e-6


def test_grow_refuses_what_it_cannot_grow(target_and_batch):
    target, _ = target_and_batch
    small = _random_small("eagle", target)
    for overrides, msg in ((dict(num_layers=1, intermediate_size=16), "only more blocks and wider MLPs"),
                           (dict(num_layers=2, intermediate_size=24, feature_layers=[0]), "fuse.weight")):
        other = build_drafter_net("eagle", target, **overrides)
        with pytest.raises(ValueError, match=msg):
            grown_state_dict(own_state_dict(small), other)
    mtp = build_drafter_net("mtp", target, num_layers=1, intermediate_size=24)
    with pytest.raises(ValueError, match="lacks|has"):
        grown_state_dict(own_state_dict(small), mtp)
