"""Packed matmuls for a model's `nn.Linear` layers on CPU, where a verify feeds them many rows at once.

A verify forward multiplies every weight by T rows (8 for a gamma-7 chain, up to ~50 for a tree), and on a CPU
those matmuls are compute-bound: they are most of what a verify costs over a 1-token step (`bench/verify_cost.py`
measures it as the "matmul floor"). torch's fp32 `F.linear` hands MKL's sgemm the weight `[out, in]` as a
transposed operand, and how fast that runs depends on the CPU: two backends keep a second copy of each weight in a
layout their kernels take directly.
- "mkl": MKL's sgemm on the weight's transpose stored row-major `[in, out]` (`torch.mm(x, w_t)`). On Intel CPUs
  that runs 1.3-2.4x `F.linear` at 8 rows (the lm_head `[4096, 256]` of the embedded model 2.4x), at 1 row up to 1.8x.
- "onednn": oneDNN's blocked layout (`torch.ops.mkldnn._linear_pointwise`). On some x86 CPUs MKL runs a generic code
  path (on the AMD Zen 5 of `bench/results/HISTORY.md` it does, AVX-512 unused), while oneDNN, also inside torch,
  runs the CPU's widest vectors: tree and chain verify forwards run faster there; on Intel CPUs slower than "mkl".
Below `MIN_ROWS` rows and `MIN_MACS` multiply-adds a call stays `F.linear` (plain decode's 1-row steps included,
so they keep transformers' own op order).

`install(model, backend)` turns every plain `nn.Linear` of `model` (type exactly `nn.Linear`, or another backend's
`PackedLinear`) into that backend's `PackedLinear` subclass, whose forward dispatches by shape; weights, parameters,
`state_dict` and `isinstance(m, nn.Linear)` are unchanged, and `uninstall(model)` turns them back. Only calls made
inside `engaged()` (the engine's `generate`) take the packed copy: anywhere else an installed layer is
`nn.Linear`, bit for bit, so the model a user holds computes what it did before it was wrapped. The copy of a
weight (as much memory again as the weight) is made at the first call that uses it and remade when the weight
changes: another tensor or storage, an in-place update its version counter records, and a write the counter does
not record (through `.data`, a fused optimizer's step), found at the copy's first use in each `engaged()` block by
the weight's rows summed bit for bit (`_row_sums`: a small part of a `generate`, bench/results/HISTORY.md). So a
model updated between two `generate` calls, however it was updated, is verified with its new weights. Calls that
need autograd, non-fp32 tensors, tensors off the CPU and weights made under `torch.inference_mode` (no version
counter) take `F.linear` unchanged.

Exactness: a row's output from a packed copy and from `F.linear` differ in the last bits (another summation
order), as MKL's own results already differ between 1 row and T rows; speculative decoding stays lossless in the
sense the engine checks (the greedy output equals plain decoding, which runs the same layers), and plain decode's
1-row steps still run `F.linear`, bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 2  # at 1 row a matmul is memory-bound, and plain decode keeps transformers' op order
MIN_MACS = 1 << 19  # below ~0.5M multiply-adds a packed call gains little (oneDNN's fixed cost outweighs its loops)

MODES = ("auto", "mkl", "onednn", "aten")
# per backend, layer -> (weakref to its weight, the weight's version, its data pointer, its row sums, the `engaged`
# block that last checked them, the packed copy)
_packed: "dict[str, weakref.WeakKeyDictionary[nn.Linear, tuple]]" = {}
_engaged = threading.local()  # .depth: `engaged()` blocks open in this thread
_block = [0]  # outermost `engaged()` blocks entered so far, any thread


def available(backend: str = "onednn") -> bool:
    """Whether this torch runs `backend`: "onednn" (`torch.ops.mkldnn._linear_pointwise`, oneDNN enabled) or "mkl"
    (torch's BLAS is MKL)."""
    if backend == "mkl":
        return torch.backends.mkl.is_available()
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.lru_cache(maxsize=1)
def intel_cpu() -> bool:
    """Whether the CPU is Intel's (the `vendor_id` of /proc/cpuinfo; False where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def check_mode(mode: str) -> None:
    """A ValueError unless `mode` is one of `MODES` ("mkl" / "onednn" only where torch runs them)."""
    if mode not in MODES:
        raise ValueError(f"cpu_linear: expected one of {MODES}, got {mode!r}")
    if mode in BACKENDS and not available(mode):
        raise ValueError(f"cpu_linear: {mode!r} is not available in this torch; use 'auto' or 'aten'")


def resolve(mode: str, model: nn.Module) -> str:
    """The backend `mode` means for `model`: "auto", for an fp32 model on CPU, is "mkl" on an Intel CPU (MKL's
    fast paths), else "onednn", each where torch runs it; "aten" for any other model. The others are themselves
    (a ValueError where torch does not run them)."""
    check_mode(mode)
    if mode != "auto":
        return mode
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return "aten"
    for backend in (("mkl", "onednn") if intel_cpu() else ("onednn",)):
        if available(backend):
            return backend
    return "aten"


def apply(mode: str, model: nn.Module, *others: nn.Module) -> str:
    """`install` the backend `resolve(mode, model)` into `model` and `others` (a drafter's modules) unless it is
    "aten"; returns the resolved backend."""
    backend = resolve(mode, model)
    if backend != "aten":
        for m in (model, *others):
            install(m, backend)
    return backend


@contextlib.contextmanager
def engaged():
    """Inside, installed layers run their packed copy for calls of enough rows (the engine's `generate`, and
    benchmarks that time its forwards, enter it); outside they are `nn.Linear`. Entering the outermost block has
    every packed copy checked against its weight's contents at its first use inside it."""
    depth = getattr(_engaged, "depth", 0)
    if not depth:
        _block[0] += 1
    _engaged.depth = depth + 1
    try:
        yield
    finally:
        _engaged.depth = depth


def _row_sums(w: torch.Tensor) -> torch.Tensor:
    """`[out]` sums of a fp32 weight `[out, in]`'s rows as integers (each element's bits, summed in int64): one
    read of it, exact, so changing any one element (by an ulp too) changes them; only a permutation within a row
    or changes whose bit patterns cancel exactly would not."""
    return w.detach().view(torch.int32).sum(1)


def _weight(m: "PackedLinear") -> torch.Tensor:
    """`m.weight` packed for `m`'s backend, remade when the weight tensor, its storage or its contents changed (a
    layer installed with each backend in turn keeps a copy for each)."""
    w = m.weight
    cache = _packed.setdefault(m.backend, weakref.WeakKeyDictionary())
    hit = cache.get(m)
    block = _block[0]
    same = hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr()
    if same and hit[4] == block:
        return hit[5]
    sums = _row_sums(w)  # first use in this block: the contents checked once
    if same and torch.equal(sums, hit[3]):
        hit = (*hit[:4], block, hit[5])
    else:
        hit = (weakref.ref(w), w._version, w.data_ptr(), sums, block, m.pack(w.detach()))
    cache[m] = hit
    return hit[5]


class PackedLinear(nn.Linear):
    """`nn.Linear` whose fp32 CPU calls of at least `MIN_ROWS` rows and `MIN_MACS` multiply-adds run on a packed copy
    of the weight (`pack`, `run`: one subclass per backend) inside `engaged()`; every other call is `nn.Linear`'s.

    x `[..., in_features]` -> `[..., out_features]`, as `nn.Linear`.
    """

    backend: str

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        """The copy of the weight `[out, in]` that `run` takes."""
        raise NotImplementedError

    @staticmethod
    def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x `[..., in]` times the weight (as `pack` made it), plus `bias` -> `[..., out]`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the size test first and alone: a 1-row call (every plain decode step) costs one numel() more than
        # nn.Linear's forward
        n = x.numel()
        if (n * self.out_features >= MIN_MACS and n >= MIN_ROWS * self.in_features
                and getattr(_engaged, "depth", 0) and _packed_ok(self, x)):
            return self.run(x, _weight(self), self.bias)
        return F.linear(x, self.weight, self.bias)


class MKLLinear(PackedLinear):
    """"mkl": MKL's sgemm on the weight's transpose, row-major `[in, out]`."""

    backend = "mkl"

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous()

    @staticmethod
    def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, packed.shape[0])
        y = torch.mm(x2, packed) if bias is None else torch.addmm(bias, x2, packed)
        return y.view(*x.shape[:-1], packed.shape[1])


class OneDNNLinear(PackedLinear):
    """"onednn": oneDNN's linear on its blocked layout of the weight."""

    backend = "onednn"

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)

    @staticmethod
    def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _linear_pointwise()(x, packed, bias, "none", [], "")


BACKENDS = {cls.backend: cls for cls in (MKLLinear, OneDNNLinear)}


def _packed_ok(m: nn.Linear, x: torch.Tensor) -> bool:
    """fp32 on CPU, no autograd needed, oneDNN switched on where the layer runs it
    (`torch.backends.mkldnn.flags`), and a weight whose in-place updates can be seen: not an inference tensor (a
    model built under `torch.inference_mode`), which has no version counter to tell a stale copy by."""
    w, b = m.weight, m.bias
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and (b is None or b.dtype == torch.float32)
            and x.device.type == "cpu" and w.device.type == "cpu"
            and (m.backend != "onednn" or torch.backends.mkldnn.enabled)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and not w.is_inference())


_OP: list = []


def _linear_pointwise():
    """`torch.ops.mkldnn._linear_pointwise`, looked up once (the lookup walks three lazy namespaces)."""
    if not _OP:
        _OP.append(torch.ops.mkldnn._linear_pointwise)
    return _OP[0]


def install(model: nn.Module, backend: str = "onednn") -> int:
    """Turn every `nn.Linear` of `model` (its own type, not a subclass) and every layer of another backend into
    `backend`'s `PackedLinear` ("mkl" or "onednn"), in place.

    Returns the number of layers turned (0 when torch does not run `backend`: the model is left as it was).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {tuple(BACKENDS)}, got {backend!r}")
    if not available(backend):
        return 0
    cls, n = BACKENDS[backend], 0
    for m in model.modules():
        if type(m) is nn.Linear or (type(m) in BACKENDS.values() and type(m) is not cls):
            m.__class__ = cls
            n += 1
    return n


def uninstall(model: nn.Module) -> int:
    """Turn `model`'s `PackedLinear` layers back into `nn.Linear` and drop their packed weights; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) in BACKENDS.values():
            m.__class__ = nn.Linear
            for cache in _packed.values():
                cache.pop(m, None)
            n += 1
    return n
