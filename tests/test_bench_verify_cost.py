"""`bench/verify_cost.py` on a tiny saved Kimi-Linear at tiny settings: run as a user would, JSON shape, trees."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "verify_cost.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_verify_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tree_parents_are_valid_eagle_like_trees():
    bench = load_script()
    for n in (1, 2, 13, 25, 49):
        p = bench.tree_parents(n, 8)
        assert len(p) == n and p[0] == -1
        assert all(0 <= p[i] < i for i in range(1, n))  # topological, one root
    assert bench.tree_parents(13, 8)[:9] == [-1] + [0] * 8  # depth 1: the anchor's topk children
    assert bench.depth(bench.tree_parents(49, 8), 49) == 7  # EAGLE's default: 48 drafts, depth 7
    with pytest.raises(ValueError):
        bench.tree_parents(0)


def test_json_has_the_ratios(tmp_path):
    save_tiny(tmp_path / "model", "kimi_linear")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, SCRIPT, "--model", tmp_path / "model", "--repeats", 2, "--warmup", 1,
            "--prompt-tokens", 32, "--json", out]
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "torch threads 1" in proc.stdout
    for name in ("step_1", "chain_8", "tree_13", "tree_25", "tree_49"):
        assert name in proc.stdout
    res = json.loads(out.read_text())
    assert "verify: chunk" in proc.stdout and "verify: per-token" in proc.stdout  # both, in the same run
    assert res["verify"] == "chunk" and set(res["impls"]) == {"chunk", "per-token"}
    assert res["ratios"] == res["impls"]["chunk"]["ratios"]
    assert set(res["impls"]["per-token"]["ratios"]) == {"chain_8", "tree_13", "tree_25", "tree_49"}
    assert set(res["ratios"]) == {"chain_8", "tree_13", "tree_25", "tree_49"}
    assert all(r > 0 for r in res["ratios"].values())
    assert res["kinds"]["step_1"]["ratio"] == pytest.approx(1.0)
    assert res["settings"]["threads"] == 1 and res["machine"]["threads"] == 1
    assert [res["kinds"][f"tree_{n}"]["tokens"] for n in (13, 25, 49)] == [13, 25, 49]
    assert all(len(k["times_s"]) == 2 for k in res["kinds"].values())
    assert isinstance(res["noisy"], bool)


def test_breakdown_and_bad_verify_name(tmp_path):
    save_tiny(tmp_path / "model", "kimi_linear")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base = [sys.executable, SCRIPT, "--model", tmp_path / "model", "--repeats", 1, "--warmup", 0, "--prompt-tokens", 16,
            "--trees", 13]
    proc = subprocess.run(list(map(str, base + ["--verify", "chunk", "--breakdown", "--json", out])),
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    bd = json.loads(out.read_text())["impls"]["chunk"]["breakdown_ms"]
    assert set(bd) == {"step_1", "chain_8", "tree_13"}
    for parts in bd.values():
        assert parts["total"] > 0 and parts["delta-rule verify"] > 0
        assert parts["delta-rule verify"] <= parts["linear-attn mixers (all)"] <= parts["total"]
        assert 0 < parts["model matmuls (F.linear)"] < parts["total"]
    bad = subprocess.run(list(map(str, base + ["--verify", "chunk,fast"])), capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode != 0 and "--verify" in bad.stderr
