"""oneDNN matmuls for a model's `nn.Linear` layers on CPU, where a verify feeds them many rows at once.

A verify forward multiplies every weight by T rows (8 for a gamma-7 chain, up to ~50 for a tree), and on a CPU
those matmuls are compute-bound: they are most of what a verify costs over a 1-token step (`bench/verify_cost.py`
measures it as the "matmul floor"). torch's fp32 `F.linear` goes to MKL's sgemm, which on CPUs other than Intel's
may run a generic code path (on the AMD Zen 5 of `bench/results/HISTORY.md` it does, AVX-512 unused), while oneDNN,
also inside torch, runs the CPU's widest vectors: tree and chain verify forwards run faster there, a 1-token step
does not (`bench/verify_cost.py`; figures in bench/RESULTS.md). On an Intel CPU MKL's own paths are the fast ones
(on the Intel Xeon of bench/RESULTS.md every verify kind runs slower with oneDNN than with `F.linear`), so "auto"
leaves the layers alone there. At one or two rows MKL is as fast or faster (oneDNN has more fixed cost per call),
so a call goes to oneDNN only from `MIN_ROWS` rows and `MIN_MACS` multiply-adds.

`install(model)` turns every plain `nn.Linear` of `model` (type exactly `nn.Linear`) into `OneDNNLinear`, a
subclass whose forward dispatches by shape; weights, parameters, `state_dict` and `isinstance(m, nn.Linear)` are
unchanged, and `uninstall(model)` turns them back. Only calls made inside `engaged()` (the engine's `generate`)
go to oneDNN: anywhere else an installed layer is `nn.Linear`, bit for bit, so the model a user holds computes
what it did before it was wrapped. The oneDNN copy of a weight (its blocked layout: as much memory again as the
weight) is made at the first call that uses it and remade when the weight changes: another tensor or storage,
an in-place update its version counter records, and a write the counter does not record (through `.data`, a
fused optimizer's step), found at the copy's first use in each `engaged()` block by the weight's rows summed bit
for bit (`_row_sums`: a small part of a `generate`, bench/results/HISTORY.md). So a model updated
between two `generate` calls, however it was updated, is verified with its new weights. Calls that need
autograd, non-fp32 tensors, tensors off the CPU and weights made under `torch.inference_mode` (no version
counter) take `F.linear` unchanged.

Exactness: a row's output from oneDNN and from MKL differ in the last bits (another summation order), as MKL's own
results already differ between 1 row and T rows; speculative decoding stays lossless in the sense the engine
checks (the greedy output equals plain decoding, which runs the same layers), and plain decode's 1-row steps
still run `F.linear`, bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 2  # at 1 row a matmul is memory-bound: MKL is as fast and plain decode keeps its op order
MIN_MACS = 1 << 19  # below ~0.5M multiply-adds oneDNN's fixed cost per call outweighs its faster loops

MODES = ("auto", "onednn", "aten")
# layer -> (weakref to its weight, the weight's version, its data pointer, its row sums, the `engaged` block that
# last checked them, the oneDNN copy)
_packed: "weakref.WeakKeyDictionary[nn.Linear, tuple]" = weakref.WeakKeyDictionary()
_engaged = threading.local()  # .depth: `engaged()` blocks open in this thread
_block = [0]  # outermost `engaged()` blocks entered so far, any thread


def available() -> bool:
    """Whether this torch has oneDNN's CPU linear (`torch.ops.mkldnn._linear_pointwise`) and it is enabled."""
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
    """A ValueError unless `mode` is one of `MODES` ("onednn" only where oneDNN is available)."""
    if mode not in MODES:
        raise ValueError(f"cpu_linear: expected one of {MODES}, got {mode!r}")
    if mode == "onednn" and not available():
        raise ValueError("cpu_linear: 'onednn' needs a torch with oneDNN enabled (torch.backends.mkldnn); use "
                         "'auto' or 'aten'")


def resolve(mode: str, model: nn.Module) -> str:
    """The backend `mode` means for `model`: "auto" is "onednn" for an fp32 model on a CPU other than Intel's when
    oneDNN is available, else "aten"; "onednn" and "aten" are themselves ("onednn" needs oneDNN: a ValueError
    otherwise)."""
    check_mode(mode)
    if mode != "auto":
        return mode
    p = next(model.parameters(), None)
    fits = p is not None and p.device.type == "cpu" and p.dtype == torch.float32 and not intel_cpu()
    return "onednn" if fits and available() else "aten"


def apply(mode: str, model: nn.Module, *others: nn.Module) -> str:
    """`install` into `model` and `others` (a drafter's modules) when `resolve(mode, model)` is "onednn";
    returns the resolved backend."""
    backend = resolve(mode, model)
    if backend == "onednn":
        for m in (model, *others):
            install(m)
    return backend


@contextlib.contextmanager
def engaged():
    """Inside, installed layers run oneDNN for calls of enough rows (the engine's `generate`, and benchmarks that
    time its forwards, enter it); outside they are `nn.Linear`. Entering the outermost block has every oneDNN copy
    checked against its weight's contents at its first use inside it."""
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


def _weight(m: nn.Linear) -> torch.Tensor:
    """`m.weight` in oneDNN's blocked layout, remade when the weight tensor, its storage or its contents changed."""
    w = m.weight
    hit = _packed.get(m)
    block = _block[0]
    same = hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr()
    if same and hit[4] == block:
        return hit[5]
    sums = _row_sums(w)  # first use in this block: the contents checked once
    if same and torch.equal(sums, hit[3]):
        hit = (*hit[:4], block, hit[5])
    else:
        hit = (weakref.ref(w), w._version, w.data_ptr(), sums, block,
               torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
    _packed[m] = hit
    return hit[5]


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose fp32 CPU calls of at least `MIN_ROWS` rows and `MIN_MACS` multiply-adds run oneDNN
    inside `engaged()`; every other call is `nn.Linear`'s.

    x `[..., in_features]` -> `[..., out_features]`, as `nn.Linear`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the size test first and alone: a 1-row call (every plain decode step) costs one numel() more than
        # nn.Linear's forward
        n = x.numel()
        if (n * self.out_features >= MIN_MACS and n >= MIN_ROWS * self.in_features
                and getattr(_engaged, "depth", 0) and _onednn_ok(self, x)):
            return _linear_pointwise()(x, _weight(self), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _onednn_ok(m: nn.Linear, x: torch.Tensor) -> bool:
    """fp32 on CPU, no autograd needed, oneDNN switched on (`torch.backends.mkldnn.flags`), and a weight whose
    in-place updates can be seen: not an inference tensor (a model built under `torch.inference_mode`), which has
    no version counter to tell a stale oneDNN copy by."""
    w, b = m.weight, m.bias
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and (b is None or b.dtype == torch.float32)
            and x.device.type == "cpu" and w.device.type == "cpu" and torch.backends.mkldnn.enabled
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and not w.is_inference())


_OP: list = []


def _linear_pointwise():
    """`torch.ops.mkldnn._linear_pointwise`, looked up once (the lookup walks three lazy namespaces)."""
    if not _OP:
        _OP.append(torch.ops.mkldnn._linear_pointwise)
    return _OP[0]


def install(model: nn.Module) -> int:
    """Turn every `nn.Linear` of `model` (its own type, not a subclass) into `OneDNNLinear`, in place.

    Returns the number of layers turned (0 when oneDNN is not available: the model is left as it was).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not available():
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = OneDNNLinear
            n += 1
    return n


def uninstall(model: nn.Module) -> int:
    """Turn `model`'s `OneDNNLinear` layers back into `nn.Linear` and drop their oneDNN weights; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is OneDNNLinear:
            m.__class__ = nn.Linear
            _packed.pop(m, None)
            n += 1
    return n
