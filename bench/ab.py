"""A/B of a bench script between an older revision and the working tree, in one run.

    python bench/ab.py --old 49fbd9e --rounds 3 --metric 'ratios.*' -- \\
        verify_cost.py --verify chunk --repeats 15 --trees 13,49
    python bench/ab.py --old 49fbd9e --rounds 2 --metric 'drafters.*.speedup' -- \\
        accept_rate.py --model embedded --kinds code --threads 1 --drafters eagle,dspark --max-prompts 10
    python bench/ab.py --old 7d2e787 --rounds 7 --kernels                    # the kernels' CPU references
    python bench/ab.py --old 7d2e787 --kernels -- --heads 4 --head-dim 64    # ... at other shapes

The script is the working tree's (`bench/SCRIPT`, or a path); only the package differs. The old revision is checked
out into a temporary git worktree, and each side imports the package through a folder that maps its top-level
folders onto the `specdec` namespace (as pyproject's package-dir does), ahead of the installed package; both run
outside either checkout, so neither tree's own folders shadow the mapping. Each round runs both sides as separate
processes, in alternating order, one torch thread each; every run writes its JSON (`--json FILE` is appended to the
script's arguments) and the numbers at the `--metric` paths are collected: dotted keys into the JSON, `*` for any one
key (a list's items are keyed 0, 1, ...). A metric path that matches nothing on either side is an error.

`--kernels` compares the torch references of the kernels: the script is bench/kernel_speed.py with `--device cpu
--reps 20` (the arguments after `--` go after those, so `--reps N` there wins), and the metrics are the milliseconds
per call of each op's reference row, named by the op.

The table gives per metric each round's old and new values, their medians, new / old and the spread of each side
(max / min over the rounds), so that a noisy machine shows as such.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import BENCH, ROOT, max_over_min  # noqa: E402
finally:
    sys.path.pop(0)


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
        rows.append(dict(name=k, old=old, new=new, old_median=o, new_median=n, ratio=n / o if o else float("nan"),
                         spread_old=max_over_min(old), spread_new=max_over_min(new)))
    return rows


def kernel_references(doc: dict) -> dict[str, float]:
    """bench/kernel_speed.py's JSON -> {op: ms per call} of its torch reference rows."""
    return {r["op"]: r["ms"] for r in doc["results"] if r["impl"] == "reference"}


def format_rows(rows: list[dict]) -> str:
    per = lambda xs: " / ".join(f"{x:.3g}" for x in xs)  # noqa: E731
    w = max([24] + [len(r["name"]) for r in rows])
    lines = [f"{'metric':{w}s} {'old (per round)':>24s} {'new (per round)':>24s} {'old':>9s} {'new':>9s} "
             f"{'new/old':>8s} {'spread old':>10s} {'spread new':>10s}"]
    for r in rows:
        lines.append(f"{r['name']:{w}s} {per(r['old']):>24s} {per(r['new']):>24s} {r['old_median']:9.4g} "
                     f"{r['new_median']:9.4g} {r['ratio']:8.3f} {r['spread_old']:10.2f} {r['spread_new']:10.2f}")
    return "\n".join(lines)


def script_path(name: str) -> Path:
    """`name` as a file (absolute: the runs start elsewhere), else `bench/name`."""
    p = Path(name)
    return p.resolve() if p.is_file() else BENCH / name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, order alternated")
    p.add_argument("--metric", action="append", default=None,
                   help="dotted path into the script's JSON, * for any one key (repeatable)")
    p.add_argument("--kernels", action="store_true",
                   help="bench/kernel_speed.py's torch references on the CPU, ms per op (no script or --metric)")
    p.add_argument("--json", default=None, help="write the collected values here")
    p.add_argument("script", nargs="?", help="bench script (a name under bench/ or a path), then its arguments")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds: expected >= 1, got {a.rounds}")
    unfence = lambda xs: xs[1:] if xs[:1] == ["--"] else xs  # noqa: E731
    if a.kernels:  # everything after the options is kernel_speed.py's
        if a.metric:
            p.error("--metric: not with --kernels (its metrics are the references' ms per op)")
        script, collect = BENCH / "kernel_speed.py", kernel_references
        args = ["--device", "cpu", "--reps", "20", *unfence(a.args if a.script is None else [a.script, *a.args])]
        what = "the kernels' torch references (ms per call)"
    else:
        if not a.metric:
            p.error("--metric: at least one (or --kernels)")
        if a.script is None:
            p.error("script: a bench script to run (or --kernels)")
        script, args = script_path(a.script), unfence(a.args)
        if not script.is_file():
            p.error(f"script: no file {a.script} (nor bench/{a.script})")
        collect = lambda doc: pick(flatten(doc), a.metric)  # noqa: E731
        what = "--metric " + ", ".join(a.metric)
    with sides(a.old) as paths, tempfile.TemporaryDirectory() as tmp:
        def run(side: str) -> dict[str, float]:
            out = Path(tmp) / f"{side}.json"
            run_side(paths[side], [str(script), *args, "--json", str(out)])
            return collect(json.loads(out.read_text()))
        vals = alternate(a.rounds, run)
    rows = compare(vals)
    if not rows:
        raise SystemExit(f"{what}: matched nothing in both sides' JSON")
    print(f"# bench/ab.py: {script.name} {' '.join(args)}; {what}; old = {a.old}, new = working tree; "
          f"{a.rounds} rounds, order alternated, 1 thread, medians")
    print(format_rows(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(old=a.old, rounds=a.rounds, script=script.name, args=args,
                                                metrics=a.metric, kernels=a.kernels, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
