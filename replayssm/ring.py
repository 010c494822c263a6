"""Ring buffers of per-token verify records, in the layout of the commit mode (see `plan`)."""

from __future__ import annotations

import torch

from .config import StateConfig
from .plan import RING_NAMES, buffer_specs, ring_names
from .pool import allocate


class RingBuffers:
    """The verify records of every linear layer.

    `layout="eager"`: `g rawv rawk beta [layer, running row, H, D, *]`, indexed by the round's row; record t of a
    row sits at position t. Eager commit folds them in the same round, so no position, start or pending count
    outlives a round (`d`, `k`, `start`, `pending` are None).

    `layout="lazy"`: `d k g rawv rawk beta [layer, slot, H, L, *]`, indexed by pool slot. Records of slot `s` live
    at positions `(start[s] + i) % L`: the first `pending[s]` are accepted but not yet folded into the checkpoint;
    a verify round appends after them. `d, k` feed the fast rebuild; `rawv, rawk, g, beta` feed the exact fold.
    """

    def __init__(self, cfg: StateConfig, *, layout: str = "eager", device: torch.device | str = "cpu"):
        if layout not in ("eager", "lazy"):
            raise ValueError(f"layout: expected 'eager' or 'lazy', got {layout!r}")
        specs = buffer_specs(cfg, layout=layout)
        self.layout = layout
        self.ring_len = cfg.ring_len if layout == "lazy" else cfg.num_verify_tokens
        held = {name: allocate(specs[name], device) for name in ring_names(layout)}
        self.d, self.k, self.g, self.rawv, self.rawk, self.beta = (held.get(name) for name in RING_NAMES)
        self.buffers: tuple[torch.Tensor, ...] = tuple(held.values())
        if layout == "lazy":
            self.start = torch.zeros(cfg.num_slots, dtype=torch.long, device=device)
            self.pending = torch.zeros(cfg.num_slots, dtype=torch.long, device=device)
        else:
            self.start = self.pending = None

    def layer(self, layer: int) -> tuple[torch.Tensor | None, ...]:
        """This layer's `(d, k, g, rawv, rawk, beta)`, each `[N, H, L, *]` (eager: `[R, H, D, *]`, d and k None)."""
        return tuple(None if b is None else b[layer] for b in (self.d, self.k, self.g, self.rawv, self.rawk, self.beta))

    def reset(self, slot: int) -> None:
        if self.layout == "lazy":
            self.start[slot] = 0
            self.pending[slot] = 0

    def compact(self, slots: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> None:
        """Lazy layout: move the records of each row's accepted tree nodes `path [B, M]` (offsets after the
        pending ones; the first `n [B]` entries count) to consecutive positions, so pending records stay
        contiguous. `slots [B]`: null-slot rows have n = 0 and keep everything. All gathers happen before the
        writes, so no source is overwritten before it is read. Device ops only."""
        L = self.ring_len
        j = torch.arange(path.shape[1], device=path.device)
        keep = j[None, :] < n[:, None]  # [B, M]
        base = self.start[slots] + self.pending[slots]
        src = (base[:, None] + path) % L
        dst = (base[:, None] + j[None, :]) % L
        rows = slots[:, None]
        for b in self.buffers:  # [Lyr, N, H, L, *]: indexed -> [B, M, Lyr, H, *]
            new, old = b[:, rows, :, src], b[:, rows, :, dst]
            b[:, rows, :, dst] = torch.where(keep.view(*keep.shape, *[1] * (new.dim() - 2)), new, old)
