"""Ring buffers of per-token verify records: `[layer, slot, H, L, dim]`, a write head and a pending count per slot."""

from __future__ import annotations

import torch

from .config import StateConfig
from .plan import RING_NAMES, buffer_specs
from .pool import allocate


class RingBuffers:
    """`d k g rawv rawk beta` records of every linear layer, indexed by pool slot.

    Records of slot `s` live at positions `(start[s] + i) % L`: the first `pending[s]` are accepted but
    not yet folded into the checkpoint (lazy commit); a verify round appends after them.
    `d, k` feed the fast rebuild; `rawv, rawk, g, beta` feed the exact fold.
    """

    def __init__(self, cfg: StateConfig, *, device: torch.device | str = "cpu"):
        specs = buffer_specs(cfg)
        self.ring_len = cfg.ring_len
        self.buffers: tuple[torch.Tensor, ...] = tuple(allocate(specs[n], device) for n in RING_NAMES)
        self.d, self.k, self.g, self.rawv, self.rawk, self.beta = self.buffers
        self.start = torch.zeros(cfg.num_slots, dtype=torch.long, device=device)
        self.pending = torch.zeros(cfg.num_slots, dtype=torch.long, device=device)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """This layer's `(d, k, g, rawv, rawk, beta)`, each `[N, H, L, *]`."""
        return tuple(b[layer] for b in self.buffers)

    def reset(self, slot: int) -> None:
        self.start[slot] = 0
        self.pending[slot] = 0

    def compact(self, slots: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> None:
        """Move the records of each row's accepted tree nodes `path [B, M]` (offsets after the pending ones;
        the first `n [B]` entries count) to consecutive positions, so pending records stay contiguous.
        `slots [B]`: null-slot rows have n = 0 and keep everything. All gathers happen before the writes,
        so no source is overwritten before it is read. Device ops only."""
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
