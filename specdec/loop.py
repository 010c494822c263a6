"""The request loop of a `SpecEngine`: its queue, its lanes and its steps.

Requests enter the queue (`SpecEngine.submit`, or `generate` for each of its prompts); `step` retires cancelled
requests, admits waiting ones in order while lanes are free and their KV pages fit, runs one round per group of
running requests that decode alike (`Request.key`) and retires finished ones; `start` / `stop` run the steps in a
background thread. An exception in an admission or a round fails only the requests it carried. Under tensor
parallelism rank 0's loop leads: before each step it sends its new requests and cancellations to the other ranks,
which `follow` it step for step.
"""

from __future__ import annotations

import abc
import collections
import threading

import torch

from . import cpu_linear
from .build import EngineParts
from .requests import Request
from .tensors import outside_inference

HEARTBEAT = 10.0  # seconds: the longest a tensor-parallel serving loop waits without a step


class _Lanes:
    """The engine's lanes (a lane is a drafter row, < max_batch_size): per lane its request (None: free) and that
    request's target slot; device token buffer `tok [L, W]` (W = max_length + 1), lengths `lens [L]` and anchors
    `anchors [L]`, which rounds update without a host round trip."""

    def __init__(self, L: int, tok: torch.Tensor):
        self.req: list[Request | None] = [None] * L
        self.slot: list = [None] * L
        self.tok = tok
        self.lens = torch.zeros(L, dtype=torch.long, device=tok.device)
        self.anchors = torch.zeros(L, dtype=torch.long, device=tok.device)

    def free(self) -> list[int]:
        return [l for l, r in enumerate(self.req) if r is None]

    def held(self) -> list[int]:
        """The lanes with a request."""
        return [l for l, r in enumerate(self.req) if r is not None]


class RequestLoop(EngineParts, metaclass=abc.ABCMeta):
    """The queue, the lanes and the steps of an engine (see the module docstring). A step calls the engine's
    admission, round and retirement, declared here as abstract methods (`SpecEngine` defines them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the engine's parts, checked and built
        # the request loop (`SpecEngine.step`): lanes (made at the first step), the queue, one step at a time
        self._lanes = None
        self._waiting: collections.deque = collections.deque()
        self._queue_lock = threading.Condition()  # the queue's; the background loop waits on it for work
        self._step_lock = threading.RLock()
        self._stepping = threading.local()  # this thread is inside a step
        self._thread: threading.Thread | None = None
        self._halt = False
        # tensor parallel serving: submissions wait in the inbox until rank 0's loop sends them to every rank, and a
        # cancellation counts once it was sent (`SpecEngine.follow`)
        self._inbox: list = []
        self._uids = 0
        self._cancelled: set[int] = set()

    @abc.abstractmethod
    def _admit(self, lanes: "_Lanes", ids: list[int], reqs: list[Request]) -> list[int]:
        """Start `reqs` in the free lanes `ids`; -> the lanes whose request goes on."""

    @abc.abstractmethod
    def _round(self, active: list[int], lanes: "_Lanes") -> None:
        """One round of the lanes `active`, whose requests decode alike."""

    @abc.abstractmethod
    def _retire(self, ids: list[int], *, publish: bool = False, status: str | None = "finished") -> None:
        """The requests of lanes `ids` leave (their slots and drafter rows let go of)."""

    @abc.abstractmethod
    def _abort(self, rows: list[int]) -> None:
        """Drop an open round of the lanes `rows`."""

    @abc.abstractmethod
    def _fresh(self, worst: int, tokens: list[int]) -> int:
        """KV tokens a request of `worst` tokens takes in fresh pages."""

    @staticmethod
    def _done(r: Request) -> bool:
        return len(r.out) >= r.max_new or (bool(r.out) and r.out[-1] in r.eos)

    def _leaving(self, r: Request) -> bool:
        """Whether `r` was cancelled: at once, or (tensor parallel) once rank 0's loop sent the cancellation."""
        return r._cancel if self.tp is None else r.uid in self._cancelled

    def follow(self) -> None:
        """Tensor parallel serving, on every rank but 0: run the request loop that rank 0's background loop
        (`start`) leads, step for step: before each step rank 0 sends its new requests and cancellations, which
        this rank submits and applies as rank 0 did. Returns when rank 0's loop stops."""
        if self.tp is None or self.tp.leads:
            raise ValueError("follow: on the ranks of a tp_group other than rank 0 (rank 0 serves with start)")
        with torch.inference_mode(), cpu_linear.engaged():
            while not self._apply(self.tp.broadcast_object(None)):
                self.step()

    def _apply(self, message) -> bool:
        """A step's message from rank 0: (halt, [(uid, prompt ids, keywords, seed)], cancelled uids) -> halt."""
        halt, new, cancelled = message
        for uid, prompt, kw, seed in new:
            if self.tp.leads:
                continue  # rank 0 queued its own requests
            _, _, reqs = self._requests(prompt, None, None, seed, None, dict(kw), one=True, agree=False)
            reqs[0].uid = uid
            self._enqueue(reqs)
        self._cancelled.update(cancelled)
        return halt

    @property
    def num_running(self) -> int:
        """Requests in a lane now."""
        return 0 if self._lanes is None else len(self._lanes.held())

    @property
    def num_waiting(self) -> int:
        """Requests queued for a lane."""
        return len(self._waiting)

    def _enqueue(self, reqs: list[Request]) -> None:
        with self._queue_lock:
            self._waiting.extend(reqs)
            self._queue_lock.notify_all()

    def _drive(self, reqs: list[Request]) -> None:
        """Until `reqs` end: step the loop here (or, while the background loop runs, wait for it); the first failed
        request's error is raised at once."""
        while not all(r.done for r in reqs):
            if self._thread is not None:
                for r in reqs:
                    r._ended.wait()
            else:
                self.step()
            err = next((r.error for r in reqs if r.error is not None), None)
            if err is not None:
                raise err

    def _withdraw(self, reqs: list[Request]) -> None:
        """`reqs` that have not ended leave the loop now: out of the queue, or retired from their lanes (publishing
        nothing); a round in flight is not theirs (steps hold the step lock)."""
        if all(r.done for r in reqs):
            return
        with self._step_lock:
            gone = {id(r) for r in reqs if not r.done}
            with self._queue_lock:
                self._waiting = collections.deque(r for r in self._waiting if id(r) not in gone)
            lanes = self._lanes
            held = [] if lanes is None else [l for l in lanes.held() if id(lanes.req[l]) in gone]
            try:
                if held:
                    self._retire(held, publish=False, status="cancelled")
            finally:
                for r in reqs:
                    if not r.done:
                        r._end("cancelled")

    @torch.inference_mode()
    def step(self) -> bool:
        """One step of the request loop: cancelled requests leave (their lanes and slots freed; what they committed
        stays, and is cached), waiting requests are admitted in order while lanes are free and their worst case's
        KV pages fit, then one round runs per group of running requests that decode alike (`Request.key`), and
        finished requests leave. An exception in an admission or a round fails only the requests it carried (with
        it; nothing of that round is committed), and the engine goes on; an interrupt (a BaseException that is not an
        Exception) fails them too and propagates. -> whether requests remain (running or waiting)."""
        with self._step_lock:
            self._stepping.on = True
            try:
                with cpu_linear.engaged():
                    self._step()
            finally:
                self._stepping.on = False
            with self._queue_lock:
                return bool(self._waiting) or bool(self._lanes.held())

    def _step(self) -> None:
        lanes = self._lanes_ready()
        self.lane_slots = lanes.slot  # the drafters' view of the lanes' slots (`TargetView.slots`)
        cancelled = [l for l in lanes.held() if self._leaving(lanes.req[l])]
        if cancelled:
            self._retire(cancelled, publish=True, status="cancelled")
        self._admit_waiting(lanes)
        running = lanes.held()
        groups: dict[tuple, list[int]] = {}
        for l in running:
            groups.setdefault(lanes.req[l].key, []).append(l)
        for active in groups.values():
            try:
                self._round(active, lanes)
                done = [l for l in active if self._done(lanes.req[l])]
                if done:
                    self._retire(done, publish=True)
            except BaseException as e:
                self._fail(active, e)
                if not isinstance(e, Exception):
                    raise

    def _admit_waiting(self, lanes: "_Lanes") -> None:
        """Admit waiting requests in order while a lane is free and their worst cases' pages fit (each check sizes
        every chosen request again: an eviction may take the prefix one would share); those that end at their first
        token leave at once and their lanes are refilled."""
        while True:
            free = lanes.free()
            ids, reqs = [], []
            with self._queue_lock:
                pending = []
                for r in self._waiting:
                    if self._leaving(r):
                        r._end("cancelled")
                    else:
                        pending.append(r)
                if len(pending) != len(self._waiting):
                    self._waiting = collections.deque(pending)
            while free and pending:
                if self.runner.fits([self._fresh(r.worst, r.hist) for r in reqs + [pending[0]]]):
                    ids.append(free.pop(0))
                    reqs.append(pending.pop(0))
                elif self.prefix_cache is None or not self.prefix_cache.evict_one():  # entries hold pages too
                    break
            if not ids:
                if pending and not lanes.held():
                    # cannot happen: the page pool holds a request at max_length (`memory.pages_within`)
                    raise RuntimeError(f"memory: a request of {pending[0].worst} tokens does not fit the KV page "
                                       f"pool even with nothing running")
                return
            with self._queue_lock:
                taken = {id(r) for r in reqs}
                self._waiting = collections.deque(r for r in self._waiting if id(r) not in taken)
            try:
                going = self._admit(lanes, ids, reqs)
            except BaseException as e:
                self._fail([l for l in ids if lanes.req[l] is not None], e, reqs=reqs)
                if not isinstance(e, Exception):
                    raise
                continue
            ended = [l for l in ids if l not in going]  # ended at their first token
            if not ended:
                return
            self._retire(ended, publish=True)

    def _fail(self, ids: list[int], error: BaseException, *, reqs: list[Request] = ()) -> None:
        """An admission or a round of lanes `ids` raised: drop what is open, let go of their slots (publishing
        nothing) and end their requests (and `reqs`, requests of an admission not yet in a lane) with `error`."""
        lanes = self._lanes
        hit = [lanes.req[l] for l in ids if lanes.req[l] is not None]
        try:
            self._abort(ids)
        finally:
            try:
                self._retire([l for l in ids if lanes.slot[l] is not None or lanes.req[l] is not None],
                             publish=False, status=None)
            finally:
                for r in {id(r): r for r in [*hit, *reqs]}.values():
                    if not r.done:
                        r._end("failed", error)

    def _lanes_ready(self) -> "_Lanes":
        if self._lanes is None:
            L, dev = self.config.max_batch_size, self.runner.device
            with outside_inference():  # kept across calls
                tok = torch.full((L, self.max_length + 1), self.pad_token_id, dtype=torch.long, device=dev)
                self._lanes = _Lanes(L, tok)
        return self._lanes

    def start(self) -> None:
        """Run the request loop in a background thread (it steps while requests wait or run, and sleeps otherwise):
        `submit` from anywhere, and `generate` waits for it. `stop()` ends it. With tp_group: on rank 0, while
        every other rank runs `follow` (each step's new requests and cancellations are sent to them first)."""
        if self.tp is not None and not self.tp.leads:
            raise ValueError("start: with tp_group, on rank 0 (the other ranks follow its loop: `follow`)")
        if self._thread is not None:
            return
        self._halt = False
        self._thread = threading.Thread(target=self._serve, name="specdec-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the background loop after its current step (requests still queued or running stay; `step` or
        `start` goes on with them)."""
        thread = self._thread
        if thread is None:
            return
        with self._queue_lock:
            self._halt = True
            self._queue_lock.notify_all()
        thread.join()
        self._thread = None

    @torch.inference_mode()
    def _serve(self) -> None:
        with cpu_linear.engaged():  # one block for the loop's life: its weights are not updated meanwhile
            while True:
                with self._queue_lock:
                    # tensor parallel: a step at least every HEARTBEAT seconds keeps the followers' collective waiting
                    while not self._halt and not self._waiting and not self._inbox and not (
                            self._lanes is not None and self._lanes.held()):
                        if not self._queue_lock.wait(None if self.tp is None else HEARTBEAT):
                            break
                    halt, new, self._inbox = self._halt, self._inbox, []
                if self.tp is not None:  # this step's requests and cancellations to every rank, then the step
                    gone = [r.uid for r in (*self._waiting, *(self._lanes.req if self._lanes else ()))
                            if r is not None and r._cancel and r.uid not in self._cancelled]
                    self._apply(self.tp.broadcast_object(
                        (halt, [(r.uid, *r.spec) for r in new], gone)))
                    self._enqueue(new)
                if halt:
                    return
                self.step()
