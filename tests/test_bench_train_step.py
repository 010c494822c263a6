"""`bench/train_step.py` as a user runs it: every chunked path trains the same model to the same loss as
transformers' own pure-torch path, and the JSON has one row per path."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_bench(tmp_path):
    out = tmp_path / "t.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--batch-size", "1", "--seq-len", "24",
                           "--chunks", "4,16", "--reps", "1", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "chunk_delta_rule C=4" in proc.stdout
    rows = json.loads(out.read_text())["paths"]
    assert [r["path"] for r in rows] == ["transformers chunk (pure torch)", "chunk_delta_rule C=4",
                                         "chunk_delta_rule C=16"]
    for r in rows:
        assert r["forward_s"] > 0 and r["backward_s"] > 0
        assert abs(r["loss"] - rows[0]["loss"]) < 1e-5 * rows[0]["loss"]  # fp32, a different op order
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--chunks", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "--chunks" in proc.stderr
