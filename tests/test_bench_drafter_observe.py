"""`bench/drafter_observe.py` on the embedded model at tiny settings: every drafter and prompt length measured, each
repeat's time and memory kept, the JSON what `main` returns."""

import json

from bench_scripts import load_bench


def test_tiny_prompts(tmp_path):
    out = tmp_path / "observe.json"
    res = load_bench("drafter_observe").main(["--drafters", "eagle,dspark", "--tokens", "40,90", "--repeats", "2",
                                              "--malloc-default", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["tokens"] == [40, 90] and res["mmap_large_blocks"] is False
    assert set(res["drafters"]) == {"eagle", "dspark"}
    for rows in res["drafters"].values():
        assert set(rows) == {"40", "90"}
        for r in rows.values():
            assert len(r["ms_all"]) == len(r["peak_mib_all"]) == 2 and min(r["ms_all"]) > 0
            assert r["peak_mib_max"] == max(r["peak_mib_all"]) and min(r["peak_mib_all"]) >= 0
            assert r["prefill_ms"] > 0 and r["of_prefill"] == r["ms"] / r["prefill_ms"]
