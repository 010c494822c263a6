#!/usr/bin/env bash
# GPU check in one command (one H200, well under 8 minutes): the Triton kernel tests on CUDA tensors
# (compiled kernels, TRITON_INTERPRET=0; the fold is bitwise equal to single steps on the device too) and the
# kernel benchmark at Kimi-Linear shapes (fold at n = 1, 2, 4, 8 against copy bandwidth, verify against fla),
# and CUDA-graph rounds against eager rounds on the embedded model, token for token (bench/graph_check.py).
#
#   bash bench/gpu_check.sh [OUT_DIR]      # logs and kernels.json land in OUT_DIR ($OUT, else /tmp/...)
#
# Wheels in ./.whl (fla is not installed on the GPU machine) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUTDIR=${1:-${OUT:-/tmp/specdec_gpu_check}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
unset SPECDEC_FORCE_TRITON
T0=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# `specdec` must import: an editable install (no deps, no network), else a symlink tree that maps the
# top-level folders onto the specdec namespace as pyproject's package-dir does.
importable() { (cd /tmp && $PY -c "import specdec.kernels" >/dev/null 2>&1); }
if ! importable; then
    $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUTDIR/pip-editable.log" 2>&1 || true
fi
if ! importable; then
    map=/tmp/specdec_src
    rm -rf "$map" && mkdir -p "$map/specdec"
    for f in specdec/*; do ln -s "$REPO/$f" "$map/specdec/"; done
    for d in kernels replayssm draft verify; do [ -d "$d" ] && ln -s "$REPO/$d" "$map/specdec/$d"; done
    export PYTHONPATH=$map${PYTHONPATH:+:$PYTHONPATH}
fi
# Run from /tmp so the checkout's own folders (specdec/, kernels/, verify/) never shadow the mapping.
(cd /tmp && $PY -c "
import torch, triton, specdec.kernels as k
print('specdec.kernels:', k.__file__, '| torch', torch.__version__, '| triton', triton.__version__,
      '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())
try:
    import fla; print('fla', fla.__version__)
except Exception as e:
    print('fla unavailable:', type(e).__name__, e)
") || { echo "specdec does not import"; exit 1; }

echo "== pytest tests/test_triton_kernels.py tests/test_fold_exactness.py tests/test_mamba2_triton.py tests/test_tree_stack.py (CUDA) =="
(cd /tmp && timeout 330 $PY -m pytest "$REPO/tests/test_triton_kernels.py" "$REPO/tests/test_fold_exactness.py" \
    "$REPO/tests/test_mamba2_triton.py" "$REPO/tests/test_tree_stack.py" -q -rfEs \
    -k "not sm90" -p no:cacheprovider \
    --junitxml="$OUTDIR/pytest.xml" 2>&1) | tee "$OUTDIR/pytest.log"
TEST_RC=${PIPESTATUS[0]}

echo "== bench/kernel_speed.py --device cuda =="
(cd /tmp && timeout 240 $PY "$REPO/bench/kernel_speed.py" --device cuda --json "$OUTDIR/kernels.json" 2>&1) \
    | tee "$OUTDIR/bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo "== bench/graph_check.py --device cuda (cuda_graph=True vs eager, token for token; ngram, mtp, dspark, eagle) =="
(cd /tmp && timeout 200 $PY "$REPO/bench/graph_check.py" --device cuda --repeats 2 --json "$OUTDIR/graphs.json" 2>&1) \
    | tee "$OUTDIR/graphs.log"
GRAPH_RC=${PIPESTATUS[0]}

echo "== summary =="
$PY - "$OUTDIR/pytest.xml" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    sys.exit(f"no test report: {e}")
rows = collections.OrderedDict()
for tc in root.iter("testcase"):
    name = tc.get("name").split("[")[0]
    state = "failed" if tc.find("failure") is not None or tc.find("error") is not None else (
        "skipped" if tc.find("skipped") is not None else "passed")
    c = rows.setdefault(name, collections.Counter())
    c[state] += 1
    c["s"] += float(tc.get("time", 0))
print(f"{'test':45s} {'pass':>5s} {'fail':>5s} {'skip':>5s} {'s':>7s}")
for name, c in rows.items():
    print(f"{name:45s} {c['passed']:5d} {c['failed']:5d} {c['skipped']:5d} {c['s']:7.1f}")
EOF
echo "tests rc=$TEST_RC bench rc=$BENCH_RC graphs rc=$GRAPH_RC total $(( $(date +%s) - T0 )) s; logs in $OUTDIR"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$GRAPH_RC" -eq 0 ]
