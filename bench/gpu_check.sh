#!/usr/bin/env bash
# The GPU check in one command, within 7 minutes on a fresh H200 (compiles and autotuning included): every Triton
# test compiled on CUDA (the fold bitwise equal to single steps), the kernel benchmark against fla and the copy
# bandwidth, CUDA-graph rounds of every drafter against eager rounds and plain decoding, a random ~1.4B
# Kimi-Linear's step costs and projected speedups, and the acceptance benchmark with graphs on. Each part has a
# budget (bench/gpu_check.py); rows print as they are measured; one JSON lands in OUT_DIR/gpu_check.json.
#
#   bash bench/gpu_check.sh [OUT_DIR [--parts tests,kernels ...]]   # OUT_DIR: $OUT, else /tmp/specdec_gpu_check
#   SPECDEC_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh   # record the commit (a copied tree has no .git)
#
# Wheels in ./.whl (fla is not installed on the GPU machine) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUTDIR=${1:-${OUT:-/tmp/specdec_gpu_check}}
[ $# -gt 0 ] && shift  # the rest goes to bench/gpu_check.py (--parts, --budget-scale)
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TRITON_CACHE_AUTOTUNING=1
# triton's cache: compiled kernels and autotune results (gpu_check.py seeds it with bench/autotune/<GPU>/)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/specdec_triton_cache}
unset SPECDEC_FORCE_TRITON
[ -n "${SPECDEC_COMMIT:-}" ] || export SPECDEC_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
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
(cd /tmp && $PY -c "import specdec.kernels") || { echo "specdec does not import"; exit 1; }

# Run from /tmp so the checkout's own folders (specdec/, kernels/, verify/) never shadow the mapping.
(cd /tmp && $PY "$REPO/bench/gpu_check.py" --out "$OUTDIR" "$@" 2>&1) | tee "$OUTDIR/gpu_check.log"
RC=${PIPESTATUS[0]}
echo "gpu_check rc=$RC, $(( $(date +%s) - T0 )) s in all; logs and gpu_check.json in $OUTDIR"
exit "$RC"
