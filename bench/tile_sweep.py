"""State tiles of the Triton kernels, timed: `(BV, num_warps)` candidates for verify, exact fold and fast rebuild.

    python bench/tile_sweep.py --device cuda --json tiles.json            # Kimi-Linear shapes (kernel_speed's)
    TRITON_INTERPRET=1 python bench/tile_sweep.py --device cpu            # tiny shapes, the interpreter (a smoke run)

Every kernel that steps a state reduces over K with `triton_utils.pair_sum`, whose bits do not depend on the tile
(bench/step_check.py checks the compiled code), so the tile is free to be the fastest one per device. Its cost is
not what a CPU can see: a tile of 4 warps splits K over the warps, and each warp bit of K is one exchange through
shared memory per reduction (two to four reductions a step), while a narrower tile runs more programs that each
normalize the same keys. For each candidate `(BV, num_warps)` (BK is always next_pow2(K)), the kernels'
`state_blocks` is replaced in this process and each op is timed as bench/kernel_speed.py times it (same inputs,
bytes and copy bandwidth); the table gives ms and the share of copy bandwidth, best per op marked.
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
    from common import load_script  # noqa: E402
finally:
    sys.path.pop(0)

CANDIDATES = [(32, 4), (16, 2), (8, 1), (32, 2), (64, 4)]
OPS = ["verify_replay_eager", "verify_replay_lazy", "exact_fold_n1", "exact_fold_n8", "fast_rebuild"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--candidates", default=",".join(f"{bv}x{w}" for bv, w in CANDIDATES),
                   help="BVxWARPS, comma separated")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--budget-s", type=float, default=None, help="start no new candidate after this many seconds")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    ks = load_script("kernel_speed")  # its cases, byte counts, copy bandwidth and timer
    import triton

    from specdec.kernels.fold import triton as tf
    from specdec.kernels.rebuild import triton as tr
    from specdec.kernels.verify import triton as tv

    defaults = ks.CUDA_DEFAULTS if a.device == "cuda" else ks.CPU_DEFAULTS
    args = argparse.Namespace(**defaults, dtype="bf16" if a.device == "cuda" else "fp32")
    s = ks.Shapes(args)
    s.ops, s.extra = set(a.ops.split(",")), set()
    nbytes = ks.byte_counts(s)
    bw = ks.copy_bandwidth(a.device)
    original = tv.state_blocks
    print(f"# device={a.device} H={s.H} K=V={s.K} D={s.D} B={s.B} layers={s.Lyr} act={args.dtype} "
          f"copy bandwidth {bw:.1f} GB/s; torch threads {torch.get_num_threads()}", flush=True)
    print(f"{'tile':>8} " + " ".join(f"{op:>22s}" for op in sorted(s.ops, key=OPS.index)), flush=True)
    rows, t0 = [], time.perf_counter()
    try:
        for cand in a.candidates.split(","):
            if a.budget_s is not None and time.perf_counter() - t0 > a.budget_s:
                print(f"# budget of {a.budget_s:.0f} s spent: {cand} and later not measured", flush=True)
                break
            bv, w = (int(x) for x in cand.split("x"))
            tile = lambda K, V, bv=bv, w=w: (triton.next_power_of_2(K), min(bv, triton.next_power_of_2(V)), w)  # noqa: E731
            tv.state_blocks = tf.state_blocks = tr.state_blocks = tile
            row = {"tile": cand}
            for op, _, fn in ks.build_cases(s, a.device, ["triton"]):
                try:
                    ms = ks.timed(fn, a.device, warmup=3, reps=20 if a.device == "cuda" else 2, budget_s=2.0)
                    row[op] = {"ms": ms, "frac_copy_bw": nbytes[op] / (ms * 1e-3) / ks.GB / bw}
                except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a result too
                    row[op] = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
            cells = [f"{row[op]['ms']:9.4f} ms {row[op]['frac_copy_bw']:6.1%}" if "ms" in row.get(op, {}) else
                     f"{'failed':>22s}" for op in sorted(s.ops, key=OPS.index)]
            print(f"{cand:>8} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    finally:
        tv.state_blocks = tf.state_blocks = tr.state_blocks = original
    best = {op: min((r for r in rows if "ms" in r.get(op, {})), key=lambda r: r[op]["ms"])["tile"]
            for op in s.ops if any("ms" in r.get(op, {}) for r in rows)}
    print("# fastest: " + ", ".join(f"{op} {t}" for op, t in sorted(best.items())), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "copy_bandwidth_gbps": bw, "rows": rows,
                                            "fastest": best}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
