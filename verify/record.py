"""`Acceptance`: what a round keeps, one record from the accept rule to the commit."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class Acceptance:
    """The accepted part of a verified round, per row; the runner, the state strategy and the KV cache commit it as
    it is. Node 0 is the anchor (the last emitted token, not yet seen by the target); a chain's node j is its
    (j-1)-th draft.

    path: `[B, M]` long, the kept nodes root first (`path[:, :num_kept]`), then -1.
    num_accepted: `[B]` long, the drafts accepted (0..G).
    num_kept: `[B]` long, the tokens the target keeps: the anchor and the accepted drafts (`num_accepted + 1`),
        0 on a row that keeps nothing (a padding row of a static-shape round).
    bonus: `[B]` long, the target's own next token (the next anchor); None where the record was made from counts
        (the state API).
    tokens: `[B, M]` long, the tokens emitted: the accepted drafts, then the bonus at `num_accepted` (entries past
        it are undefined); None with `bonus`.
    """

    path: Tensor
    num_accepted: Tensor
    num_kept: Tensor
    bonus: Tensor | None = None
    tokens: Tensor | None = None

    @classmethod
    def chain(cls, num_accepted: Tensor, bonus: Tensor, drafts: Tensor) -> "Acceptance":
        """A chain's record from its `num_accepted [B]`, `bonus [B]` and `drafts [B, G]`: M = G + 1."""
        j = torch.arange(drafts.shape[1] + 1, device=drafts.device)
        path = torch.where(j[None] <= num_accepted[:, None], j[None], -1)
        tokens = torch.where(j[None] == num_accepted[:, None], bonus[:, None],
                             torch.cat([drafts.long(), bonus[:, None]], 1))
        return cls(path, num_accepted, num_accepted + 1, bonus, tokens)

    @classmethod
    def tree(cls, path: Tensor, bonus: Tensor, nodes: Tensor) -> "Acceptance":
        """A tree's record from its `path [B, M]` (-1 padded), `bonus [B]` and node tokens `nodes [B, T]`."""
        n = (path >= 0).sum(1) - 1
        j = torch.arange(path.shape[1], device=path.device)
        tokens = torch.cat([nodes.long().gather(1, path[:, 1:].clamp(min=0)), bonus[:, None]], 1)
        return cls(path, n, n + 1, bonus, torch.where(j[None] == n[:, None], bonus[:, None], tokens))

    @classmethod
    def kept(cls, path: Tensor, num_kept: Tensor) -> "Acceptance":
        """A record of counts alone (the state API's `commit`): `path [B, M]`, `num_kept [B]` (0 keeps nothing)."""
        return cls(path, (num_kept - 1).clamp(min=0), num_kept)

    @classmethod
    def prefix(cls, num_kept: list[int], T: int, device) -> "Acceptance":
        """A chain round that keeps the first `num_kept[b]` of its T tokens (a drafter's own catch-up)."""
        n = torch.tensor(num_kept, dtype=torch.long, device=device)
        j = torch.arange(T, device=device)
        return cls.kept(torch.where(j[None] < n[:, None], j[None], -1), n)

    @classmethod
    def along(cls, path, *, device=None) -> "Acceptance":
        """A tree round that keeps `path [B, M]` (node indices root first, -1 padded; a tensor or nested lists)."""
        path = torch.as_tensor(path, dtype=torch.long, device=device)
        return cls.kept(path, (path >= 0).sum(1))

    def cut_(self, kept: dict[int, int]) -> None:
        """In place (the buffers a captured commit reads): row b keeps `kept[b]` tokens (the anchor and `kept[b] - 1`
        drafts; at least 1, fewer than it keeps now), written as Python scalars (no copy from the host). `tokens` and
        `bonus` are left as they are: a cut row's request ends in this round."""
        for b, n in kept.items():
            self.num_kept[b] = n
            self.num_accepted[b] = n - 1
            self.path[b, n:] = -1

    def masked(self, real: Tensor | None) -> "Acceptance":
        """The record with the rows where `real [B]` is False keeping nothing (padding rows); `real` None: as is."""
        return self if real is None else replace(self, num_kept=torch.where(real, self.num_kept, 0))

    def trimmed(self, m: int) -> "Acceptance":
        """The record with `path` and `tokens` cut to their first `m` columns."""
        return replace(self, path=self.path[:, :m].contiguous(),
                       tokens=None if self.tokens is None else self.tokens[:, :m].contiguous())
