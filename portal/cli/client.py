"""A small HTTP client for the Orrery API (urllib, JSON in and out).

The token goes only to the server it was given for. urllib on its own follows a redirect to any
host and sends the ``Authorization`` header along; this client follows a redirect only within
the server's own origin (same scheme, host and port) and refuses any other with an error that
names both places, sending nothing there. A server that moved (``http://`` to ``https://``, a
new host name) is reached by saying so: ``--server`` or ``orrery login`` with the new URL.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class ApiError(Exception):
    """The server refused the request; ``str()`` is what to show the user."""

    def __init__(self, status: int, detail: str, errors: list[dict[str, str]] | None = None) -> None:
        self.status, self.detail, self.errors = status, detail, errors or []
        self.retry_after: float | None = None  # the server's Retry-After, in seconds
        lines = [f"error: {detail}" if status == 0 else f"error ({status}): {detail}"]
        lines += [f"  {e.get('path', '?')}: {e.get('message', '')}" for e in self.errors]
        super().__init__("\n".join(lines))


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the port filled in for http and https, host lowercased."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: no origin matches it
        port = -1
    return scheme, (parts.hostname or ""), port or {"http": 80, "https": 443}.get(scheme, 0)


class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects within ``server``'s origin only; any other raises ``ApiError`` before a
    request (with the token or without) leaves for the new place."""

    def __init__(self, server: str) -> None:
        self.server = server

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        if origin(newurl) != origin(self.server):
            fp.close()
            raise ApiError(
                0,
                f"{self.server} redirected to {newurl}, another server: not followed, so your token "
                "is not sent there; if you trust it, use --server (or orrery login) with that URL",
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


RETRIES = 3  # a 429 or 503 with Retry-After is tried again this many times
MAX_RETRY_AFTER_S = 30.0  # a longer wait is the user's to decide: the error is shown


class Client:
    def __init__(self, server: str, token: str, timeout: float = 30.0) -> None:
        self.server, self.token, self.timeout = server.rstrip("/"), token, timeout
        self.opener = urllib.request.build_opener(SameOriginRedirects(self.server))

    def get(self, path: str, **params: Any) -> Any:
        query = {k: v for k, v in params.items() if v not in (None, "", False)}
        url = f"/api/v1/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        return self.request("GET", url)

    def post(
        self,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
        **params: Any,
    ) -> Any:
        query = {k: v for k, v in params.items() if v not in (None, "", False)}
        url = f"/api/v1/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        return self.request("POST", url, body, content_type=content_type, headers=headers)

    def patch(self, path: str, body: bytes, *, content_type: str = "application/json") -> Any:
        return self.request("PATCH", f"/api/v1/{path}", body, content_type=content_type)

    def follow(self, url: str) -> Any:
        """Fetch a ``next`` link of a paginated list (absolute URL from the server)."""
        parsed = urllib.parse.urlsplit(url)
        return self.request("GET", f"{parsed.path}?{parsed.query}")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                return self._once(method, path, body, content_type=content_type, headers=headers)
            except ApiError as exc:
                # Busy (429: refused before any work) or briefly unavailable (503: nothing done,
                # the server says when to come back): wait as told, with jitter, and go again. A
                # 503 is retried only when a retry cannot do the work twice.
                safe = exc.status == 429 or (
                    exc.status == 503 and (method == "GET" or "Idempotency-Key" in (headers or {}))
                )
                if (
                    not safe
                    or exc.retry_after is None
                    or exc.retry_after > MAX_RETRY_AFTER_S
                    or attempt == RETRIES
                ):
                    raise
                time.sleep(exc.retry_after + random.uniform(0, 1))
        raise AssertionError("unreachable")

    def _once(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        content_type: str,
        headers: dict[str, str] | None,
    ) -> Any:
        request = urllib.request.Request(self.server + path, data=body, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if body is not None:
            request.add_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with self.opener.open(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                data = json.loads(raw)
                error = ApiError(exc.code, data.get("detail", exc.reason), data.get("errors"))
            except (ValueError, AttributeError):
                error = ApiError(exc.code, str(exc.reason))
            error.retry_after = _seconds(exc.headers.get("Retry-After"))
            raise error from None
        except urllib.error.URLError as exc:
            raise ApiError(0, f"cannot reach {self.server}: {exc.reason}") from None
        except TimeoutError:
            raise ApiError(0, f"{self.server} did not answer within {self.timeout:.0f}s") from None
        return json.loads(raw) if raw else None


def _seconds(value: str | None) -> float | None:
    """A Retry-After in seconds (the HTTP-date form is not used by Orrery); None if absent."""
    try:
        return max(float(value), 0.0) if value else None
    except ValueError:
        return None
