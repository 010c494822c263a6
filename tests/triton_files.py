"""The test files that run Triton kernels, for the GPU check (`pytest $(python tests/triton_files.py) -m triton`).

A file counts when it carries the `triton` marker anywhere in its code (`pytestmark = pytest.mark.triton`, a
decorator, a `pytest.param(..., marks=...)`). Read from the source, not collected: no test module is imported.

    python tests/triton_files.py            # absolute paths, one a line (callers may run pytest from elsewhere)
    python tests/triton_files.py --relative # relative to the current directory

`needs_marker` is what tests/test_triton_files.py holds the listing to: a file that imports a `kernels.*.triton`
module, fetches an op's Triton implementation through the dispatcher or forces the Triton backend must be listed.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# built from pieces so this file's own source matches none of them
_FORCE = "SPECDEC_FORCE_" + "TRITON"
NEEDS = [
    re.compile(r"from\s+(specdec\.)?kernels(\.\w+)*\.triton\s+import"),  # from specdec.kernels.verify.triton import x
    re.compile(r"from\s+(specdec\.)?kernels(\.\w+)*\s+import\s+(\(\s*)?([\w \t,]+,\s*)?triton\b"),  # ... import triton
    re.compile(r"import\s+(specdec\.)?kernels(\.\w+)*\.triton\b"),
    re.compile(r"\btriton_impl\b"),  # dispatch.triton_impl(name), or the function itself
    re.compile(_FORCE + r"""(["']\s*[,:]\s*["']1["']|=1\b)"""),  # setenv("...", "1"), {"...": "1"}, ...=1
]


def test_files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def has_marker(path: Path) -> bool:
    """`pytest.mark.triton` appears in the file's code (comments and strings do not count)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr == "triton" and isinstance(node.value, ast.Attribute)
                and node.value.attr == "mark" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "pytest"):
            return True
    return False


def needs_marker(path: Path) -> bool:
    """The file reaches a Triton kernel: imports a Triton kernel module, asks the dispatcher for a Triton op, or
    forces the Triton backend (subprocess scripts held in strings count too)."""
    text = path.read_text()
    return any(p.search(text) for p in NEEDS)


def marked_files() -> list[Path]:
    return [p for p in test_files() if has_marker(p)]


def main(argv: list[str]) -> int:
    relative = "--relative" in argv
    for p in marked_files():
        print(os.path.relpath(p) if relative else p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
