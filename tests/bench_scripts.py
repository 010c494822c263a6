"""Import a script of `bench/` as a module (the scripts are not a package): bench/common.py's loader."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
from common import load_script as load_bench  # noqa: E402,F401
