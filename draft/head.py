"""What the head drafters (mtp, dspark, eagle, native: a trained `net` over the target's own states) share: the
checks of their size arguments and request rows, and the draft shape (a chain, or EAGLE-2's dynamic tree where the
target verifies trees). Their chain drafts are picked by `layers.DraftChain` (one `pick_draft` for all)."""

from __future__ import annotations

from .base import Drafter
from .tree import tree_options


def check_positive(name: str, value) -> None:
    """A size argument (drafts per round, request rows, tree depth): an int >= 1, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


class HeadDrafter(Drafter):
    """A drafter around a head `net` with a row of state per request row (`max_batch_size` rows). The draft shape:
    `topk` 1 a chain; above 1 EAGLE-2's dynamic tree (`tree.DynamicTree`) of `topk` children per expanded node and
    `num_nodes` drafts, on targets that verify trees (`tree`: set when bound), a chain elsewhere. A head without
    tree options (native) drafts chains."""

    topk = 1  # children per expanded node (1: a chain)
    num_nodes = 0  # a tree's node budget (drafts)
    tree = False  # whether it drafts trees: `asks_tree`, and the bound target verifies them

    def _tree_options(self, depth: int, topk: int | None, num_nodes: int | None, **defaults) -> None:
        """`topk` and `num_nodes` of a tree `depth` deep, checked (`tree.tree_options`, its `defaults`)."""
        self.topk, self.num_nodes = tree_options(depth, topk, num_nodes, **defaults)
        self.tree = self.asks_tree()

    def asks_tree(self) -> bool:
        """Whether its drafts are a tree where the target verifies one: `topk` above 1."""
        return self.topk > 1

    def bind(self, target) -> None:
        super().bind(target)
        # the generic runner verifies chains only
        self.tree = self.asks_tree() and target.supports_tree

    def max_verify_tokens(self, gamma: int) -> int:
        return (self.num_nodes if self.tree else gamma) + 1

    def _check_begin(self, rows) -> None:
        """New request rows, each within the `max_batch_size` rows of the drafter's buffers."""
        for r in rows:
            if not 0 <= r < self.max_batch_size:
                raise ValueError(f"rows: row {r} outside max_batch_size {self.max_batch_size}")
