"""The wheel carries every package folder (a plain `pip install .` must import what the editable install does)."""

from __future__ import annotations

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_folder_is_listed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        st = tomllib.load(f)["tool"]["setuptools"]
    listed, mapping = set(st["packages"]), st["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for dp, dns, fns in os.walk(os.path.join(ROOT, folder)):
            dns[:] = [d for d in dns if d != "__pycache__"]
            if "__init__.py" in fns:
                rel = os.path.relpath(dp, os.path.join(ROOT, folder))
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    assert found == listed, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"
    assert not any(p.split(".")[0] in ("draft", "verify", "kernels") for p in listed)  # one namespace


def test_draft_does_not_import_the_runner():
    """draft/ gets the runner through a factory from its caller (the engine, the training command line)."""
    import ast

    for dp, dns, fns in os.walk(os.path.join(ROOT, "draft")):
        dns[:] = [d for d in dns if d != "__pycache__"]
        for fn in (f for f in fns if f.endswith(".py")):
            path = os.path.join(dp, fn)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                assert not any(n == "specdec.runner" or n.startswith("specdec.runner.") for n in names), \
                    f"{path}:{node.lineno} imports the runner"
