"""`Request`: one request in a `SpecEngine`'s request loop, from `submit` or one prompt of `generate`.

A request waits in the engine's queue, runs in a lane (a drafter row with a target slot) from its admission to its
end, and ends finished ('stop': it emitted an eos id; 'length': it reached `max_new_tokens`), cancelled (its new
tokens so far stay committed, and cached) or failed (`error`: the exception of the admission or round that carried
it; nothing of that round was committed). Its new tokens arrive as they are committed: iterate it (blocking), or
`async for` it, from any thread; `result()` waits for the end.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

import torch

from specdec.verify import SamplingParams

from .stats import SpecStats

_END = object()  # the last item of a request's token stream


@dataclass(eq=False)
class Request:
    """One request (see the module docstring). Set by the engine: `prompt [P]` (long, the target's device), `hist`
    (prompt, committed tokens, the anchor last) and `out` (new tokens) on the host, `worst` (its KV tokens at most:
    prompt, new tokens and a verify window), how it decodes (`max_new`, stop ids `eos`, `sampling`), its sampling
    streams (`gen`: first token and acceptance; `draft_gen`: the drafter's), the counters it records into (`stats`,
    shared by a `generate` call's requests), an optional transformers `streamer`, and `index`, its row in the
    caller's batch (named in errors)."""

    prompt: torch.Tensor
    hist: list[int]
    max_new: int
    eos: set[int]
    sampling: SamplingParams
    gen: torch.Generator | None = None
    draft_gen: torch.Generator | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    streamer: object = None
    index: int = 0
    worst: int = 0
    uid: int = 0  # its number in the engine's request loop (tensor parallel: the same on every rank)
    spec: tuple = ()  # (prompt ids, keywords, seed) as submitted: what a tensor-parallel follower submits again
    out: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting, running, finished, cancelled, failed
    error: BaseException | None = None
    _cancel: bool = False
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _ended: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> tuple:
        """Requests that decode alike (one sampling rule, one stream): one round serves them together (greedy
        requests draw nothing: all of them)."""
        s = self.sampling
        if not s.do_sample:
            return (False,)
        return True, s.temperature, s.top_k, s.top_p, id(self.gen), id(self.draft_gen)

    @property
    def done(self) -> bool:
        return self._ended.is_set()

    @property
    def finish_reason(self) -> str | None:
        """'stop' (ended on an eos id), 'length' (reached max_new_tokens), 'cancelled', 'error', None (not ended)."""
        if not self.done:
            return None
        if self.status == "cancelled":
            return "cancelled"
        if self.status == "failed":
            return "error"
        return "stop" if self.out and self.out[-1] in self.eos else "length"

    def cancel(self) -> None:
        """End the request at the next round boundary (its lane and slot freed then); what it committed stays."""
        self._cancel = True

    def result(self, timeout: float | None = None) -> list[int]:
        """Its new tokens once it ended (TimeoutError past `timeout` seconds); a failed request raises its error."""
        if not self._ended.wait(timeout):
            raise TimeoutError(f"request: not ended after {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.out)

    def __iter__(self):
        """Its new tokens as they are committed (ints), until it ends; a failed request raises its error there."""
        while True:
            item = self._events.get()
            if item is _END:
                break
            yield from item
        if self.error is not None:
            raise self.error

    async def __aiter__(self):
        """The same as an async iterator (each wait runs in a worker thread: the event loop is never blocked)."""
        async for tokens in self.rounds():
            for x in tokens:
                yield x

    async def rounds(self):
        """Async iterator of its new tokens as each round commits them: a list per round (a server sends one chunk
        per round); a failed request raises its error at the end."""
        while True:
            item = await asyncio.to_thread(self._events.get)
            if item is _END:
                break
            yield item
        if self.error is not None:
            raise self.error

    # ---- the engine's side ----------------------------------------------------------------------------------
    def _emit(self, tokens: list[int]) -> None:
        self.out.extend(tokens)
        self._events.put(list(tokens))
        if self.streamer is not None:
            self.streamer.put(torch.tensor(tokens))

    def _end(self, status: str, error: BaseException | None = None) -> None:
        self.status, self.error = status, error
        self._ended.set()
        self._events.put(_END)
