"""The self-distilled corpus (`python -m specdec draft-data`): the target's own continuations of prompts.

1. Greedy records equal transformers' own greedy `generate` of the same prompts (float64 tiny target), and
   sampled records are seeded draws of the requested length.
2. Resume: a rerun appends only the prompts not yet written; a torn last line is dropped first.
3. The command line writes a corpus that `python -m specdec draft-train --data CORPUS.jsonl` trains on.
"""

from __future__ import annotations

import json

import torch
from tiny_models import float64_everywhere, greedy_reference, save_tiny, tiny_model, torch_fallbacks

import specdec
from specdec.draft.data import corpus_tokens, done_ids, draw_prompts, write_corpus

NEW = 10


def _write(target, prompts, out, **kw):
    engine = specdec.wrap(target, drafter="ngram", max_batch_size=4, max_length=64)
    with torch_fallbacks(), float64_everywhere():
        return write_corpus(engine, prompts, str(out), new_tokens=NEW, batch_size=4, progress=False, **kw)


def _records(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def test_greedy_records_are_the_targets_greedy_continuation(tmp_path):
    target = tiny_model("kimi_linear", seed=0)
    ids = torch.randint(3, 96, (400,), generator=torch.Generator().manual_seed(1))
    prompts = draw_prompts(ids, 6, 7, seed=0)
    assert all(any(torch.equal(p, ids[s:s + 7]) for s in range(394)) for p in prompts)  # windows of the text
    out = tmp_path / "corpus.jsonl"
    assert _write(target, prompts, out, temperatures=(0.0, 0.8)) == 6
    recs = _records(out)
    assert sorted(r["id"] for r in recs) == list(range(6))
    for r in recs:
        assert r["prompt"] == prompts[r["id"]].tolist() and len(r["continuation"]) == NEW
        assert r["temperature"] == (0.0 if r["id"] % 2 == 0 else 0.8)
        if r["temperature"] == 0.0:
            assert r["prompt"] + r["continuation"] == greedy_reference(target, r["prompt"], NEW)
    sampled = [r["continuation"] for r in recs if r["temperature"] > 0]
    greedy_of_sampled = [greedy_reference(target, r["prompt"], NEW)[7:] for r in recs if r["temperature"] > 0]
    assert sampled != greedy_of_sampled  # drawn, not argmax
    stream = corpus_tokens(str(out))
    assert stream.tolist() == [t for r in sorted(recs, key=lambda r: r["id"]) for t in r["prompt"] + r["continuation"]]


def test_rerun_resumes(tmp_path):
    target = tiny_model("kimi_linear", seed=0)
    ids = torch.randint(3, 96, (400,), generator=torch.Generator().manual_seed(1))
    out = tmp_path / "corpus.jsonl"
    assert _write(target, draw_prompts(ids, 3, 7, seed=0), out, temperatures=(0.0,)) == 3
    first = _records(out)
    with open(out, "a") as f:
        f.write('{"id": 3, "temper')  # an interrupted write
    assert done_ids(str(out)) == {0, 1, 2}
    more = draw_prompts(ids, 5, 7, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(more, draw_prompts(ids, 3, 7, seed=0)))
    assert _write(target, more, out, temperatures=(0.0,)) == 2
    recs = _records(out)
    assert recs[:3] == first and [r["id"] for r in recs] == [0, 1, 2, 3, 4]
    assert _write(target, more, out, temperatures=(0.0,)) == 0


def test_command_line_and_training_on_the_corpus(tmp_path, capsys):
    from specdec.cli import main
    save_tiny(tmp_path / "target", "kimi_linear")
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "corpus.jsonl"
    threads = torch.get_num_threads()
    try:
        args = ["draft-data", "--target", str(tmp_path / "target"), "--text", str(text), "--out", str(out), "--num-prompts", "4",
                "--prompt-len", "8", "--new-tokens", "24", "--batch-size", "2"]
        assert main(args) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["records"] == 4
        # resumes: 2 more, by plain decoding this time (the same continuations: greedy records are the target's own)
        assert main(args[:-4] + ["--num-prompts", "6", "--batch-size", "2", "--drafter", "none"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["written"] == 2 and summary["records"] == 6
        rc = main(["draft-train", "--target", str(tmp_path / "target"), "--data", str(out), "--drafter", "dspark",
                   "--out", str(tmp_path / "d"), "--steps", "2", "--seq-len", "16", "--batch-size", "2"])
        assert rc == 0 and (tmp_path / "d" / "model.safetensors").exists()
        assert main(args[:-2] + ["--temperatures", "warm"]) == 2
    finally:
        torch.set_num_threads(threads)
    assert "--temperatures" in capsys.readouterr().err
