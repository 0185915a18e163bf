"""The docs and CI stay in step with the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_is_generated_from_current_docstrings():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_gen_api_documents_the_checkout_it_lives_in(tmp_path):
    """``python docs/gen_api.py`` documents its own checkout's package, not another hyper_parallel found first on
    the path (the editable install, which points at /work/main while an engineer's worktree runs the script):
    before, a worktree's --write rewrote api.md from main's docstrings and --check compared against main's."""
    decoy = tmp_path / "hyper_parallel"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy hyper_parallel was documented')\n")
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert "decoy" not in done.stderr
    assert done.returncode == 0, done.stdout + done.stderr


def test_ci_runs_exactly_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2 and block[0].startswith("pip install") and "pytest" in block[1]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert block[0] in ci and block[1] in ci
    assert "--cov-fail-under=" in block[1]
