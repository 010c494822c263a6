"""Host syncs and aten ops per speculative round, by source line (CPU; what a GPU would see).

    python bench/syncs.py                                   # embedded model, ngram + mtp, batch 1 / 16 / 64
    python bench/syncs.py --batch-sizes 1,4 --drafters ngram --max-new-tokens 32 --json syncs.json
    python bench/syncs.py --static-shapes                   # the padded path CUDA graphs capture

A `TorchDispatchMode` sees every aten op `generate` runs. Ops that block the host on a CUDA device are
counted as syncs: scalar reads (`item`, `bool`, `int`: `_local_scalar_dense`), `nonzero`, boolean-mask
indexing, `masked_select`, `repeat_interleave` without an output size, tensors built from Python data
(`torch.tensor(list)`: a host-to-device copy on CUDA), and `.tolist()` / `.numpy()` (patched: on CPU they
bypass the dispatcher). Every other op that is not a view is counted as a launch. Each op is attributed to
the innermost Python frame outside torch: the package's own code (`pkg`) or the model's modules (`model`).
Counts are divided by the engine's rounds (one verify forward for the whole batch each); `all` includes
prefill, `round` counts only inside rounds. The checks of the caller's inputs (`_prompts`: host lists or CPU
tensors) are host work and are reported apart (`input_reads`). A Python scalar stored into a tensor
(`t[i] = 0`) passes by value and is not a copy. With `--kernels gpu` (default) each kernel op counts as it would
on a GPU: the Triton wrapper's host side (checks, copies) plus one launch, while the torch reference computes
the values uncounted; `--kernels cpu` counts the references as they run here.

`CaptureCheck` (tests/test_capture_safety.py) is the strict form for one step that a CUDA graph captures: any sync,
and any host data reaching device work (a host-to-device copy, which a capture refuses), is a violation.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import PROMPTS, ROOT, load_prompts, resolve_drafter, resolve_model_dir  # noqa: E402
finally:
    sys.path.pop(0)

import specdec  # noqa: E402

PKG_DIR = Path(specdec.__file__).resolve().parent
PKG_DIRS = tuple(str(p) for p in {PKG_DIR, *(ROOT / d for d in ("specdec", "kernels", "replayssm", "draft",
                                                                  "verify"))})
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())
aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.repeat_interleave.Tensor, aten.lift_fresh.default, aten.lift_fresh_copy.default,
            aten.unique_consecutive.default, aten._unique2.default, aten._unique.default, aten.unique_dim.default,
            aten.bincount.default, aten.item.default}
BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def sync_kind(func, args, kwargs) -> str | None:
    """The op's name if it blocks the host on a CUDA device (a scalar read, an output sized by values, a boolean
    mask, a tensor built from Python data), else None. A 0-dim `lift_fresh` is a Python scalar (`t[i] = 0`): it
    reaches the kernel by value."""
    if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default) and args[0].dim() == 0:
        return None
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
        return None  # sized by the caller: no read of the repeats
    if func in SYNC_OPS or (func in BOOL_INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                           for i in (args[1] or ()) if i is not None)):
        return func.__name__
    return None


ALLOC_OPS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
             aten.new_empty_strided.default}


def _is_view(func) -> bool:
    """Views and bare allocations launch nothing on a GPU."""
    return bool(getattr(func, "is_view", False)) or func in (aten.detach.default, aten.alias.default) \
        or func in ALLOC_OPS


@functools.lru_cache(maxsize=None)
def _real(fn: str) -> str:
    return os.path.realpath(fn)  # a package imported through symlinks still counts as the package


def where() -> tuple[str, str]:
    """(`pkg` or `model`, `file:line`) of the innermost frame outside torch and this script."""
    f = sys._getframe(2)
    while f is not None:
        fn = _real(f.f_code.co_filename)
        if not fn.startswith(TORCH_DIR) and fn != HERE and "/contextlib.py" not in fn:
            origin = "pkg" if fn.startswith(PKG_DIRS) else "model"
            short = fn
            for base in (*PKG_DIRS, str(ROOT)):
                if fn.startswith(base):
                    short = os.path.relpath(fn, str(ROOT) if base == str(ROOT) else str(Path(base).parent))
                    break
            if origin == "model":
                short = "/".join(Path(fn).parts[-2:])
            return origin, f"{short}:{f.f_lineno}"
        f = f.f_back
    return "model", "?"


class Counter(TorchDispatchMode):
    """Counts syncs and launches, split into prefill / round phases and by source line."""

    def __init__(self):
        super().__init__()
        self.phase = "prefill"
        self.syncs = collections.Counter()      # (phase, origin) -> n
        self.launches = collections.Counter()   # (phase, origin) -> n
        self.sync_lines = collections.Counter()  # (phase, "origin file:line kind") -> n
        self.launch_lines = collections.Counter()

    def sync(self, kind: str) -> None:
        origin, line = where()
        self.syncs[(self.phase, origin)] += 1
        self.sync_lines[(self.phase, f"{origin} {line} {kind}")] += 1

    paused = False

    def launch(self) -> None:
        origin, line = where()
        self.launches[(self.phase, origin)] += 1
        self.launch_lines[(self.phase, f"{origin} {line}")] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # under inference mode (`generate`) composite ops (`linear`, `rms_norm`, `item`) reach the mode whole,
            # where autograd would have decomposed them: count the ops their decomposition runs, as a device would
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        kind = sync_kind(func, args, kwargs)
        if kind:
            self.sync(kind)
        elif not _is_view(func):
            self.launch()
        return func(*args, **kwargs)


def patched(counter: Counter, names: tuple[str, ...] = ("tolist", "numpy")):
    """Context: `Tensor.tolist` / `Tensor.numpy` (and any other method of `names`, e.g. `cpu`) count as syncs
    while `counter` is active; on a tensor made on the host (`is_host`) they are host work."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        saved = {n: getattr(torch.Tensor, n) for n in names}

        def wrap(name):
            orig = saved[name]

            def f(self, *a, **k):
                if not counter.paused and not is_host(self):
                    counter.sync(name)
                return orig(self, *a, **k)
            return f
        try:
            for n in saved:
                setattr(torch.Tensor, n, wrap(n))
            yield
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)
    return cm()


def gpu_view(counter: Counter):
    """Context: each dispatched kernel op counts as a GPU would run it. The Triton wrapper's host side runs
    (its argument checks and copies are counted) with its kernel launch counted once and skipped; the torch
    reference then computes the values, uncounted."""
    import contextlib

    import triton

    from specdec.kernels import dispatch

    @contextlib.contextmanager
    def cm():
        mods = {importlib.import_module(m, dispatch.__package__) for _, m in dispatch.OPS.values()}
        from triton.runtime.interpreter import InterpretedFunction  # what @triton.jit makes under TRITON_INTERPRET=1

        kinds = (triton.runtime.jit.JITFunction, InterpretedFunction)
        jits = [v for m in mods for v in vars(m).values() if isinstance(v, kinds) and hasattr(v, "arg_names")]
        saved_pick, saved_run = dispatch.pick, {j: j.run for j in jits}
        saved_env = os.environ.get("SPECDEC_FORCE_TRITON")

        def pick(name, *tensors):
            ref, tri = dispatch.reference_impl(name), dispatch.triton_impl(name)

            # the op's signature: the per-token reference's (the chunk form takes the same options as **options)
            takes = inspect.signature(dispatch.MAMBA2_REFS.get(name, ref)).parameters

            def op(*args, **kwargs):
                tri(*args, **kwargs)
                counter.paused = True
                try:  # without the Triton kernels' own arguments (a tree's schedule and parent-state stack)
                    return ref(*args, **{k: v for k, v in kwargs.items() if k in takes})
                finally:
                    counter.paused = False
            return op

        def stub(*args, grid=None, warmup=False, **kwargs):
            counter.launch()
        try:
            dispatch.pick = pick
            # what callers decide from `uses_triton` follows the GPU too (a tree verify's schedule and stack)
            os.environ["SPECDEC_FORCE_TRITON"] = "1"
            for j in jits:
                j.run = stub
            yield
        finally:
            if saved_env is None:
                os.environ.pop("SPECDEC_FORCE_TRITON", None)
            else:
                os.environ["SPECDEC_FORCE_TRITON"] = saved_env
            dispatch.pick = saved_pick
            for j, r in saved_run.items():
                j.run = r
    return cm()


# ---- what a CUDA-graph capture refuses ----------------------------------------------------------------------
# arguments an op reads as a whole tensor on its own device (a copy's source, an indexed read's or write's indices
# and values): a host tensor there is copied to the device, even a 0-dim one
COPY_ARGS = {aten.copy_.default: (1,), aten._to_copy.default: (0,), aten.index.Tensor: (1,),
             aten.index_put_.default: (1, 2), aten.index_put.default: (1, 2), aten._index_put_impl_.default: (1, 2),
             aten.index_copy_.default: (2, 3), aten.index_copy.default: (2, 3), aten.index_select.default: (2,),
             aten.scatter_.src: (2, 3), aten.scatter.src: (2, 3), aten.masked_scatter_.default: (1, 2),
             aten.masked_scatter.default: (1, 2)}
_HOST = "_syncs_host_data"  # attribute that marks a tensor made on the host


def is_host(t) -> bool:
    """Whether `t` was made on the host while a `CaptureCheck` was active (see there)."""
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _mark(out, host: bool) -> None:
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            setattr(t, _HOST, host)


class CaptureCheck(Counter):
    """What a CUDA-graph capture of a step refuses, by source line (`violations`): every sync `Counter` counts
    (scalar reads, value-sized outputs, boolean masks, tensors built from Python lists, `.tolist()`, `.numpy()`,
    `.cpu()`), and host data reaching device work: a host-to-device copy, which a capture refuses
    (`Cannot copy between CPU and CUDA tensors during CUDA graph capture`).

    On a CPU every tensor is on one device, so host data is followed from where it is made (`is_host`): tensors
    built from Python data (`torch.tensor`, and the 0-dim tensor that a Python scalar written through a tensor
    index becomes: `lift_fresh`), factory calls given no device (the default device, the host's), and what ops
    compute from those alone. A host tensor that an op reads together with device tensors is a violation, except
    a 0-dim one in an operand's place (`x + t`, `fill_`: passed by value); one read as a copy's source or as an
    index or value of an indexed read or write (`COPY_ARGS`: `x[rows] = 0`) is copied to the device first.
    `torch.tensor(scalar, device=...)` is itself a copy. Syncs on host tensors are host work, not counted.

    Use `with check.checking():` around the step (`gpu_view(check)` may wrap a whole run: the Triton wrappers'
    host side is checked, their torch references not)."""

    def __init__(self, cpu_only=()):
        """cpu_only: code objects of paths that CUDA tensors never take (a memo of CPU tensors): what runs
        inside them is not checked."""
        super().__init__()
        self.cpu_only = frozenset(cpu_only)

    def sync(self, kind: str) -> None:
        f = sys._getframe(1)
        while f is not None:
            if f.f_code in self.cpu_only:
                return
            f = f.f_back
        super().sync(kind)

    def violations(self) -> list[str]:
        return [f"{phase}: {line} (x{n})" for (phase, line), n in self.sync_lines.items()]

    def checking(self):
        """Context: this dispatch mode, the factory mode and the patched methods."""
        stack = contextlib.ExitStack()
        stack.enter_context(self)
        stack.enter_context(_HostFactories(self))
        stack.enter_context(patched(self, ("tolist", "numpy", "cpu")))
        return stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            return super().__torch_dispatch__(func, types, args, kwargs)  # (decomposed: its ops come back here)
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = [t for t in ins if is_host(t)]
        on_device = len(host) < len(ins)
        if host and not on_device:
            # host work: run uncounted; what it makes stays on the host (until `_HostFactories` sees it moved)
            out = func(*args, **kwargs)
            _mark(out, True)
            return out
        if func is aten.equal.default:  # (not counted by `Counter`: the CPU-only checks that call it run on no GPU)
            self.sync(func.__name__)
        if host:
            copied = [t for i in COPY_ARGS.get(func, ()) if i < len(args)
                      for t in torch.utils._pytree.tree_leaves(args[i]) if is_host(t)]
            if copied or any(t.dim() > 0 for t in host):
                self.sync(f"host data into {func.__name__}")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            _mark(out, True)
        return out


class _HostFactories(torch.overrides.TorchFunctionMode):
    """`CaptureCheck`'s view of calls before dispatch, where an omitted `device` is still visible: factory calls
    without one make host tensors; `torch.tensor(scalar, device=...)`, and `.to(device)`, `.cuda()` or
    `torch.as_tensor(t, device=...)` of a host tensor, copy host data to the device (here, where the device is
    the host, `.to` may return its input unchanged, unseen by the dispatch mode)."""

    def __init__(self, check: CaptureCheck):
        super().__init__()
        self.check = check
        from torch.utils._device import _device_constructors
        self.factories = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.check.paused:
            return out
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            to = [*args[1:], kwargs.get("device")]
            if "cpu" in to and not is_host(args[0]):  # (spelled out: a device here is the host too)
                self.check.sync("device data to the host (.to('cpu'))")
            moves = func is torch.Tensor.cuda or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in to)
            return self._to_device(args[0], out, ".to" if func is torch.Tensor.to else ".cuda") if moves else out
        if func not in self.factories:
            return out
        device = kwargs.get("device")
        if device is None and func is torch.as_tensor and len(args) > 2:
            device = args[2]
        data = args[0] if args else None
        if device is None:
            if not isinstance(data, torch.Tensor) or is_host(data):
                _mark(out, True)
        elif isinstance(data, torch.Tensor):
            return self._to_device(data, out, func.__name__) if func in (torch.as_tensor, torch.asarray) else out
        elif func in (torch.tensor, torch.as_tensor, torch.asarray):
            if isinstance(out, torch.Tensor) and out.dim() == 0:  # (a list: `lift_fresh` counted it already)
                self.check.sync(f"{func.__name__} of a Python scalar on the device")
            _mark(out, False)  # on the device now
        return out

    def _to_device(self, src, out, what: str):
        """`out`, a copy of `src` to the device: a violation if `src` is a host tensor, and not one itself."""
        if not is_host(src):
            return out
        self.check.sync(f"host data to the device ({what})")
        out = out.view_as(out) if out is src else out  # (the input itself here: a view carries the mark)
        _mark(out, False)
        return out


def measure(engine, prompts, max_new_tokens: int, *, kernels: str = "gpu") -> dict:
    """One greedy `generate` under the counter; per-round averages and the top source lines."""
    counter = Counter()
    rounds = [0]

    def phased(fn, phase, after, calls=None):
        def run(*a, **k):
            if calls is not None:
                calls[0] += 1
            counter.phase = phase
            try:
                return fn(*a, **k)
            finally:
                counter.phase = after
        return run
    # checks of the caller's host inputs are host work, not device syncs: their own phase
    engine._prompts = phased(engine._prompts, "input", "prefill")
    engine._round = phased(engine._round, "round", "between", rounds)
    try:
        with counter, patched(counter), (gpu_view(counter) if kernels == "gpu" else contextlib.nullcontext()):
            out = engine.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=None)
    finally:
        del engine._round, engine._prompts
    rounds = rounds[0]
    total_syncs = sum(v for (ph, _), v in counter.syncs.items() if ph != "input")
    input_syncs = sum(v for (ph, _), v in counter.syncs.items() if ph == "input")
    round_syncs = sum(v for (ph, _), v in counter.syncs.items() if ph == "round")
    pkg_launch = sum(v for (ph, o), v in counter.launches.items() if o == "pkg")
    pkg_launch_round = sum(v for (ph, o), v in counter.launches.items() if o == "pkg" and ph == "round")
    model_launch = sum(v for (ph, o), v in counter.launches.items() if o == "model")
    return dict(rounds=rounds, tau=out.stats.tau, syncs_per_round=total_syncs / rounds, input_reads=input_syncs,
                round_syncs_per_round=round_syncs / rounds, pkg_launches_per_round=pkg_launch / rounds,
                round_pkg_launches_per_round=pkg_launch_round / rounds, model_launches_per_round=model_launch / rounds,
                top_syncs=[(k[1], v / rounds) for k, v in counter.sync_lines.most_common(12) if k[0] != "input"],
                top_launches=[(k[1], v / rounds) for k, v in counter.launch_lines.most_common(12) if "pkg" in k[1]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--drafters", default="ngram,mtp")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompts are cut to their first N tokens")
    p.add_argument("--strategy", default="replay")
    p.add_argument("--commit", default="eager")
    p.add_argument("--static-shapes", action="store_true",
                   help="the static-shape path CUDA graphs capture (mtp drafts inside the device step)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kernels", choices=["gpu", "cpu"], default="gpu",
                   help="gpu: kernel ops count as the Triton wrappers' host side + one launch each; "
                        "cpu: the torch references as they run here")
    p.add_argument("--top", type=int, default=8, help="source lines shown per row")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(a.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [r["prompt"] for r in load_prompts(PROMPTS, ["code", "prose"], None)]
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    rows = []
    print(f"# bench/syncs.py: {a.model}, {a.strategy}/{a.commit}{', static shapes' if a.static_shapes else ''}, "
          f"greedy, {a.max_new_tokens} new tokens, "
          f"prompts cut to {a.prompt_tokens} tokens, kernels as on a {a.kernels.upper()}, torch threads {a.threads}")
    print(f"{'drafter':8s} {'batch':>5s} {'rounds':>6s} {'tau':>5s} {'syncs/rd':>9s} {'in rd':>7s} "
          f"{'pkg ops/rd':>10s} {'in rd':>7s} {'model ops/rd':>12s}")
    for name in a.drafters.split(","):
        drafter, why = resolve_drafter(model_dir, name)
        if drafter is None:
            print(f"# {name}: skipped ({why})")
            continue
        for B in sizes:
            prompts = [tok(texts[i % len(texts)])["input_ids"][:a.prompt_tokens] for i in range(B)]
            engine = specdec.wrap(model, drafter=drafter, strategy=a.strategy, commit=a.commit, max_batch_size=B,
                                  static_shapes=a.static_shapes)
            r = measure(engine, prompts, a.max_new_tokens, kernels=a.kernels)
            r.update(drafter=name, batch=B)
            rows.append(r)
            print(f"{name:8s} {B:5d} {r['rounds']:6d} {r['tau']:5.2f} {r['syncs_per_round']:9.1f} "
                  f"{r['round_syncs_per_round']:7.1f} {r['pkg_launches_per_round']:10.1f} "
                  f"{r['round_pkg_launches_per_round']:7.1f} {r['model_launches_per_round']:12.1f}")
            for line, n in r["top_syncs"][:a.top]:
                print(f"{'':14s} sync {n:7.2f}/rd  {line}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(model=a.model, strategy=a.strategy, commit=a.commit,
                                                static_shapes=a.static_shapes, max_new_tokens=a.max_new_tokens,
                                                rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
