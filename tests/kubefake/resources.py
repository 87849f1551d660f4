"""The resources the fake serves, and what kube-apiserver fills in when it stores them.

One :class:`Resource` row per plural: its group, Kind, scope, whether it has a status subresource,
the field selectors it supports, and the server-side defaults (README "What the server fills in").
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.kubefake.quantity import canonical_map


def _get(*path: str) -> Callable[[dict[str, Any]], str]:
    def getter(obj: dict[str, Any]) -> str:
        value: Any = obj
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            return ""
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    return getter


_META_FIELDS = {
    "metadata.name": _get("metadata", "name"),
    "metadata.namespace": _get("metadata", "namespace"),
}
_POD_FIELDS = {
    **_META_FIELDS,
    "spec.nodeName": _get("spec", "nodeName"),
    "spec.restartPolicy": _get("spec", "restartPolicy"),
    "spec.schedulerName": _get("spec", "schedulerName"),
    "spec.serviceAccountName": _get("spec", "serviceAccountName"),
    "spec.hostNetwork": lambda obj: "true" if obj.get("spec", {}).get("hostNetwork") else "false",
    "status.phase": _get("status", "phase"),
    "status.podIP": _get("status", "podIP"),
    "status.nominatedNodeName": _get("status", "nominatedNodeName"),
}


@dataclass(frozen=True)
class Resource:
    """One served resource (``nodes``, ``jobs``, ...) and its rules."""

    plural: str
    kind: str
    group: str = ""
    version: str = "v1"
    namespaced: bool = True
    has_status: bool = False
    has_generation: bool = False
    fields: dict[str, Callable[[dict[str, Any]], str]] = field(default_factory=lambda: dict(_META_FIELDS))
    bookmark: dict[str, Any] = field(default_factory=dict)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return self.kind + "List"


_NODE_INFO = {
    key: ""
    for key in (
        "machineID",
        "systemUUID",
        "bootID",
        "kernelVersion",
        "osImage",
        "containerRuntimeVersion",
        "kubeletVersion",
        "kubeProxyVersion",
        "operatingSystem",
        "architecture",
    )
}

RESOURCES: dict[str, Resource] = {
    r.plural: r
    for r in (
        Resource(
            "nodes",
            "Node",
            namespaced=False,
            has_status=True,
            fields={
                **_META_FIELDS,
                "spec.unschedulable": lambda obj: (
                    "true" if obj.get("spec", {}).get("unschedulable") else "false"
                ),
            },
            bookmark={
                "spec": {},
                "status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}, "nodeInfo": _NODE_INFO},
            },
        ),
        Resource(
            "namespaces", "Namespace", namespaced=False, has_status=True, bookmark={"spec": {}, "status": {}}
        ),
        Resource(
            "pods",
            "Pod",
            has_status=True,
            has_generation=True,
            fields=_POD_FIELDS,
            bookmark={"spec": {"containers": None}, "status": {}},
        ),
        Resource(
            "services", "Service", has_status=True, bookmark={"spec": {}, "status": {"loadBalancer": {}}}
        ),
        Resource(
            "jobs",
            "Job",
            group="batch",
            has_status=True,
            has_generation=True,
            fields={**_META_FIELDS, "status.successful": _get("status", "succeeded")},
            bookmark={
                "spec": {"template": {"metadata": {"creationTimestamp": None}, "spec": {"containers": None}}},
                "status": {},
            },
        ),
        Resource("serviceaccounts", "ServiceAccount"),
        Resource("configmaps", "ConfigMap"),
        Resource("secrets", "Secret"),
        Resource("events", "Event"),
        Resource("clusterroles", "ClusterRole", group="rbac.authorization.k8s.io", namespaced=False),
        Resource(
            "clusterrolebindings", "ClusterRoleBinding", group="rbac.authorization.k8s.io", namespaced=False
        ),
        Resource("roles", "Role", group="rbac.authorization.k8s.io"),
        Resource("rolebindings", "RoleBinding", group="rbac.authorization.k8s.io"),
    )
}

BY_GROUP_VERSION: dict[tuple[str, str], dict[str, Resource]] = {}
for _resource in RESOURCES.values():
    BY_GROUP_VERSION.setdefault((_resource.group, _resource.version), {})[_resource.plural] = _resource


def bookmark_object(resource: Resource, resource_version: str) -> dict[str, Any]:
    """The empty object of the watched kind a BOOKMARK carries (030, 059)."""
    body = {
        "kind": resource.kind,
        "apiVersion": resource.api_version,
        "metadata": {"resourceVersion": resource_version, "creationTimestamp": None},
    }
    body.update(copy.deepcopy(resource.bookmark))
    return body


# ---------------------------------------------------------------------------------------------
# defaults, applied on create (and the quantity canonicalisation, on every write)
# ---------------------------------------------------------------------------------------------


def _container_defaults(container: dict[str, Any]) -> None:
    container.setdefault("resources", {})
    for variable in container.get("env") or []:
        field_ref = (variable.get("valueFrom") or {}).get("fieldRef")
        if isinstance(field_ref, dict):
            field_ref.setdefault("apiVersion", "v1")
    container.setdefault("terminationMessagePath", "/dev/termination-log")
    container.setdefault("terminationMessagePolicy", "File")
    image = container.get("image", "")
    tag = image.rsplit("/", 1)[-1]
    latest = "@" not in tag and (":" not in tag or tag.endswith(":latest"))
    container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
    resources = container.get("resources")
    if isinstance(resources, dict):
        for key in ("limits", "requests"):
            if key in resources:
                resources[key] = canonical_map(resources[key])


def pod_spec_defaults(spec: dict[str, Any]) -> None:
    """Defaults of a PodSpec, in a Pod or a Job template."""
    for container in spec.get("containers") or []:
        _container_defaults(container)
    for container in spec.get("initContainers") or []:
        _container_defaults(container)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")


def _qos_class(spec: dict[str, Any]) -> str:
    containers = spec.get("containers") or []
    limits = [c.get("resources", {}).get("limits") or {} for c in containers]
    requests = [c.get("resources", {}).get("requests") or {} for c in containers]
    if not any(limits) and not any(requests):
        return "BestEffort"
    guaranteed = all(
        lim.get("cpu")
        and lim.get("memory")
        and {k: v for k, v in req.items() if k in ("cpu", "memory")}
        == {k: v for k, v in lim.items() if k in ("cpu", "memory")}
        for lim, req in zip(limits, requests, strict=True)
    )
    return "Guaranteed" if guaranteed else "Burstable"


def default_pod(pod: dict[str, Any]) -> None:
    spec = pod.setdefault("spec", {})
    pod_spec_defaults(spec)
    for container in spec.get("containers") or []:
        resources = container.get("resources")
        if isinstance(resources, dict) and resources.get("limits"):
            requests = resources.setdefault("requests", {})
            for key, value in resources["limits"].items():
                requests.setdefault(key, value)
    tolerations = spec.setdefault("tolerations", [])
    keys = {t.get("key") for t in tolerations}
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if key not in keys:
            tolerations.append(
                {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            )
    spec.setdefault("priority", 0)
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    status = {"phase": "Pending"}
    pod["status"] = status
    status["qosClass"] = _qos_class(spec)


def default_job(job: dict[str, Any]) -> None:
    uid = job["metadata"]["uid"]
    name = job["metadata"]["name"]
    spec = job.setdefault("spec", {})
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", 1)
    spec.setdefault("backoffLimit", 6)
    if not spec.get("manualSelector"):
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        spec["manualSelector"] = False
    template = spec.setdefault("template", {})
    metadata = template.setdefault("metadata", {})
    metadata.setdefault("creationTimestamp", None)
    labels = metadata.setdefault("labels", {})
    labels.update(
        {
            "batch.kubernetes.io/controller-uid": uid,
            "batch.kubernetes.io/job-name": name,
            "controller-uid": uid,
            "job-name": name,
        }
    )
    pod_spec_defaults(template.setdefault("spec", {}))
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    job["status"] = {}


def default_service(service: dict[str, Any]) -> None:
    spec = service.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    if spec.get("clusterIP") == "None":
        spec.setdefault("clusterIPs", ["None"])
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    service["status"] = {"loadBalancer": {}}


def default_node(node: dict[str, Any]) -> None:
    spec = node.setdefault("spec", {})
    taints = spec.setdefault("taints", [])
    if not any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints):
        taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
    status = node.setdefault("status", {})
    status.setdefault("daemonEndpoints", {"kubeletEndpoint": {"Port": 0}})
    status.setdefault("nodeInfo", dict(_NODE_INFO))


def default_namespace(namespace: dict[str, Any]) -> None:
    name = namespace["metadata"]["name"]
    namespace["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
    namespace.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    namespace["status"] = {"phase": "Active"}


CREATE_DEFAULTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "pods": default_pod,
    "jobs": default_job,
    "services": default_service,
    "nodes": default_node,
    "namespaces": default_namespace,
}


_OFFSET_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?\+00:00$")


def _utc_times(value: Any) -> Any:
    """Go re-serialises every metav1.Time as ``...Z`` (a client may send ``+00:00``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, str) and item.endswith("+00:00"):
                match = _OFFSET_TIME.match(item)
                if match:
                    value[key] = match.group(1) + "Z"
            elif isinstance(item, dict | list):
                _utc_times(item)
    elif isinstance(value, list):
        for item in value:
            _utc_times(item)
    return value


def canonicalise(resource: Resource, obj: dict[str, Any]) -> None:
    """What the server's decode/encode round trip does: quantities in canonical spelling, times in
    UTC ``Z`` form, pod conditions' ``lastProbeTime`` and containers' ``lastState`` always present."""
    _utc_times(obj.get("status"))
    _utc_times(obj.get("metadata"))
    status = obj.get("status")
    if resource.plural == "nodes" and isinstance(status, dict):
        for key in ("capacity", "allocatable"):
            if key in status:
                status[key] = canonical_map(status[key])
    spec = obj.get("spec")
    if resource.plural == "pods" and isinstance(spec, dict):
        for container in spec.get("containers") or []:
            resources = container.get("resources")
            if isinstance(resources, dict):
                for key in ("limits", "requests"):
                    if key in resources:
                        resources[key] = canonical_map(resources[key])
    if resource.plural == "pods" and isinstance(status, dict):
        for container_status in status.get("containerStatuses") or []:
            container_status.setdefault("lastState", {})
        for condition in status.get("conditions") or []:
            condition.setdefault("lastProbeTime", None)
    if resource.plural == "jobs" and isinstance(status, dict):
        for counter in ("active", "succeeded", "failed"):  # int32 with omitempty in Go
            if status.get(counter) == 0:
                status.pop(counter)
