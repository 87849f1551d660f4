"""A WSGI fast path for the two hot agent endpoints, ``agent/heartbeat`` and ``agent/report``.

Ten thousand nodes reporting every ten seconds is a thousand requests a second; Django's full
request cycle (a dozen middleware, URL resolution, request objects) would cost more than the
work itself. This wrapper answers those two POSTs straight from the WSGI environ with the same
``handle`` the Django views use, and passes every other request to Django untouched. Under
ASGI (the embedded default) the Django views serve them instead, with identical answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

import orjson
from django.conf import settings
from django.core.signals import request_finished, request_started

from clusters.api.agent import bearer_of, handle, retry_headers

PREFIX = "/api/v1/agent/"
HOT = {"heartbeat", "report", "ended"}
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class AgentFastPath:
    def __init__(self, app: WsgiApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        endpoint = path[len(PREFIX) :] if path.startswith(PREFIX) else ""
        if endpoint not in HOT or environ.get("REQUEST_METHOD") != "POST":
            return self.app(environ, start_response)
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
            status, body = (
                413,
                {"detail": "The report is too large or has no length; split it.", "errors": []},
            )
        else:
            # The request signals are what Django's own handler sends: they keep database
            # connections healthy (close_old_connections) exactly as for any other request.
            request_started.send(sender=self.__class__, environ=environ)
            try:
                status, body = handle(
                    endpoint,
                    environ["wsgi.input"].read(length),
                    bearer_of(environ.get("HTTP_AUTHORIZATION", "")),
                )
            finally:
                request_finished.send(sender=self.__class__)
        payload = orjson.dumps(body)
        start_response(
            f"{status} {HTTPStatus(status).phrase}",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
                *retry_headers(body),
            ],
        )
        return [payload]
