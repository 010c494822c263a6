"""A self-distilled training corpus: the target's own continuations of prompts drawn from the training text.

    python -m specdec draft-data --target DIR --text FILE --out CORPUS.jsonl \\
        [--num-prompts 2000 --prompt-len 32 --new-tokens 224 --temperatures 0,0.8 --batch-size 16 --seed 0]

Prompt i is `prompt_len` tokens of the text at a seeded random offset; it is continued for `new_tokens`
tokens at temperature `temperatures[i % len(temperatures)]` (0: greedy). The reference recipe (DeepSpec,
`scripts/data/generate_train_data.py`) also regenerates its training text with the target, so the drafter learns
the target's own distribution rather than the text's (on this package's stdlib text the embedded target's
top-1 often differs from the next text token: bench/results/HISTORY.md). Each line of the output is one record,
`{"id": i, "temperature": t, "prompt": [ids], "continuation": [ids]}`; a rerun appends the prompts not yet written
(same seed: the same prompts), so an interrupted run resumes.

`write_corpus` takes the generating engine from its caller (anything with `specdec.wrap(...)`'s batched
`generate`); the command line (`python -m specdec draft-data`, in `specdec.cli.draft_data`) builds it with
speculative decoding, which is lossless, so the corpus is the target's own greedy / sampled text.
`corpus_tokens` reads a corpus back as one token stream for `python -m specdec draft-train --data CORPUS.jsonl`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import torch


def draw_prompts(ids: torch.Tensor, num_prompts: int, prompt_len: int, *, seed: int = 0) -> list[torch.Tensor]:
    """`num_prompts` windows `[prompt_len]` of the token stream `ids [N]` at seeded random offsets (prompt i does
    not depend on `num_prompts`, so a larger request extends a smaller one)."""
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts: expected an int >= 1, got {num_prompts!r}")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len: expected an int >= 1, got {prompt_len!r}")
    if ids.dim() != 1 or ids.numel() <= prompt_len:
        raise ValueError(f"ids: need a 1-D token stream longer than prompt_len {prompt_len}, got shape "
                         f"{list(ids.shape)}")
    out = []
    for i in range(num_prompts):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        s = int(torch.randint(0, ids.numel() - prompt_len + 1, (1,), generator=g))
        out.append(ids[s:s + prompt_len].clone())
    return out


def done_ids(path: str) -> set[int]:
    """Ids of the records already in `path` (none if it does not exist); a torn last line is dropped."""
    done = set()
    if not os.path.exists(path):
        return done
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    good = []
    for line in lines:
        if not line.strip():
            continue
        try:
            done.add(int(json.loads(line)["id"]))
            good.append(line)
        except (ValueError, KeyError, TypeError):
            break  # an interrupted write: keep what precedes it
    if len(good) != sum(1 for ln in lines if ln.strip()):
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(ln + "\n" for ln in good))
    return done


def write_corpus(engine, prompts: list[torch.Tensor], out: str, *, new_tokens: int = 224,
                 temperatures: tuple[float, ...] = (0.0, 0.8), batch_size: int = 16, seed: int = 0,
                 progress: bool = True) -> int:
    """Continue each of `prompts` (1-D token tensors `[P]`) for `new_tokens` tokens with `engine.generate` and
    append one JSON line per prompt to `out`, skipping ids already there. Prompt i uses
    `temperatures[i % len(temperatures)]` (0: greedy); batches hold prompts of one temperature.
    -> the number of records written by this call."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens: expected an int >= 1, got {new_tokens!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    temps = [float(t) for t in temperatures]
    if not temps or any(not t >= 0 for t in temps):
        raise ValueError(f"temperatures: expected numbers >= 0, got {temperatures!r}")
    done = done_ids(out)
    todo = [i for i in range(len(prompts)) if i not in done]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="corpus", unit="prompt",
                   file=sys.stderr)
    # batches of one temperature each, taken round-robin over the temperatures, so a run stopped early still
    # holds every kind of text
    per_temp = [[i for i in todo if i % len(temps) == k] for k in range(len(temps))]
    batches = [[(t, mine[j:j + batch_size]) for j in range(0, len(mine), batch_size)]
               for t, mine in zip(temps, per_temp)]
    order = [bs[rnd] for rnd in range(max(map(len, batches))) for bs in batches if rnd < len(bs)]
    written = 0
    with open(out, "a", encoding="utf-8") as f:
        for t, chunk in order:
            res = engine.generate([prompts[i] for i in chunk], max_new_tokens=new_tokens, do_sample=t > 0,
                                  temperature=t if t > 0 else 1.0, eos_token_id=None,
                                  seed=seed * 1_000_003 + chunk[0])
            for row, i in enumerate(chunk):
                n = prompts[i].numel()
                cont = res.sequences[row, n:n + new_tokens].tolist()
                f.write(json.dumps({"id": i, "temperature": t, "prompt": prompts[i].tolist(),
                                    "continuation": cont}) + "\n")
            f.flush()
            written += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return written


def json_lines(path) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of a JSON-lines file; a line that is not JSON is a ValueError
    naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None


def corpus_tokens(path: str) -> torch.Tensor:
    """A corpus file -> one token stream `[N]`: each record's prompt then its continuation, in id order."""
    recs = []
    for n, r in json_lines(path):
        try:
            recs.append((int(r["id"]), list(r["prompt"]) + list(r["continuation"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"data: {path} line {n} is not a corpus record ({type(e).__name__}: {e})") from None
    if not recs:
        raise ValueError(f"data: {path} holds no corpus records")
    recs.sort(key=lambda r: r[0])
    return torch.tensor([t for _, seq in recs for t in seq], dtype=torch.long)

