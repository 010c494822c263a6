"""EAGLE-2's dynamic draft tree, shared by the drafters that draft trees (eagle, mtp, dspark).

Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (2024), §4, as in
SafeAILab/EAGLE `eagle/model/cnets.py` (`topK_genrate`) and, batched, SGLang `python/sglang/srt/speculative/`
(`select_top_k_tokens`, `organize_draft_results`). Depth 1: the `k` most likely tokens after
the anchor. At every further depth the `k` candidates of the newest depth with the highest cumulative draft
log-probability are expanded (the drafter runs one step for them), each into its `k` most likely children.
Finally every candidate is reranked by cumulative log-probability and the best `num_nodes` are kept, in
topological order: a child never scores above its parent (`log_scores` clamps at 0), so the kept set is closed
under ancestors.

Candidates are numbered in creation order (by depth, parents first); expanded nodes are numbered in expansion
order, which is what a drafter indexes its per-node state by (hidden states, scratch K/V).
"""

from __future__ import annotations

import torch

from .base import DraftBlock


# The heads that draft one chain in their references (mtp: vLLM, and SGLang's NEXTN with `--speculative-eagle-topk
# 1`; dspark: DeepSpec's block) draft that chain unless `topk` > 1 asks for a tree. On the embedded model on a CPU a
# tree of 16 nodes of top-2 raised tau but not the speed, since every node is target compute there
# (bench/results/HISTORY.md, "The heads draft trees").
HEAD_TREE_NODES = 16  # a tree's default node budget (EAGLE's CPU tree)


def tree_options(depth: int, topk: int | None, num_nodes: int | None, *, default_topk: int = 1,
                 default_nodes: int = HEAD_TREE_NODES) -> tuple[int, int]:
    """-> (topk, num_nodes), checked, of a drafter whose tree is `depth` deep (a head's: its num_draft_tokens):
    the given ones, else the defaults (num_nodes at least depth). topk 1 is a chain of depth drafts."""
    topk = default_topk if topk is None else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an int >= 1 (1: a chain), got {topk!r}")
    if num_nodes is None:
        num_nodes = max(default_nodes, depth)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < depth:
        raise ValueError(f"num_nodes: expected an int >= {depth} (a node budget that holds a tree of depth "
                         f"{depth}: num_draft_tokens or depth), got {num_nodes!r}")
    return topk, num_nodes


def log_scores(logits: torch.Tensor, sampling=None) -> torch.Tensor:
    """Draft log-probabilities `[..., V]` of `logits [..., V]` (at the sampling temperature when sampling), in
    [-inf, 0] and never NaN, so a child's cumulative score never exceeds its parent's."""
    if sampling is not None and sampling.do_sample and sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    lp = logits.log_softmax(-1)
    return torch.nan_to_num(lp, nan=float("-inf"), posinf=0.0, neginf=float("-inf")).clamp(max=0.0)


class DynamicTree:
    """The candidates of one round's tree for B rows. Per round: `DynamicTree(root_scores, k)`, then per further
    depth `sel, src, tok = tree.frontier()`, one drafter step for the `w` nodes `tok [B, w]` (whose parents are the
    expanded nodes `src [B, w]`, -1: the anchor), `tree.grow(sel, scores [B, w, V])`; finally `tree.block(...)`."""

    def __init__(self, root_scores: torch.Tensor, k: int):
        """root_scores: `[B, V]` log-probabilities of the token after the anchor (`log_scores`); k: children per
        expanded node and nodes expanded per depth."""
        B, V = root_scores.shape
        self.k, self.device = min(k, V), root_scores.device
        s0, t0 = root_scores.topk(self.k, -1)
        neg = torch.full((B, self.k), -1, dtype=torch.long, device=self.device)
        self.score, self.tok = [s0], [t0]  # per depth: [B, n] cumulative score, token
        self.parent = [neg]  # parent candidate (-1: the anchor)
        self.src = [neg]  # expanded node whose step scored it (-1: the anchor's)
        self.level = (0, self.k)  # candidate ids of the newest depth
        self.num_expanded = 0

    def frontier(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The nodes to expand next: (candidate ids `sel [B, w]`, their parents' expanded-node ids `src [B, w]`
        (-1: the anchor), their tokens `tok [B, w]`), w = min(k, size of the newest depth)."""
        lo, hi = self.level
        rel = self.score[-1].topk(min(self.k, hi - lo), -1).indices  # within the newest depth
        return rel + lo, self.src[-1].gather(1, rel), self.tok[-1].gather(1, rel)

    @staticmethod
    def parent_states(src: torch.Tensor, root: torch.Tensor, expanded: torch.Tensor) -> torch.Tensor:
        """The drafter state each frontier node's step continues from: `root [B, 1, d]` (the anchor's step) at
        depth 1, where nothing is expanded yet (`src [B, w]` all -1), else `expanded [B, e, d]` at src (past depth 1
        every frontier node's parent is an expanded node). -> `[B, w, d]`."""
        B, w = src.shape
        if not expanded.shape[1]:
            return root.expand(B, w, root.shape[-1])
        return expanded.gather(1, src[..., None].expand(B, w, expanded.shape[-1]))

    def grow(self, sel: torch.Tensor, scores: torch.Tensor) -> None:
        """The expanded nodes `sel [B, w]` (from `frontier`) and their children's log-probabilities `scores
        [B, w, V]`: adds each one's `k` best children as the next depth."""
        B, w = sel.shape
        cs, ct = scores.topk(self.k, -1)  # [B, w, k]
        base = self.score[-1].gather(1, sel - self.level[0])
        self.score.append((base[..., None] + cs).reshape(B, w * self.k))
        self.tok.append(ct.reshape(B, w * self.k))
        self.parent.append(sel[..., None].expand(B, w, self.k).reshape(B, w * self.k))
        ids = self.num_expanded + torch.arange(w, device=self.device)
        self.src.append(ids[None, :, None].expand(B, w, self.k).reshape(B, w * self.k))
        self.num_expanded += w
        hi = self.level[1]
        self.level = (hi, hi + w * self.k)

    def block(self, num_nodes: int, *, tree: bool = True) -> DraftBlock:
        """The best `num_nodes` candidates (all of them when `tree` is False: a chain, built with k = 1) as a
        DraftBlock: tokens `[B, G]` in topological order and, for a tree, `parent [B, 1 + G]` (anchor first, -1)."""
        score, tok, parent_c = torch.cat(self.score, 1), torch.cat(self.tok, 1), torch.cat(self.parent, 1)
        B, Nc = score.shape
        dev = self.device
        G = min(num_nodes, Nc) if tree else Nc
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :G]
        keep = order.sort(1).values  # [B, G] candidate ids, topological (parents have smaller ids)
        where = torch.full((B, Nc), -1, dtype=torch.long, device=dev)
        where.scatter_(1, keep, torch.arange(1, G + 1, device=dev).expand(B, G))
        pc = parent_c.gather(1, keep)
        # closed under ancestors without a check (no host read): scores never grow along a path and the stable
        # sort puts a parent (smaller id) before a child of the same score
        parent = torch.where(pc < 0, 0, where.gather(1, pc.clamp(min=0)))
        tokens = tok.gather(1, keep)
        num = torch.full((B,), G, dtype=torch.long, device=dev)
        if not tree:
            return DraftBlock(tokens, num)
        parent = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parent], 1)
        return DraftBlock(tokens, num, None, parent)
