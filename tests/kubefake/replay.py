"""Replays the recorded exchanges against a :class:`FakeKube` and reports every difference.

The recordings were made against one real server run, in the order :data:`RECORDING_ORDER` gives.
Volatile values are normalised on both sides before comparing: uids, resourceVersions,
timestamps, generated name suffixes (mapped recorded → fake as they appear), continue tokens and
``managedFields`` (compared as present/absent only). Requests that carry recorded values (a uid in
an ownerReference, a generated pod name in a path, an RV to watch from, a continue token) are
rewritten with the fake's values first.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from tests.kubefake.http import parse_route
from tests.kubefake.server import FakeKube

RECORDINGS = Path(__file__).parent / "recordings"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \+0000 UTC")
PLACEHOLDER = re.compile(r"<([\d,]+) x '(.)'>")
GO_TEMPLATE_DUMP = re.compile(r"core\.PodTemplateSpec\{.*\}: field is immutable")
RV_IN_MESSAGE = re.compile(r"(resource version: |current: |\()\d+")


def recording_order() -> list[Path]:
    """Files in the order they were recorded (README): 033 and 037 ran after 085."""
    files = sorted(RECORDINGS.glob("*.json"))
    late = [f for f in files if f.name[:3] in ("033", "037")]
    first = [f for f in files if f not in late and f.name[:3] < "090"]
    return first + late + [f for f in files if f.name[:3] >= "090"]


def exchanges(recording: dict[str, Any]) -> list[dict[str, Any]]:
    return recording.get("exchanges") or [recording]


class Watch:
    """A watch opened on its own connection; lines are collected by a thread."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self.connection = connection
        self.response = response
        self.events: list[dict[str, Any]] = []
        self.ended = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                line = self.response.readline()
                if not line:
                    break
                self.events.append(json.loads(line))
        except Exception:  # collect() closes the socket under the reader on purpose
            pass
        self.ended = True

    def collect(self, expected: int, idle: float = 0.4, limit: float = 5.0) -> list[dict[str, Any]]:
        """Wait for ``expected`` non-bookmark events (or the stream's end), then a short idle period."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not self.ended:
            if sum(e["type"] != "BOOKMARK" for e in self.events) >= expected:
                break
            time.sleep(0.02)
        time.sleep(idle if not self.ended else 0)
        self.connection.close()
        return list(self.events)


class Replayer:
    """Sends recorded requests to ``fake`` and compares answers; collects differences in ``problems``."""

    def __init__(self, fake: FakeKube, partial_watches: set[str] = frozenset()):
        self.fake = fake
        self.partial_watches = partial_watches
        self.uids: dict[str, str] = {}
        self.names: dict[str, str] = {}
        self.rvs: dict[int, int] = {}
        self.continues: dict[str, str] = {}
        self.sa_token = ""
        self.problems: list[str] = []
        self.matched = 0
        self.watches: dict[str, tuple[Watch, dict[str, Any]]] = {}

    # -- mapping recorded values to the fake's ------------------------------------------------
    def map_rv(self, recorded: int) -> int:
        if recorded in self.rvs:
            return self.rvs[recorded]
        seen = [rv for rv in self.rvs if rv <= recorded]
        if not seen:
            return recorded
        if recorded > max(self.rvs):
            return self.fake.store.rv + (recorded - max(self.rvs))
        return self.rvs[max(seen)]

    def _learn(self, recorded: Any, actual: Any) -> None:
        """Pair up uids, generated names, RVs and continue tokens of the two bodies."""
        if isinstance(recorded, dict) and isinstance(actual, dict):
            for key, value in recorded.items():
                other = actual.get(key)
                if key == "uid" and isinstance(value, str) and isinstance(other, str):
                    self.uids[value] = other
                elif (
                    key == "resourceVersion"
                    and isinstance(value, str)
                    and value.isdigit()
                    and str(other).isdigit()
                ):
                    self.rvs[int(value)] = int(other)
                elif key == "continue" and isinstance(value, str) and isinstance(other, str):
                    self.continues[value] = other
                elif key == "name" and recorded.get("generateName") and isinstance(other, str):
                    self.names[value] = other
                else:
                    self._learn(value, other)
        elif isinstance(recorded, list) and isinstance(actual, list):
            for left, right in zip(recorded, actual, strict=False):
                self._learn(left, right)

    def _rewrite(self, text: str) -> str:
        for table in (self.uids, self.names):
            for recorded, actual in table.items():
                text = text.replace(recorded, actual)
        return text

    def _body_rv(self, request: dict[str, Any], match: re.Match[str]) -> str:
        """An RV no recorded response showed came from a read or write that was not recorded: the
        client had just read the object, so it is the object's current RV."""
        recorded = int(match.group(1))
        if recorded in self.rvs:
            return str(self.rvs[recorded])
        route = parse_route(self._rewrite(request["path"]))
        if route is not None and route.name:
            namespace = route.namespace if route.resource.namespaced else ""
            current = self.fake.store.get(
                route.resource.plural, f"{namespace}/{route.name}" if namespace else route.name
            )
            if current is not None:
                return current.obj["metadata"]["resourceVersion"]
        return str(self.map_rv(recorded))

    def _token(self, identity: str) -> str:
        if identity.startswith("envtest-admin"):
            return self.fake.admin_token
        if identity.startswith("envtest-user"):
            return self.fake.unbound_token
        if identity.startswith("orrery-adapter"):
            return self.fake.adapter_token
        if identity.startswith("system:serviceaccount"):
            return self.sa_token
        return "not-a-token"

    # -- sending ------------------------------------------------------------------------------
    def _request(
        self, exchange: dict[str, Any]
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        request = exchange["request"]
        query = dict(request.get("query") or {})
        if (
            "resourceVersion" in query
            and query["resourceVersion"] not in ("", "0")
            and query["resourceVersion"].isdigit()
        ):
            query["resourceVersion"] = str(self.map_rv(int(query["resourceVersion"])))
        if "continue" in query:
            query["continue"] = self.continues.get(query["continue"], query["continue"])
        path = self._rewrite(request["path"]) + ("?" + urlencode(query) if query else "")
        body = request.get("body")
        data = None
        if body is not None:
            text = PLACEHOLDER.sub(lambda m: m.group(2) * int(m.group(1).replace(",", "")), json.dumps(body))
            text = self._rewrite(text)
            text = re.sub(
                r'"resourceVersion": "(\d+)"',
                lambda m: f'"resourceVersion": "{self._body_rv(request, m)}"',
                text,
            )
            data = text.encode()
        headers = {k: v for k, v in (request.get("headers") or {}).items()}
        if data is not None:
            headers.setdefault("Content-Type", "application/json")
        headers["Authorization"] = f"Bearer {self._token(exchange.get('as', ''))}"
        connection = http.client.HTTPConnection("127.0.0.1", self.fake.port, timeout=30)
        connection.request(request["method"], path, body=data, headers=headers)
        return connection, connection.getresponse()

    def run_file(
        self, path: Path, excluded: dict[tuple[str, int], str], setup: dict[tuple[str, int], Any]
    ) -> None:
        recording = json.loads(path.read_text())
        prefix = path.name[:3]
        open_watches: list[tuple[str, Watch, dict[str, Any], float]] = []
        for index, exchange in enumerate(exchanges(recording)):
            label = f"{path.name}#{index}"
            for entry in [w for w in open_watches if w[3] <= exchange.get("t_ms", 0)]:
                # this watch had timed out before the exchange started: compare it now
                open_watches.remove(entry)
                self._compare_watch(entry[0], entry[1], entry[2])
            steps = setup.get((prefix, index))
            for step in steps if isinstance(steps, list | tuple) else [steps] if steps else []:
                step(self, recording)
            if (prefix, index) in excluded:
                continue
            if "events" in exchange["response"]:
                watch = self._open_watch(label, exchange)
                if watch is not None:
                    if prefix == "059":
                        self.watches[label] = (watch, exchange)
                    else:
                        seconds = float(exchange["request"]["query"].get("timeoutSeconds") or 3600)
                        open_watches.append(
                            (label, watch, exchange, exchange.get("t_ms", 0) + seconds * 1000)
                        )
                continue
            self._exchange(label, exchange)
        for label, watch, exchange, _ in open_watches:
            self._compare_watch(label, watch, exchange)

    def finish_watches(self) -> None:
        for label, (watch, exchange) in self.watches.items():
            self._compare_watch(label, watch, exchange)
        self.watches.clear()

    def _open_watch(self, label: str, exchange: dict[str, Any]) -> Watch | None:
        connection, response = self._request(exchange)
        if response.status != exchange["response"]["status"]:
            self.problems.append(
                f"{label}: status {response.status}, recorded {exchange['response']['status']}"
            )
            connection.close()
            return None
        return Watch(connection, response)

    def _compare_watch(self, label: str, watch: Watch, exchange: dict[str, Any]) -> None:
        recorded = exchange["response"]["events"]
        wanted = [e for e in recorded if e["type"] != "BOOKMARK"]
        got = watch.collect(len(wanted))
        actual = [e for e in got if e["type"] != "BOOKMARK"]
        matched = wanted
        if label in self.partial_watches:
            matched = _subsequence(
                wanted, actual, lambda e: json.dumps([e["type"], self.normalise(e["object"])], sort_keys=True)
            )
        if matched is None or [e["type"] for e in actual] != [e["type"] for e in matched]:
            self.problems.append(
                f"{label}: event types {[e['type'] for e in actual]}, recorded {[e['type'] for e in wanted]}"
            )
            return
        wanted = matched
        for number, (left, right) in enumerate(zip(wanted, actual, strict=True)):
            self._learn(left["object"], right["object"])
            self._compare(f"{label} event {number}", left["object"], right["object"])
        recorded_bookmarks = [e for e in recorded if e["type"] == "BOOKMARK"]
        for bookmark in (e for e in got if e["type"] == "BOOKMARK"):
            if recorded_bookmarks:
                self._compare(f"{label} bookmark", recorded_bookmarks[0]["object"], bookmark["object"])
        if exchange["response"].get("stream_end", "").endswith("ERROR event") and not watch.ended:
            self.problems.append(f"{label}: the stream stayed open after the ERROR event")
        self.matched += 1

    def _exchange(self, label: str, exchange: dict[str, Any]) -> None:
        connection, response = self._request(exchange)
        raw = response.read()
        connection.close()
        recorded = exchange["response"]
        if response.status != recorded["status"]:
            self.problems.append(
                f"{label}: status {response.status}, recorded {recorded['status']}: {raw[:300]!r}"
            )
            return
        for header in ("Warning",):
            if (recorded.get("headers") or {}).get(header) != response.getheader(header):
                self.problems.append(
                    f"{label}: header {header} {response.getheader(header)!r}, recorded "
                    f"{(recorded.get('headers') or {}).get(header)!r}"
                )
        expected = recorded.get("body")
        if isinstance(expected, dict):
            expected = {
                k: v for k, v in expected.items() if not k.startswith("_")
            }  # the recorder's own notes
        if expected == "" or expected is None:
            if raw:
                self.problems.append(f"{label}: body {raw[:200]!r}, recorded none")
            else:
                self.matched += 1
            return
        actual = json.loads(raw)
        if isinstance(actual, dict) and actual.get("kind") == "TokenRequest":
            self.sa_token = actual["status"]["token"]
        self._learn(expected, actual)
        if self._compare(label, expected, actual):
            self.matched += 1

    # -- comparing ----------------------------------------------------------------------------
    def normalise(self, value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {
                k: ("<managedFields>" if k == "managedFields" else self.normalise(v, k))
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.normalise(v, key) for v in value]
        if isinstance(value, str):
            if key in ("resourceVersion", "continue", "token"):
                return f"<{key}>"
            if key == "serverAddress":
                return "<address>"
            if key == "audiences":
                return "<audience>"
            for recorded, actual in self.names.items():
                value = value.replace(actual, recorded)
            value = UUID.sub("<uid>", value)
            value = TIMESTAMP.sub("<time>", value)
            value = GO_TEMPLATE_DUMP.sub("core.PodTemplateSpec{<dump>}: field is immutable", value)
            if key == "message":
                value = RV_IN_MESSAGE.sub(lambda m: m.group(1) + "<rv>", value)
            return value
        return value

    def _compare(self, label: str, expected: Any, actual: Any) -> bool:
        left, right = self.normalise(expected), self.normalise(actual)
        differences: list[str] = []
        _diff(left, right, "", differences)
        if differences:
            self.problems.append(f"{label}: " + "; ".join(differences[:6]))
            return False
        return True


def _subsequence(
    recorded: list[dict[str, Any]], actual: list[dict[str, Any]], key: Any
) -> list[dict[str, Any]] | None:
    """The recorded events the actual ones equal in order (after normalising), or None."""
    chosen, position = [], 0
    for event in actual:
        wanted = key(event)
        while position < len(recorded):
            candidate = recorded[position]
            position += 1
            if key(candidate) == wanted:
                chosen.append(candidate)
                break
        else:
            return None
    return chosen


def _diff(left: Any, right: Any, path: str, out: list[str]) -> None:
    if isinstance(left, str) and (left == "<managedFields>" or left.startswith("<redacted")):
        return
    if isinstance(left, dict) and isinstance(right, dict):
        for key in sorted(set(left) | set(right)):
            if key not in right:
                out.append(f"{path}.{key} missing")
            elif key not in left:
                out.append(f"{path}.{key} unexpected ({str(right[key])[:80]})")
            else:
                _diff(left[key], right[key], f"{path}.{key}", out)
    elif isinstance(left, list) and isinstance(right, list):
        if len(left) != len(right):
            out.append(f"{path}: {len(right)} items, recorded {len(left)}")
        for index, (a, b) in enumerate(zip(left, right, strict=False)):
            _diff(a, b, f"{path}[{index}]", out)
    elif left != right:
        out.append(f"{path}: {str(right)[:160]!r}, recorded {str(left)[:160]!r}")
