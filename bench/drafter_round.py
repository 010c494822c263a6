"""A drafter's part of a decode round at a long context: its `propose` and its `observe` of one round's kept
positions, per context length.

    python bench/drafter_round.py                                       # embedded model, dspark, 512 / 4k / 16k
    python bench/drafter_round.py --drafters dspark,mtp,eagle --tokens 512,16384 --json round.json
    python bench/ab.py --old HEAD~1 --rounds 3 --metric 'drafters.*.*.propose_ms' -- drafter_round.py --tokens 16384
    python bench/drafter_round.py --drafters eagle --drafter-options '{"context_window": 0}'  # eagle, no window

Per length, the target prefills a prompt of `--tokens` seeded random token ids into a slot it keeps (drafters that
read the target's KV cache read it there), and the drafter gets a fresh request row that observes the whole prompt,
as after a prefill. Then each of `--repeats` rounds (after one untimed) times `observe` of `--kept` positions (what a
round commits: the anchor and the accepted drafts; the prompt's last features stand in for theirs, as observe's cost
does not depend on the values) and then `propose` of `--gamma` drafts after the grown context: the drafter's work
in a round, without the target's verify. The context grows by `--kept` a round, so the rounds see the length within
`kept x repeats` tokens. Medians over the rounds, one torch thread unless `--threads` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.draft.base import Contexts, Observation  # noqa: E402


def measure(engine, ids: torch.Tensor, *, gamma: int, kept: int, repeats: int, vocab: int,
            gen: torch.Generator) -> dict:
    """Median and every round's milliseconds of observe, propose and both, after the drafter observed `ids [n]`."""
    drafter, runner = engine.drafter, engine.runner
    layers = tuple(drafter.feature_layers)
    slot = runner.alloc(1)[0]
    view = drafter.target  # request row 0 reads this slot of the target, as a generate call maps its lanes
    drafter.target = dataclasses.replace(view, slots=lambda rows: [slot for _ in rows])
    try:
        out = runner.prefill(slot, ids, capture=layers)
        hidden, feats = out.hidden[0], {i: out.captured[i][0] for i in layers}
        drafter.begin([0], [ids])
        try:
            drafter.observe(Observation.of([0], [ids], [hidden], {i: [f] for i, f in feats.items()}))
            ctx = ids
            obs, prop = [], []
            for r in range(repeats + 1):
                new = torch.randint(3, vocab, (kept,), generator=gen)
                # what the engine hands the drafter (counts on the device, host lists) is made outside the timing
                seen = Observation.of([0], [new], [hidden[-kept:]], {i: [f[-kept:]] for i, f in feats.items()})
                t = time.perf_counter()
                drafter.observe(seen)
                common.sync(ids.device)
                t1 = time.perf_counter()
                ctx = torch.cat([ctx, new])
                anchor = torch.randint(3, vocab, (1,), generator=gen)
                contexts = Contexts.of([torch.cat([ctx, anchor])])
                t2 = time.perf_counter()
                drafter.propose([0], contexts, gamma)
                common.sync(ids.device)
                t3 = time.perf_counter()
                if r:  # the first round warms up
                    obs.append((t1 - t) * 1e3)
                    prop.append((t3 - t2) * 1e3)
        finally:
            drafter.release([0])
    finally:
        runner.release([slot])
        drafter.target = view
    both = [a + b for a, b in zip(obs, prop)]
    return {"observe_ms": statistics.median(obs), "propose_ms": statistics.median(prop),
            "round_ms": statistics.median(both), "observe_ms_all": obs, "propose_ms_all": prop}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory or 'embedded'")
    p.add_argument("--drafters", default="dspark", help="trained drafters under the model's drafters/ (comma list)")
    p.add_argument("--tokens", default="512,4096,16384", help="context lengths (comma list)")
    p.add_argument("--gamma", type=int, default=7, help="drafts per propose")
    p.add_argument("--kept", type=int, default=4, help="positions each round observes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter-options", default="{}", metavar="JSON",
                   help="options passed to every drafter (specdec.wrap's drafter options), a JSON object")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        options = json.loads(a.drafter_options)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        p.error(f"--drafter-options: expected a JSON object, got {a.drafter_options!r}")
    for name in ("repeats", "gamma", "kept"):
        if getattr(a, name) < 1:
            p.error(f"--{name}: expected >= 1, got {getattr(a, name)}")
    lengths = common.token_lengths(p, a.tokens, a.kept, f"--kept ({a.kept})")
    model_dir = common.input_args(p, a.model)
    drafters = common.trained_drafters(p, model_dir, a.drafters, 'is not a trained drafter directory')
    model = common.load_cpu_model(model_dir, a.threads)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(a.seed)
    result = {"machine": common.machine_info("cpu"), "model": str(model_dir), "tokens": lengths, "gamma": a.gamma,
              "kept": a.kept, "repeats": a.repeats, "drafter_options": options, "drafters": {}}
    longest = max(lengths) + a.kept * (a.repeats + 1) + a.gamma + 2
    with torch.inference_mode():
        for name, path in drafters.items():
            engine = specdec.wrap(model, drafter=path, max_batch_size=1, num_draft_tokens=a.gamma,
                                  max_length=longest, **options)
            rows = result["drafters"][name] = {}
            for n in lengths:
                ids = torch.randint(3, vocab, (n,), generator=gen)
                rows[str(n)] = r = measure(engine, ids, gamma=a.gamma, kept=a.kept, repeats=a.repeats, vocab=vocab,
                                           gen=gen)
                print(f"{name:8s} {n:6d} tokens: propose {r['propose_ms']:8.2f} ms, observe {a.kept} "
                      f"{r['observe_ms']:8.2f} ms, round {r['round_ms']:8.2f} ms", flush=True)
            del engine
    print("\n| drafter | context | propose ms | observe ms | drafter round ms |\n|---|---|---|---|---|")
    for name, rows in result["drafters"].items():
        for n, r in rows.items():
            print(f"| {name} | {int(n):,} | {r['propose_ms']:.2f} | {r['observe_ms']:.2f} | {r['round_ms']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
