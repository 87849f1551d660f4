"""The HTTP surface: routing, authentication, RBAC, JSON bodies and chunked watch streams.

One :class:`Handler` per connection (HTTP/1.1 keep-alive, as the official client's urllib3 pool
expects). Requests are mapped to RBAC attributes exactly as kube-apiserver does (verb from method,
``watch=true`` → watch, collection GET → list, subresources such as ``pods/log``), checked, then
handed to :class:`~tests.kubefake.api.Cluster`.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import orjson

from tests.kubefake import errors
from tests.kubefake.api import rfc3339
from tests.kubefake.errors import ApiError
from tests.kubefake.rbac import Attributes, User
from tests.kubefake.resources import BY_GROUP_VERSION, Resource, bookmark_object
from tests.kubefake.selectors import parse_fields, parse_labels
from tests.kubefake.store import Entry, Event, WatchExpired

if TYPE_CHECKING:
    from tests.kubefake.server import FakeKube

DISCOVERY = json.loads((Path(__file__).parent / "discovery.json").read_text())
BODY_LIMIT = 3 * 1024 * 1024
UNKNOWN_JOB_SPEC_FIELDS_ALLOWED = {
    "parallelism",
    "completions",
    "activeDeadlineSeconds",
    "podFailurePolicy",
    "successPolicy",
    "backoffLimit",
    "backoffLimitPerIndex",
    "maxFailedIndexes",
    "selector",
    "manualSelector",
    "template",
    "ttlSecondsAfterFinished",
    "completionMode",
    "suspend",
    "podReplacementPolicy",
    "managedBy",
}
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


class Route:
    """A parsed resource path."""

    __slots__ = ("name", "namespace", "resource", "subresource")

    def __init__(self, resource: Resource, namespace: str, name: str, subresource: str):
        self.resource = resource
        self.namespace = namespace
        self.name = name
        self.subresource = subresource


def parse_route(path: str) -> Route | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    table = BY_GROUP_VERSION.get((group, version), {})
    namespace = ""
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in table and (group or rest[2] != "status"):
        namespace, rest = rest[1], rest[2:]
    if not rest or rest[0] not in table:
        return None
    resource = table[rest[0]]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if resource.plural == "namespaces" and name:
        namespace = name
    return Route(resource, namespace, name, subresource)


class Handler(BaseHTTPRequestHandler):
    """Serves one connection of the fake API server."""

    protocol_version = "HTTP/1.1"
    server_version = "kubefake"
    fake: FakeKube  # set on the subclass the server builds

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    # -- plumbing -----------------------------------------------------------------------------
    def _send(
        self,
        code: int,
        body: bytes | None,
        headers: dict[str, str] | None = None,
        content_type: str | None = "application/json",
    ) -> None:
        self.send_response(code)
        if content_type and body is not None:
            self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        if isinstance(body, Entry):
            data = body.full_bytes()
        elif isinstance(body, bytes):
            data = body
        else:
            data = orjson.dumps(body)
        self._send(code, data, headers)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > BODY_LIMIT:
            # drain so the connection stays usable, then refuse
            remaining = length
            while remaining > 0:
                remaining -= len(self.rfile.read(min(remaining, 1 << 20)))
            raise ApiError(
                413,
                errors.status(
                    413, f"Request entity too large: limit is {BODY_LIMIT}", "RequestEntityTooLarge"
                ),
            )
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        try:
            raw = self._read_body()
            user = self._authenticate()
            self._dispatch(split.path, query, raw, user)
        except ApiError as error:
            self._json(error.code, error.body, error.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _authenticate(self) -> User:
        header = self.headers.get("Authorization", "")
        token = header[7:].strip() if header.startswith("Bearer ") else ""
        user = self.fake.users.get(token) if token else None
        if user is None:
            raise errors.unauthorized()
        return user

    def _authorize(self, user: User, attributes: Attributes) -> None:
        allowed, _ = self.fake.authorizer.allowed(user, attributes)
        if not allowed:
            if attributes.is_resource:
                raise errors.forbidden(
                    user.name,
                    attributes.verb,
                    attributes.resource,
                    attributes.subresource,
                    attributes.group,
                    attributes.namespace,
                    attributes.name,
                )
            message = f'forbidden: User "{user.name}" cannot {attributes.verb} path "{attributes.path}"'
            raise ApiError(403, errors.status(403, message, "Forbidden", {}))

    def _manager(self, query: dict[str, str]) -> str:
        return query.get("fieldManager") or (self.headers.get("User-Agent") or "unknown").split("/")[0]

    @staticmethod
    def _decode(raw: bytes) -> Any:
        if not raw:
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as broken:
            raise errors.bad_request(
                f"the body of the request was in an unknown format: {broken}"
            ) from broken

    # -- dispatch -----------------------------------------------------------------------------
    def _dispatch(self, path: str, query: dict[str, str], raw: bytes, user: User) -> None:
        method = self.command
        stripped = path.rstrip("/") or "/"
        if method == "GET" and stripped in ("/version", "/api", "/apis", "/api/v1", "/apis/batch/v1"):
            self._authorize(user, Attributes(verb="get", path=path))
            self._json(200, self._discovery(stripped))
            return
        if method == "POST" and stripped in (
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        ):
            self._self_review(stripped.rsplit("/", 1)[1], self._decode(raw) or {}, user)
            return
        route = parse_route(stripped)
        if route is None:
            raise ApiError(
                404, errors.status(404, "the server could not find the requested resource", "NotFound", {})
            )
        resource = route.resource
        if route.name:
            verb = "get" if method == "GET" else _VERBS[method]
        else:
            verb = {
                "GET": "watch" if query.get("watch") in ("true", "1") else "list",
                "POST": "create",
                "DELETE": "deletecollection",
            }.get(method, _VERBS.get(method, "get"))
        name = route.name
        attributes = Attributes(
            verb=verb,
            group=resource.group,
            resource=resource.plural,
            subresource=route.subresource,
            namespace=route.namespace,
            name=name,
            path=path,
        )
        self._authorize(user, attributes)
        self._resource(route, verb, query, raw, user)

    def _discovery(self, path: str) -> Any:
        body = json.loads(json.dumps(DISCOVERY[path]))
        if path == "/api":
            body["serverAddressByClientCIDRs"][0]["serverAddress"] = self.fake.address
        return body

    def _self_review(self, kind: str, body: dict[str, Any], user: User) -> None:
        if kind == "selfsubjectreviews":
            self._json(
                201,
                {
                    "kind": "SelfSubjectReview",
                    "apiVersion": "authentication.k8s.io/v1",
                    "metadata": {"creationTimestamp": rfc3339(self.fake.clock())},
                    "status": {"userInfo": user.info()},
                },
            )
            return
        spec = body.get("spec") or {}
        if kind == "selfsubjectrulesreviews":
            namespace = spec.get("namespace", "")
            self._json(
                201,
                {
                    "kind": "SelfSubjectRulesReview",
                    "apiVersion": "authorization.k8s.io/v1",
                    "metadata": {"creationTimestamp": None},
                    "spec": {},
                    "status": self.fake.authorizer.rules_review(user, namespace),
                },
            )
            return
        attrs = spec.get("resourceAttributes")
        if attrs:
            attributes = Attributes(
                verb=attrs.get("verb", ""),
                group=attrs.get("group", ""),
                resource=attrs.get("resource", ""),
                subresource=attrs.get("subresource", ""),
                namespace=attrs.get("namespace", ""),
                name=attrs.get("name", ""),
            )
        else:
            non = spec.get("nonResourceAttributes") or {}
            attributes = Attributes(verb=non.get("verb", ""), path=non.get("path", ""))
        allowed, reason = self.fake.authorizer.allowed(user, attributes)
        review_status: dict[str, Any] = {"allowed": allowed}
        if reason:
            review_status["reason"] = reason
        self._json(
            201,
            {
                "kind": "SelfSubjectAccessReview",
                "apiVersion": "authorization.k8s.io/v1",
                "metadata": {"creationTimestamp": None},
                "spec": spec,
                "status": review_status,
            },
        )

    def _resource(self, route: Route, verb: str, query: dict[str, str], raw: bytes, user: User) -> None:
        cluster = self.fake.cluster
        resource, namespace, name, sub = route.resource, route.namespace, route.name, route.subresource
        manager = self._manager(query)
        if verb in ("list", "watch"):
            self._list_or_watch(route, verb, query)
        elif verb == "get" and sub == "log":
            text = cluster.log(namespace, name, query)
            if text is None:
                self._send(204, None, content_type=None)
            else:
                self._send(200, text, content_type="text/plain")
        elif verb == "get":
            self._json(200, cluster.get(resource.plural, namespace, name))
        elif verb == "create" and sub == "binding":
            body = self._decode(raw) or {}
            self._json(
                201, cluster.bind(namespace, name, body.get("target", {}).get("name", ""), manager=manager)
            )
        elif verb == "create" and sub == "token" and resource.plural == "serviceaccounts":
            self._json(201, self.fake.token_request(namespace, name, self._decode(raw) or {}))
        elif verb == "create":
            body = self._decode(raw)
            headers = self._unknown_fields(resource, body, query)
            entry = cluster.create(
                resource.plural, namespace, body, manager=manager, dry_run=query.get("dryRun") == "All"
            )
            self._json(201, entry, headers)
        elif verb == "update":
            self._json(
                200,
                cluster.update(
                    resource.plural, namespace, name, self._decode(raw), subresource=sub, manager=manager
                ),
            )
        elif verb == "patch":
            content_type = self.headers.get("Content-Type", "application/strategic-merge-patch+json")
            self._json(
                200,
                cluster.patch(
                    resource.plural,
                    namespace,
                    name,
                    self._decode(raw),
                    content_type,
                    subresource=sub,
                    manager=manager,
                ),
            )
        elif verb == "delete":
            body = self._decode(raw)
            if isinstance(body, dict):
                options = body
            else:
                options = {}
                if "gracePeriodSeconds" in query:
                    options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
                if "propagationPolicy" in query:
                    options["propagationPolicy"] = query["propagationPolicy"]
            result, headers = cluster.delete(resource.plural, namespace, name, options)
            self._json(200, result, headers)
        else:
            raise ApiError(405, errors.status(405, f"{verb} is not supported", "MethodNotAllowed", {}))

    def _unknown_fields(self, resource: Resource, body: Any, query: dict[str, str]) -> dict[str, str]:
        if resource.plural != "jobs" or not isinstance(body, dict):
            return {}
        unknown = sorted(
            f"spec.{k}" for k in (body.get("spec") or {}) if k not in UNKNOWN_JOB_SPEC_FIELDS_ALLOWED
        )
        if not unknown:
            return {}
        if query.get("fieldValidation") == "Strict":
            fields = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise errors.bad_request(
                f'{resource.kind} in version "{resource.version}" cannot be handled as a {resource.kind}: '
                f"strict decoding error: {fields}"
            )
        for key in unknown:
            body["spec"].pop(key.split(".", 1)[1], None)
        return {"Warning": ", ".join(f'299 - "unknown field \\"{u}\\""' for u in unknown)}

    # -- list and watch -----------------------------------------------------------------------
    def _list_options(self, route: Route, query: dict[str, str]) -> tuple[Any, bool]:
        rv, rv_match = query.get("resourceVersion"), query.get("resourceVersionMatch", "")
        if query.get("sendInitialEvents") is not None and query.get("watch") in ("true", "1"):
            raise _list_options_invalid(
                "sendInitialEvents",
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
            )
        if rv_match and not rv:
            raise _list_options_invalid(
                "resourceVersionMatch", "resourceVersionMatch is forbidden unless resourceVersion is provided"
            )
        if rv not in (None, "") and not rv.isdigit():
            raise errors.bad_request(
                f'invalid resource version: resourceVersion: Invalid value: "{rv}": '
                f'strconv.ParseUint: parsing "{rv}": invalid syntax'
            )
        label = parse_labels(query["labelSelector"]) if query.get("labelSelector") else None
        field = (
            parse_fields(query["fieldSelector"], route.resource.fields)
            if query.get("fieldSelector")
            else None
        )
        if label and field:
            return (lambda obj: label(obj) and field(obj)), True
        return (label or field), bool(label or field)

    def _list_or_watch(self, route: Route, verb: str, query: dict[str, str]) -> None:
        matcher, selected = self._list_options(route, query)
        if verb == "watch":
            self._watch(route, query, matcher)
            return
        rv = query.get("resourceVersion")
        if rv and rv != "0" and int(rv) > self.fake.store.rv:
            self.fake.wait_for_rv(int(rv))
        list_rv, items, token, remaining = self.fake.cluster.list_page(
            route.resource.plural,
            route.namespace,
            matcher,
            limit=int(query.get("limit") or 0),
            continue_token=query.get("continue", ""),
            rv=rv,
            rv_match=query.get("resourceVersionMatch", ""),
            selected=selected,
        )
        metadata: dict[str, Any] = {"resourceVersion": str(list_rv)}
        if token:
            metadata["continue"] = token
        if remaining is not None:
            metadata["remainingItemCount"] = remaining
        head = b'{"kind":"%s","apiVersion":"%s","metadata":%s,"items":[' % (
            route.resource.list_kind.encode(),
            route.resource.api_version.encode(),
            orjson.dumps(metadata),
        )
        self._send(200, head + b",".join(e.item_bytes() for e in items) + b"]}")

    def _watch(self, route: Route, query: dict[str, str], matcher: Any) -> None:
        fake, store = self.fake, self.fake.store
        rv_text = query.get("resourceVersion") or ""
        since = int(rv_text) if rv_text and rv_text != "0" else None
        timeout = float(query.get("timeoutSeconds") or fake.default_watch_seconds)
        if fake.max_watch_seconds is not None:
            timeout = min(timeout, fake.max_watch_seconds)
        bookmarks = query.get("allowWatchBookmarks") == "true" and fake.watch_cache
        match = matcher or (lambda obj: True)
        initial: list[bytes] = []
        try:
            with store.lock:
                if since is None:
                    initial = [
                        b'{"type":"ADDED","object":%s}\n' % e.full_bytes()
                        for _, e in store.items(route.resource.plural, route.namespace)
                        if match(e.obj)
                    ]
                backlog, subscription = store.subscribe(
                    route.resource.plural,
                    route.namespace,
                    since
                    if since is not None and since <= store.rv
                    else (store.rv if since is not None else None),
                )
        except WatchExpired as expired:
            message = (
                f"too old resource version: {expired.requested} ({expired.oldest})"
                if fake.watch_cache
                else "The resourceVersion for the provided watch is too old."
            )
            error = {"type": "ERROR", "object": errors.status(410, message, "Expired")}
            self._start_stream()
            self._chunk(orjson.dumps(error) + b"\n")
            self._end_stream()
            return
        floor = since or 0
        self._start_stream()
        try:
            if initial:
                self._chunk(b"".join(initial))
            lines = [line for line in (_view(e, match, floor) for e in backlog) if line]
            if lines:
                self._chunk(b"".join(lines))
            self._pump(route, subscription, match, floor, timeout, bookmarks)
            self._end_stream()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            store.unsubscribe(subscription)

    def _pump(
        self, route: Route, subscription: Any, match: Any, floor: int, timeout: float, bookmarks: bool
    ) -> None:
        fake = self.fake
        start = time.monotonic()
        deadline = start + timeout
        next_bookmark = start + fake.bookmark_interval
        final_bookmark = (
            deadline - fake.bookmark_before_timeout if timeout > fake.bookmark_before_timeout else None
        )
        while True:
            now = time.monotonic()
            if now >= deadline or fake.stopping:
                return
            wake = deadline
            if bookmarks:
                wake = min(wake, next_bookmark, final_bookmark or deadline)
            try:
                event = subscription.queue.get(timeout=max(0.0, wake - now))
            except Exception:  # queue.Empty: time for a bookmark or the end
                event = False
            if event is None:
                return
            lines = []
            if event is not False:
                lines.append(_view(event, match, floor))
                while True:
                    try:
                        more = subscription.queue.get_nowait()
                    except Exception:
                        break
                    if more is None:
                        return
                    lines.append(_view(more, match, floor))
            now = time.monotonic()
            if bookmarks and (now >= next_bookmark or (final_bookmark is not None and now >= final_bookmark)):
                if final_bookmark is not None and now >= final_bookmark:
                    final_bookmark = None
                next_bookmark = now + fake.bookmark_interval
                bookmark = bookmark_object(route.resource, str(fake.store.rv))
                lines.append(b'{"type":"BOOKMARK","object":%s}\n' % orjson.dumps(bookmark))
            data = b"".join(line for line in lines if line)
            if data:
                self._chunk(data)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _view(event: Event, match: Any, floor: int) -> bytes | None:
    """The line a selector-filtered watcher sees for ``event`` (031's enter/leave rules)."""
    if event.rv <= floor:
        return None
    if event.type == "MODIFIED" and event.old is not None:
        was, now = match(event.old.obj), match(event.entry.obj)
        if was and now:
            return event.line()
        if now:
            return b'{"type":"ADDED","object":%s}\n' % event.entry.full_bytes()
        if was:
            previous = json.loads(event.old.full_bytes())
            previous["metadata"]["resourceVersion"] = str(event.rv)
            return b'{"type":"DELETED","object":%s}\n' % orjson.dumps(previous)
        return None
    return event.line() if match(event.entry.obj) else None


def _list_options_invalid(field: str, detail: str) -> ApiError:
    message = f'ListOptions.meta.k8s.io "" is invalid: {field}: Forbidden: {detail}'
    details = {
        "group": "meta.k8s.io",
        "kind": "ListOptions",
        "causes": [{"reason": "FieldValueForbidden", "message": f"Forbidden: {detail}", "field": field}],
    }
    return ApiError(422, errors.status(422, message, "Invalid", details))
