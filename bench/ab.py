"""A/B of any bench script between an older revision and the working tree, in one run.

    python bench/ab.py --old 49fbd9e --rounds 3 --metric 'ratios.*' -- \\
        verify_cost.py --verify chunk --repeats 15 --trees 13,49
    python bench/ab.py --old 49fbd9e --rounds 2 --metric 'drafters.*.speedup' -- \\
        accept_rate.py --model embedded --kinds code --threads 1 --drafters eagle,dspark --max-prompts 10

The script is the working tree's (`bench/SCRIPT`, or a path); only the package differs. The old revision is checked
out into a temporary git worktree, and each side imports the package through a folder that maps its top-level
folders onto the `specdec` namespace (as pyproject's package-dir does), ahead of the installed package; both run
outside either checkout, so neither tree's own folders shadow the mapping. Each round runs both sides as separate
processes, in alternating order, one torch thread each; every run writes its JSON (`--json FILE` is appended to the
script's arguments) and the numbers at the `--metric` paths are collected: dotted keys into the JSON, `*` for any one
key (a list's items are keyed 0, 1, ...). The table gives per metric each round's old and new values, their medians
and new / old; a metric path that matches nothing on either side is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mapped(checkout: Path, into: Path) -> Path:
    """A folder holding `specdec/` whose entries link to the checkout's package folders."""
    pkg = into / "specdec"
    pkg.mkdir(parents=True)
    for f in (checkout / "specdec").iterdir():
        (pkg / f.name).symlink_to(f)
    for sub in ("kernels", "replayssm", "draft", "verify"):
        if (checkout / sub).is_dir():
            (pkg / sub).symlink_to(checkout / sub)
    return into


@contextlib.contextmanager
def sides(old: str):
    """-> {"old": path, "new": path}: the PYTHONPATH entries importing revision `old` and the working tree; the
    worktree of `old` is removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tree = tmp / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), old], check=True,
                       capture_output=True)
        try:
            yield {"old": str(mapped(tree, tmp / "map_old")), "new": str(mapped(ROOT, tmp / "map_new"))}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_side(pythonpath: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python ARGV...` with the package imported from `pythonpath`, one thread, outside both checkouts; raises
    with the script's stderr when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, *argv], env=env, cwd=tempfile.gettempdir(), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done


def flatten(obj, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value as {dotted key: value} (list items keyed by their index; bools left out)."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        ok = isinstance(obj, (int, float)) and not isinstance(obj, bool)
        return {prefix: float(obj)} if ok else {}
    out: dict[str, float] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def pick(values: dict[str, float], patterns: list[str]) -> dict[str, float]:
    """The entries of `flatten`'s output whose key matches a pattern, one dotted part against one part (`*` any)."""
    def match(key: str, pat: str) -> bool:
        k, p = key.split("."), pat.split(".")
        return len(k) == len(p) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(k, p))
    return {k: v for k, v in values.items() if any(match(k, p) for p in patterns)}


def alternate(rounds: int, run) -> dict[str, dict[str, list[float]]]:
    """Both sides `rounds` times, the order alternated from round to round; `run(side)` ("old" or "new") returns
    {name: value}. -> side -> name -> the values in round order."""
    vals: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for r in range(rounds):
        for side in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            for k, v in run(side).items():
                vals[side].setdefault(k, []).append(v)
    return vals


def compare(vals: dict[str, dict[str, list[float]]]) -> list[dict]:
    """Per name both sides have (in the new side's order): its values, their medians, new / old and the spread of
    each side (max / min over the rounds)."""
    rows = []
    for k in [k for k in vals["new"] if k in vals["old"]]:
        old, new = vals["old"][k], vals["new"][k]
        o, n = statistics.median(old), statistics.median(new)
        spread = lambda xs: max(xs) / min(xs) if min(xs) > 0 else float("nan")  # noqa: E731
        rows.append(dict(name=k, old=old, new=new, old_median=o, new_median=n, ratio=n / o if o else float("nan"),
                         spread_old=spread(old), spread_new=spread(new)))
    return rows


def script_path(name: str) -> Path:
    """`name` as a file (absolute: the runs start elsewhere), else `bench/name`."""
    p = Path(name)
    return p.resolve() if p.is_file() else ROOT / "bench" / name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, order alternated")
    p.add_argument("--metric", action="append", required=True,
                   help="dotted path into the script's JSON, * for any one key (repeatable)")
    p.add_argument("--json", default=None, help="write the collected values here")
    p.add_argument("script", help="bench script (a name under bench/ or a path), then its arguments")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds: expected >= 1, got {a.rounds}")
    script = script_path(a.script)
    if not script.is_file():
        p.error(f"script: no file {a.script} (nor bench/{a.script})")
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    with sides(a.old) as paths, tempfile.TemporaryDirectory() as tmp:
        def run(side: str) -> dict[str, float]:
            out = Path(tmp) / f"{side}.json"
            run_side(paths[side], [str(script), *args, "--json", str(out)])
            return pick(flatten(json.loads(out.read_text())), a.metric)
        vals = alternate(a.rounds, run)
    rows = compare(vals)
    if not rows:
        raise SystemExit(f"--metric: {a.metric} matched nothing in both sides' JSON")
    print(f"# bench/ab.py: {script.name} {' '.join(args)}; old = {a.old}, new = working tree; {a.rounds} rounds, "
          f"order alternated, 1 thread")
    print(f"{'metric':40s} {'old (per round)':>24s} {'new (per round)':>24s} {'old':>8s} {'new':>8s} {'new/old':>8s}")
    per = lambda xs: " / ".join(f"{x:.3g}" for x in xs)  # noqa: E731
    for r in rows:
        print(f"{r['name']:40s} {per(r['old']):>24s} {per(r['new']):>24s} {r['old_median']:8.4g} "
              f"{r['new_median']:8.4g} {r['ratio']:8.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(old=a.old, rounds=a.rounds, script=script.name, args=args,
                                                metrics=a.metric, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
