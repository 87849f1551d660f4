"""What the API server does with a request once it is authenticated and authorised.

:class:`Cluster` holds the :class:`~tests.kubefake.store.Store` and applies the server's rules:
defaults, validation, status-subresource separation, generation, no-op writes, preconditions,
deletion (graceful pods, finalizers, propagation policies), bindings and pods/log. The HTTP layer
(:mod:`tests.kubefake.http`) and the controller simulation (:mod:`tests.kubefake.controllers`) both
call it, so a test that plays a controller goes through the same rules a client does.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from tests.kubefake import errors
from tests.kubefake.errors import ApiError, Cause
from tests.kubefake.patches import json_patch, merge_patch, strategic_merge
from tests.kubefake.resources import CREATE_DEFAULTS, RESOURCES, Resource, canonicalise
from tests.kubefake.store import Entry, Store
from tests.kubefake.validation import CREATE_CHECKS, UPDATE_CHECKS, check_job_status

SERVER_OWNED = (
    "uid",
    "creationTimestamp",
    "resourceVersion",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "name",
    "namespace",
    "generateName",
    "selfLink",
)
ORPHAN_WARNING = (
    '299 - "child pods are preserved by default when jobs are deleted; set propagationPolicy=Background to '
    'remove them or set propagationPolicy=Orphan to suppress this warning"'
)
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
RETURNS_OBJECT_ON_DELETE = {"pods", "services", "namespaces"}


def rfc3339(seconds: float) -> str:
    return dt.datetime.fromtimestamp(int(seconds), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def object_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}" if namespace else name


def encode_continue(rv: int, start: str) -> str:
    raw = orjson.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start + "\x00"})
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_continue(token: str) -> tuple[int, str]:
    try:
        data = orjson.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return int(data["rv"]), str(data["start"]).rstrip("\x00")
    except (ValueError, KeyError, TypeError) as broken:
        raise errors.bad_request(f"continue key is not valid: {broken}") from broken


def _field_set(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        return {}
    return {
        f"f:{k}": _field_set(v)
        for k, v in body.items()
        if not k.startswith("$") and k not in ("kind", "apiVersion")
    }


class Cluster:
    """The server's behaviour over one :class:`Store`; thread-safe (one lock around each write)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time):
        self.store = store
        self.clock = clock
        self.random = random.Random()
        self.after_write: list[Callable[[Resource, str, Entry | None, Entry | None], None]] = []
        self.logs: dict[tuple[str, str, str], str] = {}
        self.unreachable_kubelets: set[str] = set()
        self.kubelets_reachable = True
        self._notify_lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------
    def now(self) -> str:
        return rfc3339(self.clock())

    def resource(self, plural: str) -> Resource:
        return RESOURCES[plural]

    def _entry(self, resource: Resource, namespace: str, name: str) -> Entry:
        entry = self.store.get(resource.plural, object_key(namespace, name))
        if entry is None:
            raise errors.not_found(resource.plural, resource.group, name)
        return entry

    def _manage(
        self,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
        manager: str,
        subresource: str,
        body: Any,
        resource: Resource,
    ) -> None:
        entries = [dict(e) for e in (old or {}).get("metadata", {}).get("managedFields") or []]
        mine = next(
            (e for e in entries if e.get("manager") == manager and e.get("subresource", "") == subresource),
            None,
        )
        fields = _field_set(body)
        if mine is None:
            mine = {"manager": manager, "operation": "Update", "apiVersion": resource.api_version}
            entries.append(mine)
            fields_v1 = fields
        else:
            fields_v1 = strategic_merge(mine.get("fieldsV1") or {}, fields)
        mine.update({"time": self.now(), "fieldsType": "FieldsV1", "fieldsV1": fields_v1})
        if subresource:
            mine["subresource"] = subresource
        obj["metadata"]["managedFields"] = sorted(
            entries, key=lambda e: (e["manager"], e.get("subresource", ""))
        )

    def _notify(self, resource: Resource, key: str, old: Entry | None, new: Entry | None) -> None:
        for hook in list(self.after_write):
            hook(resource, key, old, new)

    def _check_namespace(self, resource: Resource, namespace: str, name: str) -> None:
        if not resource.namespaced:
            return
        entry = self.store.get("namespaces", namespace)
        if entry is None:
            raise errors.not_found("namespaces", "", namespace)
        if entry.obj.get("status", {}).get("phase") == "Terminating":
            message = (
                f'{errors.qualified(resource.plural, resource.group)} "{name}" is forbidden: unable to '
                f"create new content in namespace {namespace} because it is being terminated"
            )
            cause = {
                "reason": "NamespaceTerminating",
                "message": f"namespace {namespace} is being terminated",
                "field": "metadata.namespace",
            }
            details = {
                "name": name,
                **({"group": resource.group} if resource.group else {}),
                "kind": resource.plural,
                "causes": [cause],
            }
            raise ApiError(403, errors.status(403, message, "Forbidden", details))

    # -- create -------------------------------------------------------------------------------
    def create(
        self, plural: str, namespace: str, body: Any, *, manager: str = "kubefake", dry_run: bool = False
    ) -> Entry:
        """Store a new object with the server's defaults; 409 AlreadyExists, 422 Invalid, 500 on an RV."""
        resource = self.resource(plural)
        if not isinstance(body, dict):
            raise errors.bad_request(
                f'{resource.kind} in version "{resource.version}" cannot be handled as a '
                f"{resource.kind}: the body is not an object"
            )
        obj = copy.deepcopy(body)
        obj.pop("kind", None)
        obj.pop("apiVersion", None)
        metadata = obj.setdefault("metadata", {})
        if metadata.get("resourceVersion"):
            raise errors.internal("resourceVersion should not be set on objects to be created")
        with self.store.lock:
            if not metadata.get("name") and metadata.get("generateName"):
                suffix = "".join(self.random.choice(_SUFFIX_ALPHABET) for _ in range(5))
                metadata["name"] = metadata["generateName"] + suffix
            name = metadata.get("name", "")
            if not name:
                raise ApiError(422, errors.status(422, "name or generateName is required", "Invalid"))
            if resource.namespaced:
                metadata["namespace"] = namespace
            else:
                metadata.pop("namespace", None)
            key = object_key(namespace if resource.namespaced else "", name)
            causes = CREATE_CHECKS.get(plural, lambda o: [])(obj)
            if causes:
                raise errors.invalid(resource.kind, resource.group, name, causes)
            self._check_namespace(resource, namespace, name)
            if self.store.get(plural, key) is not None:
                raise errors.already_exists(plural, resource.group, name)
            metadata["uid"] = str(uuid.uuid4())
            metadata["creationTimestamp"] = self.now()
            for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"):
                metadata.pop(server_owned, None)
            if resource.has_generation:
                metadata["generation"] = 1
            else:
                metadata.pop("generation", None)
            if plural in CREATE_DEFAULTS:
                CREATE_DEFAULTS[plural](obj)
            canonicalise(resource, obj)
            self._manage(obj, None, manager, "", body, resource)
            if dry_run:
                metadata.pop("resourceVersion", None)
                return Entry(resource, obj)
            entry = self.store.put(resource, key, obj, "ADDED")
        self._notify(resource, key, None, entry)
        return entry

    # -- read ---------------------------------------------------------------------------------
    def get(self, plural: str, namespace: str, name: str) -> Entry:
        resource = self.resource(plural)
        return self._entry(resource, namespace if resource.namespaced else "", name)

    def list_page(
        self,
        plural: str,
        namespace: str,
        matcher: Callable[[dict[str, Any]], bool] | None,
        *,
        limit: int = 0,
        continue_token: str = "",
        rv: str | None = None,
        rv_match: str = "",
        selected: bool = False,
    ) -> tuple[int, list[Entry], str | None, int | None]:
        """(list RV, items, continue, remainingItemCount) with kube-apiserver's RV and paging rules."""
        store = self.store
        snapshot_rv: int | None = None
        start = ""
        if continue_token:
            token_rv, start = decode_continue(continue_token)
            if token_rv == -1:
                snapshot_rv = None
            elif token_rv <= store.compacted:
                raise errors.gone(
                    "The provided continue parameter is too old to display a consistent list result. You can start "  # noqa: E501 - the server's message, verbatim
                    "a new list without the continue parameter, or use the continue token in this response to "  # noqa: E501 - the server's message, verbatim
                    "retrieve the remainder of the results. Continuing with the provided token results in an "
                    "inconsistent list - objects that were created, modified, or deleted between the time the first "  # noqa: E501 - the server's message, verbatim
                    "chunk was returned and now may show up in the list.",
                    encode_continue(-1, start),
                )
            else:
                snapshot_rv = token_rv
        elif rv not in (None, "") and rv_match == "Exact":
            wanted = int(rv)
            if wanted <= store.compacted:
                raise errors.gone("The resourceVersion for the provided list is too old.")
            snapshot_rv = wanted
        elif rv == "0":
            limit = 0
        with store.lock:
            list_rv = store.rv if snapshot_rv is None else snapshot_rv
            items = (
                store.items_at(plural, snapshot_rv, namespace)
                if snapshot_rv is not None
                else store.items(plural, namespace)
            )
        prefix = namespace + "/" if namespace else ""
        keyed = [(k[len(prefix) :], e) for k, e in items]
        if start:
            keyed = [(k, e) for k, e in keyed if k > start]
        if matcher is not None:
            keyed = [(k, e) for k, e in keyed if matcher(e.obj)]
        token, remaining = None, None
        if limit and len(keyed) > limit:
            page = keyed[:limit]
            token = encode_continue(
                list_rv if (not continue_token or snapshot_rv is not None) else store.rv, page[-1][0]
            )
            if not selected:
                remaining = len(keyed) - limit
            keyed = page
        return list_rv, [e for _, e in keyed], token, remaining

    # -- update / patch -----------------------------------------------------------------------
    def update(
        self,
        plural: str,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str = "",
        manager: str = "kubefake",
        check_rv: bool = True,
    ) -> Entry:
        """PUT: the body's RV must match the stored one (409), then the same rules as a patch."""
        resource = self.resource(plural)
        if not isinstance(body, dict):
            raise errors.bad_request("the body of an update must be an object")
        with self.store.lock:
            current = self._entry(resource, namespace if resource.namespaced else "", name)
            wanted_rv = body.get("metadata", {}).get("resourceVersion")
            if check_rv and wanted_rv and wanted_rv != current.obj["metadata"]["resourceVersion"]:
                raise errors.conflict(plural, resource.group, name)
            new = copy.deepcopy(body)
            new.pop("kind", None)
            new.pop("apiVersion", None)
            return self._write(resource, current, new, subresource, manager, body)

    def patch(
        self,
        plural: str,
        namespace: str,
        name: str,
        patch: Any,
        content_type: str,
        *,
        subresource: str = "",
        manager: str = "kubefake",
    ) -> Entry:
        """PATCH with strategic-merge, merge or JSON patch; stale RV in the body → 409, wrong uid → 422."""
        resource = self.resource(plural)
        with self.store.lock:
            current = self._entry(resource, namespace if resource.namespaced else "", name)
            base = copy.deepcopy(current.obj)
            if "json-patch" in content_type:
                if not isinstance(patch, list):
                    raise errors.bad_request("json patch must be a list of operations")
                new = json_patch(base, patch)
            elif not isinstance(patch, dict):
                raise errors.bad_request("patch body must be an object")
            elif "strategic-merge-patch" in content_type:
                new = strategic_merge(base, patch)
            else:
                new = merge_patch(base, patch)
            meta_patch = patch.get("metadata", {}) if isinstance(patch, dict) else {}
            if (
                meta_patch.get("resourceVersion")
                and meta_patch["resourceVersion"] != current.obj["metadata"]["resourceVersion"]
            ):
                raise errors.conflict(plural, resource.group, name)
            if meta_patch.get("uid") and meta_patch["uid"] != current.obj["metadata"]["uid"]:
                cause = Cause.invalid("metadata.uid", f'"{meta_patch["uid"]}"', "field is immutable")
                raise errors.invalid(resource.kind, resource.group, name, [cause], repeat=2)
            return self._write(resource, current, new, subresource, manager, patch)

    def _write(
        self,
        resource: Resource,
        current: Entry,
        new: dict[str, Any],
        subresource: str,
        manager: str,
        body: Any,
    ) -> Entry:
        old = current.obj
        name = old["metadata"]["name"]
        metadata = new.setdefault("metadata", {})
        for key in SERVER_OWNED:
            if key in old["metadata"]:
                metadata[key] = old["metadata"][key]
            else:
                metadata.pop(key, None)
        if resource.has_status:
            if subresource == "status":
                if "spec" in old:
                    new["spec"] = copy.deepcopy(old["spec"])
                else:
                    new.pop("spec", None)
                if resource.plural == "pods":
                    if "ownerReferences" in old["metadata"]:
                        metadata["ownerReferences"] = old["metadata"]["ownerReferences"]
                    else:
                        metadata.pop("ownerReferences", None)
                    new.setdefault("status", {}).setdefault("qosClass", old.get("status", {}).get("qosClass"))
            elif "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        canonicalise(resource, new)
        check = UPDATE_CHECKS.get(resource.plural)
        causes = check(new) if check else []
        if resource.plural == "jobs":
            causes += self._job_update_causes(old, new, subresource)
        if causes:
            listed = None
            if resource.plural == "nodes":
                # ValidateNodeUpdate runs the node checks twice and the metadata checks four times (018, 090)
                listed = causes * (4 if any(c.field == "metadata.annotations" for c in causes) else 2)
            raise errors.invalid(resource.kind, resource.group, name, causes, listed=listed)
        if self._same(old, new):
            return current
        if resource.has_generation and subresource != "status" and old.get("spec") != new.get("spec"):
            metadata["generation"] = old["metadata"].get("generation", 1) + 1
        self._manage(new, old, manager, subresource, body, resource)
        key = object_key(metadata.get("namespace", ""), name)
        if self._finished_deleting(resource, new):
            # the write that drops the last finalizer deletes in the same etcd transaction: watchers
            # see one DELETED carrying the previous state (059: 290, 293), the writer gets the new one
            gone = self._remove(resource, key, current)
            new["metadata"]["resourceVersion"] = gone.obj["metadata"]["resourceVersion"]
            return Entry(resource, new)
        entry = self.store.put(resource, key, new, "MODIFIED")
        self._notify(resource, key, current, entry)
        return entry

    @staticmethod
    def _same(old: dict[str, Any], new: dict[str, Any]) -> bool:
        strip = ("managedFields", "resourceVersion")
        left = {**old, "metadata": {k: v for k, v in old["metadata"].items() if k not in strip}}
        right = {**new, "metadata": {k: v for k, v in new["metadata"].items() if k not in strip}}
        return left == right

    def _job_update_causes(self, old: dict[str, Any], new: dict[str, Any], subresource: str) -> list[Cause]:
        if subresource == "status":
            return check_job_status(old, new)
        old_template, new_template = old["spec"].get("template"), new.get("spec", {}).get("template")
        if old_template != new_template:
            return [Cause.invalid("spec.template", "core.PodTemplateSpec{...}", "field is immutable")]
        return []

    # -- delete -------------------------------------------------------------------------------
    @staticmethod
    def _finished_deleting(resource: Resource, obj: dict[str, Any]) -> bool:
        metadata = obj["metadata"]
        if not metadata.get("deletionTimestamp") or metadata.get("finalizers"):
            return False
        if resource.plural == "namespaces":
            return False
        return resource.plural != "pods" or metadata.get("deletionGracePeriodSeconds", 0) == 0

    def _remove(self, resource: Resource, key: str, entry: Entry) -> Entry:
        last = copy.deepcopy(entry.obj)
        gone = self.store.remove(resource, key, last)
        self._notify(resource, key, entry, None)
        return gone

    def delete(
        self, plural: str, namespace: str, name: str, options: dict[str, Any]
    ) -> tuple[dict[str, Any] | Entry, dict[str, str]]:
        """DELETE with DeleteOptions; answers the object (pods, services, namespaces, or an object that
        stays) or a Success Status, plus response headers (the Orphan Warning for Jobs)."""
        resource = self.resource(plural)
        headers: dict[str, str] = {}
        policy = options.get("propagationPolicy")
        if plural == "jobs" and not policy:
            policy = "Orphan"
            headers["Warning"] = ORPHAN_WARNING
        try:
            with self.store.lock:
                return self._delete(resource, namespace, name, options, policy), headers
        except ApiError as error:
            error.headers.update(headers)
            raise

    def _delete(
        self, resource: Resource, namespace: str, name: str, options: dict[str, Any], policy: str | None
    ) -> dict[str, Any] | Entry:
        current = self._entry(resource, namespace if resource.namespaced else "", name)
        metadata = current.obj["metadata"]
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != metadata["uid"]:
            raise errors.conflict_message(
                resource.kind,
                resource.group,
                name,
                f"the UID in the precondition ({preconditions['uid']}) does not match the UID in record "
                f"({metadata['uid']}). The object might have been deleted and then recreated",
            )
        if (
            preconditions.get("resourceVersion")
            and preconditions["resourceVersion"] != metadata["resourceVersion"]
        ):
            raise errors.conflict_message(
                resource.kind,
                resource.group,
                name,
                f"the ResourceVersion in the precondition ({preconditions['resourceVersion']}) does not match the "  # noqa: E501 - the server's message, verbatim
                f"ResourceVersion in record ({metadata['resourceVersion']}). The object might have been modified",  # noqa: E501 - the server's message, verbatim
            )
        key = object_key(metadata.get("namespace", ""), name)
        new = copy.deepcopy(current.obj)
        meta = new["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers and resource.plural != "pods":
            finalizers.append("foregroundDeletion")
        if policy == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        grace = 0
        if resource.plural == "pods":
            requested = options.get("gracePeriodSeconds")
            grace = (
                int(requested)
                if requested is not None
                else int(new["spec"].get("terminationGracePeriodSeconds", 30))
            )
            terminal = new.get("status", {}).get("phase") in ("Succeeded", "Failed")
            if terminal or not new["spec"].get("nodeName"):
                grace = 0
            if meta.get("deletionGracePeriodSeconds") is not None:
                grace = min(grace, meta["deletionGracePeriodSeconds"])
        if resource.plural == "namespaces":
            finalizers = list(meta.get("finalizers") or [])
            new["status"]["phase"] = "Terminating"
        stays = bool(finalizers) or grace > 0 or resource.plural == "namespaces"
        already = bool(meta.get("deletionTimestamp"))
        if not stays and not already and resource.plural not in ("pods",):
            gone = self._remove(resource, key, current)
            if resource.plural in RETURNS_OBJECT_ON_DELETE:
                return gone
            return errors.success(name, resource.group, resource.plural, metadata["uid"])
        if finalizers:
            meta["finalizers"] = finalizers
        if not already or resource.plural == "pods":
            meta["deletionTimestamp"] = rfc3339(self.clock() + grace)
            if resource.plural != "namespaces":
                meta["deletionGracePeriodSeconds"] = grace
        if not already and "generation" in meta:
            meta["generation"] += 1
        if self._same(current.obj, new):
            entry = current
        else:
            entry = self.store.put(resource, key, new, "MODIFIED")
            self._notify(resource, key, current, entry)
        if self._finished_deleting(resource, new):
            return self._remove(resource, key, entry)
        return entry

    # -- pods: binding and log ----------------------------------------------------------------
    def bind(
        self, namespace: str, name: str, node: str, *, manager: str = "kube-scheduler"
    ) -> dict[str, Any]:
        """POST pods/NAME/binding: nodeName + PodScheduled=True; 409 when already bound (054)."""
        resource = self.resource("pods")
        with self.store.lock:
            current = self._entry(resource, namespace, name)
            bound = current.obj["spec"].get("nodeName")
            if bound:
                raise errors.conflict_message(
                    "pods/binding", "", name, f'pod {name} is already assigned to node "{bound}"'
                )
            new = copy.deepcopy(current.obj)
            new["spec"]["nodeName"] = node
            conditions = new.setdefault("status", {}).setdefault("conditions", [])
            conditions[:] = [c for c in conditions if c.get("type") != "PodScheduled"]
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastProbeTime": None,
                    "lastTransitionTime": self.now(),
                }
            )
            self._manage(new, current.obj, manager, "binding", {"spec": {"nodeName": node}}, resource)
            key = object_key(namespace, name)
            entry = self.store.put(resource, key, new, "MODIFIED")
        self._notify(resource, key, current, entry)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def log(self, namespace: str, name: str, query: dict[str, str]) -> bytes | None:
        """pods/log: None for an unbound pod (204); the text a test gave, or the apiserver's errors."""
        pod = self._entry(self.resource("pods"), namespace, name).obj
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = query.get("container", "")
        if container and container not in containers:
            raise errors.bad_request(f"container {container} is not valid for pod {name}")
        if not container:
            if len(containers) > 1:
                raise errors.bad_request(
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"  # noqa: E501 - the server's message, verbatim
                )
            container = containers[0] if containers else ""
        node_name = pod["spec"].get("nodeName")
        if not node_name:
            return None
        node = self.store.get("nodes", node_name)
        if node is None:
            raise errors.not_found("pods", "", node_name)
        addresses = node.obj.get("status", {}).get("addresses") or []
        if not addresses:
            raise errors.internal("no preferred addresses found; known addresses: []")
        text = self.logs.get((namespace, name, container))
        if text is None or not self.kubelets_reachable or node_name in self.unreachable_kubelets:
            address = next(
                (a["address"] for a in addresses if a.get("type") == "InternalIP"), addresses[0]["address"]
            )
            port = (
                node.obj.get("status", {})
                .get("daemonEndpoints", {})
                .get("kubeletEndpoint", {})
                .get("Port", 10250)
            )
            extra = "&".join(f"{k}={v}" for k, v in query.items() if k != "container")
            url = f"https://{address}:{port}/containerLogs/{namespace}/{name}/{container}" + (
                f"?{extra}" if extra else ""
            )
            raise errors.internal(f'Get "{url}": dial tcp {address}:{port}: connect: connection refused')
        return _tail(text, query).encode()


def _tail(text: str, query: dict[str, str]) -> str:
    if query.get("tailLines"):
        lines = text.splitlines(keepends=True)
        text = "".join(lines[-int(query["tailLines"]) :]) if int(query["tailLines"]) > 0 else ""
    if query.get("limitBytes"):
        text = text.encode()[: int(query["limitBytes"])].decode(errors="ignore")
    return text
