"""`bench/throughput.py` on the embedded model at tiny settings: run as a user would (subprocess), JSON shape,
positive throughput for every (batch, mode), and speculative output identical to plain output (and plain output
to transformers' generate, where it runs); with `--cuda-graph` on a CPU every specdec mode, plain decoding's too,
keeps static shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specdec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "throughput.py"
EMBEDDED = Path(specdec.__file__).resolve().parent / "embedded"
ROW_KEYS = {"batch", "mode", "tokens_per_s", "seconds", "new_tokens", "tau", "busy", "tokens_per_s_median",
            "spread", "output_sha256", "new_tokens_per_row", "identical_to_plain", "speedup_vs_plain", "speedup_vs_hf",
            "scaling_vs_batch1", "speedup_vs_plain_graph"}
NEW = 8


@pytest.mark.skipif(not (EMBEDDED / "config.json").is_file(), reason="the embedded model is not built")
@pytest.mark.parametrize("batching, graph", [("continuous", False), ("calls", False), ("continuous", True)])
def test_tiny_run_json_shape_and_lossless(tmp_path, batching, graph):
    out = tmp_path / "out.json"
    args = [sys.executable, SCRIPT, "--batch-sizes", "1,2", "--drafters", "ngram", "--max-new-tokens", NEW,
            "--prompt-tokens", 24, "--repeats", 1, "--threads", 1, "--draft-schedule", "2:1", "--json", out]
    args += [] if batching == "continuous" else ["--batching", batching]
    args += ["--cuda-graph"] if graph else []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tok/s" in proc.stdout and "torch threads 1" in proc.stdout  # the printed header and table

    res = json.loads(out.read_text())
    assert set(res) == {"machine", "settings", "rows", "errors", "lossless"}
    assert res["errors"] == [] and res["lossless"] is True
    assert res["settings"]["batch_sizes"] == [1, 2] and res["settings"]["threads"] == 1
    assert res["settings"]["requests"] == 4  # default: twice the largest batch size
    assert res["settings"]["batching"] == batching
    assert res["settings"]["draft_schedule"] == {"2": 1}
    assert (res["settings"]["device"], res["settings"]["cuda_graph"]) == ("cpu", graph)
    assert res["settings"]["graph_mode"] == ("static" if graph else None)  # no CUDA graphs on a CPU
    assert res["machine"]["threads"] == 1
    rows = {(r["batch"], r["mode"]): r for r in res["rows"]}
    hf_ran = not rows[(1, "hf")].get("skipped")
    modes = {"ngram", "ngram@2:1", "plain"} | ({"hf"} if hf_ran else set())
    assert {(b, m) for b in (1, 2) for m in modes} <= set(rows)
    for (B, mode), r in rows.items():
        if r.get("skipped"):
            assert mode == "hf"
            continue
        assert set(r) == ROW_KEYS, (B, mode)
        assert len(r["tokens_per_s"]) == 1 and r["tokens_per_s_median"] > 0
        assert r["new_tokens"] == 4 * NEW and r["new_tokens_per_row"] == [NEW]  # every batch size serves 4 requests
        assert r["spread"] >= 1.0 and r["identical_to_plain"] is True  # hf too: plain decoding is its output
        assert r["speedup_vs_plain_graph"] == (r["speedup_vs_plain"] if graph else None)
        assert r["scaling_vs_batch1"] == pytest.approx(
            r["tokens_per_s_median"] / rows[(1, mode)]["tokens_per_s_median"])
    for B, mode in ((1, "ngram"), (2, "ngram"), (1, "ngram@2:1"), (2, "ngram@2:1")):
        spec, plain = rows[(B, mode)], rows[(B, "plain")]
        assert spec["output_sha256"] == plain["output_sha256"]  # greedy speculative decoding is lossless
        assert spec["tau"] >= 1.0 and plain["tau"] == 1.0 and plain["speedup_vs_plain"] == 1.0
        # rows per round / B: always full at batch 1, and for plain decoding, whose rows all end together
        assert plain["busy"] == 1.0 and 0.5 <= spec["busy"] <= 1.0 and (B == 2 or spec["busy"] == 1.0)
        assert spec["speedup_vs_plain"] == pytest.approx(spec["tokens_per_s_median"] / plain["tokens_per_s_median"])
