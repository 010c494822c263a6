"""The wheel carries every package folder (a plain `pip install .` must import what the editable install does)."""

from __future__ import annotations

import ast
import os
import tomllib

from site_view import site_view

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


def _imports(folder: str):
    """-> (path, line, names) per import statement of the .py files below `folder`; `from m import a` names `m`
    and `m.a`."""
    for path, node in _nodes(folder):
        if isinstance(node, ast.Import):
            yield path, node.lineno, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            yield path, node.lineno, [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]


def _nodes(folder: str):
    """-> (path, node) for every syntax node of the .py files below `folder`."""
    for dp, dns, fns in os.walk(os.path.join(ROOT, folder)):
        dns[:] = [d for d in dns if d != "__pycache__"]
        for fn in (f for f in fns if f.endswith(".py")):
            path = os.path.join(dp, fn)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                yield path, node


def test_draft_does_not_import_the_runner():
    """draft/ gets the runner through a factory from its caller (the engine, the training command line)."""
    for path, line, names in _imports("draft"):
        assert not any(n == "specdec.runner" or n.startswith("specdec.runner.") for n in names), \
            f"{path}:{line} imports the runner"


def test_package_imports_no_test_helper():
    """The tests' helpers (tests/*.py: assertions, tiny models, harnesses) are not installed, so no package folder
    may import them."""
    helpers = {f[:-3] for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        folders = set(tomllib.load(f)["tool"]["setuptools"]["package-dir"].values())
    for folder in sorted(folders):
        for path, line, names in _imports(folder):
            assert not any(n.split(".")[0] in helpers or n == "specdec.testing" for n in names), \
                f"{path}:{line} imports a test helper: {names}"


def test_bench_scripts_shadow_no_module():
    """`python bench/X.py` puts bench/ first on sys.path, so a script named like a module that transformers or torch
    imports (transformers imports the `kernels` package when it is installed) would be imported in its place."""
    import importlib.machinery
    import importlib.metadata
    import sys

    bench = os.path.realpath(os.path.join(ROOT, "bench"))
    path = [p for p in sys.path if os.path.realpath(p or ".") != bench]  # (tests that load bench scripts add it)
    installed = set(importlib.metadata.packages_distributions())
    for name in sorted(os.listdir(bench)):
        stem = name[:-3] if name.endswith(".py") else None
        if stem is None:
            continue
        assert stem not in sys.stdlib_module_names, f"bench/{name} shadows the standard library's {stem}"
        assert stem not in installed, f"bench/{name} shadows the installed package {stem}"
        found = importlib.machinery.PathFinder.find_spec(stem, path)
        assert found is None, f"bench/{name} shadows the importable module {stem} ({found.origin})"


def test_checkout_root_on_sys_path_hides_no_package(tmp_path):
    """`python -m specdec ...` from the checkout root puts the root on sys.path, where the folder `kernels/` would
    stand in for the PyPI package `kernels` (which transformers imports when it is installed, and probes for at load
    when it is not): there a top-level `import kernels` gets the real package, or, in a site without it, an empty
    namespace that transformers' probe reads as absent, as a folder without `__init__.py` would be; either way
    transformers' models and specdec.kernels import. Also with the root on the path a second time (a symlink)."""
    import importlib.metadata
    import subprocess
    import sys

    probe = ("import kernels, os; f = getattr(kernels, '__file__', None); print(f and os.path.realpath(f))"
             "\nimport transformers.models.kimi_linear.modeling_kimi_linear, specdec.kernels as k; print(k.__name__)"
             "\nfrom transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())")
    link = tmp_path / "checkout"
    link.symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        importlib.metadata.distribution("kernels")
        sites = {"installed": None}
    except importlib.metadata.PackageNotFoundError:
        sites = {}
    sites["absent"] = site_view(tmp_path / "site", without=("kernels",))
    for case, view in sites.items():
        # -S and site.addsitedir: the interpreter's own site-packages replaced by the view
        cmd = [sys.executable, "-c", probe] if view is None else \
            [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(view)!r})\n{probe}"]
        for extra in ({}, {"PYTHONPATH": str(link)}):
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**env, **extra}, timeout=120)
            assert proc.returncode == 0, (case, extra, proc.stderr[-2000:])
            where, name, probed = proc.stdout.split()
            assert name == "specdec.kernels", (case, proc.stdout)
            if case == "installed":
                assert not where.startswith(os.path.realpath(ROOT) + os.sep) and probed == "True", (case, proc.stdout)
            else:
                assert where == "None" and probed == "False", (case, extra, proc.stdout)


def test_runner_classes_are_named_by_the_factory_only():
    """Outside `runner.make_runner` the package asks a runner's declared capabilities (`target.TargetRunner`),
    never its class: no `isinstance(..., HybridRunner / GenericRunner)` and no `HybridRunner` import."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        folders = set(tomllib.load(f)["tool"]["setuptools"]["package-dir"].values())
    found = [f"{path}:{node.lineno} {ast.unparse(node)}" for folder in sorted(folders)
             for path, node in _nodes(folder) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "isinstance" and "Runner" in ast.unparse(node.args[1])]
    assert not found, found
    import specdec.generic
    import specdec.runner
    import specdec.target
    for cls in (specdec.runner.HybridRunner, specdec.generic.GenericRunner):
        assert issubclass(cls, specdec.target.TargetRunner) and not cls.__abstractmethods__
