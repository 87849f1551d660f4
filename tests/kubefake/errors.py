"""Status bodies and the exception that carries them, shaped as kube-apiserver v1.33 answers.

Every error the fake sends goes through :class:`ApiError`; its ``body`` is the Status object the
real server writes (``details.kind`` is the plural resource for 403/404/409, the Kind for 422).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An HTTP error answered with a Status body (``code`` and ``body`` as the server sends them)."""

    def __init__(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        super().__init__(body.get("message", ""))
        self.code = code
        self.body = body
        self.headers = headers or {}


def status(
    code: int,
    message: str | None,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A failure Status object; ``reason``/``details`` are left out when None (401, 500 have none)."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": metadata or {},
        "status": "Failure",
    }
    if message is not None:
        body["message"] = message
    if reason is not None:
        body["reason"] = reason
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def _details(name: str | None, group: str, kind: str, **extra: Any) -> dict[str, Any]:
    details: dict[str, Any] = {}
    if name:
        details["name"] = name
    if group:
        details["group"] = group
    details["kind"] = kind
    details.update(extra)
    return details


def qualified(resource: str, group: str) -> str:
    """``jobs.batch`` for a grouped resource, ``nodes`` for the core group."""
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, group: str, name: str) -> ApiError:
    message = f'{qualified(resource, group)} "{name}" not found'
    return ApiError(404, status(404, message, "NotFound", _details(name, group, resource)))


def already_exists(resource: str, group: str, name: str) -> ApiError:
    message = f'{qualified(resource, group)} "{name}" already exists'
    return ApiError(409, status(409, message, "AlreadyExists", _details(name, group, resource)))


def conflict(resource: str, group: str, name: str) -> ApiError:
    message = (
        f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": the object has been modified; '  # noqa: E501 - the server's message, verbatim
        "please apply your changes to the latest version and try again"
    )
    return ApiError(409, status(409, message, "Conflict", _details(name, group, resource)))


def conflict_message(kind_or_resource: str, group: str, name: str, why: str) -> ApiError:
    message = f'Operation cannot be fulfilled on {qualified(kind_or_resource, group)} "{name}": {why}'
    return ApiError(409, status(409, message, "Conflict", _details(name, group, kind_or_resource)))


def bad_request(message: str) -> ApiError:
    return ApiError(400, status(400, message, "BadRequest"))


def unauthorized() -> ApiError:
    return ApiError(401, status(401, "Unauthorized", "Unauthorized"))


def internal(message: str) -> ApiError:
    return ApiError(500, status(500, message))


def gone(message: str, continue_token: str | None = None) -> ApiError:
    metadata = {"continue": continue_token} if continue_token else {}
    return ApiError(410, status(410, message, "Expired", metadata=metadata))


class Cause:
    """One validation error: ``field`` and the message after the field name."""

    __slots__ = ("field", "message", "reason")

    def __init__(self, field: str, reason: str, message: str):
        self.field = field
        self.reason = reason
        self.message = message

    @classmethod
    def invalid(cls, field: str, value: str, detail: str) -> Cause:
        return cls(field, "FieldValueInvalid", f"Invalid value: {value}: {detail}")

    @classmethod
    def required(cls, field: str, detail: str = "") -> Cause:
        return cls(field, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))

    @classmethod
    def unsupported(cls, field: str, value: str, supported: list[str]) -> Cause:
        values = ", ".join(f'"{v}"' for v in supported)
        return cls(field, "FieldValueNotSupported", f"Unsupported value: {value}: supported values: {values}")

    @classmethod
    def forbidden(cls, field: str, detail: str) -> Cause:
        return cls(field, "FieldValueForbidden", f"Forbidden: {detail}")

    @classmethod
    def too_long(cls, field: str, limit: int) -> Cause:
        return cls(field, "FieldValueTooLong", f"Too long: may not be more than {limit} bytes")


def invalid(
    kind: str, group: str, name: str, causes: list[Cause], repeat: int = 1, listed: list[Cause] | None = None
) -> ApiError:
    """422 Invalid: ``Kind[.group] "name" is invalid: field: msg`` (several wrapped in ``[...]``).

    ``repeat`` reproduces the server listing the same cause more than once in ``details.causes``
    while the message names it once (recordings 052 and 090)."""
    parts = [f"{c.field}: {c.message}" for c in causes]
    text = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    message = f'{qualified(kind, group)} "{name}" is invalid: {text}'
    listed = causes * repeat if listed is None else listed
    cause_list = [{"reason": c.reason, "message": c.message, "field": c.field} for c in listed]
    return ApiError(422, status(422, message, "Invalid", _details(name, group, kind, causes=cause_list)))


def forbidden(
    user: str, verb: str, resource: str, subresource: str, group: str, namespace: str, name: str
) -> ApiError:
    """403 with the RBAC message shape of recordings 081/084."""
    subject = qualified(resource, group) + (f' "{name}"' if name else "")
    full = f"{resource}/{subresource}" if subresource else resource
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    message = f'{subject} is forbidden: User "{user}" cannot {verb} resource "{full}" in API group "{group}" {scope}'  # noqa: E501 - the server's message, verbatim
    return ApiError(403, status(403, message, "Forbidden", _details(name, group, resource)))


def success(name: str, group: str, resource: str, uid: str) -> dict[str, Any]:
    """The 200 Status a DELETE answers when the object is gone at once (030, 070)."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": _details(name, group, resource, uid=uid),
    }
