"""bench/gpu_check.py's reading of a test report: the compiled fold property counts as bitwise only when every
family of tests/test_fold_exactness.py ran and passed (a run cut by its budget says so instead)."""

from bench_scripts import load_bench

gc = load_bench("gpu_check")


def _xml(tmp_path, cases):
    tag = {"failed": "<failure/>", "skipped": "<skipped/>"}
    body = "".join(f'<testcase classname="tests.x" name="{n}">{tag.get(s, "")}</testcase>' for n, s in cases)
    p = tmp_path / "r.xml"
    p.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return p


def test_fold_bitwise_needs_every_family(tmp_path):
    fams = gc.fold_families()
    assert set(fams) >= {"kda", "gdn", "mamba2"}
    ids = [f"test_fold_equals_single_steps[triton-{f}]" for f in fams]
    counts, fold = gc.read_report(_xml(tmp_path, [(i, "passed") for i in ids] + [("test_other", "failed")]))
    assert counts == {"passed": len(ids), "failed": 1, "skipped": 0}
    assert gc.fold_bitwise(fold, fams) == (True, [])
    # one family cut by the budget: not known, and said so
    _, fold = gc.read_report(_xml(tmp_path, [(i, "passed") for i in ids[1:]]))
    assert gc.fold_bitwise(fold, fams) == (None, [fams[0]])
    # one failed (or skipped: the kernels did not run) is not bitwise
    for bad in ("failed", "skipped"):
        _, fold = gc.read_report(_xml(tmp_path, [(ids[0], bad)] + [(i, "passed") for i in ids[1:]]))
        assert gc.fold_bitwise(fold, fams)[0] is False
    # the reference backend's passes do not count for the compiled kernels
    _, fold = gc.read_report(_xml(tmp_path, [(i.replace("triton", "reference"), "passed") for i in ids]))
    assert gc.fold_bitwise(fold, fams) == (None, fams)
    assert gc.read_report(tmp_path / "missing.xml") == ({"passed": 0, "failed": 0, "skipped": 0}, {})
