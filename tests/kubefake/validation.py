"""The 422 checks kube-apiserver makes that an adapter could trip (018, 043, 047, 053, 056, 090, 092).

Each ``check_*`` returns the list of :class:`~tests.kubefake.errors.Cause`; the caller raises
:func:`~tests.kubefake.errors.invalid` when it is not empty. Messages are the server's own text.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import orjson

from tests.kubefake.errors import Cause
from tests.kubefake.quantity import parse

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE_HELP = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "  # noqa: E501 - the server's message, verbatim
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
QUALIFIED_HELP = (
    "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "  # noqa: E501 - the server's message, verbatim
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' (e.g. "
    "'example.com/MyName')"
)
SUBDOMAIN_HELP = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
ANNOTATIONS_LIMIT = 262144
CONFIGMAP_LIMIT = 1048576
TAINT_EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute"]


def go_quote(value: Any) -> str:
    return orjson.dumps(value).decode() if isinstance(value, str) else str(value)


def _qualified_name_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and not _SUBDOMAIN.match(prefix):
        return False
    return bool(name) and len(name) <= 63 and bool(_QUALIFIED.match(name))


def check_metadata(metadata: dict[str, Any], *, named: bool = True) -> list[Cause]:
    causes: list[Cause] = []
    name = metadata.get("name", "")
    if named and name and not _SUBDOMAIN.match(name):
        causes.append(Cause.invalid("metadata.name", go_quote(name), SUBDOMAIN_HELP))
    for key, value in (metadata.get("labels") or {}).items():
        if not _qualified_name_ok(key):
            causes.append(Cause.invalid("metadata.labels", go_quote(key), QUALIFIED_HELP))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(Cause.invalid("metadata.labels", go_quote(value), LABEL_VALUE_HELP))
    annotations = metadata.get("annotations") or {}
    if sum(len(k) + len(v) for k, v in annotations.items() if isinstance(v, str)) > ANNOTATIONS_LIMIT:
        causes.append(Cause.too_long("metadata.annotations", ANNOTATIONS_LIMIT))
    return causes


def check_node(node: dict[str, Any]) -> list[Cause]:
    causes = check_metadata(node.get("metadata", {}))
    for index, taint in enumerate(node.get("spec", {}).get("taints") or []):
        # the server names the field metadata.taints (sic, recording 018)
        if not _qualified_name_ok(taint.get("key", "")):
            causes.append(
                Cause.invalid(f"metadata.taints[{index}].key", go_quote(taint.get("key", "")), QUALIFIED_HELP)
            )
        if taint.get("effect") not in TAINT_EFFECTS:
            causes.append(
                Cause.unsupported(
                    f"metadata.taints[{index}].effect", go_quote(taint.get("effect", "")), TAINT_EFFECTS
                )
            )
    return causes


def _go_quantity(text: str) -> str:
    value = parse(text)[0]  # type: ignore[index]
    scale = 0
    while value.denominator != 1:
        value *= 10
        scale -= 1
    return (
        f"resource.Quantity{{i:resource.int64Amount{{value:{int(value)}, scale:{scale}}}, "
        f'd:resource.infDecAmount{{Dec:(*inf.Dec)(nil)}}, s:"", Format:"DecimalSI"}}'
    )


def check_pod_spec(spec: dict[str, Any], path: str, *, job: bool) -> list[Cause]:
    causes: list[Cause] = []
    for index, container in enumerate(spec.get("containers") or []):
        where = f"{path}.containers[{index}]"
        if not container.get("image"):
            causes.append(Cause.required(f"{where}.image"))
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for key, value in limits.items():
            parsed = parse(str(value))
            if key.startswith("nvidia.com/") and parsed and parsed[0].denominator != 1:
                causes.append(
                    Cause.invalid(
                        f"{where}.resources.limits[{key}]", _go_quantity(str(value)), "must be an integer"
                    )
                )
        for key, value in requests.items():
            if key.startswith("nvidia.com/") and key in limits:
                request, limit = parse(str(value)), parse(str(limits[key]))
                if request and limit and request[0] != limit[0]:
                    causes.append(
                        Cause.invalid(
                            f"{where}.resources.requests",
                            go_quote(value),
                            f"must be equal to {key} limit of {_decimal(limit[0])}",
                        )
                    )
    if job and spec.get("restartPolicy") not in ("OnFailure", "Never"):
        causes.append(Cause.required(f"{path}.restartPolicy", 'valid values: "OnFailure", "Never"'))
    return causes


def _decimal(value: Fraction) -> str:
    from tests.kubefake.quantity import canonical

    return canonical(str(float(value)) if value.denominator != 1 else str(int(value)))


def check_job(job: dict[str, Any]) -> list[Cause]:
    causes = check_metadata(job.get("metadata", {}))
    spec = job.get("spec", {})
    for key in ("backoffLimit", "parallelism", "completions", "activeDeadlineSeconds"):
        value = spec.get(key)
        if isinstance(value, int) and value < (1 if key == "activeDeadlineSeconds" else 0):
            bound = "greater than 0" if key == "activeDeadlineSeconds" else "greater than or equal to 0"
            causes.append(Cause.invalid(f"spec.{key}", str(value), f"must be {bound}"))
    template = spec.get("template", {})
    causes += check_pod_spec(template.get("spec", {}), "spec.template.spec", job=True)
    return causes


def check_pod(pod: dict[str, Any]) -> list[Cause]:
    return check_metadata(pod.get("metadata", {})) + check_pod_spec(pod.get("spec", {}), "spec", job=False)


def check_configmap(configmap: dict[str, Any]) -> list[Cause]:
    causes = check_metadata(configmap.get("metadata", {}))
    data = configmap.get("data") or {}
    if sum(len(k) + len(v) for k, v in data.items() if isinstance(v, str)) > CONFIGMAP_LIMIT:
        causes.append(Cause.too_long("[]", CONFIGMAP_LIMIT))
    return causes


def _conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in status.get("conditions") or []}


def check_job_status(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    """Job status rules of 1.33 (053, 056): terminal conditions need their interim ones, and stay."""
    causes: list[Cause] = []
    before, after = _conditions(old.get("status", {})), _conditions(new.get("status", {}))
    status = new.get("status", {})
    if (
        after.get("Failed") == "True"
        and after.get("FailureTarget") != "True"
        and before.get("FailureTarget") != "True"
    ):
        causes.append(
            Cause(
                "status.conditions",
                "FieldValueInvalid",
                "Invalid value: cannot set Failed=True condition without the FailureTarget=true condition",
            )
        )
    if after.get("Complete") == "True":
        if after.get("SuccessCriteriaMet") != "True" and before.get("SuccessCriteriaMet") != "True":
            causes.append(
                Cause(
                    "status.conditions",
                    "FieldValueInvalid",
                    "Invalid value: cannot set Complete=True condition without the SuccessCriteriaMet=true condition",  # noqa: E501 - the server's message, verbatim
                )
            )
        elif not status.get("completionTime"):
            causes.append(
                Cause.required("status.completionTime", "completionTime is required for Complete jobs")
            )
    if status.get("completionTime") and after.get("Complete") != "True":
        stamp = status["completionTime"].replace("T", " ").replace("Z", " +0000 UTC")
        causes.append(
            Cause(
                "status.completionTime",
                "FieldValueInvalid",
                f"Invalid value: {stamp}: cannot set completionTime when there is no Complete=True condition",
            )
        )
    for terminal in ("Complete", "Failed"):
        if before.get(terminal) == "True" and after.get(terminal) != "True":
            causes.append(
                Cause(
                    "status.conditions",
                    "FieldValueInvalid",
                    f"Invalid value: cannot disable the terminal {terminal}=True condition",
                )
            )
    return causes


CREATE_CHECKS = {
    "nodes": check_node,
    "jobs": check_job,
    "pods": check_pod,
    "configmaps": check_configmap,
}
UPDATE_CHECKS = {"nodes": check_node, "jobs": check_job, "pods": check_pod}
