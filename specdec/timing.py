"""Timing comparison of decoding paths on one machine (speculative vs plain decode, say), shared by `specdec demo`
and bench/accept_rate.py.

A short warm-up of every path keeps first-call costs out of the timings; each prompt then runs every path
`repeats` times, interleaved (a, b, a, b, ...), so that a drift in the machine's speed hits all paths alike.
A path's time on a prompt is the median of its repeats; its tokens/s pools the prompts (new tokens over the sum
of those medians), and a speedup is the ratio of two pooled tokens/s. The spread of a prompt is
(max - min) / median of its repeats (the larger over the paths compared); above `NOISY` (median over prompts)
one speedup figure would mislead, so callers report the range over repeats instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

SMALL_MODEL = 50e6  # parameters: below this one torch thread is fastest (and steadiest) on a CPU
NOISY = 0.25  # spread between repeats above which one speedup figure would mislead
WARMUP_TOKENS = 8  # new tokens of each warm-up call


def torch_threads(model, threads: int | None = None, *, device: str = "cpu") -> int:
    """Set torch's intra-op thread count and return it: `threads`, else 1 for a model under `SMALL_MODEL`
    parameters on CPU, else torch's current count."""
    import torch

    if threads is None:
        small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL and device == "cpu"
        threads = 1 if small else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def warm_up(paths: Iterable[Callable[[int], Any]], max_new_tokens: int) -> None:
    """Call each path once for `min(max_new_tokens, WARMUP_TOKENS)` new tokens (each takes that count)."""
    n = min(max_new_tokens, WARMUP_TOKENS)
    for path in paths:
        path(n)


def interleave(paths: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[tuple[Any, float]]]:
    """Run every path `repeats` times, interleaved in the order given. -> per path, (result, seconds) of each
    repeat (wall clock around the call)."""
    runs: dict[str, list[tuple[Any, float]]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, path in paths.items():
            t = time.perf_counter()
            out = path()
            runs[name].append((out, time.perf_counter() - t))
    return runs


def spread(times: list[float]) -> float:
    """(max - min) / median of the repeated timings of one run; 0 for a single one."""
    med = statistics.median(times)
    return (max(times) - min(times)) / med if med > 0 and len(times) > 1 else 0.0


@dataclass
class Pooled:
    """One path's timings pooled over prompts: its new tokens (all prompts) and, per prompt, the seconds of
    each repeat."""

    tokens: int = 0
    seconds: list[list[float]] = field(default_factory=list)

    def add(self, new_tokens: int, seconds: list[float]) -> Pooled:
        """One prompt: `new_tokens` generated in each of the repeats that took `seconds`."""
        self.tokens += new_tokens
        self.seconds.append(list(seconds))
        return self

    @property
    def median_seconds(self) -> float:
        """Sum over prompts of the median of the repeats."""
        return sum(statistics.median(s) for s in self.seconds)

    @property
    def tokens_per_s(self) -> float:
        t = self.median_seconds
        return self.tokens / t if t > 0 else 0.0

    def tokens_per_s_per_repeat(self) -> list[float]:
        """Tokens/s of each repeat, pooled over prompts (every prompt ran the same number of repeats)."""
        return [self.tokens / t if t > 0 else 0.0 for t in map(sum, zip(*self.seconds))]


def speedup(spec: Pooled, base: Pooled) -> float:
    """Pooled tokens/s of `spec` over that of `base` (0 when `base` has none)."""
    b = base.tokens_per_s
    return spec.tokens_per_s / b if b > 0 else 0.0


def speedup_per_repeat(spec: Pooled, base: Pooled) -> list[float]:
    """`speedup` of each repeat."""
    return [s / b if b > 0 else 0.0 for s, b in zip(spec.tokens_per_s_per_repeat(), base.tokens_per_s_per_repeat())]


def pooled_spread(*paths: Pooled) -> float:
    """Median over prompts of the largest `spread` among `paths` on that prompt (the paths share their prompts)."""
    per_prompt = [max(spread(s) for s in times) for times in zip(*(p.seconds for p in paths))]
    return statistics.median(per_prompt) if per_prompt else 0.0


def is_noisy(spread_: float) -> bool:
    return spread_ > NOISY


def noisy_note(spread_: float, per_repeat: list[float]) -> str:
    """The warning for a noisy comparison: how far repeats differ and the speedup range over them."""
    return (f"repeats differ by {spread_ * 100:.0f}% (speedup {min(per_repeat):.2f}x to {max(per_repeat):.2f}x over "
            f"repeats); rerun on a quiet machine or with more --repeats")
