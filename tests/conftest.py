import http.server
import os
import pwd
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from clusters.ingest.buffer import get_buffer
from clusters.services.aggregation import forget_catalog
from clusters.services.credentials import forget_cached_identities
from portal.choices import Scope
from portal.services.tokens import issue_token
from tests.factories import make_cluster, make_node, make_project, make_queue, make_user


@pytest.fixture(autouse=True)
def clean_pipeline():
    """Each test starts with an empty heartbeat buffer and cold caches: the buffer remembers the
    last sequence number per node id, and ids are reused between tests (SQLite reuses them
    after a rollback)."""
    get_buffer().clear()
    forget_cached_identities()
    forget_catalog()
    yield
    get_buffer().clear()


@pytest.fixture
def api(db) -> Callable[..., APIClient]:
    """``api(alice)`` is a client sending alice's bearer token (every scope unless ``scopes``
    says otherwise); ``api()`` sends none."""

    def make(user: Any = None, scopes: tuple[str, ...] = tuple(Scope.values)) -> APIClient:
        client = APIClient()
        if user is not None:
            _, plaintext = issue_token(user, name="tests", scopes=scopes)
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
        return client

    return make


@pytest.fixture
def alice(db):
    return make_user("alice")


@pytest.fixture
def bob(db):
    return make_user("bob")


@pytest.fixture
def operator(db):
    return make_user("ops", staff=True)


@pytest.fixture
def vision(alice):
    return make_project("vision", members=(alice,))


@pytest.fixture
def queue(vision):
    return make_queue(vision)


@pytest.fixture
def node(db):
    return make_node(make_cluster("sim-a"), gpus=8, model="h100", name="a-n001")


def _whole_machine(what: str) -> None:
    """State of the whole machine is used by the second of make test's two processes only."""
    assert os.environ.get("ORRERY_TEST_PROCESS") != "first", (
        f"{what} is shared by the whole machine: list this test's file in scripts/test.sh's second process"
    )


@pytest.fixture(scope="session")
def slurm():
    """A real Slurm (scripts/slurm-dev-cluster.sh: slurmctld, four slurmd with fake A100s,
    slurmrestd with JWT), started or found running once per test run; stopped at the end."""
    _whole_machine("the dev Slurm")
    script = str(Path(__file__).resolve().parents[1] / "scripts/slurm-dev-cluster.sh")
    up = subprocess.run([script, "up"], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    env = dict(line.removeprefix("export ").replace("'", "").split("=", 1) for line in up.stdout.splitlines())
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    yield env | {"script": script}
    subprocess.run([script, "down"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def unix_users() -> Any:
    """Two real Unix accounts, ``orrt-alice`` and ``orrt-bob`` (home directories, their own
    groups), created for this test run and removed at its end with everything they ran. The
    tests that use them run as root, as an agent or a Slurm submit host does."""
    assert os.geteuid() == 0, "the identity tests create Unix users: run the suite as root"
    _whole_machine("the test Unix accounts")
    names = ("orrt-alice", "orrt-bob")
    for name in names:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", "-r", name], capture_output=True)
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
    yield {name.removeprefix("orrt-"): pwd.getpwnam(name) for name in names}
    for name in names:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", "-r", name], capture_output=True)


class _Catcher(http.server.BaseHTTPRequestHandler):
    caught: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.caught.append((self.path, dict(self.headers), body))
        self.send_response(202)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def catcher():
    """An HTTP server on loopback that answers every POST 202 and keeps (path, headers, body)."""
    _Catcher.caught = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Catcher)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, _Catcher.caught
    server.shutdown()
    server.server_close()
