"""CUDA graphs against eager rounds, token for token, on the embedded model.

    python bench/graph_check.py --device cuda --json graphs.json     # on a GPU: dynamic, static, cuda_graph
    python bench/graph_check.py                                      # on CPU: dynamic and static only

For each drafter of `--drafters` (default: ngram, drafted on the host before the device step, and the shipped
mtp, dspark and eagle drafters, whose drafting is part of the captured step) and each batch size, the first B
held-out prompts (cut to `--prompt-tokens`) are generated greedily for `--max-new-tokens` tokens (no early
stop) by three engines: `dynamic` (shapes follow the round), `static` (`static_shapes=True`, the padded path,
run eagerly) and `graph` (`cuda_graph=True`, CUDA only). Every output must equal `dynamic`'s token for token,
or the script exits with status 1. After a warm-up call each mode runs `--repeats` times, interleaved; the table
shows the median tokens/s and how many step shapes were captured as graphs (and how many fell back to eager).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--drafters", default="ngram,mtp,dspark,eagle",
                   help="ngram, or trained drafters of the embedded model")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specdec
    from specdec.graphs import _Captured

    model_dir = ROOT / "specdec" / "embedded"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["prompt"] for line in (model_dir / "prompts.jsonl").read_text().splitlines() if line]
    modes = {"dynamic": {}, "static": {"static_shapes": True}}
    if a.device.startswith("cuda"):
        modes["graph"] = {"cuda_graph": True}
    print(f"# device {a.device} ({torch.cuda.get_device_name() if a.device.startswith('cuda') else 'cpu'}), "
          f"dtype {a.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'drafter':>8} {'batch':>5} {'mode':>8} {'tok/s':>9} {'spread':>7} {'identical':>9} {'graphs':>7} "
          f"{'eager':>6}")
    results, failed = {}, False
    for name, B in [(d, int(b)) for d in a.drafters.split(",") for b in a.batch_sizes.split(",")]:
        drafter = name if name == "ngram" else str(model_dir / "drafters" / name)
        prompts = [tok(texts[i % len(texts)])["input_ids"][:a.prompt_tokens] for i in range(B)]
        engines = {m: specdec.wrap(model, drafter=drafter, max_batch_size=B, **o) for m, o in modes.items()}
        outs, times = {}, {m: [] for m in modes}
        for r in range(a.repeats + 1):  # the first pass warms up (and, for graphs, captures)
            for m in list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]:
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t = time.perf_counter()
                out = engines[m].generate(prompts, max_new_tokens=a.max_new_tokens, eos_token_id=None)
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
                if r:
                    times[m].append(time.perf_counter() - t)
                outs[m] = [out.sequences[i, len(q):len(q) + a.max_new_tokens].tolist() for i, q in enumerate(prompts)]
        for m in modes:
            same = outs[m] == outs["dynamic"]
            failed |= not same
            g = engines[m]._graphs
            captured = sum(isinstance(e, _Captured) for e in g.entries.values()) if g else 0
            eager = sum(e == "eager" for e in g.entries.values()) if g else 0
            rate = [B * a.max_new_tokens / t for t in times[m]]
            med = statistics.median(rate)
            spread = max(rate) / min(rate)
            results.setdefault(name, {}).setdefault(str(B), {})[m] = dict(
                tokens_per_s=med, spread=spread, identical=same, graphs=captured, eager_fallbacks=eager)
            print(f"{name:>8} {B:>5} {m:>8} {med:>9.1f} {spread:>7.2f} {str(same):>9} {captured:>7} {eager:>6}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "dtype": a.dtype, "results": results}, indent=1))
    if failed:
        print("FAIL: an output differs from the dynamic engine's", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
