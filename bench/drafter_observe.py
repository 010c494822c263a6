"""A drafter's `observe` of one long prompt: its time and peak memory, what a drafter adds to time to first token.

    python bench/drafter_observe.py                                   # embedded model, eagle, 4096 tokens
    python bench/drafter_observe.py --drafters eagle,dspark --tokens 1024,4096 --json observe.json
    python bench/ab.py --old HEAD~1 --rounds 1 --metric 'drafters.*.*.*' -- drafter_observe.py --tokens 4096

The target prefills a prompt of `--tokens` seeded random token ids once per length (its captured features are what
the drafter observes; observe's cost does not depend on the text), timed once: a drafter's catch-up (a request
restored from the prefix cache observes its whole prompt) is reported as a fraction of that prefill. Then each
repeat gives the drafter a fresh request row (`begin`), times its `observe` of the whole prompt, as the engine calls
it after a prefill, and lets the row go (`release`). Peak memory: the process's resident set, sampled by a thread
while `observe` runs, less its size just before: what `observe` itself held at its peak. For that, glibc's malloc
serves every block of 64 KiB or more from its own mapping (`mallopt(M_MMAP_THRESHOLD)`), so a tensor freed before
`observe` leaves no resident memory for it to reuse unseen (each such block then costs its page faults, in the times
too; `--malloc-default` leaves malloc as it is: the times as an engine sees them, the memory a lower bound). Medians
over `--repeats`, one torch thread unless `--threads` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.draft.base import Observation  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def mmap_large_blocks(threshold: int = 64 << 10) -> bool:
    """glibc: serve blocks of `threshold` bytes or more from mappings of their own (returned at free); False where
    the C library is not glibc."""
    import ctypes
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def rss() -> int:
    """The process's resident set in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The largest resident set seen while the block runs, sampled every `every` seconds by a thread."""

    def __init__(self, every: float = 5e-4):
        self.every, self.peak = every, 0

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.every)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def grown(self) -> int:
        return self.peak - self.start


def measure(engine, ids: torch.Tensor, repeats: int) -> dict:
    """Median and every repeat of observe's milliseconds and peak growth (MiB) over the prompt `ids [n]`; the
    target's prefill of it (once: `prefill_ms`), and observe's median as a fraction of that (`of_prefill`)."""
    drafter, runner = engine.drafter, engine.runner
    layers = tuple(drafter.feature_layers)
    slot = runner.alloc(1)[0]
    try:
        t = time.perf_counter()
        out = runner.prefill(slot, ids, capture=layers)
        common.sync(ids.device)
        prefill_ms = (time.perf_counter() - t) * 1e3
    finally:
        runner.release([slot])
    # what the engine hands the drafter after a prefill (counts on the device), made outside the timing
    seen = Observation.of([0], [ids], [out.hidden[0]], {i: [out.captured[i][0]] for i in layers})
    ms, mib = [], []
    for _ in range(repeats):
        drafter.begin([0], [ids])
        try:
            with PeakRSS() as peak:
                t = time.perf_counter()
                drafter.observe(seen)
                common.sync(ids.device)
                ms.append((time.perf_counter() - t) * 1e3)
        finally:
            drafter.release([0])
        mib.append(peak.grown / 2 ** 20)
    med = statistics.median(ms)
    return {"ms": med, "peak_mib": statistics.median(mib), "peak_mib_max": max(mib), "ms_all": ms,
            "peak_mib_all": mib, "prefill_ms": prefill_ms, "of_prefill": med / prefill_ms}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory or 'embedded'")
    p.add_argument("--drafters", default="eagle", help="trained drafters under the model's drafters/ (comma list)")
    p.add_argument("--tokens", default="4096", help="prompt lengths (comma list)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--malloc-default", action="store_true",
                   help="leave glibc's malloc thresholds as they are (peak memory then a lower bound)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {a.repeats}")
    lengths = common.token_lengths(p, a.tokens, 2, "2")
    model_dir = common.input_args(p, a.model)
    drafters = common.trained_drafters(p, model_dir, a.drafters, 'observes no features (a trained drafter directory is needed)')
    model = common.load_cpu_model(model_dir, a.threads)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(a.seed)
    result = {"machine": common.machine_info("cpu"), "model": str(model_dir), "tokens": lengths,
              "repeats": a.repeats, "mmap_large_blocks": not a.malloc_default and mmap_large_blocks(), "drafters": {}}
    with torch.inference_mode():
        for name, path in drafters.items():
            engine = specdec.wrap(model, drafter=path, max_batch_size=1, max_length=max(lengths) + 64)
            rows = result["drafters"][name] = {}
            for n in lengths:
                ids = torch.randint(3, vocab, (n,), generator=gen)
                rows[str(n)] = r = measure(engine, ids, a.repeats)
                print(f"{name:8s} {n:6d} tokens: observe {r['ms']:9.1f} ms ({100 * r['of_prefill']:.1f}% of the "
                      f"target's prefill, {r['prefill_ms']:.0f} ms), peak +{r['peak_mib']:8.1f} MiB "
                      f"(largest +{r['peak_mib_max']:.1f})", flush=True)
            del engine
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
