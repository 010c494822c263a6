"""`hf_compat.transformers_generate`, the plain-decode reference of the benchmarks and the demo, against an
independent greedy decode: the model's uncached full forward, one token at a time."""

import pytest
import torch
from tiny_models import float64_everywhere, tiny_model

from specdec.hf_compat import FAMILIES, torch_fallbacks, transformers_generate


def uncached_greedy(model, prompt: torch.Tensor, new: int) -> list[int]:
    """Argmax of the last position of a fresh forward over all tokens so far, `new` times (no cache)."""
    ids = prompt
    with torch.no_grad(), torch_fallbacks():
        for _ in range(new):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids[0].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_generate_equals_uncached_greedy(family):
    """Greedy: the same tokens as the uncached decode (the cached recurrent steps and the chunked prefill the
    reference runs on CPU), float64 throughout; sampling with a seed repeats itself and returns the shape asked."""
    model = tiny_model(family, seed=3)
    prompt = torch.randint(3, 90, (1, 21), generator=torch.Generator().manual_seed(4))
    with float64_everywhere():
        got = transformers_generate(model, prompt, max_new_tokens=10, min_new_tokens=10)
        want = uncached_greedy(model, prompt, 10)
    assert got[0].tolist() == want
    a, b = (transformers_generate(model, prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True,
                                  temperature=1.5, seed=7) for _ in range(2))
    assert a.shape == (1, 27) and torch.equal(a, b) and torch.equal(a[:, :21], prompt)
