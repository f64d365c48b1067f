"""The pure core is type-checked (docs/design.rst, "How the code is
written"): mypy must accept it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def test_the_pure_core_type_checks(tmp_path):
    # (the typed modules are those pyproject.toml's [tool.mypy] lists)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
