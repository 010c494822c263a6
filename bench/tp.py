"""Tokens per second of a tensor-parallel target (`wrap(model, tp_group=...)`) at tp = 1 and 2, and its collectives
per round.

    python bench/tp.py                                   # embedded model, ngram and mtp, batch 1 and 4, gloo on CPU
    python bench/tp.py --drafters ngram --batches 1 --max-new-tokens 16 --json tp.json

Two ranks of a gloo group on this machine (two worker processes, as torchrun starts them), one thread each.
Each repeat runs, interleaved: tp = 1 on rank 0 alone with one thread and with two (rank 1 waits in a barrier,
idle), then tp = 2 on both ranks. The same prompts (held-out ones, cut to `--prompt-tokens`) and greedy decoding
throughout; `identical`: tp = 2 generated what tp = 1 did (fp32: the all-reduces sum in another order, so a near
tie may resolve differently; the float64 tests require identity). Collectives per round: the all-reduces of the
layers plus the block broadcast and the fault vote, counted by the engine's group; `all-reduce`: the median time
of one all-reduce of a round's hidden state `[B, T, d]` alone (what each of those costs). Medians over `--repeats`.
On a GPU machine with N devices, `torchrun --nproc-per-node N -m specdec generate --tp N` runs the same engine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import specdec  # noqa: E402
from specdec.parallel import close_group  # noqa: E402

CONFIGS = ("tp1 x1 thread", "tp1 x2 threads", "tp2")


def _measure(rank: int, a: dict, model_dir: str, drafters: dict, prompts: list) -> dict:
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    group = dist.group.WORLD
    out = []
    for name, drafter in drafters.items():
        for B in a["batches"]:
            batch = [torch.tensor(prompts[b % len(prompts)]) for b in range(B)]
            length = max(len(p) for p in batch) + a["max_new_tokens"] + 8
            opts = dict(drafter=drafter, max_batch_size=B, max_length=length)
            single = specdec.wrap(model, **opts) if rank == 0 else None
            tp = specdec.wrap(model, tp_group=group, **opts)

            def run(engine):
                t0 = time.perf_counter()
                res = engine.generate(batch, max_new_tokens=a["max_new_tokens"], eos_token_id=None)
                return res, time.perf_counter() - t0

            times = {c: [] for c in CONFIGS}
            seqs = {}
            for rep in range(a["repeats"] + 1):  # the first: warm-up, not timed
                for threads, config in ((1, CONFIGS[0]), (2, CONFIGS[1])):
                    dist.barrier()
                    if rank == 0:
                        torch.set_num_threads(threads)
                        res, dt = run(single)
                        seqs[config] = res.sequences.tolist()
                        if rep:
                            times[config].append(dt)
                    dist.barrier()
                torch.set_num_threads(1)
                res, dt = run(tp)
                seqs["tp2"] = res.sequences.tolist()
                if rep:
                    times["tp2"].append(dt)
            new = B * a["max_new_tokens"]
            hidden = torch.zeros(B, tp.runner.num_verify_tokens, tp.runner.hidden_size)
            reduce_s = []
            for _ in range(40):  # one all-reduce of a round's hidden state [B, T, d], alone
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(hidden)
                reduce_s.append(time.perf_counter() - t0)
            out.append(dict(drafter=name, batch=B, new_tokens=new, samples_s=times,
                                tokens_per_s={c: new / statistics.median(t) for c, t in times.items() if t},
                                spread={c: common.spread(t) for c, t in times.items() if t},
                                identical=seqs.get(CONFIGS[0]) == seqs["tp2"] if rank == 0 else None,
                                collectives_per_round=sorted(set(res.stats.collectives)),
                                reduces_per_forward=tp.runner.shards.reduces,
                                tau=res.stats.as_dict()["tau"], rounds=res.stats.as_dict()["rounds"],
                                allreduce_us=statistics.median(reduce_s[10:]) * 1e6))
    return out


def worker(job: Path, rank: int, port: int) -> None:
    """One rank of two (a gloo group on `port` of this machine): the measurements of `job`; rank 0 writes them
    beside it."""
    spec = json.loads(job.read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ok = False
    try:
        torch.set_num_threads(1)
        rows = _measure(dist.get_rank(), spec["opts"], spec["model_dir"], spec["drafters"], spec["prompts"])
        if dist.get_rank() == 0:
            (job.parent / "rows.json").write_text(json.dumps(rows))
        ok = True
    finally:
        close_group(ok)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # --worker JOB RANK PORT
        return worker(Path(argv[1]), int(argv[2]), int(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--prompts", default=str(common.PROMPTS))
    p.add_argument("--kinds", default="code,prose")
    p.add_argument("--drafters", default="ngram,mtp")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.repeats < 3:
        p.error(f"--repeats: expected >= 3 (a median of at least 3), got {a.repeats}")
    for flag, val in (("--prompt-tokens", a.prompt_tokens), ("--max-new-tokens", a.max_new_tokens)):
        if val < 1:
            p.error(f"{flag}: expected >= 1, got {val}")
    batches = [int(b) for b in common.split_list(a.batches)]
    model_dir = common.input_args(p, a.model, a.prompts)
    drafters = {}
    for name in common.split_list(a.drafters):
        d, why = common.resolve_drafter(model_dir, name)
        if d is None:
            p.error(f"--drafters: {name}: {why}")
        drafters[name] = d
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(q["prompt"]).input_ids[-a.prompt_tokens:]
               for q in common.load_prompts(a.prompts, common.split_list(a.kinds), max(batches))]
    opts = dict(batches=batches, max_new_tokens=a.max_new_tokens, repeats=a.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps(dict(opts=opts, model_dir=str(model_dir), drafters=drafters, prompts=prompts)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["OMP_NUM_THREADS"] = "2"
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(job), str(rank), str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        outs = [proc.communicate(timeout=3600) for proc in procs]
        failed = [f"rank {r} ({proc.returncode}):\n{err[-4000:]}" for r, (proc, (_, err)) in
                  enumerate(zip(procs, outs)) if proc.returncode != 0]
        done = Path(tmp) / "rows.json"  # rank 0 writes it after its last collective: both ranks measured everything
        if failed and not done.exists():
            raise RuntimeError("a rank failed: " + "\n".join(failed))
        for f in failed:  # after the measurements: reported, the rows stand
            print(f"warning: {f.splitlines()[0]} failed in its teardown, after the measurements:\n"
                  f"{f.splitlines()[-1] if len(f.splitlines()) > 1 else ''}", file=sys.stderr)
        rows = json.loads(done.read_text())
    print(f"tensor parallel, {a.model}, gloo on CPU ({common.cpu_name()}, {os.cpu_count()} cores), "
          f"{a.max_new_tokens} new tokens per request, greedy, medians of {a.repeats}")
    print(f"{'drafter':>8} {'batch':>5} " + " ".join(f"{c + ' tok/s':>20}" for c in CONFIGS)
          + f" {'tp2 / tp1x1':>11} {'tp2 / tp1x2':>11} {'identical':>9} {'coll./round':>11} {'all-reduce':>10}"
          f" {'spread':>6}")
    for r in rows:
        tps = r["tokens_per_s"]
        r["ratio_tp2_over_tp1_1thread"] = tps["tp2"] / tps[CONFIGS[0]]
        r["ratio_tp2_over_tp1_2threads"] = tps["tp2"] / tps[CONFIGS[1]]
        print(f"{r['drafter']:>8} {r['batch']:>5} " + " ".join(f"{tps[c]:>20.1f}" for c in CONFIGS)
              + f" {r['ratio_tp2_over_tp1_1thread']:>11.2f} {r['ratio_tp2_over_tp1_2threads']:>11.2f}"
              f" {str(r['identical']):>9} {','.join(map(str, r['collectives_per_round'])):>11}"
              f" {r['allreduce_us']:>7.0f} us"
              f" {max(r['spread'].values()):>6.2f}")
    if any(max(r["spread"].values()) > 0.25 for r in rows):
        print("note: a configuration's spread ((p90 - p10) / median over repeats) exceeds 25%: a noisy machine")
    res = dict(model=a.model, max_new_tokens=a.max_new_tokens, prompt_tokens=a.prompt_tokens, repeats=a.repeats,
               machine=common.machine_info("cpu"), threads_per_rank=1, rows=rows,
               teardown_failures=[f.splitlines()[0] for f in failed])
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
