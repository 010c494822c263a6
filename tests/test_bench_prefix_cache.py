"""`bench/prefix_cache.py` on the embedded model at tiny settings: a conversation whose turns after the first reuse
the previous turn's committed end (every prompt token but the new prompt's), identical outputs with and without
the cache, and ratios that are the medians' ratios."""

import json
import statistics

from bench_scripts import load_bench


def test_tiny_conversation(tmp_path):
    out = tmp_path / "prefix.json"
    res = load_bench("prefix_cache").main(["--turns", "4", "--prompt-tokens", "16", "--max-new-tokens", "6",
                                           "--repeats", "3", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["identical"] is True and res["threads"] == 1 and len(res["rows"]) == 4
    rows = res["rows"]
    assert rows[0]["cached_tokens"] == 0
    for prev, r in zip(rows, rows[1:]):
        # the previous turn's history and reply are cached (its last new token, the anchor, is not committed)
        assert r["cached_tokens"] >= prev["prompt_tokens"] + 6 - 1, (prev, r)
        assert r["cached_tokens"] < r["prompt_tokens"]
    for r in rows:
        med = {n: statistics.median(v) for n, v in r["samples_ttft_s"].items()}
        assert r["ttft_ratio"] == med["no cache"] / med["cache"] and len(r["samples_ttft_s"]["cache"]) == 3
    assert res["cache"]["entries"] >= 4 and 0 < res["cache"]["bytes"] <= res["cache"]["budget"]
    assert 0 < res["hit_rate"] < 1
