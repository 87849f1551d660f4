"""One error format for the whole API.

Every error body is ``{"detail": "<sentence>", "errors": [{"path": …, "message": …}]}``; the
list is present for input errors and names each bad field by its path in the request
(``spec.resources.gpus``, ``jobs[3].metadata.name``, ``query.state``). Domain refusals map to
status codes here, once: an invalid spec is 400, an idempotency key reused for another request
422, a transition the job's state does not allow (or a checkpoint of a job not running) 409, a
cap on waiting jobs 429.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from scheduling.services.budgets import BudgetExhausted
from scheduling.services.jobs import IdempotencyConflict, NotActive, OperatorsOnly, TooManyPending
from scheduling.services.transitions import InvalidTransition, TransitionConflict
from scheduling.services.updates import NotWaiting
from scheduling.spec import SpecError


class InputError(exceptions.APIException):
    """400 with a list of ``(path, message)`` pairs."""

    status_code = status.HTTP_400_BAD_REQUEST

    def __init__(self, errors: list[tuple[str, str]], detail: str = "Invalid request.") -> None:
        self.errors = errors
        super().__init__(detail)


def _flatten(detail: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(detail, dict):
        return [
            e for key, value in detail.items() for e in _flatten(value, f"{path}.{key}" if path else str(key))
        ]
    if isinstance(detail, list):
        if all(not isinstance(d, dict | list) for d in detail):
            return [(path or "(body)", str(d)) for d in detail]
        return [e for i, value in enumerate(detail) for e in _flatten(value, f"{path}[{i}]")]
    return [(path or "(body)", str(detail))]


def handle_exception(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, SpecError):
        exc = InputError(exc.errors, "Invalid job spec.")
    elif isinstance(exc, IdempotencyConflict):
        return _body(422, str(exc) + " Use a new key for a new request.", extra={"jobId": exc.job.pk})
    elif isinstance(exc, TooManyPending):
        response = _body(429, f"Too many waiting jobs: {exc}.")
        response["Retry-After"] = "30"
        return response
    elif isinstance(exc, BudgetExhausted):
        return _body(409, f"Budget exhausted: {exc}.", extra={"code": "budget_exhausted"})
    elif isinstance(exc, InvalidTransition | TransitionConflict | NotActive | NotWaiting):
        return _body(409, str(exc))
    elif isinstance(exc, OperatorsOnly):
        return _body(403, f"{str(exc)[0].upper()}{str(exc)[1:]}.")
    elif isinstance(exc, RequestDataTooBig):
        return _body(
            413, "The request body is too large (the limit is 8 MiB); split a batch into smaller ones."
        )
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found.")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()

    response = exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, InputError):
        errors = exc.errors
        detail = str(exc.detail)
    elif isinstance(exc, exceptions.ValidationError):
        errors = _flatten(exc.detail, "")
        detail = "Invalid request."
    elif isinstance(exc, exceptions.ParseError):
        errors = getattr(exc, "errors", None) or [("(body)", str(exc.detail))]
        detail = str(exc.detail)
    else:
        errors = []
        detail = str(exc.detail) if hasattr(exc, "detail") else str(exc)
    response.data = {"detail": detail, "errors": [{"path": p, "message": m} for p, m in errors]}
    return response


def _body(code: int, detail: str, extra: dict[str, Any] | None = None) -> Response:
    return Response({"detail": detail, "errors": [], **(extra or {})}, status=code)
