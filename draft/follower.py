"""The drafter of a tensor-parallel rank other than 0 (`specdec.parallel`): rank 0 drafts alone and broadcasts its
block (`TensorParallel.share_block`)."""

from __future__ import annotations

from .base import DraftBlock, Drafter


class Follower(Drafter):
    """Keeps nothing; it answers what the engine reads of a drafter's shape (feature layers, tree, verify window) as
    rank 0's drafter `lead` does."""

    def __init__(self, lead: Drafter, gamma: int):
        self.name = f"{lead.name} (rank 0)"
        self.feature_layers = tuple(lead.feature_layers)
        self.observes_features = lead.observes_features
        self.tree = lead.tree
        self._verify = lead.max_verify_tokens(gamma)

    def bind(self, target) -> None:
        self.tree = self.tree and target.supports_tree

    def max_verify_tokens(self, gamma: int) -> int:
        return self._verify

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        raise RuntimeError("a follower rank does not draft: rank 0's block is broadcast")
