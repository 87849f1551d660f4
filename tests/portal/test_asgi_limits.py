"""The ASGI application refuses a body over the limit before Django spools it to disk: driven
through ``portal.asgi.application`` itself, as daphne drives it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.conf import settings

from portal.asgi import application

MiB = 2**20


async def call(method: str, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple:
    """Run one request through the ASGI app; returns (status, body, bytes the app pulled)."""
    pending = list(chunks)
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if not pending:  # the body is all sent: the client waits for the answer
            await asyncio.Event().wait()
        chunk = pending.pop(0)
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, pulled


@pytest.mark.django_db(transaction=True)
async def test_a_declared_length_over_the_limit_is_refused_unread():
    size = settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1
    status, body, pulled = await call(
        "POST", "/api/v1/jobs", [b"x" * MiB], [(b"content-length", str(size).encode())]
    )
    assert status == 413 and b"too large" in body and pulled == 0


@pytest.mark.django_db(transaction=True)
async def test_a_chunked_body_is_cut_off_at_the_limit():
    chunks = [b"x" * MiB] * 64  # 64 MiB offered, no Content-Length
    status, body, pulled = await call("POST", "/api/v1/jobs", chunks, [(b"transfer-encoding", b"chunked")])
    assert status == 413 and b"too large" in body
    assert pulled <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE + MiB  # stopped at the limit, not at 64 MiB


@pytest.mark.django_db(transaction=True)
async def test_bodies_within_the_limit_reach_the_application():
    status, _, pulled = await call(
        "POST", "/api/v1/jobs", [b"{}"], [(b"content-length", b"2"), (b"content-type", b"application/json")]
    )
    assert status == 401 and pulled == 2  # the API answered (no token), not the limit
