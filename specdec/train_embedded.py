"""Train the embedded default model: a small Kimi-Linear (KDA + MLA, 3:1) on the CPython standard library.

    python -m specdec train-embedded --out specdec/embedded --minutes 45
    python -m specdec train-embedded --family qwen3_5 --tokenizer specdec/embedded --out DIR --minutes 30 \\
        --checkpoint DIR.ckpt --prompts ""

`--family qwen3_5` trains a small Qwen3.5 text model (Gated DeltaNet + gated full attention, 3:1) with the same loop
and data, and saves it with one freshly initialized MTP layer under the published checkpoints' names (`mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`: what `drafter="native"`
reads; fine-tune it with `python -m specdec draft-train --drafter native`). `--tokenizer DIR` reuses that
directory's tokenizer (the embedded model's) instead of training one. `--checkpoint FILE` keeps a resumable
training state there at every validation (a rerun with the same arguments continues from it).

Data: the stdlib `.py` sources (test folders excluded) plus the prose of `pydoc_data/topics.py`. A fixed
set of files and topics (chosen by a hash of their name) is held out for validation and for the
benchmark prompts (`bench/data/prompts.jsonl`). A byte-level BPE tokenizer is trained with `tokenizers`.
Runs on CPU with transformers' own layers, the chunked delta rule swapped for `kernels.chunk_delta_rule`
(the same recurrence, vectorized across chunks).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sysconfig
import time

import torch

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "unittest", "lib2to3"}
EOS, PAD = "<|endoftext|>", "<|pad|>"


def held_out(name: str, every: int) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % every == 0


def corpus(root: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """-> (train docs, held-out docs), name -> text. Names: stdlib-relative paths, or `topic:<key>`."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held = {}, {}
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in SKIP_DIRS and not d.startswith("test"))
        for f in sorted(fns):
            if not f.endswith(".py") or f.startswith("test_"):
                continue
            rel = os.path.relpath(os.path.join(dp, f), root)
            if rel == os.path.join("pydoc_data", "topics.py"):
                continue
            try:
                with open(os.path.join(dp, f), encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            (held if held_out(rel, 25) else train)[rel] = text
    ns: dict = {}
    with open(os.path.join(root, "pydoc_data", "topics.py"), encoding="utf-8") as fh:
        exec(compile(fh.read(), "topics.py", "exec"), ns)  # a plain dict literal of prose
    for key, text in sorted(ns["topics"].items()):
        (held if held_out("topic:" + key, 10) else train)["topic:" + key] = text
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token=EOS, pad_token=PAD, bos_token=EOS)


FAMILIES = ("kimi_linear", "qwen3_5")
CHUNK = {"kimi_linear": 8, "qwen3_5": 16}  # the CPU chunked delta rule's chunk size in training


def model_config(vocab_size: int, eos_id: int, pad_id: int, family: str = "kimi_linear"):
    """kimi_linear: ~9M parameters, 8 layers, KDA on 6, MLA on 2 (layers 3 and 7: the published 3:1 pattern).
    qwen3_5: ~1.4M parameters, hidden 128, 4 layers (Gated DeltaNet on 0-2, gated attention on 3), tied embeddings."""
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        layers = 4
        return Qwen3_5TextConfig(
            vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
            rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    from transformers import KimiLinearConfig
    layers = 8
    return KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=48, v_head_dim=64, linear_num_heads=4, linear_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        mlp_layer_types=["dense"] * layers, num_experts=1, num_experts_per_token=1, num_shared_experts=0,
        rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)


def fresh_mtp_tensors(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """One freshly initialized Qwen3.5 MTP layer under the published names: the decoder layer is a full-attention
    `Qwen3_5DecoderLayer` initialized by transformers (`_init_weights`), `fc` normal(0, initializer_range), the
    zero-centred norms zero (scale 1)."""
    import copy

    from transformers import Qwen3_5ForCausalLM
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers, cfg.layer_types, cfg.vocab_size = 1, ["full_attention"], 2
    torch.manual_seed(seed)
    layer = Qwen3_5ForCausalLM(cfg).model.layers[0]
    d = config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    out = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    out["mtp.fc.weight"] = torch.randn(d, 2 * d, generator=gen) * config.initializer_range
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.zeros(d)
    return out


def add_tensors(path: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Add `tensors` (in `dtype`) to the single safetensors file of the checkpoint directory `path`."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state.update({k: v.to(dtype).contiguous() for k, v in tensors.items()})
    save_file(state, file, metadata={"format": "pt"})


def make_prompts(held: dict[str, str], tok, n_code: int = 30, n_prose: int = 10, seed: int = 0) -> list[dict]:
    """Code continuations (the lines before a `def` in a held-out file, plus its first line) and prose
    openings of held-out topics."""
    rng = random.Random(seed)
    code = [(k, v) for k, v in held.items() if not k.startswith("topic:")]
    prose = [(k, v) for k, v in held.items() if k.startswith("topic:") and len(v) > 400]
    out = []
    for name, text in rng.sample(code, min(n_code, len(code))):
        lines = text.splitlines()
        defs = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and i >= 8]
        if not defs:
            continue
        i = rng.choice(defs)
        out.append({"id": f"code-{len(out)}", "kind": "code", "source": name,
                    "prompt": "\n".join(lines[max(0, i - 24):i + 2]) + "\n"})
    for name, text in rng.sample(prose, min(n_prose, len(prose))):
        out.append({"id": f"prose-{len(out)}", "kind": "prose", "source": name, "prompt": text.strip()[:400]})
    return out


def dump_corpus(path: str, megabytes: float = 2.0) -> None:
    """Write about `megabytes` of the training text (the drafters' distillation data) to `path`."""
    train_docs, _ = corpus()
    text, budget = [], int(megabytes * 2 ** 20)
    for name in sorted(train_docs, key=lambda n: hashlib.sha1(n.encode()).hexdigest()):  # a mixed sample
        text.append(train_docs[name])
        budget -= len(train_docs[name])
        if budget <= 0:
            break
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(text))


def train(*, out: str | None = None, prompts: str = "bench/data/prompts.jsonl", minutes: float = 45.0,
          vocab_size: int = 4096, seq_len: int = 256, batch_size: int = 16, lr: float = 2e-3, val_every: int = 100,
          seed: int = 0, threads: int | None = None, family: str = "kimi_linear", tokenizer: str | None = None,
          checkpoint: str | None = None) -> dict:
    """Train a `family` model for `minutes` and save it (with its tokenizer and `training.json`) to `out` (default:
    the package's `embedded/`); the held-out benchmark prompts go to `prompts` ("" for none). `tokenizer`: a
    directory whose tokenizer is reused; `checkpoint`: a resumable training state, resumed if present. Returns the
    summary it prints last."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if out is None:
        out = os.path.join(os.path.dirname(__file__), "embedded")
    if threads:
        torch.set_num_threads(threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.draft.registry import load_plain
    from specdec.hf_compat import torch_fallbacks

    torch.manual_seed(seed)
    t0 = time.time()
    train_docs, held_docs = corpus()
    tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else \
        train_tokenizer(list(train_docs.values()), vocab_size)
    eos = tok.convert_tokens_to_ids(EOS)

    def stream(docs):
        ids = []
        for enc in tok(list(docs.values()))["input_ids"]:
            ids.extend(enc + [eos])
        return torch.tensor(ids, dtype=torch.long)

    train_ids, val_ids = stream(train_docs), stream(held_docs)
    print(json.dumps({"train_docs": len(train_docs), "held_docs": len(held_docs), "train_tokens": train_ids.numel(),
                      "val_tokens": val_ids.numel(), "prep_s": round(time.time() - t0, 1)}), flush=True)
    model = AutoModelForCausalLM.from_config(model_config(len(tok), eos, tok.convert_tokens_to_ids(PAD), family))
    model.config._experts_implementation = "eager"
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    S, B = seq_len, batch_size
    budget = minutes * 60
    val_gen = torch.Generator().manual_seed(seed + 1)
    val_batches = [torch.stack([val_ids[s:s + S + 1] for s in torch.randint(0, val_ids.numel() - S - 1, (B,),
                                                                              generator=val_gen).tolist()])
                   for _ in range(4)]

    def loss_of(batch):
        logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def validate():
        model.eval()
        with torch.no_grad():
            v = sum(float(loss_of(b)) for b in val_batches) / len(val_batches)
        model.train()
        return v

    log = []
    step, t_train = 0, time.time()
    if checkpoint and os.path.exists(checkpoint):
        state = load_plain(checkpoint, what="--checkpoint")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        torch.set_rng_state(state["rng"])
        step, log = state["step"], state["log"]
        t_train -= state["elapsed"]  # the schedule continues where it stopped
        print(json.dumps({"resumed": checkpoint, "step": step, "s": round(state["elapsed"])}), flush=True)

    def save_state():
        if checkpoint:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "rng": torch.get_rng_state(), "step": step, "log": log, "elapsed": time.time() - t_train},
                       checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)  # never a torn checkpoint

    with torch_fallbacks(family, chunked=True, chunk_size=CHUNK[family]):
        model.train()
        while True:
            elapsed = time.time() - t_train
            if elapsed > budget:
                break
            # warmup by steps, cosine decay by elapsed time: the schedule ends with the budget at any speed
            frac = min(elapsed / budget, 1.0)
            step_lr = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for gp in opt.param_groups:
                gp["lr"] = step_lr
            starts = torch.randint(0, train_ids.numel() - S - 1, (B,), generator=gen).tolist()
            batch = torch.stack([train_ids[s:s + S + 1] for s in starts])
            loss = loss_of(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            entry = {"step": step, "loss": round(loss.item(), 4), "lr": round(step_lr, 6),
                     "s": round(time.time() - t_train)}
            if step % val_every == 0:
                entry["val_loss"] = round(validate(), 4)
            if step % 10 == 0 or "val_loss" in entry:
                print(json.dumps(entry), flush=True)
            log.append(entry)
            if "val_loss" in entry:
                save_state()
        final_val = validate()
    summary = {"family": family, "params": n_params, "steps": step, "tokens_seen": step * B * S,
               "train_seconds": round(time.time() - t_train),
               "final_train_loss": sum(e["loss"] for e in log[-20:]) / max(1, len(log[-20:])),
               "final_val_loss": round(final_val, 4), "seq_len": S, "batch_size": B, "vocab_size": len(tok)}
    print(json.dumps(summary), flush=True)
    os.makedirs(out, exist_ok=True)
    model.config._experts_implementation = None
    model.to(torch.bfloat16).save_pretrained(out)
    if family == "qwen3_5":  # the MTP layer the published Qwen3.5 checkpoints ship, freshly initialized
        add_tensors(out, fresh_mtp_tensors(model.config, seed), torch.bfloat16)
    tok.save_pretrained(out)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump({"summary": summary, "log": [e for e in log if e["step"] % 10 == 0 or "val_loss" in e]}, f)
    if prompts:
        os.makedirs(os.path.dirname(prompts) or ".", exist_ok=True)
        with open(prompts, "w") as f:
            for rec in make_prompts(held_docs, tok):
                f.write(json.dumps(rec) + "\n")
    return summary

