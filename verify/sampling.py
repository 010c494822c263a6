"""Sampling parameters and the logits -> probabilities transform shared by target and draft.

Speculative sampling is lossless only if the draft distribution `q` and the target distribution `p`
are both the distributions actually sampled from, so the same `probs_from_logits` (temperature,
then top-k, then top-p, then softmax) is applied to both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """How the next token is chosen, with transformers' `generate` semantics.

    `do_sample=False` is greedy (argmax; the other fields are ignored). `top_k=0` and `top_p=1.0`
    disable those filters.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample: expected a bool, got {self.do_sample!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature: expected a number, got {self.temperature!r}")
        if self.do_sample and not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature: expected a finite value > 0 when do_sample=True, got {self.temperature} "
                             "(use do_sample=False for greedy decoding)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 disables it), got {self.top_k!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                or not (0.0 < self.top_p <= 1.0)):
            raise ValueError(f"top_p: expected 0 < top_p <= 1 (1 disables it), got {self.top_p!r}")


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Next-token distribution `[..., V]` from `logits` `[..., V]` under `params`.

    Sampling: temperature, then top-k, then top-p (the ops of transformers' `TemperatureLogitsWarper`,
    `TopKLogitsWarper`, `TopPLogitsWarper`: top-k keeps ties with the k-th logit; top-p keeps the
    smallest set of most likely tokens whose cumulative probability reaches `top_p`, and at least one
    token), then softmax. Greedy: the one-hot of the argmax (first index on ties).
    The result is float64 for float64 logits and float32 otherwise.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1 or logits.shape[-1] < 1:
        got = (f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(logits).__name__)
        raise ValueError(f"logits: expected a floating tensor [..., V] with V >= 1, got {got}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype)
    if not params.do_sample:
        best = scores.argmax(-1, keepdim=True)
        return torch.zeros_like(scores).scatter_(-1, best, 1.0)
    # Disabled filters are skipped, as transformers does, so results match it bit for bit.
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        # Ascending sort: drop the low tail whose total mass is <= 1 - top_p, never the top token.
        sorted_scores, order = torch.sort(scores, descending=False)
        tail_mass = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = tail_mass <= 1 - params.top_p
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores.softmax(-1)


def sample_token(logits: Tensor, params: SamplingParams, generator=None) -> Tensor:
    """One token per row of `logits [B, V]` -> `[B]` int64: the argmax (greedy), or a draw from
    `probs_from_logits` (in float64) with `generator`."""
    if not params.do_sample:
        return logits.argmax(-1)
    probs = probs_from_logits(logits, params).to(torch.float64)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
