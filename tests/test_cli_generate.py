"""`python -m specdec generate`: a tiny saved model and tokenizer, run in a subprocess as a user would.

The oracle is independent of specdec: transformers' own greedy `generate`, in-process, on its pure-torch
linear-attention path. The subprocess gets no such help (and no TRITON_INTERPRET, `cli_harness.run_specdec`).
"""

import json

import pytest
import torch

from cli_harness import ROOT, assert_argument_error, bad_arguments, run_specdec
from tiny_models import torch_fallbacks

FAMILY = "qwen3_5"  # the saved model (conftest's `saved_tiny`)
SEED = 0  # model weights; a greedy near-tie between the two sides would be fixed here, not by a looser check
PROMPT = "def foo("
NEW = 12


@pytest.fixture(scope="module")
def saved(saved_tiny):
    """-> (directory, tokenizer, prompt ids, the oracle's new token ids)."""
    path, model, tokenizer = saved_tiny
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (model.config.pad_token_id, model.config.eos_token_id)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch_fallbacks(), torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = ref[0, ids.shape[1]:].tolist()
    assert len(new) == NEW  # no early EOS with this seed: all 12 tokens are compared
    return path, tokenizer, ids[0].tolist(), new


def run_cli(*args, timeout=180):
    return run_specdec("generate", *args, timeout=timeout)


def test_json_equals_transformers_greedy(saved):
    path, tokenizer, _, oracle = saved
    # the model itself as the drafter: drafts are accepted, so the accept path is exercised as well
    proc = run_cli("--model", path, "--prompt", PROMPT, "--max-new-tokens", NEW, "--drafter", "model",
                   "--draft-model", path, "--num-draft-tokens", 4, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
    assert set(out) == {"text", "tokens", "stats"}
    assert out["tokens"] == oracle
    assert out["text"] == tokenizer.decode(oracle, skip_special_tokens=True)
    stats = out["stats"]
    assert stats["new_tokens"] == NEW and stats["tokens_per_s"] > 0
    assert stats["accepted"] > 0 and stats["tau"] > 1 and 0 < stats["alpha"] <= 1
    assert stats["rounds"] >= 1 and len(stats["per_position"]) <= 4


def test_trained_drafter_directory_equals_transformers_greedy():
    """`--drafter DIR`: the embedded model with its trained EAGLE head (a tree drafter), as a user would run it;
    the tokens equal transformers' greedy generate on the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = ROOT / "specdec" / "embedded"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    with torch_fallbacks(), torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id)
    proc = run_cli("--model", path, "--prompt", PROMPT, "--max-new-tokens", 24, "--drafter",
                   path / "drafters" / "eagle", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    new = ref[0, ids.shape[1]:].tolist()
    assert out["tokens"] == new[:len(out["tokens"])] and (len(out["tokens"]) == 24 or out["tokens"][-1] == 0)
    assert out["stats"]["accepted"] > 0


def test_stream_prints_text_and_stats(saved):
    path, tokenizer, prompt_ids, oracle = saved
    proc = run_cli("--model", path, "--prompt", PROMPT, "--max-new-tokens", NEW, "--strategy", "snapshot")
    assert proc.returncode == 0, proc.stderr
    assert tokenizer.decode(prompt_ids + oracle, skip_special_tokens=True) in proc.stdout
    assert f"{NEW} new tokens in" in proc.stdout and "tokens/s" in proc.stdout
    for word in ("rounds", "tau", "alpha", "acceptance per draft position", "first token after"):
        assert word in proc.stdout


def test_plain_decoding_with_drafter_none(saved):
    """`--drafter none` (the Python API's None): plain decoding through the same runner, transformers' tokens."""
    path, _, _, oracle = saved
    proc = run_cli("--model", path, "--prompt", PROMPT, "--max-new-tokens", NEW, "--drafter", "none",
                   "--threads", 1, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == oracle and out["stats"]["proposed"] == 0 and out["stats"]["tau"] == 1


@pytest.mark.parametrize("args, flag", [
    (["--prompt", "x"], "--model"),
    (["--model", "{missing}", "--prompt", "x"], "--model"),
    (["--model", "{empty}", "--prompt", "x"], "--model"),  # a directory without a model
    (["--model", "{model}", "--prompt", "x", "--strategy", "tree"], "--strategy"),
    (["--model", "{model}", "--prompt", "x", "--commit", "later"], "--commit"),
    (["--model", "{model}", "--prompt", "x", "--drafter", "model"], "--draft-model"),
    (["--model", "{model}", "--prompt", "x", "--drafter", "nope"], "--drafter"),
    (["--model", "{model}", "--prompt", "x", "--drafter", "native", "--draft-model", "{model}"], "--draft-model"),
    (["--model", "{model}", "--prompt", "x", "--drafter", "{empty}"], "--drafter"),  # a directory, no drafter
    (["--model", "{model}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--model", "{model}", "--prompt", "x", "--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["--model", "{model}", "--prompt", "x", "--temperature", "0.5"], "--temperature"),
    (["--model", "{model}", "--prompt", "x", "--do-sample", "--top-p", "0"], "--top-p"),
    (["--model", "{model}", "--prompt", "x", "--dtype", "float16"], "--dtype"),
    (["--model", "{model}", "--prompt", "x", "--threads", "0"], "--threads"),
    (["--model", "{model}", "--prompt", "x", "--strategy", "snapshot", "--commit", "lazy"], "--commit"),
    (["--model", "{model}", "--prompt", ""], "--prompt"),
])
def test_bad_arguments_exit_2(saved, tmp_path, args, flag):
    proc = run_cli(*bad_arguments(args, saved[0], tmp_path), timeout=120)
    assert_argument_error(proc, "generate", flag)
