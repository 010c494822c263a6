"""bench/tile_sweep.py: the candidate tile reaches the launches it sweeps. `--sass` compiles each candidate for sm_90
(no GPU needed) and must read back, from the compiled kernels, the warps and V blocks of that candidate; a tile of
one warp keeps K inside the warp, so its verify step needs fewer barriers than a tile that splits K over 4 warps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
ts = load_bench("tile_sweep")


def test_sass_sweep_compiles_each_candidate(tmp_path):
    out = tmp_path / "tiles.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "tile_sweep.py"), "--sass", "--candidates", "32x4,8x1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    K = data["shapes"]["K"]
    rows = {row["tile"]: row for row in data["rows"]}
    assert set(rows) == {"32x4", "8x1"}
    for tile, row in rows.items():
        bv, warps = (int(x) for x in tile.split("x"))
        for name in ts.SASS_KERNELS:
            k = row[name]
            # the compiled kernel was launched with this candidate: its warps, and V split in K / BV blocks
            assert k["num_warps"] == warps and k["grid"][2] == -(-K // bv), (tile, name, k["grid"], k["num_warps"])
            assert k["spill_bytes"] == 0 and k["loop_instructions"] > 0, (tile, name)
            assert k["warps_per_sm"] == k["ctas_per_sm"] * warps
            assert k["warp_instructions_per_step"] == k["loop_instructions"] * warps * k["grid"][2]
        assert tile in r.stdout
    # each warp bit of K is an exchange through shared memory per reduction: one warp needs fewer barriers
    assert rows["8x1"]["verify_chain"]["loop_barriers"] < rows["32x4"]["verify_chain"]["loop_barriers"]
    assert rows["8x1"]["exact_fold"]["loop_barriers"] < rows["32x4"]["exact_fold"]["loop_barriers"]


@pytest.mark.parametrize("text", ["", "32", "32x", "ax4", "32x0", "32x4,"])
def test_bad_candidates(text):
    with pytest.raises(ValueError, match="--candidates: expected BVxWARPS"):
        ts.parse_candidates(text)
    assert ts.parse_candidates("32x4,8x1") == [(32, 4), (8, 1)]
