"""State tiles of the Triton kernels, timed: `(BV, num_warps)` candidates for verify, exact fold and fast rebuild.

    python bench/tile_sweep.py --device cuda --json tiles.json            # Kimi-Linear shapes (kernel_speed's)
    TRITON_INTERPRET=1 python bench/tile_sweep.py --device cpu            # tiny shapes, the interpreter (a smoke run)

Every kernel that steps a state reduces over K with `triton_utils.pair_sum`, whose bits do not depend on the tile
(bench/step_check.py `--tiles` checks the compiled code), so each kernel's tile is free to be the fastest one per
device. Its cost is not what a CPU can see: a tile of 4 warps splits K over the warps, and each warp bit of K is
one exchange through shared memory per reduction (two to four reductions a step), while a narrower tile runs more
programs that each normalize the same keys. For each candidate `(BV, num_warps)` (BK is always next_pow2(K)) every
state kernel is launched with it (`SPECDEC_STATE_TILE`) and each op is timed as bench/kernel_speed.py times it
(same inputs, bytes and copy bandwidth; on CUDA the device's time of a graph replay, kernel_speed's `ms`); the table
gives ms and the share of copy bandwidth, and the fastest tile per op. The JSON's `state_tiles` is the entry for
kernels/state_tiles.json: per kernel the tile of least time (verify: the eager replay verify; fold: its times at
n = 1, 2, 4, 8 summed; rebuild: the fast rebuild), keyed by the device's name; the kernels take it from there.

    python bench/tile_sweep.py --sass --json bench/results/tile_sass.json   # no GPU: the compiled code per tile

`--sass` times nothing: it compiles each candidate for sm_90 through bench/sass_report.py (no GPU needed) and gives
per kernel the registers, spills, resident CTAs and warps per SM, and per step (per record for fold and rebuild) the
loop's instructions, barriers and shuffles, and the warp instructions one (request, head) issues per step (loop
instructions x warps x V blocks). They are proxies for what the sweep on a GPU decides: barriers stall a step's
warps, resident warps hide latency, issued instructions bound the throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import load_script, state_tile  # noqa: E402
finally:
    sys.path.pop(0)

# the fewest barriers per step first (bench/RESULTS.md, the per-tile compiled code), so a short budget measures them
CANDIDATES = [(8, 1), (16, 2), (32, 4), (32, 2), (64, 4)]
SASS_KERNELS = ["verify_chain", "verify_tree", "exact_fold", "fast_rebuild"]  # bench/sass_report.py's names


# the ops the sweep times of each state kernel, and those whose time picks its tile (verify: the eager replay,
# Kimi-Linear's default; the fold: the sum over its record counts)
KERNEL_OPS = {"verify": ["verify_replay_eager", "verify_replay_lazy"],
              "fold": ["exact_fold_n1", "exact_fold_n2", "exact_fold_n4", "exact_fold_n8"], "rebuild": ["fast_rebuild"]}
PICK = {**KERNEL_OPS, "verify": ["verify_replay_eager"]}
OPS = [op for ops in KERNEL_OPS.values() for op in ops]


def pick_tiles(rows: list[dict]) -> dict[str, str]:
    """`{kernel: tile}` (kernels/state_tiles.json's form): per kernel the tile whose PICK ops took the least time
    in all, among the tiles that measured every one of them."""
    out = {}
    for kernel, ops in PICK.items():
        done = [r for r in rows if all("ms" in r.get(op, {}) for op in ops)]
        if done:
            out[kernel] = min(done, key=lambda r: sum(r[op]["ms"] for op in ops))["tile"]
    return out


def parse_candidates(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in c.split("x")) for c in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(c) != 2 or c[0] < 1 or c[1] < 1 for c in out):
        raise ValueError(f"--candidates: expected BVxWARPS[,BVxWARPS...] (e.g. 32x4,8x1), got {text!r}")
    return out


def sass_sweep(candidates: list[tuple[int, int]], shapes: dict) -> list[dict]:
    """Per candidate, bench/sass_report.py's summary of each of SASS_KERNELS compiled with that tile, plus the
    resident warps per SM and the warp instructions per (request, head) and step; rows printed as compiled."""
    sr = load_script("sass_report")  # sets TRITON_INTERPRET=0: compiles for sm_90, runs nothing
    print(f"# sm_90 SASS per state tile (no GPU): H={shapes['H']} K=V={shapes['K']} D={shapes['D']} "
          f"requests={shapes['B']} layers={shapes['Lyr']} bf16 activations, fp32 state", flush=True)
    cols = ("regs", "spill", "CTA/SM", "warps/SM", "loop ins", "bar", "shfl", "warp ins/step")
    print(f"{'tile':>6} {'kernel':14s} " + " ".join(f"{c:>8s}" for c in cols), flush=True)
    rows = []
    for bv, w in candidates:
        with state_tile(f"{bv}x{w}"):
            r = sr.report(shapes["H"], shapes["K"], shapes["D"], shapes["B"], shapes["Lyr"], 4, only=set(SASS_KERNELS))
        row = {"tile": f"{bv}x{w}"}
        for name in SASS_KERNELS:
            k = dict(r["kernels"][name])
            k["warps_per_sm"] = k["ctas_per_sm"] * k["num_warps"]
            k["warp_instructions_per_step"] = k["loop_instructions"] * k["num_warps"] * k["grid"][2]
            row[name] = k
            vals = (k["regs"], k["spill_bytes"], k["ctas_per_sm"], k["warps_per_sm"], k["loop_instructions"],
                    k["loop_barriers"], k["loop_shuffles"], k["warp_instructions_per_step"])
            print(f"{row['tile']:>6} {name:14s} " + " ".join(f"{v:8d}" for v in vals), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--candidates", default=",".join(f"{bv}x{w}" for bv, w in CANDIDATES),
                   help="BVxWARPS, comma separated")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--budget-s", type=float, default=None, help="start no new candidate after this many seconds")
    p.add_argument("--sass", action="store_true",
                   help="no timing: each candidate's compiled code for sm_90 (bench/sass_report.py; no GPU needed)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        candidates = parse_candidates(a.candidates)
    except ValueError as e:
        p.error(str(e))
    ks = load_script("kernel_speed")  # its shapes, cases, byte counts, copy bandwidth and timers
    if a.sass:
        d = ks.CUDA_DEFAULTS
        shapes = dict(H=d["heads"], K=d["head_dim"], D=d["draft_tokens"], B=d["requests"], Lyr=d["layers"])
        rows = sass_sweep(candidates, shapes)
        if a.json:
            Path(a.json).write_text(json.dumps({"device": "none (sm_90 compile only)", "shapes": shapes,
                                                "rows": rows}, indent=1))
        return 0

    defaults = ks.CUDA_DEFAULTS if a.device == "cuda" else ks.CPU_DEFAULTS
    args = argparse.Namespace(**defaults, dtype="bf16" if a.device == "cuda" else "fp32")
    s = ks.Shapes(args)
    s.ops, s.extra = set(a.ops.split(",")), set()
    nbytes = ks.byte_counts(s)
    bw = ks.copy_bandwidth(a.device)
    print(f"# device={a.device} H={s.H} K=V={s.K} D={s.D} B={s.B} layers={s.Lyr} act={args.dtype} "
          f"copy bandwidth {bw:.1f} GB/s; torch threads {torch.get_num_threads()}", flush=True)
    print(f"{'tile':>8} " + " ".join(f"{op:>22s}" for op in sorted(s.ops, key=OPS.index)), flush=True)
    rows, t0 = [], time.perf_counter()
    for bv, w in candidates:
        cand = f"{bv}x{w}"
        if a.budget_s is not None and time.perf_counter() - t0 > a.budget_s:
            print(f"# budget of {a.budget_s:.0f} s spent: {cand} and later not measured", flush=True)
            break
        row = {"tile": cand}
        with state_tile(f"{bv}x{w}"):
            for op, _, fn in ks.build_cases(s, a.device, ["triton"]):
                try:  # kernel_speed's `ms`: on CUDA the device's time of a graph replay
                    ms = ks.measure(fn, a.device, slow=a.device == "cpu", reps=2 if a.device == "cpu" else 10)[0]
                    row[op] = {"ms": ms, "frac_copy_bw": nbytes[op] / (ms * 1e-3) / ks.GB / bw}
                except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a result too
                    row[op] = {"error": f"{type(e).__name__}: {e}"[:200]}
        rows.append(row)
        cells = [f"{row[op]['ms']:9.4f} ms {row[op]['frac_copy_bw']:6.1%}" if "ms" in row.get(op, {}) else
                 f"{'failed':>22s}" for op in sorted(s.ops, key=OPS.index)]
        print(f"{cand:>8} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    best = {op: min((r for r in rows if "ms" in r.get(op, {})), key=lambda r: r[op]["ms"])["tile"]
            for op in s.ops if any("ms" in r.get(op, {}) for r in rows)}
    print("# fastest: " + ", ".join(f"{op} {t}" for op, t in sorted(best.items())), flush=True)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    tiles = {"devices": {name: pick_tiles(rows)}}
    print(f"# kernels/state_tiles.json entry: {json.dumps(tiles['devices'])}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "device_name": name, "copy_bandwidth_gbps": bw,
                                            "rows": rows, "fastest": best, "state_tiles": tiles}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
