"""Whether an engine's buffers fit: its memory plan by part, the device's free memory, and the error `wrap` raises.

The plan lists every buffer an engine holds, as the `BufferSpec`s its allocations are made from (the state
strategies allocate `replayssm.plan` specs, the KV cache `kv_cache.kv_spec`s), grouped into parts: the recurrent
state pool, the speculative state (rings and conv records, or snapshots), the KV cache and the drafter's caches.
Some are allocated at build, others at first use (the KV cache at each layer's first write); both count, since a
configuration that only fails at its first `generate` has not fitted.

Not counted: the weights (already in memory when `wrap` runs, so outside what is free) and a round's transient
activations (logits, attention scores), which the caller's headroom covers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from specdec.replayssm.plan import BufferSpec

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class InsufficientMemoryError(ValueError):
    """The buffers a configuration needs exceed the device's free memory (raised before any of them is allocated).
    A `ValueError`, as for any other option that cannot be honoured: the fix is a smaller option."""


def format_bytes(n: int) -> str:
    """`1536` -> "1.5 KiB"; powers of 1024."""
    value, unit = float(n), UNITS[0]
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


@dataclass
class MemoryPlan:
    """Buffers by part, `{part: {name: BufferSpec}}` (parts in report order), on `device`; `deferred` names the
    buffers allocated at first use rather than at build."""

    device: torch.device
    parts: dict[str, dict[str, BufferSpec]] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)

    def add(self, part: str, specs: dict[str, BufferSpec], *, deferred: bool = False) -> "MemoryPlan":
        if not specs:
            return self
        self.parts.setdefault(part, {}).update(specs)
        if deferred:
            self.deferred |= set(specs)
        return self

    def copy(self) -> "MemoryPlan":
        return MemoryPlan(self.device, {part: dict(specs) for part, specs in self.parts.items()}, set(self.deferred))

    def specs(self, *, deferred: bool | None = None) -> dict[str, BufferSpec]:
        """Every buffer by name (`deferred` True / False: only those allocated at first use / at build)."""
        return {name: spec for part in self.parts.values() for name, spec in part.items()
                if deferred is None or (name in self.deferred) == deferred}

    def part_bytes(self) -> dict[str, int]:
        return {part: sum(s.nbytes for s in specs.values()) for part, specs in self.parts.items()}

    @property
    def total(self) -> int:
        return sum(self.part_bytes().values())


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """Linux's estimate of the memory a new allocation can get without swapping (`MemAvailable`), in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_bytes(device: torch.device | str) -> int | None:
    """Memory free for new buffers on `device`, in bytes; None where unknown (then nothing is checked).
    CUDA: the driver's free memory plus what torch's caching allocator holds unused (it reuses that first).
    CPU: `MemAvailable` of /proc/meminfo, else the available physical pages (`os.sysconf`)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        available = _meminfo_available()
        if available is None:
            try:
                available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                return None
        return int(available)
    return None


def budget_bytes(option, device: torch.device | str) -> int:
    """`SpecConfig.memory` as bytes: an int as it is; a float, that share of the free memory of `device`."""
    if isinstance(option, float):
        free = free_bytes(device)
        if free is None:
            raise ValueError(f"memory: a share of the free memory ({option}) needs to know it, and {device}'s is "
                             f"unknown; give bytes")
        return int(free * option)
    return int(option)


def pages_within(plan: MemoryPlan, option, *, max_length: int, options: dict) -> int:
    """The KV pages the budget `option` (`budget_bytes`) leaves after every other buffer of `plan` (its KV pages
    aside): InsufficientMemoryError when they cannot hold one request at `max_length` (a request's cap), or when
    the budget exceeds the free memory."""
    from .kv_cache import page_specs, token_bytes
    budget = budget_bytes(option, plan.device)
    kv = plan.parts.get("KV cache", {})
    pages = page_specs(kv)
    page_size = next(iter(pages.values())).shape[1] if pages else 1
    page = token_bytes(kv) * page_size
    rest = plan.total - sum(s.nbytes for s in pages.values())
    n = (budget - rest) // page - 1 if page else 0  # the scratch page aside
    least = -(-max_length // page_size)
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    if page and n < least:
        parts = ", ".join(f"{part} {format_bytes(b)}" for part, b in plan.part_bytes().items() if part != "KV cache")
        raise InsufficientMemoryError(
            f"memory: {format_bytes(budget)} leaves {format_bytes(max(budget - rest, 0))} for KV pages after {parts}, "
            f"but one request at max_length ({max_length} tokens) needs {least} pages of {format_bytes(page)} "
            f"({format_bytes(least * page)}); raise memory or lower max_length or max_batch_size ({opts})")
    free = free_bytes(plan.device)
    if free is not None and budget > free:
        raise InsufficientMemoryError(f"memory: a budget of {format_bytes(budget)} exceeds the {format_bytes(free)} "
                                      f"free on {plan.device} ({opts})")
    return max(n, 0)


def check_fits(plan: MemoryPlan, options: dict, *, what: str = "wrap") -> None:
    """`InsufficientMemoryError` when `plan` needs more than the free memory of its device, naming `options`
    (`{"max_batch_size": 8, "max_length": 4096}`), the bytes of each part and what is free."""
    free = free_bytes(plan.device)
    need = plan.total
    if free is None or need <= free:
        return
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    parts = ", ".join(f"{part} {format_bytes(n)}" for part, n in plan.part_bytes().items())
    raise InsufficientMemoryError(
        f"{', '.join(options)}: {what} with {opts} needs {format_bytes(need)} of buffers ({parts}), but only "
        f"{format_bytes(free)} is free on {plan.device}; lower {' or '.join(options)} (the KV cache grows with "
        f"max_batch_size x max_length, the state pool and rings with max_batch_size)")
