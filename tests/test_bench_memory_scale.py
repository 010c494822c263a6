"""`bench/memory_scale.py` on the embedded model at small settings: (a) the cache's KV copies against the distinct KV
of a growing conversation, (b) one budget run with pages and with a static reservation of the same bytes, with
identical outputs and the paged side running more requests at once, (c) the decode cost per context."""

import json

from bench_scripts import load_bench


def test_tiny_settings(tmp_path):
    out = tmp_path / "memory.json"
    res = load_bench("memory_scale").main([
        "--conv-lengths", "96,192", "--message-tokens", "48", "--reply-tokens", "8",
        "--requests", "6", "--long", "4096", "--short", "32", "--long-share", "0.34", "--max-new-tokens", "4",
        "--budget-mib", "14", "--contexts", "64,128", "--decode-tokens", "4", "--repeats", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    rows = res["conversation"]["rows"]
    assert [r["tokens"] >= t for r, t in zip(rows, (96, 192))] == [True, True]
    for r in rows:  # every entry copies its prefix's KV: at least the distinct KV
        assert r["kv_copies"] >= r["distinct_kv_bytes"] > 0 and r["entries"] >= 2
    w = res["workload"]
    assert w["identical"] is True and w["sizes"].count(4096) == 2
    assert w["paged"]["most_at_once"] > w["static"]["most_at_once"] == w["static"]["lanes"], w
    assert w["paged"]["wall_s"] > 0 and w["static"]["tokens_per_s"] > 0
    assert set(res["decode"]) == {"64", "128"} and all(r["ms_per_token"] > 0 for r in res["decode"].values())
