"""A/B of `bench/kernel_speed.py` between an older revision and the working tree, in one run.

    python bench/ab_kernels.py --old 7d2e787 --rounds 7 --json ab.json      # CPU references, tiny shapes
    python bench/ab_kernels.py --old 7d2e787 -- --heads 4 --head-dim 64      # extra kernel_speed.py arguments

The benchmark script is the working tree's; only the package differs (the worktree of the old revision and
the import mapping are `bench/ab.py`'s, which does the same for any bench script). Each round runs both sides as
separate processes, in alternating order, with one torch thread; the table gives per op the median milliseconds
of each side, new / old, and the spread (max / min over the rounds) so a noisy machine shows as such.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from ab import alternate, compare, run_side as run_script, sides  # noqa: E402
finally:
    sys.path.pop(0)


def run_side(pythonpath: str, extra: list[str], out: Path) -> dict[str, float]:
    run_script(pythonpath, [str(ROOT / "bench" / "kernel_speed.py"), "--device", "cpu", "--json", str(out), *extra])
    rows = json.loads(out.read_text())["results"]
    return {r["op"]: r["ms"] for r in rows if r["impl"] == "reference"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20, help="timed calls per op per round (kernel_speed.py --reps)")
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs="*", help="more kernel_speed.py arguments (after --)")
    a = p.parse_args(argv)
    extra = ["--reps", str(a.reps), *a.extra]
    with sides(a.old) as paths, tempfile.TemporaryDirectory() as tmp:
        times = alternate(a.rounds, lambda side: run_side(paths[side], extra, Path(tmp) / f"{side}.json"))
    print(f"# bench/kernel_speed.py --device cpu {' '.join(a.extra)}: torch references, old = {a.old}, "
          f"new = working tree; {a.rounds} rounds x {a.reps} calls, 1 thread, medians")
    print(f"{'op':24s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'spread old':>10s} {'spread new':>10s}")
    rows = []
    for r in compare(times):
        rows.append(dict(op=r["name"], old_ms=r["old_median"], new_ms=r["new_median"], ratio=r["ratio"],
                         spread_old=r["spread_old"], spread_new=r["spread_new"]))
        print(f"{r['name']:24s} {r['old_median']:9.4f} {r['new_median']:9.4f} {r['ratio']:8.2f} "
              f"{r['spread_old']:10.2f} {r['spread_new']:10.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(old=a.old, rounds=a.rounds, reps=a.reps, extra=a.extra,
                                                times=times, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
