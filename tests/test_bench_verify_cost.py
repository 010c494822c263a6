"""`bench/verify_cost.py` on a tiny saved Kimi-Linear at tiny settings: run as a user would, JSON shape, trees."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_scripts import load_bench
from tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "verify_cost.py"


def test_tree_parents_are_valid_eagle_like_trees():
    bench = load_bench("verify_cost")
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
    floor = res["matmul_floor"]
    assert set(floor["floor_ratios"]) == set(res["ratios"]) and floor["kinds"]["step_1"]["floor"] == pytest.approx(1.0)
    assert "matmul floor" in proc.stdout


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
        # the tiny model's last layer is MLA, which the runner runs in latent form: timed all the same
        assert 0 < parts["attention layers"] < parts["total"]
        assert 0 < parts["model matmuls (nn.Linear)"] < parts["total"]
    bad = subprocess.run(list(map(str, base + ["--verify", "chunk,fast"])), capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode != 0 and "--verify" in bad.stderr
    bad = subprocess.run(list(map(str, base + ["--cpu-linear", "auto,mkl"])), capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode != 0 and "--cpu-linear" in bad.stderr


def test_linear_backends_in_one_run(tmp_path):
    """`--cpu-linear onednn,aten`: both nn.Linear backends timed in the same run, as separate cases."""
    save_tiny(tmp_path / "model", "kimi_linear")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, SCRIPT, "--model", tmp_path / "model", "--repeats", 1, "--warmup", 0, "--prompt-tokens",
            16, "--trees", 13, "--verify", "chunk", "--cpu-linear", "onednn,aten", "--json", out]
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res["impls"]) == {"chunk / onednn linear", "chunk / aten linear"}
    assert res["cpu_linear"] == "onednn" and res["settings"]["cpu_linear"] == ["onednn", "aten"]
    assert res["ratios"] == res["impls"]["chunk / onednn linear"]["ratios"]
    assert "verify: chunk / aten linear" in proc.stdout


def test_matmul_floor_records_every_linear_of_a_forward():
    """`linear_calls` sees exactly the model's nn.Linear calls of one forward (checked against the `F.linear` calls
    a TorchFunctionMode sees: same weights, same order, T rows each), leaves the committed state as it was, and the
    floor of step_1 is 1."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from specdec.runner import HybridRunner
    from tiny_models import tiny_model

    class Linears(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear:
                seen.append((args[1], args[0].shape[:-1].numel()))
            return func(*args, **(kwargs or {}))

    bench = load_bench("verify_cost")
    model = tiny_model("qwen3_5", dtype=torch.float32)  # dense MLPs: every weight matmul is an nn.Linear
    runner = HybridRunner(model, max_batch_size=1, max_length=64, num_verify_tokens=13)
    slots = runner.alloc(1)
    runner.prefill(slots[0], torch.arange(3, 23))
    seen = []
    inputs = bench.make_inputs(runner, torch.arange(3, 23), bench.kinds(5, [13], 4))
    for name, (x, p) in inputs.items():
        seen.clear()
        with Linears():
            calls = bench.linear_calls(runner, slots, x, p)
        assert len(calls) == len(seen) > 0, name
        for (m, shape, dtype), (w, rows) in zip(calls, seen):
            assert m.weight is w and dtype == torch.float32
            assert torch.Size(shape[:-1]).numel() == rows == x.shape[1], name
    # the recording forwards were aborted: the next 1-token step equals one taken before them
    x, p = inputs["step_1"]
    fresh = HybridRunner(model, max_batch_size=1, max_length=64, num_verify_tokens=13)
    fresh_slots = fresh.alloc(1)
    fresh.prefill(fresh_slots[0], torch.arange(3, 23))
    torch.testing.assert_close(runner.forward(slots, x).logits, fresh.forward(fresh_slots, x).logits, rtol=0, atol=0)
    runner.abort()
    floor = bench.matmul_floor(runner, slots, inputs, 1e-3, repeats=2, warmup=0)
    assert floor["step_1"]["floor"] == pytest.approx(1.0)
    assert set(floor) == set(inputs) and all(f["matmul_ms"] > 0 for f in floor.values())


def test_onednn_case_runs_onednn_and_aten_case_does_not(monkeypatch):
    """The "onednn" case times what `generate` runs (installed layers inside `cpu_linear.engaged()`: oneDNN from
    its threshold on); the "aten" case the same layers as `F.linear`. Counted by the layers fetching their oneDNN
    weight."""
    import torch
    from torch import nn

    from specdec import cpu_linear

    bench = load_bench("verify_cost")
    lin = nn.Linear(256, 768)
    cpu_linear.install(lin)
    x = torch.randn(8, 256)
    calls = []
    orig = cpu_linear._weight
    monkeypatch.setattr(cpu_linear, "_weight", lambda m: calls.append(m) or orig(m))
    with torch.no_grad():
        with bench.case(None, "aten"):
            lin(x)
        assert not calls
        with bench.case(None, "onednn"):
            lin(x)
        assert calls == [lin]
        lin(x)  # outside any case: nn.Linear
        assert calls == [lin]
