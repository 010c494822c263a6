"""The GPU check in one process, part by part, each within its budget; one JSON at the end.

    python bench/gpu_check.py --out DIR                 # what bench/gpu_check.sh runs after installing
    python bench/gpu_check.py --out DIR --parts tests,kernels --budget-scale 0.5

Parts, in order (a budget in seconds each; a part that runs out prints what it has and the next one starts):
  tests     every test file that runs a Triton kernel (tests/triton_files.py lists them), compiled on CUDA
            (TRITON_INTERPRET=0), in a pytest subprocess stopped by SIGINT at its budget (the report keeps
            what ran); `fold_bitwise`: every `test_fold_equals_single_steps[triton-*]` ran and passed (None when one
            did not run, False when one failed)
  kernels   bench/kernel_speed.py at Kimi-Linear shapes (Triton and fla, no torch references); `ms` is the
            device's time of a call (replayed from a CUDA graph, as a graphed round runs it), `call_ms` one eager
            call with its host work; the goals read `ms`
  tiles     bench/tile_sweep.py: the state tile candidates of verify, fold and rebuild (the bits do not depend on
            the tile, the speed does); the fastest per kernel as DIR/state_tiles.json (copy its entry into
            kernels/state_tiles.json to ship it), and the kernel goals with each kernel at its picked tile
  graphs    bench/graph_check.py: ngram, mtp, dspark, eagle and plain decoding, eager vs CUDA-graph rounds token
            for token, speedups against plain decoding with graphs and against transformers' `generate`
  realistic bench/realistic.py: a random ~1.4B Kimi-Linear, step_1 / chain_8 / tree_49 and one graphed round
            per drafter, projected speedups (labelled as projected)
  accept    bench/accept_rate.py on the embedded model, every drafter, CUDA graphs on, against both baselines

The benches run in this process (one import of torch and transformers, one autotune of fla's kernels per shape;
TRITON_CACHE_AUTOTUNING keeps those across processes too). Autotune results persist across machines as files: the
ones shipped for this GPU (bench/autotune/<GPU>/, triton's cache layout `<key hash>/<kernel>.autotune.json`) are
copied into triton's cache folder first, so a kernel whose key, configs, source and triton build match is not tuned
again (the key hash covers all of them; anything else is tuned as before); after each part every result in the
cache goes to DIR/autotune/<GPU>/ (copy it to bench/autotune/ to ship it), and the JSON's `autotune` says how many
were shipped and which kernels were tuned in this run. Every row is printed as soon as it is measured. The
JSON (`DIR/gpu_check.json`) holds the keys below, plus each part's own JSON beside it:
  device, date, commit, tests {passed, failed, skipped}, fold_bitwise,
  kernels {op: {ms, frac_copy_bw, call_ms, timing}}, kernel_goals {goal: {value, target, met}},
  graphs {drafter: {identical, eager_fallbacks, speedup_vs_plain_graph, speedup_vs_transformers}},
  realistic {params, step_1_ms, ratios, projected_speedup}, accept, budgets {part: {budget_s, used_s}},
  autotune {shipped, tuned_now}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import BENCH, ROOT, load_script  # noqa: E402
finally:
    sys.path.pop(0)

# seconds per part: 375 in all, with ~30 s of setup within 7 minutes (kernels: ~13 ops, each an eager and a
# graph-replay timing, plus their first compiles at Kimi shapes)
BUDGETS = {"tests": 100, "kernels": 20, "tiles": 30, "graphs": 105, "realistic": 80, "accept": 40}
# The kernel goals at Kimi shapes: (op, measure, target, at most / at least)
GOALS = [("verify_chain_vs_fla", "verify chain ms / fla fused_recurrent_kda ms", 1.0, "max"),
         *[(f"exact_fold_n{n}", f"exact fold n={n}, share of copy bandwidth", 0.8, "min") for n in (1, 2, 4, 8)],
         ("fast_rebuild", "fast rebuild, share of copy bandwidth", 0.6, "min"),
         ("short_conv_verify", "short conv verify (windows kept), share of copy bandwidth", 0.4, "min"),
         ("short_conv_verify_records", "short conv verify (records kept), share of copy bandwidth", 0.4, "min")]


AUTOTUNE = BENCH / "autotune"  # shipped autotune results: <GPU>/<key hash>/<kernel>.autotune.json


def gpu_folder(name: str) -> str:
    """A device name as a folder name (`NVIDIA H200` -> `NVIDIA_H200`)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def triton_cache_dir() -> Path:
    """The folder triton caches compiled kernels and autotune results in (TRITON_CACHE_DIR, else its default)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path(os.environ.get("TRITON_HOME") or Path.home()) /
                ".triton" / "cache")


def autotune_files(root: Path) -> set[str]:
    """The autotune results under `root`, as `<key hash>/<kernel>.autotune.json` paths relative to it."""
    return {p.relative_to(root).as_posix() for p in root.glob("*/*.autotune.json")} if root.is_dir() else set()


def seed_autotune(src: Path, cache: Path) -> int:
    """Copy the results under `src` into triton's cache folder `cache`, keeping any file already there; -> how many
    were copied."""
    n = 0
    for rel in sorted(autotune_files(src)):
        dst = cache / rel
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dst)
            n += 1
    return n


def collect_autotune(cache: Path, dst: Path, before: set[str]) -> list[str]:
    """Copy every autotune result of `cache` to `dst`; -> the kernels tuned since `before` (files new in `cache`)."""
    now = autotune_files(cache)
    for rel in sorted(now):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cache / rel, dst / rel)
    return sorted(Path(rel).name.removesuffix(".autotune.json") for rel in now - before)


class _Expired(Exception):
    pass


def _run_main(name: str, argv: list[str], hard_s: float) -> int | str:
    """`bench/<name>.py`'s main(argv), stopped by SIGALRM after `hard_s` (its own `--budget-s` comes first)."""
    def expire(*_):
        raise _Expired(f"{name}: hard stop after {hard_s:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(hard_s)))
    try:
        return load_script(name).main(argv)
    except _Expired as e:
        print(f"# {e}", flush=True)
        return "expired"
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 - one broken part must not hide the others
        traceback.print_exc()
        return f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def part_tests(out: Path, budget: float) -> dict:
    files = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_files.py")], capture_output=True, text=True,
                           check=True).stdout.split()
    # the compiled fold property first: its families compile a kernel per drawn example, the longest tests here
    files.sort(key=lambda f: Path(f).name != "test_fold_exactness.py")
    print(f"# {len(files)} test files run Triton kernels: {' '.join(Path(f).name for f in files)}", flush=True)
    xml = out / "pytest.xml"
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.pop("SPECDEC_FORCE_TRITON", None)
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))  # compiles are CPU work; the GPU is shared
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-rfE", "-p", "no:cacheprovider", "-n", str(workers),
           f"--junitxml={xml}"]
    proc = subprocess.Popen(cmd, cwd="/tmp", env=env)
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        print(f"# tests: budget of {budget:.0f} s spent, stopping (SIGINT keeps the report of what ran)", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    counts, fold = read_report(xml)
    bitwise, missing = fold_bitwise(fold, fold_families())
    print(f"# fold == single verify steps, compiled: {fold or 'not run'}; families not run: {missing or 'none'}",
          flush=True)
    return {"tests": {**counts, "rc": rc, "files": [Path(f).name for f in files]}, "fold_bitwise": bitwise,
            "fold_tests": fold}


def read_report(xml: Path) -> tuple[dict, dict]:
    """`({passed, failed, skipped}, {test id: state})` of a junit XML, the second for the compiled fold property
    (`test_fold_equals_single_steps[triton-*]`); empty counts when there is no report."""
    counts, fold = {"passed": 0, "failed": 0, "skipped": 0}, {}
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"# tests: no report ({e})", flush=True)
        return counts, fold
    for tc in root.iter("testcase"):
        state = ("failed" if tc.find("failure") is not None or tc.find("error") is not None else
                 "skipped" if tc.find("skipped") is not None else "passed")
        counts[state] += 1
        if (tc.get("name") or "").startswith("test_fold_equals_single_steps[triton"):
            fold[tc.get("name")] = state
    return counts, fold


def fold_bitwise(fold: dict, families: list[str]) -> tuple[bool | None, list[str]]:
    """True when the compiled fold property passed for every family, False when any failed or was skipped (the
    kernels did not run), None when a family did not run (the budget); and the families not run."""
    missing = [f for f in families if f"test_fold_equals_single_steps[triton-{f}]" not in fold]
    if any(s != "passed" for s in fold.values()):
        return False, missing
    return (None if missing else True), missing


def fold_families() -> list[str]:
    """The step families tests/test_fold_exactness.py draws (its FAMILIES), read without importing the tests."""
    import re

    text = (ROOT / "tests" / "test_fold_exactness.py").read_text()
    block = text[text.index("FAMILIES = {"):]
    return re.findall(r'"([\w-]+)": dict\(rule=', block[:block.index("}\n")])


def part_kernels(out: Path, budget: float) -> dict:
    path = out / "kernels.json"
    rc = _run_main("kernel_speed", ["--device", "cuda", "--no-reference", "--budget-s", str(budget * 0.8),
                                    "--json", str(path)], budget + 30)
    if not path.exists():
        return {"kernels": {}, "kernel_goals": {}, "kernels_rc": rc}
    rows = json.loads(path.read_text())["results"]
    # ms: the device's time per call (a graph replay); call_ms: one eager call, host work included
    k = {r["op"]: {key: r.get(key) for key in ("ms", "frac_copy_bw", "call_ms", "timing")}
         for r in rows if r["impl"] in ("triton", "fla")}
    return {"kernels": k, "kernel_goals": kernel_goals(k), "kernels_rc": rc}


def kernel_goals(k: dict, label: str = "") -> dict:
    """GOALS judged on `k` (`{op: {ms, frac_copy_bw}}`), each printed as met, not met or not measured."""
    goals = {}
    for name, what, target, kind in GOALS:
        if name == "verify_chain_vs_fla":
            a, b = k.get("verify_replay_eager"), k.get("fla_fused_recurrent_kda")
            value = a["ms"] / b["ms"] if a and b else None
        else:
            value = k.get(name, {}).get("frac_copy_bw")
        met = None if value is None else (value <= target if kind == "max" else value >= target)
        goals[name] = {"what": what, "value": value, "target": target, "met": met}
        print(f"# goal{label} {what}: {'-' if value is None else f'{value:.3f}'} "
              f"({'<=' if kind == 'max' else '>='} {target}): "
              f"{'not measured' if met is None else 'met' if met else 'NOT met'}", flush=True)
    return goals


def part_tiles(out: Path, budget: float) -> dict:
    """bench/tile_sweep.py; its `state_tiles` entry goes to DIR/state_tiles.json (kernels/state_tiles.json's form),
    and the kernel goals are judged again with each kernel at the tile picked for it (fla's time from the kernels
    part)."""
    path = out / "tiles.json"
    rc = _run_main("tile_sweep", ["--device", "cuda", "--budget-s", str(budget * 0.7), "--json", str(path)],
                   budget + 20)
    data = json.loads(path.read_text()) if path.exists() else {}
    if data.get("state_tiles"):
        (out / "state_tiles.json").write_text(json.dumps(data["state_tiles"], indent=1))
    picked = next(iter((data.get("state_tiles") or {}).get("devices", {}).values()), {})
    best = {}
    for kernel, ops in load_script("tile_sweep").KERNEL_OPS.items():  # each op at the tile its kernel ships with
        row = next((r for r in data.get("rows", []) if r["tile"] == picked.get(kernel)), None)
        best.update({op: {**row[op], "tile": row["tile"]} for op in ops if row and "ms" in row.get(op, {})})
    kernels = json.loads((out / "kernels.json").read_text())["results"] if (out / "kernels.json").exists() else []
    best.update({r["op"]: {"ms": r["ms"]} for r in kernels if r["impl"] == "fla"})
    return {"tiles": data.get("fastest"), "state_tiles": data.get("state_tiles"),
            "kernel_goals_best_tile": kernel_goals(best, " (picked tiles)") if best else {}, "tiles_rc": rc}


def part_graphs(out: Path, budget: float) -> dict:
    """graph_check's `summary[drafter][B]`; per drafter: identical and eager fallbacks over every batch size,
    the speedups at batch 1 (each batch size under `by_batch`)."""
    path = out / "graphs.json"
    rc = _run_main("graph_check", ["--device", "cuda", "--repeats", "2", "--max-new-tokens", "32",
                                   "--budget-s", str(budget * 0.85), "--json", str(path)], budget + 30)
    data = json.loads(path.read_text()) if path.exists() else {}
    graphs = {}
    for d, by_b in data.get("summary", {}).items():
        rows = [v for v in by_b.values() if isinstance(v, dict)]
        first = by_b.get("1") or (rows[0] if rows else {})
        graphs[d] = {"identical": bool(rows) and all(v.get("identical") for v in rows),
                     "eager_fallbacks": sum(int(v.get("eager_fallbacks") or 0) for v in rows),
                     "speedup_vs_plain_graph": first.get("speedup_vs_plain_graph"),
                     "speedup_vs_transformers": first.get("speedup_vs_transformers"), "by_batch": by_b}
    return {"graphs": graphs, "graphs_not_run": data.get("not_run"), "graphs_rc": rc}


def part_realistic(out: Path, budget: float) -> dict:
    path = out / "realistic.json"
    # the likely best projection first (tau on the embedded model over the verify's cost: dspark's and mtp's chains
    # of 8 at 1.24x a step before eagle's 49-node tree at 2.20x, RESULTS), so a short budget still measures it
    rc = _run_main("realistic", ["--device", "cuda", "--repeats", "10", "--round-repeats", "2", "--new-tokens", "24",
                                 "--drafters", "dspark,mtp,eagle,ngram", "--budget-s", str(budget * 0.85),
                                 "--json", str(path)], budget + 30)
    data = json.loads(path.read_text()) if path.exists() else {}
    keep = ("params", "dtype", "step_1_ms", "chain_8_ms", "tree_49_ms", "ratios", "round_ms", "tau", "tau_source",
            "projected_speedup", "plain_round_ms", "projected_speedup_vs_plain_round")
    return {"realistic": {k: data[k] for k in keep if k in data}, "realistic_rc": rc}


def part_accept(out: Path, budget: float) -> dict:
    path = out / "accept.json"
    rc = _run_main("accept_rate", ["--model", "embedded", "--device", "cuda", "--kinds", "code", "--max-prompts", "3",
                                   "--max-new-tokens", "32", "--repeats", "3", "--cuda-graph",
                                   "--budget-s", str(budget * 0.85), "--json", str(path)], budget + 30)
    data = json.loads(path.read_text()) if path.exists() else {}
    keep = ("tau", "tokens_per_s_spec", "tokens_per_s_plain_graph", "speedup_vs_plain_graph",
            "tokens_per_s_transformers", "speedup_vs_transformers", "identical", "identical_transformers", "skipped")
    return {"accept": {d: {k: v.get(k) for k in keep} for d, v in data.get("drafters", {}).items()},
            "accept_rc": rc}


PARTS = {"tests": part_tests, "kernels": part_kernels, "tiles": part_tiles, "graphs": part_graphs,
         "realistic": part_realistic, "accept": part_accept}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/specdec_gpu_check"))
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's budget")
    p.add_argument("--commit", default=os.environ.get("SPECDEC_COMMIT", "unknown"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    result = {"device": dev, "date": datetime.date.today().isoformat(), "commit": a.commit,
              "torch": torch.__version__, "triton": triton.__version__, "budgets": {}}
    try:
        import fla

        result["fla"] = fla.__version__
    except Exception as e:  # noqa: BLE001
        result["fla"] = f"unavailable: {type(e).__name__}"
    print(f"# gpu_check: {dev}, torch {torch.__version__}, triton {triton.__version__}, fla {result['fla']}, "
          f"commit {a.commit}", flush=True)
    cache, folder = triton_cache_dir(), gpu_folder(dev)
    shipped = seed_autotune(AUTOTUNE / folder, cache) if torch.cuda.is_available() else 0
    before = autotune_files(cache)
    result["autotune"] = {"shipped": shipped, "tuned_now": []}
    print(f"# autotune results shipped for {folder}: {shipped} copied into {cache}", flush=True)
    t_all = time.perf_counter()
    for name in a.parts.split(","):
        budget = BUDGETS[name] * a.budget_scale
        print(f"\n== {name} (budget {budget:.0f} s) ==", flush=True)
        t0 = time.perf_counter()
        try:
            result.update(PARTS[name](out, budget))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"
        used = time.perf_counter() - t0
        result["budgets"][name] = {"budget_s": budget, "used_s": round(used, 1)}
        result["autotune"]["tuned_now"] = collect_autotune(cache, out / "autotune" / folder, before)
        print(f"# {name}: {used:.0f} s of {budget:.0f}; kernels autotuned so far: "
              f"{', '.join(result['autotune']['tuned_now']) or 'none'}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    t = result.get("tests", {})
    print(f"\n# summary: tests {t.get('passed')} passed / {t.get('failed')} failed / {t.get('skipped')} skipped, "
          f"fold bitwise {result.get('fold_bitwise')}; graphs "
          + ", ".join(f"{d} identical={g['identical']} eager={g['eager_fallbacks']}"
                      for d, g in result.get("graphs", {}).items())
          + f"; realistic projected {result.get('realistic', {}).get('projected_speedup')}; "
          f"{result['total_s']:.0f} s in all", flush=True)
    ok = t.get("failed", 1) == 0 and result.get("fold_bitwise") is not False and all(
        g.get("identical") for g in result.get("graphs", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
