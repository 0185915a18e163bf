"""The docs and CI stay in step with the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_is_generated_from_current_docstrings():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ci_runs_exactly_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2 and block[0].startswith("pip install") and "pytest" in block[1]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert block[0] in ci and block[1] in ci
    assert "--cov-fail-under=" in block[1]
