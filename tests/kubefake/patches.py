"""The three PATCH flavours the recordings use: strategic merge, JSON merge (RFC 7386), JSON patch (RFC 6902).

Strategic merge knows the merge keys of the lists Orrery touches (conditions and addresses by
``type``, containers and env by ``name``, taints by ``key``, ...) and the directives the kubelet and
the Job controller send (``$setElementOrder/…``, ``$deleteFromPrimitiveList/…``, ``$patch: delete``).
It keys lists by field name only, not by the full schema path: enough for Nodes, Pods, Jobs.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.kubefake.errors import ApiError, status

MERGE_KEYS = {
    "conditions": "type",
    "addresses": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ownerReferences": "uid",
    "taints": "key",
    "imagePullSecrets": "name",
    "podIPs": "ip",
    "hostIPs": "ip",
}
MERGED_PRIMITIVE_LISTS = {"finalizers"}
ATOMIC = {"state", "lastState"}  # a ContainerState holds one of waiting/running/terminated


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, ``null`` removes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge(target: Any, patch: Any) -> Any:
    """Kubernetes strategic merge for the fields listed in :data:`MERGE_KEYS`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    orders: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field) or [] if item not in value]
            if not result[field]:
                result.pop(field)
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in MERGE_KEYS and all(isinstance(v, dict) for v in value):
            result[key] = _merge_keyed_list(result.get(key) or [], value, MERGE_KEYS[key])
        elif isinstance(value, list) and key in MERGED_PRIMITIVE_LISTS:
            merged = list(result.get(key) or [])
            merged += [item for item in value if item not in merged]
            result[key] = merged
        elif isinstance(value, dict) and key not in ATOMIC:
            result[key] = strategic_merge(result.get(key), value)
        else:
            result[key] = copy.deepcopy(value)
    for field, order in orders.items():
        key = MERGE_KEYS.get(field)
        items = result.get(field)
        if key and isinstance(items, list):
            rank = {entry.get(key): i for i, entry in enumerate(order) if isinstance(entry, dict)}
            result[field] = sorted(items, key=lambda item: rank.get(item.get(key), len(rank)))
    return result


def _merge_keyed_list(current: list[dict], patch: list[dict], key: str) -> list[dict]:
    merged = [dict(item) for item in current]
    for item in patch:
        position = next((i for i, old in enumerate(merged) if old.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if position is not None:
                merged.pop(position)
        elif position is None:
            merged.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            merged[position] = strategic_merge(merged[position], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def _invalid_patch(message: str) -> ApiError:
    return ApiError(422, status(422, message, "Invalid"))


def json_patch(target: Any, operations: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/remove/replace/test/move/copy over a deep copy of ``target``."""
    document = copy.deepcopy(target)
    for operation in operations:
        op, parts = operation.get("op"), _pointer(operation.get("path", ""))
        if op in ("move", "copy"):
            source = _pointer(operation.get("from", ""))
            value = copy.deepcopy(_get(document, source))
            if op == "move":
                _remove(document, source)
            document = _add(document, parts, value)
        elif op == "add":
            document = _add(document, parts, copy.deepcopy(operation.get("value")))
        elif op == "remove":
            _remove(document, parts)
        elif op == "replace":
            _remove(document, parts)
            document = _add(document, parts, copy.deepcopy(operation.get("value")))
        elif op == "test":
            if _get(document, parts) != operation.get("value"):
                raise _invalid_patch("the server rejected our request due to an error in our request")
        else:
            raise _invalid_patch(f"Unexpected kind: {op}")
    return document


def _get(document: Any, parts: list[str]) -> Any:
    for part in parts:
        try:
            document = document[int(part)] if isinstance(document, list) else document[part]
        except (KeyError, IndexError, ValueError) as missing:
            raise _invalid_patch(f"jsonpatch: path not found: {part}") from missing
    return document


def _add(document: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _get(document, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        parent[last] = value
    return document


def _remove(document: Any, parts: list[str]) -> None:
    parent = _get(document, parts[:-1])
    try:
        if isinstance(parent, list):
            parent.pop(int(parts[-1]))
        else:
            del parent[parts[-1]]
    except (KeyError, IndexError, ValueError) as missing:
        raise _invalid_patch(
            f"jsonpatch remove operation does not apply: doc is missing path: {parts}"
        ) from missing
