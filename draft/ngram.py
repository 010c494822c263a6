"""Prompt lookup: draft the continuation of the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

from .base import DraftBlock, Drafter


class NgramDrafter(Drafter):
    """No weights. For n from `max_ngram` down to `min_ngram`, find the latest earlier occurrence of the
    last n tokens and propose the (up to gamma) tokens that followed it."""

    name = "ngram"
    observes_features = False  # its context is the token history alone

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, **unknown):
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not an option of the ngram drafter (options: max_ngram, min_ngram)")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram/max_ngram: expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, ctx: list[int], gamma: int) -> list[int]:
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for i in range(len(ctx) - n - 1, -1, -1):
                if ctx[i:i + n] == suffix:
                    follow = ctx[i + n:i + n + gamma]
                    if follow:
                        return follow
        return []

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        device = contexts.tensors[0].device if contexts.tensors else "cpu"
        return DraftBlock.from_lists([self.lookup(h, gamma) for h in contexts.host], device)
