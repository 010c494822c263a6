"""`generate` runs under `torch.inference_mode` (no autograd bookkeeping per op), and leaves nothing of it behind:
the engine's state (KV cache, index caches, every drafter's buffers) stays normal tensors, so the runner and the
drafters can still be driven outside it, and the caller gets a normal tensor back.

Oracles: transformers' own greedy `generate` (outputs), the model's own forward (the runner driven afterwards), and
`Tensor.is_inference()` over every tensor the engine holds.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_greedy, float64_everywhere, generate_f64, torch_fallbacks

import specdec
from specdec.verify import Acceptance

# conftest's `target`; linear-attention and full-attention layers: the KV cache grows inside `generate`
FAMILY = "qwen3_5"
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11]]
N = 12
MODES = {"replay": {}, "lazy": {"commit": "lazy"}, "snapshot": {"strategy": "snapshot"},
         "static": {"static_shapes": True}}
RESULTS = {"last_confidence"}  # a drafter's result of its last call (read, never written by the caller)


def inference_tensors(root, name: str = "engine") -> list[str]:
    """Paths of the inference tensors reachable from `root` through the package's objects, modules, lists, tuples
    and dicts (attribute names in `RESULTS` skipped)."""
    seen, found = set(), []

    def walk(x, path: str, depth: int) -> None:
        if depth > 10 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.is_inference():
                found.append(path)
            return
        if isinstance(x, (list, tuple)):
            items = enumerate(x)
        elif isinstance(x, dict):
            items = list(x.items())
        elif isinstance(x, torch.nn.Module):
            items = [*x.named_parameters(recurse=False), *x.named_buffers(recurse=False), *x.named_children(),
                     *((k, v) for k, v in vars(x).items() if not k.startswith("_"))]
        elif type(x).__module__.split(".")[0] in ("specdec", "draft", "replayssm", "verify") and hasattr(x, "__dict__"):
            items = list(vars(x).items())
        else:
            return
        for k, v in items:
            if k not in RESULTS:
                walk(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]", depth + 1)

    walk(root, name, 0)
    return found


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("drafter", ["ngram", "mtp", "eagle", "dspark"])
def test_generate_in_inference_mode_leaves_normal_state(target, drafter, mode):
    torch.manual_seed(0)  # untrained drafter weights: reproducible
    engine = specdec.wrap(target, drafter=drafter, untrained=drafter != "ngram", num_draft_tokens=4, max_batch_size=2,
                          **MODES[mode])
    seen = []
    forward = engine.runner.forward

    def spy(*a, **k):
        seen.append(torch.is_inference_mode_enabled())
        return forward(*a, **k)

    engine.runner.forward = spy
    out = generate_f64(engine, PROMPTS, max_new_tokens=N)
    engine.runner.forward = forward
    assert_greedy(out, target, PROMPTS, N)
    assert seen and all(seen), "the verify forwards ran outside inference mode"
    assert not torch.is_inference_mode_enabled()
    assert inference_tensors(engine) == []
    assert not out.sequences.is_inference()
    out.sequences[0, 0] = out.sequences[0, 0]  # the caller may write it

    # the runner driven outside inference mode, on the state `generate` left: its prefill is the model's forward
    ids = torch.tensor(PROMPTS[0])
    slot = engine.runner.alloc(1)[0]
    try:
        with torch_fallbacks(), float64_everywhere():
            got = engine.runner.prefill(slot, ids).logits
            with torch.no_grad():
                ref = target(ids[None]).logits
        assert torch.allclose(got.reshape(-1, ref.shape[-1])[-1], ref[0, -1], rtol=1e-9, atol=1e-9)
    finally:
        engine.runner.release([slot])


def test_generic_runner_after_generate():
    """The own-forward path (Llama, the target as its own draft model): after `generate`, its runner driven outside
    inference mode still gives the model's uncached logits."""
    from test_generic_families import tiny

    model = tiny("llama")
    engine = specdec.wrap(model, drafter="model", draft_model=model, max_batch_size=2)
    engine.generate([torch.tensor([5, 6, 7, 8, 9]), torch.tensor([3, 4, 5])], max_new_tokens=8, eos_token_id=None)
    assert inference_tensors(engine) == []
    runner = engine.runner
    slots = runner.alloc(1)
    try:
        first = runner.prefill(slots[0], torch.tensor([5, 6, 7])).logits.reshape(-1, model.config.vocab_size)
        window = runner.forward(slots, torch.tensor([[8, 9, 10]])).logits[0]
        runner.commit(Acceptance.prefix([2], 3, runner.device), host_counts=[2])
    finally:
        runner.release(slots)
    with torch.no_grad():
        ref = model(torch.tensor([[5, 6, 7, 8, 9, 10]]), use_cache=False).logits[0]
    assert torch.allclose(first[-1], ref[2], rtol=1e-9, atol=1e-9)
    assert torch.allclose(window, ref[3:6], rtol=1e-9, atol=1e-9)
