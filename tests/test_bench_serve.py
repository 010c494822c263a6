"""`bench/serve.py` on the embedded model at tiny settings: the server started per drafter, every request answered,
the greedy texts of the drafter equal plain decoding's, and the JSON what `main` returns."""

import json

from bench_scripts import load_bench


def test_tiny_load(tmp_path):
    out = tmp_path / "serve.json"
    res = load_bench("serve").main(["--drafters", "ngram,none", "--requests", "6", "--clients", "3",
                                    "--max-tokens", "6", "--prompt-tokens", "24", "--turns", "2",
                                    "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert set(res["load"]) == {"ngram", "none"}
    for name, r in res["load"].items():
        assert r["lost"] == 0 and r["errored"] == 0 and r["completed"] == 6, r["errors"]
        assert 6 <= r["tokens"] <= 36  # 6 replies of 1 to 6 tokens (an eos may end one early)
        assert len(r["texts"]) == 6 and all(r["texts"].values())
        assert r["metrics"]["specdec_requests_finished_total"] >= 6
    assert res["load"]["ngram"]["identical"] is True  # the same texts as plain decoding
    assert res["load"]["ngram"]["metrics"]["specdec_drafted_tokens_total"] > 0
    assert res["load"]["none"]["metrics"]["specdec_drafted_tokens_total"] == 0
    for turns in res["chat"].values():
        assert [t["turn"] for t in turns] == [1, 2] and all(t["error"] is None and t["ttft_s"] > 0 for t in turns)
        assert turns[1]["prompt_chars"] > turns[0]["prompt_chars"]
