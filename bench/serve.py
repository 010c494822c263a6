"""`specdec serve` under load: concurrent clients streaming completions, per drafter, and a multi-turn chat.

    python bench/serve.py                                        # embedded model: dspark (the best) and none
    python bench/serve.py --drafters dspark,none --requests 200 --clients 32 --json bench/results/serve.json
    python bench/serve.py --requests 6 --clients 3 --max-tokens 8 --turns 2     # a quick look

For each drafter of `--drafters` ("none": plain decoding) the server is started as a process (`python -m specdec
serve`, `--max-batch-size` lanes, `--threads` torch threads), then `--requests` streaming completions at temperature
0 (the prompts of the embedded model's prompts.jsonl in turn, each cut to `--prompt-tokens`) are sent by
`--clients` concurrent clients (the official `openai` client, one thread each). Per request: time to first token
(the first chunk with text), the gaps between chunks (inter-token latency: a round that commits several tokens
sends them in one chunk) and the tokens it got (`usage`). Reported: throughput (completion tokens per second of
wall time), p50 / p99 time to first token and inter-token latency, tokens per request, and requests lost (no
answer) or errored (an error status or chunk); 0 and 0 is the bar. The greedy texts of every drafter must equal
plain decoding's (`identical`).

Then a multi-turn chat (`--turns` turns, one client): each turn resends the whole conversation (its prompt, the
replies so far and a new message of the next prompt), as chat clients do; time to first token at each turn, with
the server's prefix cache on (turn n starts from turn n-1's cached state).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m specdec serve` as a process, up until the block ends."""

    def __init__(self, model: Path, drafter: str, a):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["OMP_NUM_THREADS"] = str(a.threads)
        self.cmd = [sys.executable, "-m", "specdec", "serve", "--model", str(model), "--drafter", drafter,
                    "--port", str(self.port), "--max-batch-size", str(a.max_batch_size),
                    "--served-model-name", "bench"]
        self.env = env

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        while time.time() - t0 < 300:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("the server did not come up")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}


def stream_one(client, prompt: str, max_tokens: int) -> dict:
    """One streaming completion -> its times (from the call), text, tokens and error (None: none)."""
    t0 = time.perf_counter()
    arrivals, text, tokens, error = [], [], 0, None
    try:
        for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True):
            now = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(now)
                text.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None) is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # an error status, an error chunk, a dropped connection
        error = f"{type(e).__name__}: {e}"
    return dict(ttft=arrivals[0] if arrivals else None, gaps=[b - a for a, b in zip(arrivals, arrivals[1:])],
                total=time.perf_counter() - t0, text="".join(text), tokens=tokens, error=error)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


def load(url: str, prompts: list[str], a) -> dict:
    import openai
    jobs: queue.Queue = queue.Queue()
    for i in range(a.requests):
        jobs.put(i)
    results: dict[int, dict] = {}

    def client_loop():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            results[i] = stream_one(client, prompts[i % len(prompts)], a.max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results.values() if r["error"] is None]
    tokens = sum(r["tokens"] for r in done)
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    gaps = [g for r in done for g in r["gaps"]]
    return dict(wall_s=wall, requests=a.requests, clients=a.clients, completed=len(done),
                lost=a.requests - len(results), errored=sum(r["error"] is not None for r in results.values()),
                errors=sorted({r["error"] for r in results.values() if r["error"]})[:5],
                tokens=tokens, tokens_per_s=tokens / wall, requests_per_s=len(done) / wall,
                ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), itl_p50_s=pct(gaps, 50), itl_p99_s=pct(gaps, 99),
                tokens_per_request=statistics.mean(r["tokens"] for r in done) if done else 0,
                texts={i: results[i]["text"] for i in sorted(results)})


def chat_series(url: str, prompts: list[str], a) -> list[dict]:
    """`--turns` turns of one conversation: each resends the history plus the next prompt as a new message."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    history, rows = "", []
    for turn in range(a.turns):
        history += prompts[turn % len(prompts)]
        r = stream_one(client, history, a.max_tokens)
        history += r["text"]
        rows.append(dict(turn=turn + 1, prompt_chars=len(history), ttft_s=r["ttft"], error=r["error"]))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--drafters", default="dspark,none", help="comma list: best (the model's best.txt), a name "
                   "under the model's drafters/, ngram, or none")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="each prompt cut to about this many tokens")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer
    model_dir = common.resolve_model_dir(a.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    raw = [json.loads(line)["prompt"] for line in open(model_dir / "prompts.jsonl")]
    prompts = [tok.decode(tok(t).input_ids[:a.prompt_tokens]) for t in raw]
    rows, series = {}, {}
    print(f"serve, {model_dir.name}, {a.requests} requests from {a.clients} clients, max_tokens {a.max_tokens}, "
          f"{a.max_batch_size} lanes, threads {a.threads}")
    for name in common.split_list(a.drafters):
        drafter = name
        if name not in ("none", "ngram"):
            if name == "best":
                name = (model_dir / "drafters" / "best.txt").read_text().split()[0]
            drafter = str(model_dir / "drafters" / name)
        with ServerProcess(model_dir, drafter, a) as srv:
            rows[name] = load(srv.url, prompts, a)
            rows[name]["metrics"] = srv.metrics()
            series[name] = chat_series(srv.url, prompts, a)
    plain = rows.get("none")
    for name, r in rows.items():
        r["identical"] = None if plain is None else r["texts"] == plain["texts"]
    print(f"{'drafter':>8} {'tok/s':>7} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'tau':>5} {'lost':>5} {'err':>4} {'identical':>9}")
    for name, r in rows.items():
        def ms(x):
            return f"{x * 1e3:.0f}ms" if x is not None else "-"
        print(f"{name:>8} {r['tokens_per_s']:>7.1f} {r['requests_per_s']:>6.2f} {ms(r['ttft_p50_s']):>9} "
              f"{ms(r['ttft_p99_s']):>9} {ms(r['itl_p50_s']):>8} {ms(r['itl_p99_s']):>8} "
              f"{r['metrics'].get('specdec_tau', 0):>5.2f} {r['lost']:>5} {r['errored']:>4} {str(r['identical']):>9}")
    if plain is not None:
        for name, r in rows.items():
            if name != "none":
                print(f"{name}: {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x plain's throughput at equal load")
    print("multi-turn chat: time to first token per turn (the prefix cache on)")
    for name, turns in series.items():
        t = [r["ttft_s"] for r in turns]
        print(f"{name:>8} " + " ".join(f"{x * 1e3:.0f}" if x is not None else "-" for x in t)
              + (f"   turn {len(t)} / turn 1: {t[-1] / t[0]:.2f}" if len(t) > 1 and t[0] and t[-1] else ""))
    out = dict(args=vars(a), machine=common.machine_info("cpu"), load=rows, chat=series)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
