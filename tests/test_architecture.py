"""The import contracts of ``pyproject.toml`` hold (``lint-imports``), and what the package ships.

Layers bottom to top, production code free of the development broker, datagen and the test
harness, and ``tests/`` and ``bench/`` independent of each other. On failure the message is
import-linter's report: which import breaks which contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.harness import REPO


def _lint_imports() -> str:
    found = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    assert found, "import-linter is not installed next to this interpreter (requirements.txt)"
    return found


def test_import_contracts_are_kept():
    result = subprocess.run([_lint_imports(), "--no-cache", "--no-logo"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "0 broken" in report, report


def test_the_installed_package_leaves_out_test_doubles_and_demos():
    """What ``pip install`` ships: the find rule of ``pyproject.toml``, as setuptools applies it."""
    import tomllib
    from setuptools import find_packages

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        rule = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_packages(REPO, include=rule["include"], exclude=rule.get("exclude", ())))
    assert not {p for p in shipped if p.startswith(("odl.harness", "odl.demos"))}, shipped
    for needed in ("odl.cli", "odl.train", "odl.models.dynamic", "odl.broker", "odl.datagen",
                   "publisher", "serving_plugin"):  # odl-kafka and odl-datagen are commands
        assert needed in shipped, needed
