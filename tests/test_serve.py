"""`specdec serve`: the server started as a real process on 127.0.0.1, talked to with the official `openai` client
(and raw HTTP for what the client will not send). The oracle is transformers' own greedy `generate` of the same
saved model, in-process, in float64 on its pure-torch layers; the server runs the model in float64 too.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import http.client
import urllib.error
import urllib.request

import openai
import pytest
import torch

from cli_harness import ROOT
from tiny_models import save_tiny, torch_fallbacks

FAMILY = "qwen3_5"
SEED = 0
NEW = 12
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny qwen3_5 model whose tokenizer has a chat template -> (directory, float64 model, tokenizer)."""
    path = tmp_path_factory.mktemp("serve_model")
    model, tok = save_tiny(path, FAMILY, seed=SEED)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path, model.double().eval(), tok


def call(method: str, url: str, body: str | None = None, timeout: float = 30) -> tuple[int, str]:
    """(status, body text) of one plain HTTP request (stdlib: what the openai client will not send)."""
    req = urllib.request.Request(url, data=None if body is None else body.encode(), method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait(url: str, proc=None, timeout: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()}")
        try:
            if call("GET", url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("the server did not come up")


@contextlib.contextmanager
def serve_process(path, *args, launcher=()):
    """`python [launcher] -m specdec serve` on the saved model (float64, 4 lanes, max_length 160, named "tiny") with
    `args`, one thread a process -> (its base URL, the process), stopped at the end."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, *launcher, "-m", "specdec", "serve", "--model", str(path), "--port",
                             str(port), "--dtype", "float64", "--max-batch-size", "4", "--max-length", "160",
                             "--served-model-name", "tiny", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(model_dir):
    """The server on the saved model -> its base URL."""
    with serve_process(model_dir[0], "--num-draft-tokens", "4") as (url, _):
        yield url


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy(model_dir, ids: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy continuation of `ids` (stops at the eos id, as the server does)."""
    _, model, tok = model_dir
    with torch_fallbacks(), torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def text_of(model_dir, tokens: list[int]) -> str:
    return model_dir[2].decode(tokens, skip_special_tokens=True)


PROMPTS = ["def foo(", "import os\n", "class A:", "return x"]


def test_completions_and_chat_at_temperature_0_are_greedy(server, model_dir):
    c, tok = client(server), model_dir[2]
    for p in PROMPTS[:2]:
        r = c.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
        want = greedy(model_dir, tok(p).input_ids)
        assert r.choices[0].text == text_of(model_dir, want)
        assert r.usage.prompt_tokens == len(tok(p).input_ids) and r.usage.completion_tokens == len(want)
        assert r.choices[0].finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")
    messages = [{"role": "user", "content": "print"}]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert r.choices[0].message.content == text_of(model_dir, greedy(model_dir, list(ids)))
    assert r.choices[0].message.role == "assistant"


def test_streamed_deltas_concatenate_to_the_whole_text(server):
    c = client(server)
    whole = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=NEW, temperature=0)
    parts = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=NEW,
                                                                temperature=0, stream=True)]
    assert "".join(parts) == whole.choices[0].text and len(parts) > 2
    messages = [{"role": "user", "content": "x = 1"}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_cut_the_text(server, model_dir):
    c, tok = client(server), model_dir[2]
    full = text_of(model_dir, greedy(model_dir, tok(PROMPTS[0]).input_ids))
    stop = full[3:5]
    assert stop and full.find(stop) == 3
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:3] and r.choices[0].finish_reason == "stop"
    parts = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW,
                                                                temperature=0, stop=stop, stream=True)]
    assert "".join(parts) == full[:3]


def concurrent_texts(url: str, prompts: list[str]) -> list[str]:
    """One greedy completion per prompt, each from its own client thread, all at once."""
    outs = {}

    def one(i):
        outs[i] = client(url).completions.create(model="tiny", prompt=prompts[i], max_tokens=NEW,
                                                 temperature=0).choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [outs[i] for i in range(len(prompts))]


def test_16_concurrent_clients_each_get_their_own_output(server, model_dir):
    tok = model_dir[2]
    prompts = [f"{PROMPTS[i % 4]}{i}" for i in range(16)]
    outs = concurrent_texts(server, prompts)
    for i, p in enumerate(prompts):
        assert outs[i] == text_of(model_dir, greedy(model_dir, tok(p).input_ids)), i


def _metric(url: str, name: str) -> float:
    for line in call("GET", url + "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def drop_a_stream(url: str, *, lines: int) -> list[str]:
    """Start a long streaming completion, read its first `lines` lines, and go away mid-stream -> those lines."""
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 140, "temperature": 0, "stream": True}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    got = [resp.readline().decode() for _ in range(lines)]
    conn.sock.close()
    conn.close()
    return got


def test_a_dropped_stream_frees_its_lane(server):
    before = _metric(server, "specdec_requests_cancelled_total")
    got = drop_a_stream(server, lines=3)
    assert any(line.startswith("data: ") for line in got)
    t0 = time.time()
    while (_metric(server, "specdec_requests_running") > 0
           or _metric(server, "specdec_requests_cancelled_total") == before) and time.time() - t0 < 60:
        time.sleep(0.1)
    assert _metric(server, "specdec_requests_running") == 0
    assert _metric(server, "specdec_requests_cancelled_total") == before + 1
    r = client(server).completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),  # prompt + max_tokens > max_length
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("{not json", 400, None),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, param):
    route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    code, text = call("POST", server + route, content)
    assert code == status, text
    err = json.loads(text)["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    ok = client(server).completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert json.loads(call("GET", server + "/health")[1]) == {"status": "ok"}
    text = call("GET", server + "/metrics")[1]
    for name in ("specdec_tau", "specdec_acceptance_rate", "specdec_tokens_per_second", "specdec_requests_running",
                 "specdec_requests_waiting", "specdec_prefix_hit_rate", "specdec_drafter_failures_total"):
        assert f"# TYPE {name} " in text and any(ln.startswith(name + " ") for ln in text.splitlines())
    assert _metric(server, "specdec_generated_tokens_total") > 0


def test_a_chat_without_template_is_a_400(tmp_path):
    """The embedded model's tokenizer has no chat template: chat is refused, completions served (an in-process
    server on a real socket)."""
    import specdec
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specdec.server import create_app
    path = ROOT / "specdec" / "embedded"
    engine = specdec.wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), drafter="ngram",
                          max_batch_size=2, max_length=256)
    with _uvicorn(create_app(engine, AutoTokenizer.from_pretrained(path), model_name="embedded")) as url:
        code, text = call("POST", url + "/v1/chat/completions",
                          json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
        assert code == 400 and "no chat template" in json.loads(text)["error"]["message"]
        assert client(url).completions.create(model="embedded", prompt="Once", max_tokens=3,
                                              temperature=0).usage.completion_tokens == 3


class _uvicorn:
    """`app` served by uvicorn in a thread on a free port of 127.0.0.1 (its lifespan runs the engine's loop)."""

    def __init__(self, app):
        import uvicorn
        self.port = _port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        url = f"http://127.0.0.1:{self.port}"
        _wait(url)
        return url

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def test_a_failing_drafter_costs_only_speed(model_dir):
    """The drafter raises in every round: every request is served with the greedy output (plain decode), and
    /metrics counts the failures."""
    import specdec
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specdec.server import create_app
    path, _, tok = model_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    engine = specdec.wrap(model, drafter="ngram", max_batch_size=2, max_length=160, num_draft_tokens=4)

    def broken(*a, **k):
        raise RuntimeError("drafter down")
    engine.drafter.propose = broken
    with _uvicorn(create_app(engine, AutoTokenizer.from_pretrained(path), model_name="tiny")) as url:
        with pytest.warns(RuntimeWarning, match="drafter .* failed"):
            for p in PROMPTS[:2]:
                r = client(url).completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
                assert r.choices[0].text == text_of(model_dir, greedy(model_dir, tok(p).input_ids))
        assert _metric(url, "specdec_drafter_failures_total") >= 2


def test_tensor_parallel_serving_under_torchrun(model_dir):
    """`torchrun --nproc-per-node 2 -m specdec serve --tp 2`: rank 0 serves HTTP, rank 1 follows its loop step for
    step; four concurrent clients get transformers' greedy output, a sampled request with a seed answers, and a
    dropped stream is cancelled on both ranks (the next requests are served)."""
    path, _, tok = model_dir
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()))
    with serve_process(path, "--tp", "2", launcher=torchrun) as (url, proc):
        outs = concurrent_texts(url, PROMPTS)
        for i, p in enumerate(PROMPTS):
            assert outs[i] == text_of(model_dir, greedy(model_dir, tok(p).input_ids)), i
        sampled = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0.9,
                                                 seed=7)
        assert sampled.usage.completion_tokens >= 1
        assert drop_a_stream(url, lines=1)[0].startswith("data: ")
        t0 = time.time()
        while _metric(url, "specdec_requests_cancelled_total") < 1 and time.time() - t0 < 60:
            time.sleep(0.1)
        assert _metric(url, "specdec_requests_cancelled_total") == 1
        again = client(url).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=NEW, temperature=0)
        assert again.choices[0].text == outs[2]
        assert proc.poll() is None
