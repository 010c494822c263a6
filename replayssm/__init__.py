"""ReplaySSM state: slot pool, rings, snapshot and replay strategies, tree buffer, memory plan."""

from .config import StateConfig, check_ring_len, next_pow2, resolve_dtype

__all__ = ["StateConfig", "check_ring_len", "next_pow2", "resolve_dtype"]

from .plan import BufferSpec, buffer_specs, format_plan, plan_json  # noqa: E402
from .pool import SlotPool  # noqa: E402
from .ring import RingBuffers  # noqa: E402
from .strategy import ReplayStrategy, SnapshotStrategy, StateStrategy, make_strategy  # noqa: E402

__all__ += ["BufferSpec", "buffer_specs", "format_plan", "plan_json", "SlotPool", "RingBuffers",
            "ReplayStrategy", "SnapshotStrategy", "StateStrategy", "make_strategy"]
