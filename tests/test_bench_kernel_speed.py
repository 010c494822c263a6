"""bench/kernel_speed.py's device timing, on a stand-in for the CUDA runtime (no GPU here): the calls captured in one
graph are replayed and the time per call is a replay's time over the calls; where a capture fails, the same calls
run eagerly, queued, and are timed the same way."""

from __future__ import annotations

import contextlib

import pytest
from bench_scripts import load_bench

ks = load_bench("kernel_speed")


class FakeCuda:
    """A device clock in ms: each call of the timed function costs `cost` ms of device time when it runs (eagerly,
    or as a node of a replayed graph); a capture records the calls without running them."""

    def __init__(self, cost: float, capturable: bool):
        self.clock, self.cost, self.capturable = 0.0, cost, capturable
        self.capturing, self.captured, self.ran = False, 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        class Graph:
            def __init__(self):
                self.calls = 0

            def replay(self):
                fake.clock += self.calls * fake.cost
                fake.ran += self.calls

        class Stream:
            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def graph(g):
            before, fake.current = fake.current, Stream()  # captures on a stream of its own
            fake.capturing = True
            yield
            fake.capturing = False
            g.calls, fake.captured = fake.captured, 0
            if not fake.capturable:  # as torch: the capture's end raises, the capture stream stays current
                raise RuntimeError("operation not permitted when stream is capturing")
            fake.current = before

        def set_stream(s):
            fake.current = s

        self.current = self.default = Stream()
        self.Event, self.CUDAGraph, self.graph, self.Stream = Event, Graph, graph, Stream
        self.current_stream = lambda: fake.current
        self.set_stream = set_stream
        self.stream = lambda s: contextlib.nullcontext()
        self.synchronize = lambda: None

    def fn(self):
        if self.capturing:
            self.captured += 1
        else:
            self.clock += self.cost
            self.ran += 1


@pytest.mark.parametrize("capturable,method", [(True, "graph"), (False, "queued")])
def test_device_time_per_call(monkeypatch, capturable, method):
    fake = FakeCuda(cost=1.5, capturable=capturable)
    for name in ("Event", "CUDAGraph", "graph", "Stream", "current_stream", "set_stream", "stream", "synchronize"):
        monkeypatch.setattr(ks.torch.cuda, name, getattr(fake, name))
    ms, how = ks.device_timed(fake.fn, calls=10, reps=7, budget_s=5.0)
    assert how == method
    assert ms == pytest.approx(1.5)
    assert fake.current is fake.default  # the caller's stream is current again, after a failed capture too
    # the side-stream call, one untimed run of the 10 calls, then 7 timed runs of them
    assert fake.ran == 1 + 10 + 7 * 10
