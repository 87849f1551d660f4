"""``python manage.py …`` as the docs show it: any Python on the PATH, not only the virtualenv's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The interpreter the virtualenv was made from: it has no Django of its own.
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def _run(manage: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [BASE_PYTHON, str(manage), *args],
        cwd=manage.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_python_without_django_runs_the_command_with_the_virtualenv():
    done = _run(ROOT / "manage.py", "help", "issue_token")
    assert done.returncode == 0, done.stderr
    assert "usage: manage.py issue_token" in done.stdout


def test_without_a_virtualenv_it_says_how_to_make_one(tmp_path):
    shutil.copy(ROOT / "manage.py", tmp_path / "manage.py")
    done = _run(tmp_path / "manage.py", "help")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "make venv" in done.stderr and "Traceback" not in done.stderr
