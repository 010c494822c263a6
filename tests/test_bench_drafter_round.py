"""`bench/drafter_round.py` on the embedded model at tiny settings: every drafter and context length measured, each
round's times kept, the JSON what `main` returns."""

import json

from bench_scripts import load_bench


def test_tiny_contexts(tmp_path):
    out = tmp_path / "round.json"
    res = load_bench("drafter_round").main(["--drafters", "dspark,mtp,eagle", "--tokens", "40,90", "--repeats", "2",
                                            "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["tokens"] == [40, 90] and res["gamma"] == 7 and res["kept"] == 4
    assert set(res["drafters"]) == {"dspark", "mtp", "eagle"}
    for rows in res["drafters"].values():
        assert set(rows) == {"40", "90"}
        for r in rows.values():
            assert len(r["observe_ms_all"]) == len(r["propose_ms_all"]) == 2
            assert min(r["observe_ms_all"]) > 0 and min(r["propose_ms_all"]) > 0
            assert r["round_ms"] >= min(a + b for a, b in zip(r["observe_ms_all"], r["propose_ms_all"]))
