"""`bench/graph_check.py` on the embedded model at tiny settings, run as a user would (subprocess): on a CPU it
compares the static-shape path (where eagle, mtp and dspark draft inside the device step) with the dynamic path,
token for token, for the shipped drafters (the script exits 1 on a difference); the JSON records every drafter
and batch size as identical. The same script compares CUDA-graph replay on a GPU (bench/gpu_check.sh)."""

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
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["results"]
    assert sorted(res) == sorted(DRAFTERS)
    for name in DRAFTERS:
        assert sorted(res[name]) == ["1", "3"]
        for B, modes in res[name].items():
            assert sorted(modes) == ["dynamic", "static"], (name, B)  # no CUDA here: no graph mode
            assert all(m["identical"] for m in modes.values()), (name, B, modes)
            assert all(m["tokens_per_s"] > 0 for m in modes.values())
