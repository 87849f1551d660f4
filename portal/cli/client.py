"""A small HTTP client for the Orrery API (urllib, JSON in and out)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class ApiError(Exception):
    """The server refused the request; ``str()`` is what to show the user."""

    def __init__(self, status: int, detail: str, errors: list[dict[str, str]] | None = None) -> None:
        self.status, self.detail, self.errors = status, detail, errors or []
        lines = [f"error: {detail}" if status == 0 else f"error ({status}): {detail}"]
        lines += [f"  {e.get('path', '?')}: {e.get('message', '')}" for e in self.errors]
        super().__init__("\n".join(lines))


class Client:
    def __init__(self, server: str, token: str, timeout: float = 30.0) -> None:
        self.server, self.token, self.timeout = server.rstrip("/"), token, timeout

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
        request = urllib.request.Request(self.server + path, data=body, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if body is not None:
            request.add_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                data = json.loads(raw)
                raise ApiError(exc.code, data.get("detail", exc.reason), data.get("errors")) from None
            except (ValueError, AttributeError):
                raise ApiError(exc.code, str(exc.reason)) from None
        except urllib.error.URLError as exc:
            raise ApiError(0, f"cannot reach {self.server}: {exc.reason}") from None
        except TimeoutError:
            raise ApiError(0, f"{self.server} did not answer within {self.timeout:.0f}s") from None
        return json.loads(raw) if raw else None
