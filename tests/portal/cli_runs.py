"""Running the ``orrery`` CLI against a live server in tests: alice's world (a member of project
vision, one simulated cluster with eight H100s), an environment with none of the caller's
``ORRERY_*`` settings, and the CLI run as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from portal.services.tokens import issue_token
from tests.factories import make_cluster, make_node, make_project, make_queue, make_user


def alice_world() -> tuple[Any, str]:
    """alice, a member of project vision (queue default), a cluster sim-a with one node of
    eight H100s; returns alice and an API token of hers."""
    alice = make_user("alice")
    make_queue(make_project("vision", members=(alice,)))
    make_node(make_cluster("sim-a"), gpus=8, model="h100")
    return alice, issue_token(alice)[1]


def cli_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment less every ``ORRERY_*`` setting, with a config file of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORRERY_")}
    return env | {"ORRERY_CONFIG": str(tmp_path / "config.yaml")}


def run_cli(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``orrery ARGS`` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "portal.cli.commands", *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
