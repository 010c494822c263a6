"""`bench/graph_check.py` on the embedded model at tiny settings, run as a user would (subprocess): on a CPU it
compares the static-shape path (where eagle, mtp and dspark draft inside the device step) with the dynamic path,
token for token, for the shipped drafters and plain decoding (`drafter=None`; the script exits 1 on a difference);
the JSON records every drafter and batch size as identical, plain decoding's output as transformers' generate's,
and the summary's speedups as the ratios of the rates it measured (static mode standing in for graph mode on a
CPU). The same script compares CUDA-graph replay on a GPU (bench/gpu_check.sh)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specdec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "graph_check.py"
EMBEDDED = Path(specdec.__file__).resolve().parent / "embedded"
DRAFTERS = ["ngram", "mtp", "dspark", "eagle"]


@pytest.mark.skipif(not (EMBEDDED / "drafters" / "eagle" / "config.json").is_file(),
                    reason="the embedded model's drafters are not built")
def test_static_equals_dynamic_for_the_shipped_drafters(tmp_path):
    out = tmp_path / "graphs.json"
    args = [sys.executable, SCRIPT, "--device", "cpu", "--batch-sizes", "1,3", "--drafters", ",".join(DRAFTERS),
            "--max-new-tokens", 12, "--prompt-tokens", 40, "--repeats", 1, "--json", out]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    res, summary, hf = data["results"], data["summary"], data["transformers"]
    assert sorted(res) == sorted(DRAFTERS + ["plain"]) == sorted(summary)
    assert (data["mode"], data["cuda_graph"], data["not_run"]) == ("static", False, [])
    for B in ("1", "3"):  # transformers' own greedy generate on the same prompts: plain decoding's tokens
        assert hf[B]["identical"] is True and hf[B]["tokens_per_s"] > 0
    for name in DRAFTERS + ["plain"]:
        assert sorted(res[name]) == ["1", "3"]
        for B, modes in res[name].items():
            assert sorted(modes) == ["dynamic", "static"], (name, B)  # no CUDA here: no graph mode
            assert all(m["identical"] for m in modes.values()), (name, B, modes)
            assert all(m["tokens_per_s"] > 0 for m in modes.values())
            s = summary[name][B]
            assert set(s) == {"identical", "eager_fallbacks", "speedup_vs_plain_graph", "speedup_vs_transformers",
                              "mode"}
            assert (s["identical"], s["eager_fallbacks"], s["mode"]) == (True, 0, "static")
            rate = modes["static"]["tokens_per_s"]
            assert s["speedup_vs_plain_graph"] == pytest.approx(rate / res["plain"][B]["static"]["tokens_per_s"])
            assert s["speedup_vs_transformers"] == pytest.approx(rate / hf[B]["tokens_per_s"])
    assert all(summary["plain"][B]["speedup_vs_plain_graph"] == 1.0 for B in ("1", "3"))


def test_budget_and_flags(tmp_path):
    """A spent `--budget-s` starts no row: exit 0, the JSON lists what did not run. `--cuda-graph` needs CUDA."""
    out = tmp_path / "graphs.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base = [sys.executable, SCRIPT, "--device", "cpu", "--batch-sizes", "1,2", "--drafters", "ngram"]
    proc = subprocess.run(list(map(str, base + ["--budget-s", "1e-9", "--json", out])), capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["not_run"] == ["plain@1", "ngram@1", "hf@1", "plain@2", "ngram@2", "hf@2"]
    assert data["results"] == {} and data["summary"] == {} and data["transformers"] == {}
    assert "not run: plain@1, ngram@1, hf@1, plain@2, ngram@2, hf@2" in proc.stdout
    proc = subprocess.run(list(map(str, base + ["--cuda-graph"])), capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 2 and "--cuda-graph: CUDA graphs need --device cuda" in proc.stderr
