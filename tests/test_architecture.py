"""The import contracts of ``pyproject.toml`` hold (``lint-imports``, the pinned import-linter).

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
