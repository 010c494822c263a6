"""Is the compiled state step the same arithmetic in every kernel that steps a state? (sm_90, no GPU needed)

    python bench/step_check.py                      # the drawn variants at K = V = 3, 64, 128; table on stdout
    python bench/step_check.py --head-dims 3 --json step_check.json
    PYTHONPATH=/path/to/triton-3.6 python bench/step_check.py     # under another triton

A committed state is bitwise the one plain decode reaches only if the exact fold runs the verify's step with the
same arithmetic, in the same order, on the same device (docs/EXACTNESS.md). Whether it does is decided by the compiler:
the order of a reduction follows the layout it picks for the reduced tensor, and a kernel's layouts change with
its loads and with triton's version. This check compiles each kernel through its public wrapper for
`GPUTarget("cuda", 90, 32)` (bench/sass_report.py `capture`) and reads the TTGIR, the last level where the
layouts are explicit: per kernel it takes every state update of the per-token loop (a `math.fma` on the `[BK, BV]`
tile: `S' + k d^T`, and the fast rebuild's `S + (k e^R) d^T`) and writes its whole dataflow as one canonical
expression: each op with its attributes and operands, commutative operands sorted, loaded values and
loop-carried values as leaves, layout conversions and exact widening casts (`extf`) transparent, and for every
reduction its axis length and, when that length is above two, the layout it reduces over (two elements have one
sum whatever the layout; more do not).

It fails (exit 1) unless, for every variant drawn (rule, gate, norm, activation dtype, head size):
- the exact fold has one update expression, and the verify chain, the tree (with its stack and with the snapshot
  buffer) and the lazy verify each hold that same expression;
- the lazy verify's other update is the fast rebuild kernel's.
The canonical form is written per kernel in the JSON (`--json`) so two tritons can be compared by eye.

`--tiles 8x1,16x2` also compiles every kernel with each of these state tiles (`SPECDEC_STATE_TILE`: V columns x
warps) at `--tile-head-dims` (128), and fails unless each kernel's updates equal its updates at the default tile,
the tile's V width aside (a tile splits V; the K reductions and every op per element must be the same): then
verify, fold and rebuild may each take their own tile (kernels/state_tiles.json) and a fold is still bit for bit
the verify's steps.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import load_script, state_tile  # noqa: E402
finally:
    sys.path.pop(0)


@functools.cache
def _sass_report():
    """bench/sass_report.py, which sets TRITON_INTERPRET=0 for this process: load it (and so this check's
    compiling part) only in a process of its own, before any kernel module is imported; the canonical form
    (`TTGIR`) needs neither."""
    return load_script("sass_report")

# (rule, gate, norm, activation dtype): one variant per drawn choice, Kimi-Linear's first
VARIANTS = [("delta", "gate_in", "sqrt_div", "bf16"), ("delta", "kda", "rsqrt", "fp32"),
            ("delta", "kda", "rsqrt", "bf16"), ("delta", "gdn", "rsqrt", "bf16"),
            ("delta", "gdn", "sqrt_div", "fp32"), ("mamba2", "gdn", "rsqrt", "fp32")]
LEAF_OPS = {"tt.load", "ttg.local_load", "ttg.async_wait", "tt.descriptor_load", "scf.for", "scf.if", "scf.while",
            "tt.get_program_id", "ttg.async_copy_global_to_local", "ttg.local_alloc"}
TRANSPARENT = {"ttg.convert_layout", "arith.extf", "tt.unsplat"}  # value-preserving: other layout, width or rank
COMMUTATIVE = {"arith.addf", "arith.mulf", "arith.maximumf", "arith.minimumf", "arith.maxnumf", "arith.minnumf",
               "arith.addi", "arith.muli", "arith.andi", "arith.ori", "arith.xori"}


def _strip_type(t: str) -> str:
    """`tensor<4x4xf32, #blocked>` -> `tensor<4x4xf32>` (layouts dropped, nested ones too; shape and element
    type kept)."""
    out, i = [], 0
    while (j := t.find("tensor<", i)) >= 0:
        out.append(t[i:j])
        depth, k = 0, j + len("tensor")
        while k < len(t):
            depth += {"<": 1, ">": -1}.get(t[k], 0)
            k += 1
            if depth == 0:
                break
        out.append("tensor<" + t[j + 7:k - 1].split(",")[0] + ">")
        i = k
    return "".join(out) + t[i:]


class TTGIR:
    """The ops of one kernel's TTGIR by result name, and its layout aliases."""

    def __init__(self, text: str, width: int | None = None):
        self.width = width  # a tile's V width, written as `V` in every type (`modulo_width`), before any sorting
        self.layouts = dict(re.findall(r"^(#[\w]+) = (.*)$", text, flags=re.M))
        self.defs: dict[str, tuple] = {}  # name -> (op, operands, attrs, result type, operand type, region ops)
        lines = [re.sub(r"\s*loc\(.*$", "", ln) for ln in text.splitlines()]
        i = 0
        while i < len(lines):
            ln = lines[i]
            m = re.match(r"\s*(%[\w.]+)(?::\d+)?\s*=\s*(\"[\w.]+\"|[\w.]+)(.*)$", ln)
            i += 1
            if not m:
                continue
            name, op, rest = m.group(1), m.group(2).strip('"'), m.group(3)
            region = []
            if op == "tt.reduce":  # the combine region, up to `}) : (operand type) -> result type`
                while i < len(lines) and not lines[i].lstrip().startswith("})"):
                    r = re.match(r"\s*%[\w.]+\s*=\s*([\w.]+)", lines[i])
                    if r:
                        region.append(r.group(1))
                    i += 1
                rest += lines[i] if i < len(lines) else ""
                i += 1
            head, _, typ = rest.rpartition(" : ")
            if op == "tt.reduce":
                head = rest.split("({")[0]
                typ = rest.split("})")[-1]
            operands = re.findall(r"%[\w.]+(?:#\d+)?", head)
            attrs = re.sub(r"%[\w.]+(?:#\d+)?", "", head)
            attrs = re.sub(r"#[\w]+", "", attrs).strip(" ,()")
            in_type = ""
            if op == "tt.reduce":
                tm = re.search(r":\s*\((.*)\)\s*->\s*(.*)$", typ)
                in_type, typ = (tm.group(1), tm.group(2)) if tm else ("", typ)
            self.defs[name] = (op, operands, attrs, typ.strip(), in_type, tuple(region))

    def _layout(self, t: str) -> str:
        """The layout text of a tensor type, aliases resolved (nested ones too)."""
        m = re.search(r"tensor<[^,]*,\s*(.*)>\s*$", t)
        lay = m.group(1) if m else ""
        for _ in range(4):
            lay = re.sub(r"#[\w]+", lambda a: self.layouts.get(a.group(0), a.group(0)), lay)
        return lay

    def expr(self, name: str, memo: dict) -> str:
        """The canonical expression of a value (see the module docstring)."""
        base = name.split("#")[0]
        if name in memo:
            return memo[name]
        d = self.defs.get(base)
        if d is None or d[0] in LEAF_OPS:
            out = "x"
        else:
            op, operands, attrs, typ, in_type, region = d
            args = [self.expr(o, memo) for o in operands]
            if op in TRANSPARENT:
                out = args[0]
            else:
                if op in COMMUTATIVE:
                    args = sorted(args)
                elif op == "math.fma":
                    args = sorted(args[:2]) + args[2:]
                extra = ""
                if op == "tt.reduce":
                    shape = re.match(r"tensor<([0-9x]*)", in_type)
                    dims = [int(s) for s in shape.group(1).split("x") if s] if shape else []
                    axis = int(re.search(r"axis = (\d+)", attrs).group(1))
                    extra = f"|{'/'.join(region)}|n={dims[axis] if dims else '?'}"
                    if dims and dims[axis] > 2:
                        extra += f"|layout={self._layout(in_type)}"
                if op == "arith.constant":
                    attrs = re.sub(r"\s+", " ", attrs)
                out = f"{op}[{attrs}{extra}:{_strip_type(typ)}]"
                if self.width:
                    out = modulo_width(out, self.width)
                out += f"({','.join(args)})"
        memo[name] = out
        return out

    def updates(self) -> list[str]:
        """Canonical expressions of the state updates: `math.fma` on a rank-2 tile."""
        memo: dict = {}
        return sorted({self.expr(n, memo) for n, d in self.defs.items()
                       if d[0] == "math.fma" and re.match(r"tensor<\d+x\d+x", d[3])})


def modulo_width(expr: str, bv: int) -> str:
    """`expr` with every tensor dim of length `bv` (the tile's V width: `[BK, BV]` tiles, `[BV]` vectors) written as
    `V`. Sound only when no other dim has that length: the K block (next_pow2(K)) must differ from it, and
    `pair_sum`'s split dims are 2."""
    def dims(m):
        return "tensor<" + "".join("V" + "x" if d == str(bv) else d + "x" for d in m.group(1).split("x")[:-1]) + \
            m.group(1).split("x")[-1] + ">"

    return re.sub(r"tensor<((?:\d+x)+[a-z]\w*)>", dims, expr)


# the state kernel each checked launch runs (its tile: kernels/triton_utils.py `state_blocks`)
TILE_OP = {"verify_chain": "verify", "verify_tree": "verify", "verify_tree_snapshot": "verify", "verify_lazy": "verify",
           "exact_fold": "fold", "fast_rebuild": "rebuild"}


def _digest(e: str) -> str:
    return hashlib.sha1(e.encode()).hexdigest()[:10]


def _calls(K: int, rule: str, gate: str, norm: str, act: str):
    """`{kernel: (its module, call)}`: the package's launches of one variant (2 requests, 4 tokens, 2 heads)."""
    from specdec.kernels.fold import triton as tf
    from specdec.kernels.rebuild import triton as tr
    from specdec.kernels.verify import triton as tv

    sr = _sass_report()
    B, D, H, V, Lyr = 2, 4, 2, K, 2
    N, L = B + 1, 8
    dt = torch.bfloat16 if act == "bf16" else torch.float32
    gdn = gate == "gdn"
    gate_in = gate == "gate_in"
    GK = 1 if gdn else K
    gdt = dt if gate_in else torch.float32
    e = sr.empty
    q, k, v = (e(B, D, H, K, dtype=dt) for _ in range(3))
    g = e(B, D, H, dtype=gdt) if gdn else e(B, D, H, K, dtype=gdt)
    beta = e(B, D, H)
    params = dict(A_log=e(H), dt_bias=e(H, K)) if gate_in else {}
    params_all = dict(A_log=e(Lyr, H), dt_bias=e(Lyr, H, K)) if gate_in else {}
    state, idx = e(N, H, K, V), torch.arange(B)
    ring = (e(N, H, L, V, dtype=dt), e(N, H, L, K, dtype=dt), e(N, H, L, GK, dtype=gdt), e(N, H, L, V, dtype=dt),
            e(N, H, L, K, dtype=dt), e(N, H, L))
    start = torch.zeros(N, dtype=torch.long)
    parent = torch.tensor([[-1, 0, 1, 0]] * B)  # a fork: node 3 reloads the root's state
    from specdec.kernels.tree import tree_stack_slots

    stack = e(B, tree_stack_slots(D), H, K, V)
    kw = dict(ring=ring, ring_start=start, norm=norm, rule=rule, **params)
    verify = tv.verify_delta_rule
    calls = {
        "verify_chain": ([tv], lambda: verify(q, k, v, g, beta, state, idx, **kw)),
        "verify_tree": ([tv], lambda: verify(q, k, v, g, beta, state, idx, parent=parent, tree_stack=stack, **kw)),
        "verify_tree_snapshot": ([tv], lambda: verify(q, k, v, g, beta, state, idx, parent=parent,
                                                      intermediate_states=e(B, D, H, K, V), **kw)),
        "exact_fold": ([tf],
                       lambda: tf.exact_fold(e(Lyr, N, H, K, V), e(Lyr, N, H, L, V, dtype=dt), e(Lyr, N, H, L, K, dtype=dt),
                                             e(Lyr, N, H, L, GK, dtype=gdt), e(Lyr, N, H, L), idx, start,
                                             torch.full((B,), D), norm=norm, rule=rule, **params_all)),
    }
    if rule == "delta":  # lazy commit (and so the fast rebuild) serves the delta rule
        calls["verify_lazy"] = ([tv], lambda: verify(q, k, v, g, beta, state, idx,
                                                     num_pending=torch.ones(N, dtype=torch.int32), **kw))
        calls["fast_rebuild"] = ([tr],
                                 lambda: tr.fast_rebuild(state, idx, ring[0], ring[1], ring[2], start,
                                                         torch.full((B,), D), **params))
    return calls


def compile_ttgir(K: int, rule: str, gate: str, norm: str, act: str, tile: str | None = None) -> dict[str, str]:
    """`{kernel: TTGIR text}` of one variant, compiled with the state tile `tile` (`BVxWARPS`, every kernel) or the
    package's default tile."""
    with state_tile(tile):
        return {name: _sass_report().capture(fns, call)[0][1].asm["ttgir"]
                for name, (fns, call) in _calls(K, rule, gate, norm, act).items()}


def updates(ttgir: dict[str, str], widths: dict[str, int] | None = None) -> dict[str, list[str]]:
    """`{kernel: [update expression]}`; with `widths` (`{kernel: its tile's V width}`) that width written as `V`."""
    return {name: TTGIR(text, (widths or {}).get(name)).updates() for name, text in ttgir.items()}


def widths_at(K: int, tile: str | None) -> dict[str, int]:
    """`{kernel: V width}` of each checked kernel at `tile` (None: the default), V = K, as the launches take it."""
    from specdec.kernels import triton_utils as tu

    with state_tile(tile):
        return {name: tu.state_blocks(K, K, op)[1] for name, op in TILE_OP.items()}


def check_tiles(K: int, variant: tuple, tiles: list[str], default: dict[str, str]) -> list[str]:
    """Problems of the variant's kernels at each of `tiles` against `default`, its TTGIR at the default tile."""
    BK = 1 << max(0, (K - 1).bit_length())
    base = widths_at(K, None)
    widths = set(base.values()).union(*(widths_at(K, t).values() for t in tiles))
    if BK in widths or 2 in widths:
        raise ValueError(f"--tiles: the K block {BK} must differ from every tile's V width {sorted(widths)} (and "
                         f"none be 2) to tell the dims apart; check tiles at K = 128 (--tile-head-dims)")
    want = updates(default, base)
    problems = []
    for tile in tiles:
        found = updates(compile_ttgir(K, *variant, tile=tile), widths_at(K, tile))
        for name, exprs in found.items():
            if exprs != want[name]:
                problems.append(f"tile {tile}: {name}'s updates {[_digest(x) for x in exprs]} differ from the "
                                f"default tile's {[_digest(x) for x in want[name]]}")
    return problems


def check_variant(K: int, rule: str, gate: str, norm: str, act: str) -> dict:
    """Compile one variant's kernels and compare their updates; `{"ok", "kernels": {name: [expr]}, "problems",
    "ttgir": {name: text}}`."""
    ttgir = compile_ttgir(K, rule, gate, norm, act)
    found = updates(ttgir)
    problems = []
    fold = found["exact_fold"]
    if len(fold) != 1:
        problems.append(f"exact_fold has {len(fold)} update expressions, expected 1")
    step = fold[0] if fold else None
    for name in ("verify_chain", "verify_tree", "verify_tree_snapshot", "verify_lazy"):
        if name in found and step not in found[name]:
            problems.append(f"{name}: no update equals the exact fold's step ({_digest(step or '')}); it has "
                            f"{[_digest(x) for x in found[name]]}")
    if "verify_lazy" in found:
        rest = [x for x in found["verify_lazy"] if x != step]
        if rest != found["fast_rebuild"]:
            problems.append(f"verify_lazy's rebuild {[_digest(x) for x in rest]} != fast_rebuild's "
                            f"{[_digest(x) for x in found['fast_rebuild']]}")
    return {"ok": not problems, "problems": problems, "kernels": found, "ttgir": ttgir}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dims", default="3,64,128", help="K = V of the variants, comma separated")
    p.add_argument("--variants", default=None, help="indices into VARIANTS (default: all)")
    p.add_argument("--tiles", default="", help="state tiles BVxWARPS, comma separated: each kernel's updates at "
                                               "each tile must equal its updates at the default tile")
    p.add_argument("--tile-head-dims", default="128", help="the head dims --tiles is checked at")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tiles = [t.strip() for t in a.tiles.split(",") if t.strip()]
    tile_dims = {int(x) for x in a.tile_head_dims.split(",")}
    _sass_report()  # before triton: compile for real
    import triton

    from specdec.kernels import triton_utils as tu

    for t in tiles:  # one clear error for a malformed tile, before anything compiles
        try:
            if "=" in t:
                raise ValueError(f"--tiles: one BVxWARPS per tile, every kernel at it (no OP=), got {t!r}")
            tu.parse_tiles(t, "--tiles")
        except ValueError as e:
            p.error(str(e))
    if os.environ.pop(tu.TILE_ENV, None) is not None:  # the default side is the package's own tile
        print(f"# {tu.TILE_ENV} ignored: the kernels compile at the package's default tiles and at --tiles")

    chosen = VARIANTS if a.variants is None else [VARIANTS[int(i)] for i in a.variants.split(",")]
    print(f"# triton {triton.__version__}, sm_90 TTGIR; a column holds the digest of each kernel's update "
          f"expressions (fold's step first)")
    print(f"{'K':>4} {'rule':>6} {'gate':>8} {'norm':>8} {'act':>5}  {'fold':>10} {'chain':>10} {'tree':>10} "
          f"{'snapshot':>10} {'lazy':>21} {'rebuild':>10}  ok")
    results, ok = [], True
    for K in (int(x) for x in a.head_dims.split(",")):
        for rule, gate, norm, act in chosen:
            r = check_variant(K, rule, gate, norm, act)
            ttgir = r.pop("ttgir")
            if tiles and K in tile_dims:
                tile_problems = check_tiles(K, (rule, gate, norm, act), tiles, ttgir)
                r["problems"] += tile_problems
                r["ok"] = r["ok"] and not tile_problems
                r["tiles"] = {t: not any(m.startswith(f"tile {t}:") for m in tile_problems) for t in tiles}
            ks = r["kernels"]
            step = ks["exact_fold"][0] if ks["exact_fold"] else ""
            cell = lambda n: ",".join(_digest(x) for x in sorted(ks.get(n, []), key=lambda x: x != step)) or "-"
            print(f"{K:4d} {rule:>6} {gate:>8} {norm:>8} {act:>5}  {cell('exact_fold'):>10} {cell('verify_chain'):>10} "
                  f"{cell('verify_tree'):>10} {cell('verify_tree_snapshot'):>10} {cell('verify_lazy'):>21} "
                  f"{cell('fast_rebuild'):>10}  {'yes' if r['ok'] else 'NO'}"
                  + (f"  tiles {' '.join(t + (' same' if v else ' DIFFER') for t, v in r['tiles'].items())}"
                     if "tiles" in r else ""), flush=True)
            for msg in r["problems"]:
                print(f"#   {msg}")
            ok &= r["ok"]
            results.append(dict(K=K, rule=rule, gate=gate, norm=norm, act=act, **r))
    print(f"# {'the same step in every kernel' if ok else 'STEPS DIFFER'} (triton {triton.__version__})")
    if a.json:
        Path(a.json).write_text(json.dumps({"triton": triton.__version__, "ok": ok, "variants": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
