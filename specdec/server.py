"""An OpenAI-compatible HTTP server over a `SpecEngine` (`specdec serve`; FastAPI + uvicorn, the `[serve]` extra).

Routes, as vLLM, SGLang and `transformers serve` expose them:
- `POST /v1/completions` and `POST /v1/chat/completions` (the tokenizer's chat template; a 400 when it has none):
  `max_tokens`, `temperature` (0: greedy; unset: the model's generation config), `top_p`, `top_k` (vLLM's
  extension), `seed`, `stop` (strings), `n` (1), `stream` (server-sent events ending `data: [DONE]`), `usage` and
  `finish_reason` ('stop' at an eos id or a stop string, 'length' at max_tokens).
- `GET /v1/models`, `GET /health`, and `GET /metrics` (Prometheus text: tau, acceptance, tokens, requests running
  and waiting, prefix hit rate, drafter failures).

Every request is a `Request` of the engine's background loop (`SpecEngine.start`), so concurrent clients are batched
in its rounds; a client that disconnects mid-stream cancels its request at the next round boundary. Bad requests
get OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) with a 4xx status; a request that fails
in a round gets a 500 with its error, and the server goes on.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request as HTTPRequest  # the module needs the [serve] extra; FastAPI reads this annotation

from .stats import SpecStats


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _error(message: str, *, status: int, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class Server:
    """The app's state: `engine` (its loop started by the app), `tokenizer`, the name clients address the model by
    (`model_name`), and the counters every request records into (`stats`)."""

    def __init__(self, engine, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.stats = SpecStats()
        self.started = time.time()
        self.eos = engine.eos_token_id if engine.eos_token_id is not None else tokenizer.eos_token_id
        self.requests = {"finished": 0, "failed": 0, "cancelled": 0}

    # ---- request bodies ---------------------------------------------------------------------------------------
    def _settings(self, body: dict) -> dict:
        """The engine keywords of an OpenAI body (checked here: a `_BadRequest` names the field)."""
        def number(name, lo=None, hi=None, *, integer=False, lo_open=False):
            v = body.get(name)
            if v is None:
                return None
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or (lo is not None and (v <= lo if lo_open else v < lo)) or \
                    (hi is not None and v > hi):
                bound = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
                raise _BadRequest(f"{name}: expected {'an integer' if integer else 'a number'} {bound}"
                                  f"{f' and <= {hi}' if hi is not None else ''}, got {v!r}", name)
            return v

        model = body.get("model")
        if model is not None and model != self.model_name:
            raise _BadRequest(f"The model `{model}` does not exist (this server serves `{self.model_name}`)", "model",
                              status=404, code="model_not_found")
        n = number("n", 1, 1, integer=True)
        max_tokens = number("max_tokens", 1, integer=True)
        if body.get("max_completion_tokens") is not None:
            max_tokens = number("max_completion_tokens", 1, integer=True)
        temperature = number("temperature", 0, 100)
        top_p = number("top_p", 0, 1, lo_open=True)
        top_k = number("top_k", -1, integer=True)
        seed = number("seed", integer=True)
        del n
        kw: dict = {"max_new_tokens": max_tokens or 16, "eos_token_id": self.eos}
        if temperature == 0:
            kw["do_sample"] = False
        elif temperature is not None or top_p is not None:
            kw.update(do_sample=True, temperature=1.0 if temperature is None else float(temperature),
                      top_p=1.0 if top_p is None else float(top_p), top_k=0 if top_k in (None, -1) else top_k)
        if seed is not None:
            kw["seed"] = seed
        return kw

    def _stops(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise _BadRequest(f"stop: expected a non-empty string or a list of up to 4, got {stop!r}", "stop")
        return stops

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise _BadRequest("messages: expected a non-empty list of {role, content} with string content",
                                  "messages")
            if not getattr(self.tokenizer, "chat_template", None):
                raise _BadRequest("This model's tokenizer has no chat template: use /v1/completions with a prompt",
                                  "messages")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt).input_ids
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
                ids = prompt
            else:
                raise _BadRequest("prompt: expected a string or a list of token ids (one prompt)", "prompt")
        if not ids:
            raise _BadRequest("prompt: tokenizes to no tokens", "prompt" if not chat else "messages")
        return list(ids)

    def submit(self, body: dict, chat: bool):
        """-> (the engine's Request, prompt ids, stop strings)."""
        kw = self._settings(body)
        stops = self._stops(body)
        ids = self._prompt(body, chat)
        try:
            req = self.engine.submit(ids, stats=self.stats, **kw)
        except ValueError as e:  # the engine's checks (length, token ids): the field it names
            name = str(e).split(":", 1)[0]
            raise _BadRequest(str(e), {"max_new_tokens": "max_tokens", "input_ids": "prompt"}.get(name, name))
        return req, ids, stops

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- metrics ----------------------------------------------------------------------------------------------
    def metrics(self) -> str:
        s, eng = self.stats, self.engine
        up = max(time.time() - self.started, 1e-9)
        gen_tokens = s.tokens
        rows = [
            ("specdec_requests_running", "gauge", "requests in a lane", eng.num_running),
            ("specdec_requests_waiting", "gauge", "requests queued", eng.num_waiting),
            ("specdec_tau", "gauge", "tokens committed per verify forward (bonus included)", s.tau),
            ("specdec_acceptance_rate", "gauge", "accepted / proposed drafts", s.alpha),
            ("specdec_prefix_hit_rate", "gauge", "share of prompt tokens served from the prefix cache",
             s.prefix_hit_rate),
            ("specdec_tokens_per_second", "gauge", "tokens committed by rounds per second of uptime", gen_tokens / up),
            ("specdec_generated_tokens_total", "counter", "tokens committed by rounds", gen_tokens),
            ("specdec_prompt_tokens_total", "counter", "prompt tokens admitted", s.prompt_tokens),
            ("specdec_cached_prompt_tokens_total", "counter", "prompt tokens served from the prefix cache",
             s.cached_tokens),
            ("specdec_rounds_total", "counter", "verify forwards, counted per request", s.rounds),
            ("specdec_drafted_tokens_total", "counter", "draft tokens proposed", s.proposed),
            ("specdec_accepted_tokens_total", "counter", "draft tokens accepted", s.accepted),
            ("specdec_drafter_failures_total", "counter", "rounds whose drafter failed (plain decode)",
             s.drafter_failures),
        ] + [(f"specdec_requests_{k}_total", "counter", f"requests {k}", v) for k, v in self.requests.items()]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
        return "\n".join(out) + "\n"


def _stop_cut(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string starts in `text` at `start` or later (None: none)."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def create_app(engine, tokenizer, *, model_name: str):
    """The FastAPI app serving `engine` (its loop runs from the app's startup to its shutdown)."""
    import asyncio
    import contextlib

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    server = Server(engine, tokenizer, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _error(f"invalid request: {exc.errors()[0].get('msg', exc)}", status=400)

    async def body_of(request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _BadRequest(f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(server.started),
                                            "owned_by": "specdec"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    async def complete(request: HTTPRequest, chat: bool):
        try:
            body = await body_of(request)
            req, ids, stops = server.submit(body, chat)
        except _BadRequest as e:
            return _error(e.message, status=e.status, param=e.param, code=e.code)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, reason, delta: bool):
            if chat:
                key = "delta" if delta else "message"
                return {"index": 0, key: ({"role": "assistant", "content": text} if not delta else
                                          {"content": text}), "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        hold = max((len(s) for s in stops), default=1) - 1  # text a stop string could still start in

        def finish(text_now: str, checked: int = 0):
            """(text to return, finish reason) once the request ended or a stop string showed up (`checked`: the
            text before it was searched with every stop string whole)."""
            cut = _stop_cut(text_now, stops, max(0, checked - hold))
            if cut is not None:
                return text_now[:cut], "stop"
            return text_now, ("stop" if req.finish_reason == "stop" else "length")

        def record(status: str):
            server.requests[status] += 1

        if not body.get("stream"):
            tokens, text, checked = [], "", 0
            try:
                async for got in req.rounds():
                    tokens += got
                    if stops:  # only the new text (and what a stop string could have begun in) is searched
                        text = server.text(tokens)
                        if _stop_cut(text, stops, max(0, checked - hold)) is not None:
                            req.cancel()
                            break
                        checked = len(text)
            except Exception as e:  # the round that carried it failed: this request only
                record("failed")
                return _error(f"generation failed: {type(e).__name__}: {e}", status=500, kind="server_error")
            text, reason = finish(text if stops else server.text(tokens), checked)  # with stops: decoded above
            record("finished")
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice(text, reason, delta=False)], "usage": usage(len(tokens))})

        async def events():
            tokens, text, sent, done = [], "", 0, False
            try:
                if chat:
                    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]}
                    yield f"data: {json.dumps(head)}\n\n"
                async for got in req.rounds():
                    tokens += got
                    text = server.text(tokens)
                    cut = _stop_cut(text, stops, max(0, sent - hold))  # what was sent holds no stop string
                    ready = cut if cut is not None else max(len(text) - hold, sent)
                    if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                        ready = min(ready, len(text) - 1)
                    if ready > sent:
                        piece = text[sent:ready]
                        sent = ready
                        chunk = {"id": rid, "object": "chat.completion.chunk" if chat else kind,
                                 "created": created, "model": model_name, "choices": [choice(piece, None, True)]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if cut is not None:
                        req.cancel()
                        break
                text, reason = finish(text, sent)  # the last round's text: the tokens are all decoded
                last = {"id": rid, "object": "chat.completion.chunk" if chat else kind, "created": created,
                        "model": model_name, "choices": [choice(text[sent:], reason, True)],
                        "usage": usage(len(tokens))}
                yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
                record("finished")
            except asyncio.CancelledError:  # the client went away
                raise
            except Exception as e:
                record("failed")
                err = {"error": {"message": f"generation failed: {type(e).__name__}: {e}", "type": "server_error",
                                 "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
                done = True
            finally:
                if not done:  # a dropped stream: its lane and slot are freed at the next round boundary
                    req.cancel()
                    record("cancelled")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await complete(request, chat=True)

    return app
