"""The pure core is type-checked (docs/design.rst, "How the code is
written"): mypy must accept it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURE = ["pool.py", "affinity.py", "classstats.py", "locality.py", "slowstart.py", "relearn.py", "outlier.py",
        "resume.py", "frames.py", "protocol.py", "classifier.py",
        "settings.py", "tree.py", "httpparse.py", "h1.py", "spool.py", "forwarding.py",
        "guard.py", "proxyproto.py", "policies.py"]


def test_the_pure_core_type_checks(tmp_path):
    paths = [os.path.join(ROOT, "src", "zc_lb", name) for name in PURE]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), *paths],
        capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
