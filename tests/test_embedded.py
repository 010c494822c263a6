"""The embedded model and its shipped drafters: greedy spec output == the model's own greedy decode; the command
that trains it (`python -m specdec train-embedded`) at a tiny budget."""

from __future__ import annotations

import json
import os

import pytest
import torch

import specdec
from specdec.hf_compat import torch_fallbacks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "specdec", "embedded")


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(MODEL)
    with open(os.path.join(ROOT, "bench", "data", "prompts.jsonl")) as f:
        records = [json.loads(line) for line in f]
    prompts = [tok(r["prompt"])["input_ids"][-96:] for r in (records[0], records[-1])]  # a code and a prose prompt
    refs = []
    with torch_fallbacks("kimi_linear"):
        for p in prompts:
            refs.append(model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24, eos_token_id=None)[0])
    return model, prompts, refs


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "eagle", "dspark"])
def test_greedy_equals_plain_greedy(embedded, drafter):
    model, prompts, refs = embedded
    name = drafter if drafter == "ngram" else os.path.join(MODEL, "drafters", drafter)
    engine = specdec.wrap(model, drafter=name, num_draft_tokens=5, max_batch_size=2)
    out = engine.generate([torch.tensor(p) for p in prompts], max_new_tokens=24, eos_token_id=None)
    for b, ref in enumerate(refs):
        assert out.sequences[b, :ref.numel()].tolist() == ref.tolist(), f"{drafter}: prompt {b} differs"
    assert out.stats.accepted > 0, f"{drafter}: the trained drafter never had a draft accepted"


def test_train_embedded_command(tmp_path, capsys):
    """`train-embedded` with the embedded model's tokenizer and a seconds-long budget saves a loadable model, its
    training log, the held-out prompts and a resumable checkpoint; `--dump-corpus` writes the training text."""
    from transformers import AutoModelForCausalLM

    from specdec.cli import main
    out, prompts, ck = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "state.pt"
    threads = torch.get_num_threads()
    try:
        rc = main(["train-embedded", "--tokenizer", MODEL, "--out", str(out), "--prompts", str(prompts),
                   "--minutes", "0.01", "--seq-len", "16", "--batch-size", "2", "--val-every", "1", "--threads", "1",
                   "--checkpoint", str(ck)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["family"] == "kimi_linear" and summary["steps"] >= 1 and summary["seq_len"] == 16
    assert json.load(open(out / "training.json"))["summary"] == summary
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "kimi_linear"
    assert torch.load(ck, weights_only=True)["step"] >= 1
    assert all(json.loads(line)["prompt"] for line in prompts.read_text().splitlines())
    text = tmp_path / "text.txt"
    assert main(["train-embedded", "--dump-corpus", str(text), "--corpus-mb", "0.02"]) == 0
    assert len(text.read_text(encoding="utf-8")) >= 0.02 * 2 ** 20
