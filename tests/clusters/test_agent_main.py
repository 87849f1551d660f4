"""``orrery-agent``'s start-up: a join token it cannot use ends it at once with one line on
standard error and a non-zero status, never a traceback or a loop of refused registrations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOOD = "orj_" + "A" * 43


def _agent(tmp_path: Path, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ORRERY_JOIN_TOKEN"}
    if token is not None:
        env["ORRERY_JOIN_TOKEN"] = token
    argv = [sys.executable, "-m", "clusters.agent", "--server", "http://127.0.0.1:9", "--once"]
    argv += ["--fake-gpus", "a100:1", "--no-cgroups", "--work-dir", str(tmp_path / "work"), *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=60)


@pytest.mark.parametrize(
    ("token", "file_bytes", "said"),
    [
        ("not-a-token", None, b"ORRERY_JOIN_TOKEN is malformed"),
        ("orj_short\nHost: evil", None, b"is malformed"),
        ("orj_" + "\u00e9" * 43, None, b"is malformed"),
        ("orn_" + "A" * 43, None, b"is malformed"),  # a node credential, not a join token
        (None, b"orj_\xff\xfe" + b"A" * 41, b"cannot read the join token from"),
        (None, b"", b"is malformed"),
        (None, "missing", b"No such file"),
    ],
    ids=["garbage", "header-injection", "non-ascii", "wrong-kind", "not-utf8", "empty-file", "no-file"],
)
def test_an_unusable_join_token_is_one_line_and_a_failure(tmp_path, token, file_bytes, said):
    args: tuple[str, ...] = ()
    if file_bytes is not None:
        path = tmp_path / "join-token"
        if file_bytes != "missing":
            path.write_bytes(file_bytes)
        args = ("--join-token-file", str(path))
    done = _agent(tmp_path, *args, token=token)
    assert done.returncode == 1
    assert done.stderr.count(b"\n") == 1 and said in done.stderr and b"Traceback" not in done.stderr


def test_a_well_formed_token_goes_on_to_register(tmp_path):
    (tmp_path / "join-token").write_text(GOOD + "\n")
    done = _agent(tmp_path, "--join-token-file", str(tmp_path / "join-token"))
    assert done.returncode == 0  # one round: the server is unreachable, the agent says so and goes on
    assert b"cannot register yet" in done.stderr
