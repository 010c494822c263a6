"""Slot pool: the persistent per-request conv windows and fp32 checkpoints of every linear layer."""

from __future__ import annotations

import torch

from specdec.tensors import outside_inference

from .config import StateConfig
from .plan import BufferSpec, pool_specs


def allocate(spec: BufferSpec, device: torch.device | str, *, fill: float = 0.0) -> torch.Tensor:
    """A tensor of `spec`'s shape and dtype on `device` (a normal tensor, see `outside_inference`)."""
    with outside_inference():
        return torch.full(spec.shape, fill, dtype=spec.dtype, device=device)


class SlotPool:
    """`conv[layer, slot, C, Kc-1]` and `ssm[layer, slot, H, K, V]` for `max_requests` slots plus the null slot.

    `seq_len[slot]` counts the tokens folded into the checkpoint. With a track interval, the state right
    after every `track_interval`-th token is kept in `track_ssm / track_conv[layer, slot, 2, ...]` (ping-pong:
    index `(count // interval) % 2`), with its token count in `track_len[slot, 2]` (-1: none yet).
    """

    def __init__(self, cfg: StateConfig, *, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        specs = pool_specs(cfg)
        self.conv = allocate(specs["conv_state"], self.device)
        self.ssm = allocate(specs["ssm_state"], self.device)
        self.seq_len = torch.zeros(cfg.num_slots, dtype=torch.long, device=self.device)
        if cfg.track_interval is not None:
            self.track_ssm = allocate(specs["track_ssm"], self.device)
            self.track_conv = allocate(specs["track_conv"], self.device)
            self.track_len = torch.full((cfg.num_slots, 2), -1, dtype=torch.long, device=self.device)
        else:
            self.track_ssm = self.track_conv = self.track_len = None
        self._free = list(range(cfg.max_requests))
        self._used: set[int] = set()

    @property
    def null_slot(self) -> int:
        return self.cfg.null_slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int]:
        """Take `n` zeroed slots; a `RuntimeError` (and nothing taken) when fewer than `n` are free."""
        if n < 1:
            raise ValueError(f"n: expected >= 1, got {n}")
        if n > len(self._free):
            raise RuntimeError(f"slot pool exhausted: requested {n} slot(s), {len(self._free)} of "
                               f"{self.cfg.max_requests} free")
        slots = [self._free.pop(0) for _ in range(n)]
        for s in slots:
            self._used.add(s)
            self.reset(s)
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool; freeing a slot that is not allocated is a `ValueError`."""
        bad = [s for s in slots if s not in self._used]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(f"slots: {bad or slots} not allocated (or repeated); allocated: {sorted(self._used)}")
        for s in slots:
            self._used.remove(s)
            self._free.append(s)

    def reset(self, slot: int) -> None:
        """Zero one slot's state (a fresh request)."""
        self.conv[:, slot] = 0
        self.ssm[:, slot] = 0
        self.seq_len[slot] = 0
        if self.track_len is not None:
            self.track_ssm[:, slot] = 0
            self.track_conv[:, slot] = 0
            self.track_len[slot] = -1

    def load(self, slot: int, *, conv: torch.Tensor, ssm: torch.Tensor, seq_len: int = 0) -> None:
        """Set a slot's state after prefill: conv `[Lyr, C, Kc-1]`, ssm `[Lyr, H, K, V]`."""
        if slot not in self._used:
            raise ValueError(f"slot: {slot} is not allocated")
        if tuple(conv.shape) != tuple(self.conv.shape[:1] + self.conv.shape[2:]):
            raise ValueError(f"conv: expected shape {[self.conv.shape[0], *self.conv.shape[2:]]}, got {list(conv.shape)}")
        if tuple(ssm.shape) != tuple(self.ssm.shape[:1] + self.ssm.shape[2:]):
            raise ValueError(f"ssm: expected shape {[self.ssm.shape[0], *self.ssm.shape[2:]]}, got {list(ssm.shape)}")
        self.conv[:, slot] = conv.to(self.conv.dtype)
        self.ssm[:, slot] = ssm.to(self.ssm.dtype)
        self.seq_len[slot] = seq_len

    def advance(self, slots: torch.Tensor, n: torch.Tensor) -> None:
        """A prefill chunk folded `n [B]` more tokens into the checkpoints of the distinct `slots [B]`."""
        self.seq_len[slots] += n

    def check_slots(self, slots: torch.Tensor, *, arg: str = "slots") -> None:
        """Every entry is -1, the null slot, or an allocated slot; allocated slots appear once."""
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{arg}: expected a 1-D integer tensor, got {slots.dtype} of shape {list(slots.shape)}")
        real = [s for s in slots.tolist() if s != -1 and s != self.null_slot]
        bad = [s for s in real if s not in self._used]
        if bad:
            raise ValueError(f"{arg}: slots {bad} are not allocated (allocated: {sorted(self._used)}, "
                             f"null slot {self.null_slot}, -1 skips)")
        if len(set(real)) != len(real):
            raise ValueError(f"{arg}: a slot appears twice in {slots.tolist()}")
