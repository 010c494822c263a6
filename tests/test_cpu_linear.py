"""`specdec.cpu_linear`: oneDNN `nn.Linear` layers against a float64 recomputation, the 1-row and autograd paths
against `F.linear` bit for bit, weight updates, undo, and the engine's `cpu_linear` option (greedy output equal to
transformers' greedy generate on an untouched copy of the model)."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from assertions import assert_close
from torch import nn

import specdec
from specdec import cpu_linear
from specdec.draft import NoDraft

from tiny_models import tiny_model, torch_fallbacks


def test_available():
    assert cpu_linear.available(), "torch's CPU wheels ship oneDNN (torch.backends.mkldnn)"


def onednn_calls(fn, *, engaged: bool = True):
    """Run `fn()` (inside `cpu_linear.engaged()`, as the engine's `generate` runs, unless `engaged` is False),
    returning its result and the layers whose call took the oneDNN path (fetched their oneDNN weight)."""
    calls = []
    orig = cpu_linear._weight

    def counting(m):
        calls.append(m)
        return orig(m)

    cpu_linear._weight = counting
    try:
        with cpu_linear.engaged() if engaged else contextlib.nullcontext():
            return fn(), calls
    finally:
        cpu_linear._weight = orig


@pytest.mark.parametrize("rows", [4, 8, 49])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(256, 768, bias=bias)
    x = torch.randn(1, rows, 256)
    cpu_linear.install(lin)
    assert type(lin) is cpu_linear.OneDNNLinear and isinstance(lin, nn.Linear)
    with torch.no_grad():
        y, calls = onednn_calls(lambda: lin(x))
    assert calls, "a fp32 call of >= 2 rows and >= MIN_MACS should run oneDNN"
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert_close(y, ref.float(), msg=f"rows={rows}")


def test_one_row_and_small_calls_are_f_linear_bitwise():
    torch.manual_seed(0)
    lin = nn.Linear(256, 768)
    small = nn.Linear(64, 4)
    cpu_linear.install(lin), cpu_linear.install(small)
    with torch.no_grad():
        for m, x in ((lin, torch.randn(1, 256)), (lin, torch.randn(3, 1, 256)[:1]), (small, torch.randn(8, 64))):
            y, calls = onednn_calls(lambda: m(x))
            assert not calls
            assert_close(y, F.linear(x, m.weight, m.bias), exact=True)


def test_autograd_and_other_dtypes_take_f_linear():
    torch.manual_seed(1)
    lin = nn.Linear(256, 256)
    cpu_linear.install(lin)
    x = torch.randn(16, 256)
    y, calls = onednn_calls(lambda: lin(x))  # grad enabled, weight requires grad
    assert not calls and y.requires_grad
    y.sum().backward()
    assert lin.weight.grad is not None
    assert_close(y.detach(), F.linear(x, lin.weight, lin.bias).detach(), exact=True)
    lin64 = nn.Linear(256, 256).double()
    cpu_linear.install(lin64)
    with torch.no_grad():
        x64 = torch.randn(16, 256, dtype=torch.float64)
        y, calls = onednn_calls(lambda: lin64(x64))
    assert not calls
    assert_close(y, F.linear(x64, lin64.weight, lin64.bias), exact=True)


def test_weight_updates_are_seen():
    torch.manual_seed(2)
    lin = nn.Linear(256, 256, bias=False)
    cpu_linear.install(lin)
    x = torch.randn(16, 256)
    ref = lambda: F.linear(x.double(), lin.weight.double()).float()  # noqa: E731
    with torch.no_grad(), cpu_linear.engaged():
        lin(x)
        lin.weight.mul_(-2.0)  # in place: the version counter moves
        y, calls = onednn_calls(lambda: lin(x))
        assert calls
        assert_close(y, ref(), msg="after an in-place update")
        lin.weight = nn.Parameter(torch.randn(256, 256) / 16)  # a new tensor, nn.Linear's scale
        assert_close(lin(x), ref(), msg="after a new weight")
        lin.weight.data = torch.randn(256, 256) / 16  # new storage under the same tensor
        assert_close(lin(x), ref(), msg="after new storage")


def test_unrecorded_weight_writes_are_seen_at_the_next_engaged_block():
    """Writes torch's version counter does not record (through `.data`, as weight-sync code does; a fused
    optimizer's step) are seen from the next `engaged()` block on (one per `generate`): the copy is checked
    against the weight's row sums at its first use there. Teeth: with the version counter alone the old copy
    would answer (the first check below)."""
    torch.manual_seed(4)
    lin = nn.Linear(256, 256)
    cpu_linear.install(lin)
    x = torch.randn(16, 256)
    ref = lambda: F.linear(x.double(), lin.weight.double(), lin.bias.double()).float()  # noqa: E731
    with torch.no_grad():
        onednn_calls(lambda: lin(x))
        version = lin.weight._version
        lin.weight.data.mul_(-2.0)
        assert lin.weight._version == version  # unrecorded
        y, calls = onednn_calls(lambda: lin(x))
    assert calls
    assert_close(y, ref(), msg="after a write through .data")
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=True)
    lin(x).square().sum().backward()
    version = lin.weight._version
    opt.step()
    assert lin.weight._version == version  # the fused step records nothing either
    with torch.no_grad():
        y, calls = onednn_calls(lambda: lin(x))
    assert calls
    assert_close(y, ref(), msg="after a fused optimizer step")


def test_outside_engaged_an_installed_layer_is_nn_linear():
    """Calls outside `engaged()` (the user's own forwards of a wrapped model) are `F.linear`'s, bit for bit, at
    any row count."""
    torch.manual_seed(6)
    lin = nn.Linear(256, 768)
    cpu_linear.install(lin)
    x = torch.randn(49, 256)
    with torch.no_grad():
        y, calls = onednn_calls(lambda: lin(x), engaged=False)
        assert not calls
        assert_close(y, F.linear(x, lin.weight, lin.bias), exact=True)
        y, calls = onednn_calls(lambda: lin(x))
        assert calls
        with cpu_linear.engaged(), cpu_linear.engaged():  # nested blocks
            pass
        y, calls = onednn_calls(lambda: lin(x), engaged=False)
        assert not calls


def test_inference_mode_weights_take_f_linear():
    """A layer made under `torch.inference_mode` has inference-tensor weights, with no version counter to tell a
    stale oneDNN copy by: its calls take `F.linear` (they raised before), and an in-place update is seen."""
    torch.manual_seed(5)
    with torch.inference_mode():
        lin = nn.Linear(256, 256)
    cpu_linear.install(lin)
    x = torch.randn(16, 256)
    with torch.inference_mode():
        y, calls = onednn_calls(lambda: lin(x))
        assert not calls
        assert_close(y, F.linear(x, lin.weight, lin.bias), exact=True)
        lin.weight.mul_(-2.0)
        assert_close(lin(x), F.linear(x.double(), lin.weight.double(), lin.bias.double()).float(),
                     msg="after an in-place update")


def test_install_uninstall_and_copies():
    torch.manual_seed(3)

    class Custom(nn.Linear):
        pass

    net = nn.Sequential(nn.Linear(256, 256), Custom(256, 256), nn.ReLU(), nn.Linear(256, 256))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert cpu_linear.install(net) == 2
    assert cpu_linear.install(net) == 0  # already turned
    assert type(net[1]) is Custom  # a subclass keeps its own forward
    x = torch.randn(16, 256)
    with torch.no_grad():
        y = net(x)
        twin = copy.deepcopy(net)  # the oneDNN weights live outside the modules
        assert_close(twin(x), y, exact=True)
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert cpu_linear.uninstall(net) == 2
    assert [type(m) for m in net] == [nn.Linear, Custom, nn.ReLU, nn.Linear]
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module"):
        cpu_linear.install("not a module")


def test_auto_is_onednn_off_intel_cpus(monkeypatch):
    """"auto": oneDNN for an fp32 model on a CPU other than Intel's, `F.linear` ("aten") on Intel's or for any
    other model."""
    assert isinstance(cpu_linear.intel_cpu(), bool)  # this machine's answer, from /proc/cpuinfo
    model = nn.Linear(256, 256)
    for intel, backend in ((False, "onednn"), (True, "aten")):
        monkeypatch.setattr(cpu_linear, "intel_cpu", lambda: intel)
        assert cpu_linear.resolve("auto", model) == backend
        assert cpu_linear.resolve("auto", model.double()) == "aten"
        model.float()


def test_engine_option(monkeypatch):
    with pytest.raises(ValueError, match="cpu_linear: expected one of"):
        specdec.SpecConfig(cpu_linear="mkl")
    monkeypatch.setattr(cpu_linear, "intel_cpu", lambda: False)  # "auto" is oneDNN on this CPU
    model = tiny_model("qwen3_next", dtype=torch.float32).eval()
    ref_model = copy.deepcopy(model)
    specdec.wrap(model, drafter=NoDraft(), cpu_linear="aten")
    assert not any(type(m) is cpu_linear.OneDNNLinear for m in model.modules())
    engine = specdec.wrap(model, drafter="ngram")  # auto: an fp32 model on CPU
    assert any(type(m) is cpu_linear.OneDNNLinear for m in model.modules())
    assert not any(type(m) is cpu_linear.OneDNNLinear for m in ref_model.modules())
    f64 = tiny_model("qwen3_next")
    specdec.wrap(f64, drafter="ngram")
    assert not any(type(m) is cpu_linear.OneDNNLinear for m in f64.modules()), "auto: fp32 models only"
    # a repetitive prompt: ngram drafts something
    prompt = torch.tensor([[3, 5, 7, 9, 11, 3, 5, 7, 9, 11, 3, 5, 7, 9]])
    monkeypatch.setattr(cpu_linear, "MIN_MACS", 1)  # the tiny model's matmuls are far below the real threshold
    out, calls = onednn_calls(lambda: engine.generate(prompt, max_new_tokens=24))
    assert calls and out.stats.proposed > 0  # prefill and verifies of several rows ran oneDNN
    with torch_fallbacks():
        ref = ref_model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert out.sequences.tolist() == ref.tolist()


def test_engine_decodes_with_weights_updated_between_calls(monkeypatch):
    """A wrapped model updated between two `generate` calls without torch's version counter seeing it (a weight
    sync through `.data`, as RL loops do; a fused optimizer's step) decodes with its new weights: greedy output
    equal to transformers' generate on an unwrapped copy holding the same weights. Teeth: with the oneDNN copies
    of the old weights in its verifies, the negated head below would pick other tokens there; and the wrapped
    model's own forward outside `generate` equals the copy's bit for bit."""
    model = tiny_model("qwen3_next", dtype=torch.float32).eval()
    ref_model = copy.deepcopy(model)
    engine = specdec.wrap(model, drafter="ngram", cpu_linear="onednn")
    monkeypatch.setattr(cpu_linear, "MIN_MACS", 1)  # the tiny model's matmuls are far below the real threshold
    prompt = torch.tensor([[3, 5, 7, 9, 11, 3, 5, 7, 9, 11, 3, 5, 7, 9]])

    def check():
        out, calls = onednn_calls(lambda: engine.generate(prompt, max_new_tokens=24, eos_token_id=None))
        assert calls and out.stats.proposed > 0
        with torch_fallbacks():
            ref = ref_model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
            with torch.no_grad():
                assert_close(model(prompt).logits, ref_model(prompt).logits, exact=True)
        assert out.sequences.tolist() == ref.tolist()

    check()
    for m in (model, ref_model):  # weight sync through .data: the version counter does not move
        m.lm_head.weight.data.mul_(-1.0)
        m.model.layers[0].linear_attn.out_proj.weight.data.mul_(1.5)
    check()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    with torch_fallbacks():  # (transformers without the `kernels` package would send CPU tensors to fla's Triton)
        model(prompt).logits.square().mean().backward()
    opt.step()
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.copy_(p)
    check()


def test_drafters_score_through_the_targets_head():
    """`draft.layers.target_logits`: without autograd the target's head module runs (its oneDNN copy, the one the
    verify keeps warm); with autograd the detached weight, so no gradient reaches the target. Both against
    a float64 recomputation."""
    from specdec.draft.layers import target_logits

    torch.manual_seed(0)
    head = nn.Linear(256, 4096, bias=False)  # the embedded model's lm_head
    cpu_linear.install(head)
    x = torch.randn(7, 256, requires_grad=True)
    ref = (x.detach().double() @ head.weight.detach().double().t())
    with torch.no_grad():
        out, calls = onednn_calls(lambda: target_logits(head, x))
    assert calls == [head]
    assert_close(out, ref.float(), dtype=torch.float32)
    out, calls = onednn_calls(lambda: target_logits(head, x))
    assert calls == []
    out.sum().backward()
    assert head.weight.grad is None and x.grad is not None
    assert_close(out.detach(), ref.float(), dtype=torch.float32)
