"""Acceptance rules of speculative decoding: greedy and rejection sampling, for chains and trees.

Rows `b` of a batch are independent requests. Shapes: `B` rows, `G` drafts per chain, `T` tree nodes
(node 0 is the root: the already-accepted anchor token, not yet seen by the target), `V` vocabulary.

Sampling follows Leviathan et al. / Chen et al.: a draft token `x` drawn from `q` is accepted with
probability `min(1, p(x) / q(x))`; at the first rejection the bonus token is drawn from the residual
`norm(max(0, p - q))`, and after a full accept from `p` at the next position. Trees use recursive
rejection over siblings (SpecInfer / EAGLE): a rejected child turns `p` into its residual and the next
sibling is tried against that. Emitted tokens then follow the target distribution exactly.

The chain functions are the tree rule on a chain, vectorized over positions instead of walked node by
node; both use the same primitives (`_accept`, `_residual`, `_sample`, `_draft_dist`) and the same
random draws, so a chain and the equivalent chain-shaped tree give identical results for one seed.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..kernels.tree import VerifyTree
from .record import Acceptance

__all__ = ["accept_chain_greedy", "accept_chain_sampling", "accept_tree_greedy", "accept_tree_sampling",
           "accept_round"]


# ----------------------------------------------------------------------------------------------
# input checks (all raise ValueError naming the argument, before any work)


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def is_int_tensor(t: object) -> bool:
    """A tensor of integers (token ids, counts, parents): not floating, complex or bool."""
    return (isinstance(t, Tensor) and not t.is_floating_point() and not t.is_complex()
            and t.dtype != torch.bool)


def _check_device(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {_describe(t)}")


def _check_probs(name: str, t: object, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected a floating tensor {what} = {list(shape)}, got {_describe(t)}")
    _check_device(name, t, device)


def _check_scores(name: str, t: object, lead: tuple[int, int], what: str) -> int:
    """Check `t` is floating `[*lead, V]` with `V >= 1`; return `V`."""
    if (not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() != 3 or tuple(t.shape[:2]) != lead
            or t.shape[2] < 1):
        raise ValueError(f"{name}: expected a floating tensor {what} = [{lead[0]}, {lead[1]}, V], got {_describe(t)}")
    return t.shape[2]


def _check_tokens_in_vocab(name: str, tokens: Tensor, live: Tensor, vocab: int) -> None:
    bad = live & ((tokens < 0) | (tokens >= vocab))
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: token {int(tokens[at])} at {at} is outside the vocabulary [0, {vocab})")


def _check_chain(draft_tokens: Tensor, target: Tensor, target_name: str, draft_probs: Tensor | None,
                 num_drafts: Tensor | None) -> tuple[int, int, int]:
    """Validate chain inputs; return `(B, G, V)`."""
    if not is_int_tensor(draft_tokens) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens: expected an integer tensor [B, G], got {_describe(draft_tokens)}")
    b, g = draft_tokens.shape
    v = _check_scores(target_name, target, (b, g + 1), "[B, G+1, V]")
    device = target.device
    _check_device("draft_tokens", draft_tokens, device)
    if draft_probs is not None:
        _check_probs("draft_probs", draft_probs, (b, g, v), "[B, G, V]", device)
    live = torch.ones(b, g, dtype=torch.bool, device=device)
    if num_drafts is not None:
        if not is_int_tensor(num_drafts) or tuple(num_drafts.shape) != (b,):
            raise ValueError(f"num_drafts: expected an integer tensor [B] = [{b}], got {_describe(num_drafts)}")
        _check_device("num_drafts", num_drafts, device)
        if bool(((num_drafts < 0) | (num_drafts > g)).any()):
            raise ValueError(f"num_drafts: expected values in [0, G] = [0, {g}], got {num_drafts.tolist()}")
        live = torch.arange(g, device=device) < num_drafts[:, None]
    _check_tokens_in_vocab("draft_tokens", draft_tokens, live, v)
    return b, g, v


def _check_tree(tokens: Tensor, parent, target: Tensor, target_name: str,
                draft_probs: Tensor | None) -> tuple[int, int, int, VerifyTree]:
    """Validate tree inputs; return `(B, T, V, tree)`."""
    if not is_int_tensor(tokens) or tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens: expected an integer tensor [B, T] with T >= 1, got {_describe(tokens)}")
    b, t = tokens.shape
    v = _check_scores(target_name, target, (b, t), "[B, T, V]")
    device = target.device
    _check_device("tokens", tokens, device)
    if isinstance(parent, Tensor):
        _check_device("parent", parent, device)
    tree = VerifyTree.check(parent, b, t)
    if draft_probs is not None:
        _check_probs("draft_probs", draft_probs, (b, t, v), "[B, T, V]", device)
    _check_tokens_in_vocab("tokens", tokens, (tree.parent >= 0), v)
    return b, t, v, tree


def _check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")


# ----------------------------------------------------------------------------------------------
# shared primitives


def _work_dtype(*ts: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (low-precision probs are upcast)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _accept(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """`u < min(1, p(x) / q(x))` for `u` uniform in [0, 1), all `[B]`; written without the division."""
    return u * q_x < p_x


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """`norm(max(0, p - q))` row-wise, `[B, V]`."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    # s == 0 means p == q, where a rejection has probability 0 and only rounding gets here: keep p.
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), p)


def _sample(dist: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of `dist` `[B, V]` -> `[B]` int64."""
    if dist.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=dist.device)
    return torch.multinomial(dist, 1, generator=generator).squeeze(-1)


def _draft_dist(q: Tensor | None, tokens: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
    """The draft distribution `[B, V]` a token `[B]` was drawn from: `q` `[B, V]`, or one-hot when None."""
    if q is not None:
        return q.to(dtype)
    one_hot = torch.zeros(tokens.shape[0], vocab, dtype=dtype, device=tokens.device)
    return one_hot.scatter_(-1, tokens.clamp(0, vocab - 1)[:, None], 1.0)


def _gather_tok(dist: Tensor, tokens: Tensor) -> Tensor:
    """`dist[b, tokens[b]]` for `dist` `[B, V]`, `tokens` `[B]` (padding tokens are clamped; callers mask them)."""
    return dist.gather(-1, tokens.clamp(0, dist.shape[-1] - 1)[:, None]).squeeze(-1)


def _prefix_len(ok: Tensor, num_drafts: Tensor | None) -> Tensor:
    """Length `[B]` of the all-True prefix of `ok` `[B, G]`, capped at `num_drafts` `[B]`."""
    if num_drafts is not None:
        ok = ok & (torch.arange(ok.shape[1], device=ok.device) < num_drafts[:, None])
    return ok.long().cumprod(1).sum(1)


def _first_match_path(tree: VerifyTree, ok: Tensor) -> tuple[Tensor, Tensor]:
    """The greedy walk of `_walk_tree` without a loop over the nodes: from the root, move to the first child (in
    index order) that would be accepted, until there is none.

    `ok` `[B, T]` bool: node `j` is accepted when its parent is the current node. A node is on the path iff it and
    each of its ancestors below the root is its parent's first acceptable child, so the path is read off the
    ancestor mask. Same results as `_walk_tree`: `path [B, T]` (-1 padded) and the last accepted node `[B]`.
    """
    parent = tree.parent
    b, t = parent.shape
    idx = torch.arange(t, device=parent.device)
    ok = ok & (parent >= 0)  # padding nodes (parent -1 past the root) are never taken
    earlier_sibling = (parent[:, :, None] == parent[:, None, :]) & (idx[None, :] < idx[:, None])  # [B, j, k]: k < j
    first = ok & ~(earlier_sibling & ok[:, None, :]).any(-1)
    first[:, 0] = True  # the root
    on = ~(tree.ancestors() & ~first[:, None, :]).any(-1)  # [B, T]: every node from the root down to it taken
    cur = torch.where(on, idx, 0).amax(1)  # the deepest node on the path has the largest index
    path = torch.where(on, idx, t).sort(1).values
    return path.masked_fill(path == t, -1), cur


def _walk_tree(parent: Tensor, try_child: Callable[[int, Tensor, Tensor], Tensor]) -> Tensor:
    """Walk every row of a tree from the root, trying children in index order.

    `parent` `[B, T]` (topological, -1 = root / padding). `try_child(j, m, cur)` gets node `j`, the
    rows `m` `[B]` whose current node is `j`'s parent and the current nodes `cur` `[B]`, and returns
    the rows `[B]` (a subset of `m`) that accept `j`. Since `parent[j] < j`, a node's children all
    come after it, so one pass over `j` tries each current node's children in index order.
    Returns `path` `[B, T]` (node indices root..last accepted, -1 padded).
    """
    b, t = parent.shape
    device = parent.device
    rows = torch.arange(b, device=device)
    cur = torch.zeros(b, dtype=torch.long, device=device)
    steps = torch.zeros(b, dtype=torch.long, device=device)
    path = torch.full((b, t), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    for j in range(1, t):
        acc = try_child(j, parent[:, j] == cur, cur)
        cur = torch.where(acc, j, cur)
        steps = steps + acc.long()
        path[rows, steps] = torch.where(acc, j, path[rows, steps])
    return path


def _trimmed(acc: Acceptance, tree: VerifyTree) -> Acceptance:
    """A public tree rule's record: `path` and `tokens` cut to the tree's depth + 1 columns (one host read)."""
    return acc.trimmed(int(tree.depth().max()) + 1 if tree.B > 0 else 1)


# ----------------------------------------------------------------------------------------------
# the rules (inputs taken as checked: the public functions below check them, the engine's round checked its
# draft block once with `check_block`)


def _chain_greedy(drafts: Tensor, logits: Tensor, num_drafts: Tensor | None) -> Acceptance:
    best = logits.argmax(-1)
    n = _prefix_len(drafts.long() == best[:, :-1], num_drafts)
    return Acceptance.chain(n, best.gather(1, n[:, None]).squeeze(1), drafts)


def _chain_sampling(drafts: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                    generator: torch.Generator | None, num_drafts: Tensor | None) -> Acceptance:
    (b, g), v = drafts.shape, target_probs.shape[-1]
    dtype = _work_dtype(target_probs, draft_probs)
    p = target_probs.to(dtype)
    x = drafts.long()
    u = torch.rand((b, g), generator=generator, dtype=dtype, device=p.device)
    p_x = p[:, :g].gather(-1, x.clamp(0, v - 1)[..., None]).squeeze(-1)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.to(dtype).gather(-1, x.clamp(0, v - 1)[..., None]).squeeze(-1)
    n = _prefix_len(_accept(u, p_x, q_x), num_drafts)
    p_n = p.gather(1, n[:, None, None].expand(b, 1, v)).squeeze(1)
    if g == 0:
        return Acceptance.chain(n, _sample(p_n, generator), drafts)
    proposed = torch.full_like(n, g) if num_drafts is None else num_drafts.long()
    rejected = n < proposed
    at = n.clamp(max=g - 1)
    q_rows = None if draft_probs is None else draft_probs.gather(1, at[:, None, None].expand(b, 1, v)).squeeze(1)
    q_n = _draft_dist(q_rows, x.gather(1, at[:, None]).squeeze(1), v, dtype)
    dist = torch.where(rejected[:, None], _residual(p_n, q_n), p_n)
    return Acceptance.chain(n, _sample(dist, generator), drafts)


def _tree_greedy(tokens: Tensor, tree: VerifyTree, logits: Tensor) -> Acceptance:
    best = logits.argmax(-1)
    ok = tokens.long() == best.gather(1, tree.parent.clamp(min=0))  # node j's token is the argmax at its parent
    path, cur = _first_match_path(tree, ok)
    return Acceptance.tree(path, best.gather(1, cur[:, None]).squeeze(1), tokens)


def _tree_sampling(tokens: Tensor, tree: VerifyTree, draft_probs: Tensor | None, target_probs: Tensor,
                   generator: torch.Generator | None) -> Acceptance:
    (b, t), v = tokens.shape, target_probs.shape[-1]
    dtype = _work_dtype(target_probs, draft_probs)
    p = target_probs.to(dtype)
    tok = tokens.long()
    u = torch.rand((b, t - 1), generator=generator, dtype=dtype, device=p.device)
    p_cur = p[:, 0]  # [B, V]: the current node's target distribution, or its residual after rejections

    def try_child(j: int, m: Tensor, cur: Tensor) -> Tensor:
        nonlocal p_cur
        x = tok[:, j]
        q_j = _draft_dist(None if draft_probs is None else draft_probs[:, j], x, v, dtype)
        acc = m & _accept(u[:, j - 1], _gather_tok(p_cur, x), _gather_tok(q_j, x))
        rej = m & ~acc
        p_cur = torch.where(acc[:, None], p[:, j], torch.where(rej[:, None], _residual(p_cur, q_j), p_cur))
        return acc

    path = _walk_tree(tree.parent, try_child)
    return Acceptance.tree(path, _sample(p_cur, generator), tokens)


def accept_round(ids: Tensor, tree: VerifyTree | None, *, num_drafts: Tensor, logits: Tensor | None = None,
                 draft_probs: Tensor | None = None, target_probs: Tensor | None = None,
                 generator: torch.Generator | None = None) -> Acceptance:
    """A verified round's rule, on inputs checked once upstream (the engine's `check_block`, or a static draft
    step's device-built tree): greedy with `logits [B, T, V]`, else sampling with `target_probs [B, T, V]`.

    `ids [B, T]` = `[anchor, drafts]`; `tree` None for a chain (its `num_drafts [B]` proposed), else the round's
    tree; `draft_probs` `[B, T - 1, V]` (a draft's distribution; None: deterministic drafts). Device ops only,
    nothing read back: the record's `path` keeps `M = T` columns."""
    if tree is None:
        if logits is not None:
            return _chain_greedy(ids[:, 1:], logits, num_drafts)
        return _chain_sampling(ids[:, 1:], draft_probs, target_probs, generator, num_drafts)
    if logits is not None:
        return _tree_greedy(ids, tree, logits)
    q = None if draft_probs is None else torch.cat([torch.zeros_like(draft_probs[:, :1]), draft_probs], 1)
    return _tree_sampling(ids, tree, q, target_probs, generator)


# ----------------------------------------------------------------------------------------------
# the public rules: inputs checked (one ValueError naming the argument), then the rule


def accept_chain_greedy(draft_tokens: Tensor, target_logits: Tensor, *,
                        num_drafts: Tensor | None = None) -> Acceptance:
    """Greedy acceptance of a draft chain.

    `draft_tokens` `[B, G]`; `target_logits` `[B, G+1, V]`, position `i` = the target's scores for the
    token after the anchor and drafts `0..i-1`. `num_drafts` `[B]` (optional, values in 0..G): row `b`
    proposed only its first `num_drafts[b]` drafts (the rest is padding and never accepted).
    Returns an `Acceptance`: `num_accepted` `[B]` (drafts accepted, 0..G), `bonus` `[B]` the target's argmax at
    the first mismatch or after the last accepted draft, `path` / `tokens` `[B, G+1]`.
    """
    _check_chain(draft_tokens, target_logits, "target_logits", None, num_drafts)
    return _chain_greedy(draft_tokens, target_logits, num_drafts)


def accept_chain_sampling(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, *,
                          generator: torch.Generator | None = None,
                          num_drafts: Tensor | None = None) -> Acceptance:
    """Speculative-sampling acceptance of a draft chain (lossless: emitted tokens follow `p`).

    `draft_tokens` `[B, G]`, draft `i` drawn from `draft_probs[:, i]` `[B, G, V]` (None = deterministic
    drafts, `q` one-hot at the draft token); `target_probs` `[B, G+1, V]`, position `i` = the target's
    distribution after the anchor and drafts `0..i-1` (use `probs_from_logits` on both sides).
    `num_drafts` `[B]` as in `accept_chain_greedy`. Every random draw uses `generator`.
    Returns an `Acceptance` as `accept_chain_greedy`'s; its `bonus` is drawn from the residual
    `norm(max(0, p - q))` at the first rejection, or from `p` after the last proposed draft.
    """
    _check_chain(draft_tokens, target_probs, "target_probs", draft_probs, num_drafts)
    _check_generator(generator)
    return _chain_sampling(draft_tokens, draft_probs, target_probs, generator, num_drafts)


def accept_tree_greedy(tokens: Tensor, parent: Tensor | VerifyTree, target_logits: Tensor) -> Acceptance:
    """Greedy acceptance of a draft tree.

    `tokens` `[B, T]` (node 0 = root / anchor); `parent` `[T]` or `[B, T]` int (or a `VerifyTree`),
    `parent[0] = -1`, `-1 <= parent[i] < i` (-1 at `i > 0` marks an unused padding node); `target_logits`
    `[B, T, V]`, node `i` = the target's scores after the path root..i.
    From the root, move to the first child (in index order) whose token is the target's argmax at the
    current node; stop when there is none.
    Returns an `Acceptance`: `path` `[B, M]` (node indices root..last accepted, -1 padded, `M` = tree depth + 1),
    `bonus` `[B]` (the argmax at the last accepted node), `num_accepted`, `tokens`.
    """
    _, _, _, tree = _check_tree(tokens, parent, target_logits, "target_logits", None)
    return _trimmed(_tree_greedy(tokens, tree, target_logits), tree)


def accept_tree_sampling(tokens: Tensor, parent: Tensor | VerifyTree, draft_probs: Tensor | None,
                         target_probs: Tensor, *, generator: torch.Generator | None = None) -> Acceptance:
    """Speculative-sampling acceptance of a draft tree by recursive rejection over siblings.

    `tokens` `[B, T]` and `parent` as in `accept_tree_greedy`; node `j`'s token was
    drawn from `draft_probs[:, j]` `[B, T, V]` (row 0 unused; None = deterministic drafts, one-hot `q`);
    `target_probs` `[B, T, V]`, node `i` = the target's distribution after the path root..i.
    At the current node, children are tried in index order: child `j` is accepted with probability
    `min(1, p(x_j) / q_j(x_j))`; on rejection `p <- norm(max(0, p - q_j))` and the next child is tried
    against that. An accepted child becomes the current node with `p` = its target distribution; when
    no child is left the bonus is drawn from the current `p` (the residual if children were rejected).
    Every random draw uses `generator`. Returns an `Acceptance` as `accept_tree_greedy`'s.
    """
    _, _, _, tree = _check_tree(tokens, parent, target_probs, "target_probs", draft_probs)
    _check_generator(generator)
    return _trimmed(_tree_sampling(tokens, tree, draft_probs, target_probs, generator), tree)
