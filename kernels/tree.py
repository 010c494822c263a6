"""The verify tree of a round: its parents, checked once, and what the kernels, the KV cache and acceptance derive
from them, made once per tree and shared by every layer.

A tree of T nodes per row: `parent [B, T]`, node i's parent `-1 <= parent[i] < i` (topological order); node 0 is
the root (the anchor, parent -1) and a later node with parent -1 is an unused padding node. A chain is no tree:
callers pass None, and token t follows t - 1.
"""

from __future__ import annotations

import torch


def topology_errors(parent: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool, True where `parent [B, T]` breaks `-1 <= parent[i] < i`: the one rule every tree obeys.
    Device ops only: the callers read it back, alone (`VerifyTree.check`) or with their other checks
    (`specdec.draft.check_block`)."""
    idx = torch.arange(parent.shape[-1], device=parent.device)
    return (parent < -1) | (parent >= idx)


class VerifyTree:
    """A round's tree `parent [B, T]` (long, contiguous), taken as valid.

    `VerifyTree.check(parent, ...)` builds one from a caller's tensor at a public boundary (one host read); the
    engine builds its trees from blocks `check_block` already checked, and a static draft step's on the device,
    so they go straight to `VerifyTree(parent)`. Derived tensors (`ancestors`, `depth`, `schedule`, `int32`,
    `conv_rows`) are made on first use and kept with the tree: a forward passes one tree to every layer."""

    __slots__ = ("parent", "_memo")

    def __init__(self, parent: torch.Tensor):
        self.parent = parent
        self._memo: dict = {}

    @classmethod
    def check(cls, parent, B: int | None = None, T: int | None = None, *, device=None) -> "VerifyTree":
        """`parent` `[T]` (one tree for every row) or `[B, T]`, any integer tensor or list, or a `VerifyTree`
        (its shape checked only) -> a `VerifyTree` on `device`; one ValueError naming `parent` otherwise."""
        if isinstance(parent, VerifyTree):
            if (B is not None and parent.B != B) or (T is not None and parent.T != T):
                raise ValueError(f"parent: expected a tree of [{B}, {T}] nodes, got {list(parent.parent.shape)}")
            return parent
        p = torch.as_tensor(parent, device=device)
        if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool or p.dim() not in (1, 2) \
                or (p.dim() == 1 and B is None):
            raise ValueError(f"parent: expected an integer tensor [B, T]{' or [T]' if B is not None else ''}, "
                             f"got {p.dtype} {list(p.shape)}")
        shape = list(p.shape)
        if p.dim() == 1:
            p = p.expand(B, -1)
        if (B is not None and p.shape[0] != B) or (T is not None and p.shape[1] != T):
            t = "T" if T is None else T
            raise ValueError(f"parent: expected an integer tensor [T] = [{t}] or [B, T] = [{B}, {t}], got {shape}")
        bad = topology_errors(p)
        root, other = torch.stack([(p[:, 0] != -1).any(), bad.any()]).tolist() if p.numel() else (False, False)
        if root:
            raise ValueError(f"parent: node 0 is the root and must have parent -1, got {p[:, 0].tolist()}")
        if other:
            row, node = (int(i) for i in bad.nonzero()[0])
            raise ValueError("parent: not topological; expected -1 <= parent[i] < i for every node i (-1 marks the "
                             f"root or an unused padding node), got parent[{node}] = {int(p[row, node])} in row {row}")
        return cls(p.long().contiguous())

    @property
    def B(self) -> int:
        return self.parent.shape[0]

    @property
    def T(self) -> int:
        return self.parent.shape[1]

    def _get(self, key, make):
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = make()
        return out

    def ancestors(self) -> torch.Tensor:
        """`[B, T, T]` bool: node t sees node u iff u is t or an ancestor of t (`ancestor_mask`)."""
        return self._get("ancestors", lambda: ancestor_mask(self.parent))

    def depth(self) -> torch.Tensor:
        """`[B, T]` long: each node's depth (the root 0; a padding node 0)."""
        return self._get("depth", lambda: self.ancestors().sum(-1) - 1)

    def schedule(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Triton tree verify's walk, `tree_schedule(parent)`."""
        return self._get("schedule", lambda: tree_schedule(self.parent))

    def int32(self) -> torch.Tensor:
        """`parent` as a contiguous int32 tensor (what the Triton kernels read)."""
        return self._get("int32", lambda: self.parent.to(torch.int32).contiguous())

    def rows(self, rows: torch.Tensor | None) -> "VerifyTree":
        """The tree of the rows `rows [R]` (None: every row), kept per distinct selection of CPU rows."""
        if rows is None:
            return self
        if rows.device.type != "cpu":
            return VerifyTree(self.parent[rows])
        return self._get(("rows", tuple(rows.tolist())), lambda: VerifyTree(self.parent[rows]))

    def memo(self, key, make):
        """`make()` once per tree and `key`: what a kernel derives from the tree alone (its conv rows)."""
        return self._get(("user", key), make)


def as_tree(parent, B: int, T: int, device=None) -> VerifyTree | None:
    """A kernel's `parent=` argument: None (a chain), a `VerifyTree`, or `[T]` / `[B, T]` parents (checked)."""
    return None if parent is None else VerifyTree.check(parent, B, T, device=device)


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """Tree parents `[B, T]` (topological, -1 = a root) -> `[B, T, T]` bool: node t sees node u iff u is t or
    an ancestor of t. Pointer jumping: each boolean matrix product doubles the hops covered, so
    ceil(log2 T) products instead of a walk over the nodes."""
    B, T = parent.shape
    eye = torch.eye(T, dtype=torch.bool, device=parent.device).expand(B, T, T)
    one_hop = torch.zeros(B, T, T + 1, dtype=torch.bool, device=parent.device)
    one_hop.scatter_(2, parent.long().where(parent >= 0, T)[..., None], True)  # -1 -> a dropped column T
    reach = (eye | one_hop[..., :T]).to(torch.float32)
    for _ in range(max(T - 1, 1).bit_length()):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach > 0


def tree_stack_slots(num_nodes: int) -> int:
    """States a tree verify keeps at once under `tree_schedule`, for any tree of `num_nodes` nodes (at least 1).

    A node's state is kept only while a later child still needs it, and children go smaller subtree first, so a
    state kept under s others sits in a subtree at least twice as large as the one under it at each level: a
    kept node (two children or more, 3 nodes) at stack depth s needs `2^(s+2) - 1` nodes. Hence
    `floor(log2(T + 1)) - 1` slots: 5 for 64 nodes, 2 for 8.
    """
    return max((num_nodes + 1).bit_length() - 2, 1)


def tree_schedule(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The order a tree verify walks the nodes in, and where it keeps and reloads states (no host reads).

    Depth first, children smaller subtree first: a node's state stays in registers for its first child, is
    kept in a stack slot only when it has a second child, and the last (largest) child reloads it last, so the
    stack never holds more than `tree_stack_slots(T)` states.

    Args:
        parent: `[B, T]` topological parents (-1: a root, restarted from the checkpoint).
    Returns:
        `(order, load, store)`, each `[B, T]` int32 indexed by step: `order[b, i]` the node of step i;
        `load[b, i]`: -2 go on from the state in registers (the parent was step i-1), -1 restart from the
        checkpoint (a root), s >= 0 reload stack slot s; `store[b, i]`: the slot the step's state goes to, or -1.
    """
    B, T = parent.shape
    dev = parent.device
    p = parent.long()
    anc = ancestor_mask(parent).to(torch.float32)  # [B, node, ancestor-or-self]
    size = anc.sum(1)  # [B, T]: nodes in each node's subtree
    idx = torch.arange(T, device=dev)
    # before[b, i, j]: sibling j is walked before i (smaller subtree first, ties by index)
    smaller = (size[:, None, :] < size[:, :, None]) | ((size[:, None, :] == size[:, :, None]) & (idx < idx[:, None]))
    before = (p[:, :, None] == p[:, None, :]) & smaller
    offset = 1 + (before.to(torch.float32) * size[:, None, :]).sum(2)  # position after the parent's
    pre = ((anc @ offset[..., None])[..., 0] - 1).long()  # [B, T]: each node's step (float sums of ints: exact)
    last = ~before.any(1)  # no sibling walked after it
    # a node's ancestors whose states are kept while its subtree runs: one per non-last child on its path
    kept_above = (anc @ ((~last) & (p >= 0)).to(torch.float32)[..., None])[..., 0].long()
    children = torch.zeros(B, T + 1, dtype=torch.long, device=dev).scatter_add_(
        1, p.where(p >= 0, T), torch.ones_like(p))[:, :T]
    store = kept_above.where(children >= 2, -1)
    pre_parent = pre.gather(1, p.clamp(min=0))
    slot_parent = kept_above.gather(1, p.clamp(min=0))
    load = torch.where(p < 0, -1, torch.where(pre_parent == pre - 1, -2, slot_parent))
    load = load.where(pre > 0, -2)  # step 0 starts from the checkpoint already
    order = torch.empty_like(p).scatter_(1, pre, idx.expand(B, T))  # the node of each step
    return order.to(torch.int32), load.gather(1, order).to(torch.int32), store.gather(1, order).to(torch.int32)
