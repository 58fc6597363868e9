"""``examples/python_refit.py`` end to end (the Python API's refit: 2 trainer processes of
``fsdp:2``, 2 engine processes of ``tp:3`` pulling into their own parameters, 3 versions of
SmolLM2-135M and a rollback), its report checked by the harness's checker. A pytest module, so
the suite's two workers run it beside another module."""

from __future__ import annotations

from examples_ci import run_example_ci


def test_python_refit_example(tmp_path):
    r = run_example_ci("python_refit", tmp_path, args=())
    versions = r["versions"]
    assert len(versions) == 3 and all(v["verified"] for v in versions), versions
    assert len({v["version_id"] for v in versions}) == 3
    assert r["rollback_verified"] is True and r["addresses_unchanged"] is True
