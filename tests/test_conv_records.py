"""Conv input records: the loop-free verify conv and the windows rebuilt from records at commit.

The verify pass keeps each token's pre-conv input `[row, T, C]` instead of the window after every token
`[row, T, C, Kc-1]`; commit rebuilds the window of the last accepted token from the committed window and those
inputs. Checked bit for bit against the windows the verify pass keeps (the full-snapshot scheme), against the
per-token `conv_step` recurrence, and against plain decode (`short_conv` along each node's root path).
"""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close, root_path
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kernels.common import conv_step
from specdec.kernels.recurrent import short_conv
from specdec.kernels.scatter.naive import commit_conv_windows, rebuild_windows
from specdec.kernels.verify.naive import short_conv_verify

NAN = float("nan")


@st.composite
def conv_cases(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    tree = draw(st.booleans())
    parents = [[-1] + [draw(st.integers(-1, i - 1)) if tree else i - 1 for i in range(1, T)] for _ in range(B)]
    return dict(B=B, T=T, C=draw(st.sampled_from([1, 3, 12, 33])), Kc=draw(st.integers(2, 5)), tree=tree,
                parents=parents, bias=draw(st.booleans()), act=draw(st.sampled_from(["silu", None])),
                dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16])),
                seed=draw(st.integers(0, 2 ** 16)))


def make_inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, T, C, Kc, dt = c["B"], c["T"], c["C"], c["Kc"], c["dtype"]
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dt)  # noqa: E731
    N = B + 2
    return dict(x=r(B, T, C), w=r(C, Kc), bias=r(C) if c["bias"] else None, conv_state=r(N, C, Kc - 1),
                slots=torch.randperm(N - 1, generator=g)[:B], null_slot=N - 1)


@settings(max_examples=60, deadline=None)
@given(c=conv_cases())
def test_verify_conv_equals_per_token_steps_and_plain_decode(c):
    """One gather for all tokens (no per-token loop) gives the per-token `conv_step` recurrence's windows bit for
    bit and its pre-activation outputs bit for bit (Kc <= 4); after silu, the outputs of plain decode
    (`short_conv`) along each node's root path bit for bit (`conv_step`'s unpadded silu rounds its vector tail
    differently)."""
    inp = make_inputs(c)
    B, T, C, Kc = c["B"], c["T"], c["C"], c["Kc"]
    windows = torch.full((B, T, C, Kc - 1), NAN, dtype=c["dtype"])
    inputs = torch.full((B, T, C), NAN, dtype=c["dtype"])
    parent = torch.tensor(c["parents"]) if c["tree"] else None
    y = short_conv_verify(inp["x"], inp["w"], inp["bias"], inp["conv_state"], inp["slots"], parent=parent,
                          window_states=windows, conv_inputs=inputs, activation=c["act"])
    assert_close(inputs, inp["x"], exact=True, msg="conv_inputs are the pre-conv inputs")
    for b in range(B):
        root = inp["conv_state"][inp["slots"][b]]
        for t in range(T):
            path = root_path(c["parents"][b], t)
            win = root[None]
            for node in path:  # the per-token recurrence, as the verify pass ran it before
                y_step, win = conv_step(win, inp["x"][b, node][None], inp["w"], inp["bias"], None)
            assert_close(windows[b, t], win[0].to(windows.dtype), exact=True, msg=f"row {b} node {t} window")
            y_dec, _ = short_conv(inp["x"][b, path][None], inp["w"], inp["bias"], conv_state=root[None],
                                  activation=c["act"])
            assert_close(y[b, t], y_dec[0, -1], exact=True, msg=f"row {b} node {t} y vs plain decode")
            # conv_step sums its Kc products with torch's `sum`, left to right up to 4 of them (every hybrid's
            # conv); longer sums run in vector lanes, another order: there plain decode above is the reference
            if c["act"] is None and Kc <= 4:
                assert_close(y[b, t], y_step[0].to(y.dtype), exact=True, msg=f"row {b} node {t} y vs conv_step")


@settings(max_examples=60, deadline=None)
@given(c=conv_cases(), data=st.data())
def test_windows_rebuilt_from_records_equal_kept_windows(c, data):
    """Commit from records: the window after the last accepted node of each row's path (a prefix for chains) is
    the window the verify pass keeps for that node, bit for bit; skipped rows (-1, null slot, nothing accepted)
    and foreign slots are untouched."""
    inp = make_inputs(c)
    B, T, C, Kc = c["B"], c["T"], c["C"], c["Kc"]
    slots = inp["slots"].clone()
    for b in range(B):
        if data.draw(st.integers(0, 4)) == 0:
            slots[b] = data.draw(st.sampled_from([-1, inp["null_slot"]]))
    parent = torch.tensor(c["parents"]) if c["tree"] else None
    windows = torch.full((1, B, T, C, Kc - 1), NAN, dtype=c["dtype"])
    inputs = torch.full((1, B, T, C), NAN, dtype=c["dtype"])
    short_conv_verify(inp["x"], inp["w"], inp["bias"], inp["conv_state"], slots, parent=parent,
                      window_states=windows[0], conv_inputs=inputs[0], null_slot=inp["null_slot"])
    paths = [root_path(c["parents"][b], data.draw(st.integers(0, T - 1))) for b in range(B)]
    count = torch.tensor([len(p) if data.draw(st.integers(0, 5)) else 0 for p in paths])  # 0: nothing accepted
    path = torch.tensor([p + [0] * (T - len(p)) for p in paths])
    conv = inp["conv_state"].clone()[None]
    commit_conv_windows(conv, inputs, slots, path, count, null_slot=inp["null_slot"])
    want = inp["conv_state"].clone()[None]
    for b, s in enumerate(slots.tolist()):
        if s not in (-1, inp["null_slot"]) and count[b] > 0:
            want[0, s] = windows[0, b, paths[b][count[b] - 1]]
    assert_close(conv, want, exact=True, msg="windows rebuilt from records")
    # any count, chain form (no path): the last Kc-1 columns of [window, x_0 .. x_{count-1}]
    n = torch.randint(0, T + 1, (B,))
    got = rebuild_windows(inp["conv_state"][slots.clamp(min=0)][None], inputs.nan_to_num(), None, n)
    for b in range(B):
        full = torch.cat([inp["conv_state"][slots.clamp(min=0)[b]], inputs[0, b, :n[b]].nan_to_num().T], -1)
        assert_close(got[0, b], full[:, full.shape[1] - (Kc - 1):], exact=True, msg=f"row {b}, {int(n[b])} tokens")


@pytest.mark.triton
def test_no_tokens_gives_an_empty_output(triton_device):
    """T = 0: an empty output and nothing written, as the Triton kernel and `short_conv` give it (the reference
    raised from an unfold over nothing)."""
    from specdec.kernels.verify.triton import short_conv_verify as triton_conv
    x, w, state = torch.randn(2, 0, 6), torch.randn(6, 4), torch.randn(4, 6, 3)
    win = torch.zeros(2, 3, 6, 3)
    for fn, dev in ((short_conv_verify, "cpu"), (triton_conv, triton_device)):
        win_d = win.to(dev)
        y = fn(x.to(dev), w.to(dev), None, state.to(dev), torch.tensor([0, 1], device=dev), window_states=win_d)
        assert y.shape == (2, 0, 6) and bool((win_d == 0).all())
    assert short_conv(x, w, conv_state=state[:2])[0].shape == (2, 0, 6)
