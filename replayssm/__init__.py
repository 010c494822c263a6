"""ReplaySSM state: slot pool, rings, snapshot and replay strategies, tree buffer, memory plan."""

from .config import StateConfig, check_ring_len, next_pow2, resolve_dtype

__all__ = ["StateConfig", "check_ring_len", "next_pow2", "resolve_dtype"]
