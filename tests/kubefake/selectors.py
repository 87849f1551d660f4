"""Label and field selectors as kube-apiserver parses them (recordings 020–022, 060).

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` and ``!k``,
joined by commas. Field selectors: ``f=v``, ``f==v``, ``f!=v`` over the fields each resource
supports (see :data:`tests.kubefake.resources.RESOURCES`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tests.kubefake.errors import bad_request

Matcher = Callable[[dict[str, Any]], bool]

_TOKEN = re.compile(r"\s*(!=|==|=|!|\(|\)|,|[^\s!=(),]+)")


def _tokens(text: str) -> list[str]:
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if not match:
            break
        tokens.append(match.group(1))
        position = match.end()
        while position < len(text) and text[position].isspace():
            position += 1
    return tokens


def parse_labels(text: str) -> Matcher:
    """A matcher over an object's ``metadata.labels``; 400 BadRequest for a malformed selector."""
    tokens = _tokens(text or "")
    requirements: list[Matcher] = []
    index = 0

    def fail(detail: str) -> None:
        raise bad_request(f"unable to parse requirement: {detail}")

    while index < len(tokens):
        token = tokens[index]
        if token == "!":
            key = tokens[index + 1] if index + 1 < len(tokens) else ""
            requirements.append(lambda labels, k=key: k not in labels)
            index += 2
        else:
            key = token
            operator = tokens[index + 1] if index + 1 < len(tokens) else ","
            if operator == ",":
                requirements.append(lambda labels, k=key: k in labels)
                index += 1
            elif operator in ("=", "==", "!="):
                value = tokens[index + 2] if index + 2 < len(tokens) and tokens[index + 2] != "," else ""
                index += 3 if value else 2
                if operator == "!=":
                    requirements.append(lambda labels, k=key, v=value: labels.get(k) != v)
                else:
                    requirements.append(lambda labels, k=key, v=value: labels.get(k) == v)
            elif operator in ("in", "notin"):
                if index + 2 >= len(tokens) or tokens[index + 2] != "(":
                    found = tokens[index + 2] if index + 2 < len(tokens) else ""
                    fail(f"found '{found}' expected: '('")
                values, index = set(), index + 3
                while index < len(tokens) and tokens[index] != ")":
                    if tokens[index] != ",":
                        values.add(tokens[index])
                    index += 1
                if index >= len(tokens):
                    fail("found '', expected: ')'")
                index += 1
                if operator == "in":
                    requirements.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
                else:
                    requirements.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
            else:
                fail(f"found '{operator}', expected: in, notin, =, ==, !=, gt, lt")
        if index < len(tokens):
            if tokens[index] != ",":
                fail(f"found '{tokens[index]}', expected: ',' or 'end of string'")
            index += 1

    def matches(obj: dict[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(requirement(labels) for requirement in requirements)

    return matches


def parse_fields(text: str, fields: dict[str, Callable[[dict[str, Any]], str]]) -> Matcher:
    """A matcher over the resource's selectable fields; 400 for a field the resource lacks."""
    requirements: list[tuple[Callable[[dict[str, Any]], str], str, bool]] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if "!=" in part:
            key, value = part.split("!=", 1)
            negate = True
        elif "==" in part:
            key, value = part.split("==", 1)
            negate = False
        elif "=" in part:
            key, value = part.split("=", 1)
            negate = False
        else:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        key = key.strip()
        if key not in fields:
            raise bad_request(f"field label not supported: {key}")
        requirements.append((fields[key], value.strip(), negate))

    def matches(obj: dict[str, Any]) -> bool:
        return all((getter(obj) == value) != negate for getter, value, negate in requirements)

    return matches
