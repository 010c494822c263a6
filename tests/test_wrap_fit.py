"""`wrap` checks its memory plan against the free memory before it allocates anything, and the plan is what the
engine allocates.

1. Options that cannot fit (`max_batch_size=100000`, `max_length=10**8`, a draft model's runner) raise one
   `InsufficientMemoryError` (a `ValueError`) naming the options, the bytes of each part and the free bytes, and
   no state pool, ring or KV buffer was built (the free memory is set small, so the check does not depend on the
   machine; one case uses the machine's own).
2. The plan equals the buffers a wrapped engine holds, name by name (shape and dtype) and in bytes, on hybrid tiny
   models (Kimi-Linear's MLA latents, Qwen3-Next, a Mamba2 hybrid with a shared attention block), for every
   strategy and commit mode: the pool and rings at build, the KV cache and a one-token round's buffers after a
   generate. Drafter caches: the planned bound holds what eagle and dspark allocate.
3. A normal wrap still generates.
"""

from __future__ import annotations

import resource

import pytest
import test_generic_families as generic
import torch
from tiny_models import tiny_model

import specdec
from specdec import memory
from specdec import runner as runner_mod
from specdec.draft.registry import build_drafter_net
from specdec.memory import InsufficientMemoryError, format_bytes
from specdec.replayssm.plan import RING_NAMES

MIB = 2 ** 20
PROMPT = torch.tensor([[3, 4, 5, 6, 3, 4, 5]])


@pytest.fixture(scope="module")
def kimi():
    return tiny_model("kimi_linear", dtype=torch.float32)


@pytest.fixture
def spy_strategy(monkeypatch):
    """Records every state strategy built (the pool and rings are allocated there)."""
    built = []
    real = runner_mod.make_strategy

    def spy(*args, **kwargs):
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "make_strategy", spy)
    return built


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


@pytest.mark.parametrize("option,text", [(dict(max_batch_size=100000), "max_batch_size=100000, max_length=4096"),
                                         (dict(max_length=10 ** 8), "max_batch_size=8, max_length=100000000")])
def test_too_large_fails_before_allocating(kimi, option, text, monkeypatch, spy_strategy):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 64 * MIB)
    rss = peak_rss()
    with pytest.raises(InsufficientMemoryError) as err:
        specdec.wrap(kimi, **option)
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert msg.startswith("max_batch_size, max_length: ") and text in msg
    # one attention layer holding MLA latents (r = 16, rope 8) in fp32: pages of 16 tokens `[pages + 1, 16, 1, dim]`
    # for max_length + 8 verify tokens in every request slot, and the block table `[slots + 1, pages per slot]`
    slots, length = option.get("max_batch_size", 8), option.get("max_length", 4096) + 8
    per_slot = -(-length // 16)
    kv = (slots * per_slot + 1) * 16 * (16 + 8) * 4 + (slots + 1) * per_slot * 8
    assert f"KV cache {format_bytes(kv)}" in msg
    assert "state pool " in msg and "rings " in msg and "64.0 MiB is free on cpu" in msg
    assert not spy_strategy  # no pool, ring or snapshot buffer was built
    assert peak_rss() - rss < 256 * MIB


def test_machine_free_memory(kimi, spy_strategy):
    """The real free memory (MemAvailable on Linux) against a KV cache no machine holds."""
    free = memory.free_bytes("cpu")
    assert isinstance(free, int) and free > 0
    with pytest.raises(ValueError, match=r"max_length=1000000000000 needs .* is free on cpu"):
        specdec.wrap(kimi, max_length=10 ** 12)
    assert not spy_strategy


def test_free_bytes_without_meminfo(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: None)
    assert memory.free_bytes("cpu") > 0
    assert memory.free_bytes("meta") is None  # unknown: nothing is checked


def test_draft_model_runner_is_checked_first(kimi, monkeypatch, spy_strategy):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 64 * MIB)
    with pytest.raises(InsufficientMemoryError, match="the draft model with max_batch_size=100000") as err:
        specdec.wrap(kimi, drafter="model", draft_model=kimi, max_batch_size=100000)
    assert "KV cache" in str(err.value)
    assert not spy_strategy


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2 ** 30, 2 ** 50)] == \
        ["0 B", "1023 B", "1.5 KiB", "3.0 GiB", "1.0 PiB"]


# ---- the plan is the allocation -----------------------------------------------------------------------
def held(engine) -> dict[str, torch.Tensor]:
    """The engine's state and KV buffers by the plan's names (None entries: not allocated)."""
    st, kv = engine.runner.state, engine.runner.kv
    rings = getattr(st, "rings", None)
    named = {"conv_state": st.pool.conv, "ssm_state": st.pool.ssm, "track_ssm": st.pool.track_ssm,
             "track_conv": st.pool.track_conv, "gate_A_log": getattr(st, "gate_A_log", None),
             "gate_dt_bias": getattr(st, "gate_dt_bias", None), "conv_inputs": getattr(st, "conv_inputs", None),
             "step_ssm": getattr(st, "step_states", None), "step_conv_window": getattr(st, "step_windows", None),
             "tree_state_stack": getattr(st, "tree_stack", None),
             "snapshot_intermediate_ssm": getattr(st, "states", None),
             "intermediate_conv_window": getattr(st, "conv_windows", None),
             **{name: getattr(rings, name.removeprefix("ring_")) for name in RING_NAMES if rings is not None},
             **{f"kv.{layer}.{j}": t for layer, ts in kv.store.items() for j, t in enumerate(ts)},
             **{p.table_name: p.table for p in kv.pages.values()}}
    return {name: t for name, t in named.items() if t is not None}


def storage_bytes(engine) -> int:
    """Floating-point bytes reachable from the runner's state strategy (its pool, rings) and KV cache (its pages, and
    its block tables), each storage once: what `held` maps must be all there is."""
    seen, total = set(), 0
    st = engine.runner.state
    objs = [st, st.pool, *([st.rings] if hasattr(st, "rings") else [])]
    kv = engine.runner.kv
    values = [v for o in objs for v in vars(o).values()] + [t for ts in kv.store.values() for t in ts]
    tables = [p.table for p in kv.pages.values()]
    total = sum(t.untyped_storage().nbytes() for t in tables)
    for v in values:
        for t in (v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def check_equal(plan_specs: dict, tensors: dict[str, torch.Tensor]) -> None:
    assert sorted(tensors) == sorted(plan_specs)
    for name, t in tensors.items():
        spec = plan_specs[name]
        assert (tuple(t.shape), t.dtype) == (spec.shape, spec.dtype), name
        assert t.numel() * t.element_size() == spec.nbytes


def mamba2_hybrid():
    # Zamba2: two Mamba2 layers and a hybrid one whose shared transformer block holds a KV cache
    return generic.tiny("zamba2")


@pytest.mark.parametrize("family,strategy,commit", [
    ("kimi_linear", "replay", "eager"), ("kimi_linear", "replay", "lazy"), ("kimi_linear", "snapshot", "eager"),
    ("qwen3_next", "replay", "eager"), ("zamba2", "replay", "eager")])
def test_plan_equals_allocation(kimi, family, strategy, commit):
    model = {"kimi_linear": lambda: kimi, "qwen3_next": lambda: tiny_model("qwen3_next", dtype=torch.float32),
             "zamba2": mamba2_hybrid}[family]()
    # plain decoding: every round is a one-token round, which also allocates that round's buffers
    engine = specdec.wrap(model, drafter=None, strategy=strategy, commit=commit, max_batch_size=3, max_length=48)
    plan = engine.memory_plan
    assert set(plan.part_bytes()) == {"state pool", "snapshots" if strategy == "snapshot" else "rings", "KV cache"}
    at_build = plan.specs(deferred=False)
    check_equal(at_build, held(engine))
    assert storage_bytes(engine) == sum(s.nbytes for s in at_build.values())
    out = engine.generate(PROMPT, max_new_tokens=6)
    assert out.sequences.shape == (1, PROMPT.shape[1] + 6)
    check_equal(plan.specs(), held(engine))
    assert storage_bytes(engine) == plan.total
    assert plan.parts["KV cache"]  # every family here has attention


def test_drafter_caches_bound_what_they_allocate():
    """The planned drafter caches (eagle, dspark: K/V per layer) hold at least what a generate allocates."""
    from specdec.draft import dspark_drafter as dspark, eagle_drafter as eagle
    target = tiny_model("qwen3_next", dtype=torch.float32, num_layers=2)
    for kind, make, caches in (("eagle", eagle.make_drafter, lambda d: [t for kv in d.cache for t in kv]),
                               ("dspark", dspark.make_drafter, lambda d: [*d.k, *d.v])):
        torch.manual_seed(0)
        drafter = make(build_drafter_net(kind, target), gamma=3, max_batch_size=2)
        engine = specdec.wrap(target, drafter=drafter, num_draft_tokens=3, max_batch_size=2, max_length=40)
        planned = engine.memory_plan.parts["drafter caches"]
        assert planned and all(name.startswith(kind) for name in planned)
        engine.generate(PROMPT.repeat(2, 1), max_new_tokens=8)
        allocated = sum(t.numel() * t.element_size() for t in caches(drafter))
        kv = sum(s.nbytes for name, s in planned.items() if name.endswith((".k", ".v")))
        assert 0 < allocated <= kv, kind


def test_normal_wrap_generates_the_greedy_tokens(kimi):
    plain = specdec.wrap(kimi, drafter=None).generate(PROMPT, max_new_tokens=8).sequences
    spec = specdec.wrap(kimi).generate(PROMPT, max_new_tokens=8).sequences
    assert torch.equal(plain, spec)
