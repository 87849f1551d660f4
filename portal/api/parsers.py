"""Request bodies in JSON and in YAML (the way people write job specs), read and parsed within
fixed bounds, so that no body, however crafted, keeps a worker busy for more than about a second.

Every body is held to the same rules, whatever its media type:

* size: at most ``DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes, counted while reading (one byte past the
  limit is read, never more), not taken from ``Content-Length``; over it, 413;
* text: UTF-8 only; no string, key or value, holds NUL or a lone surrogate (neither can be
  stored in PostgreSQL, nor rendered back in an answer);
* shape: at most ``MAX_DEPTH`` nested collections and ``MAX_NODES`` values, aliases counted
  as expanded (the YAML anchor bomb is a small document that expands into billions);
* numbers: integers of at most ``MAX_NUMBER_DIGITS`` digits (Python refuses longer ones, and
  takes quadratic time over YAML's base-60 ``1:2:3:…``); floats finite.

A value breaking a rule is a 400 that names its path in the body (``spec.run``,
``jobs[3].metadata.labels.team``), through ``BodyRefused``.

YAML is parsed by libyaml (``CSafeLoader``): the pure-Python loader takes minutes over a few
megabytes. Its events are walked first, counting nodes and depth, and the document is built only
when they are within bounds; building makes plain data only (no Python objects from tags).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import yaml
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser, JSONParser

from scheduling.spec import path_key, text_problem

MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_NUMBER_DIGITS = 4300  # Python's own limit for int(str)
_MAX_INT_BITS = 14_000  # a little under 4300 decimal digits, so that str() works
_READ_CHUNK = 1 << 16
_UTF8 = {"utf-8", "utf8", "utf_8", "us-ascii", "ascii"}

if not getattr(yaml, "__with_libyaml__", False):  # pragma: no cover - depends on the build
    raise ImproperlyConfigured(
        "PyYAML is installed without libyaml; YAML request bodies would use the pure-Python "
        "loader, which takes minutes over a few megabytes. Install libyaml and reinstall PyYAML."
    )


class BodyRefused(ParseError):
    """400: the body parsed, but values in it break the rules above; ``errors`` lists
    ``(path, message)`` pairs, rendered like every other input error."""

    def __init__(self, errors: list[tuple[str, str]], detail: str = "Invalid request body.") -> None:
        self.errors = errors
        super().__init__(detail)


class _Refused:
    """A value the parser could not accept, left in place so that the walk names its path."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __str__(self) -> str:  # as a mapping key in a path
        return "(number)"


def read_body(stream: Any) -> bytes:
    """The whole body, or ``RequestDataTooBig`` (413) as soon as more than the limit is read."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    chunks, size = [], 0
    while True:
        chunk = stream.read(_READ_CHUNK if limit is None else min(_READ_CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            raise RequestDataTooBig("Request body exceeded settings.DATA_UPLOAD_MAX_MEMORY_SIZE.")


def _text(stream: Any, parser_context: dict | None, what: str) -> str:
    charset = ((parser_context or {}).get("encoding") or "utf-8").lower()
    if charset not in _UTF8:
        raise ParseError(f"{what}: send it in UTF-8, not {charset[:40]}.")
    try:
        return read_body(stream).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParseError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start}).") from None


def _too_long(text: str) -> _Refused | None:
    """Refuse a number literal Python cannot build (more than 4300 digits), from its length."""
    if len(text) > MAX_NUMBER_DIGITS:
        return _Refused(f"is a number of more than {MAX_NUMBER_DIGITS} digits")
    return None


def _json_int(text: str) -> Any:
    return _too_long(text) or int(text)


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_document(document: Any) -> None:
    """Raise ``BodyRefused`` naming each string with NUL or a lone surrogate, each refused number
    and each collection nested too deeply; stop at once past ``MAX_NODES`` values (counted before
    a collection's items are visited, so a long list costs nothing to refuse). A document within
    the rules, nearly every one, is walked once without building the paths (most of a walk's
    time); only one that breaks a rule is walked again to name where."""
    if _within_rules(document):
        return
    errors: list[tuple[str, str]] = []
    stack: list[tuple[Any, str, int]] = [(document, "", 0)]
    seen = 1
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            problem = text_problem(value)
            if problem:
                errors.append((path or "(body)", problem))
        elif isinstance(value, _Refused):
            errors.append((path or "(body)", value.message))
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append((path or "(body)", "is not a finite number"))
        elif isinstance(value, dict | list | tuple):
            seen += len(value)
            if seen > MAX_NODES:
                raise BodyRefused([("(body)", f"has more than {MAX_NODES} values")], "The body is too large.")
            if depth >= MAX_DEPTH:
                errors.append((path or "(body)", f"is nested more than {MAX_DEPTH} levels deep"))
            elif isinstance(value, dict):
                items = []
                for key, item in value.items():
                    where = f"{path}.{path_key(key)}" if path else path_key(key)
                    problem = _key_problem(key)
                    if problem:
                        errors.append((where, f"its name {problem}"))
                    items.append((item, where, depth + 1))
                stack.extend(reversed(items))
            else:
                stack.extend((value[i], f"{path}[{i}]", depth + 1) for i in reversed(range(len(value))))
    if errors:
        raise BodyRefused(errors[:100], "Invalid request body.")


def _within_rules(document: Any) -> bool:
    """Whether ``check_document`` would find nothing to refuse: its walk without the paths."""
    stack: list[tuple[Any, int]] = [(document, 0)]
    seen = 1
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if text_problem(value):
                return False
        elif isinstance(value, _Refused) or (isinstance(value, float) and not math.isfinite(value)):
            return False
        elif isinstance(value, dict | list | tuple):
            seen += len(value)
            if seen > MAX_NODES or depth >= MAX_DEPTH:
                return False
            if isinstance(value, dict):
                for key in value:
                    if isinstance(key, _Refused) or (isinstance(key, str) and text_problem(key)):
                        return False
                stack.extend((item, depth + 1) for item in value.values())
            else:
                stack.extend((item, depth + 1) for item in value)
    return True


def _key_problem(key: Any) -> str | None:
    if isinstance(key, str):
        return text_problem(key)
    return key.message if isinstance(key, _Refused) else None


class StrictJsonParser(JSONParser):
    """JSON under the rules above. A document that is not JSON (``NaN``, a trailing comma) is
    a 400 ``JSON parse error``; one that is JSON but breaks a rule names the values at fault."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        text = _text(stream, parser_context, "JSON parse error")
        try:
            try:
                document = json.loads(text, parse_constant=_json_constant)
            except json.JSONDecodeError:
                raise
            except ValueError:
                # Not a syntax error: an integer Python cannot build. Parse again, building
                # each integer by hand (slower), to name where it is.
                document = json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {str(exc)[:300]}") from None
        except RecursionError:
            raise ParseError("JSON parse error: nested too deeply.") from None
        check_document(document)
        return document


class _BoundedYamlLoader(yaml.CSafeLoader):
    """libyaml's safe loader whose integers are checked before and after Python builds them: a
    long digit string is refused (``int()`` refuses over 4300 digits, and base 60 ``1:2:3:…``
    takes quadratic time), and so is a hexadecimal one too large to print in decimal."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        refused = _too_long(node.value)
        if refused is not None:
            return refused
        value = super().construct_yaml_int(node)
        if value.bit_length() > _MAX_INT_BITS:
            return _Refused(f"is a number of more than {MAX_NUMBER_DIGITS} digits")
        return value


_BoundedYamlLoader.add_constructor("tag:yaml.org,2002:int", _BoundedYamlLoader.construct_yaml_int)


def check_yaml_events(events: Iterable[yaml.Event]) -> int:
    """Walk a stream's events without building anything; raise ``BodyRefused`` as soon as it
    holds more than ``MAX_NODES`` nodes or nests deeper than ``MAX_DEPTH``, counting each alias
    as the node it stands for (its size and height). Returns the number of nodes, expanded."""
    anchored: dict[str, tuple[int, int]] = {}  # anchor → (nodes, height) of the node it names
    open_: list[list[Any]] = []  # per open collection: [anchor, nodes before it, tallest child]
    total = 0
    for event in events:
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, before, tallest = open_.pop()
            height = tallest + 1
            if anchor is not None:
                anchored[anchor] = (total - before, height)
            if open_:
                open_[-1][2] = max(open_[-1][2], height)
            continue
        if isinstance(event, yaml.AliasEvent):
            nodes, height = anchored.get(event.anchor, (1, 0))
        elif isinstance(event, yaml.NodeEvent):
            nodes, height = 1, int(isinstance(event, yaml.CollectionStartEvent))
        else:
            continue  # stream and document boundaries
        total += nodes
        where = f"line {event.start_mark.line + 1}" if event.start_mark else "the body"
        if total > MAX_NODES:
            raise BodyRefused(
                [("(body)", f"has more than {MAX_NODES} values (aliases counted as expanded), at {where}")],
                "The body is too large.",
            )
        if len(open_) + height > MAX_DEPTH:
            raise BodyRefused(
                [("(body)", f"is nested more than {MAX_DEPTH} levels deep, at {where}")],
                "Malformed YAML: nested too deeply.",
            )
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, total - 1, 0])
        else:
            if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
                anchored[event.anchor] = (1, 0)
            if open_:
                open_[-1][2] = max(open_[-1][2], height)
    return total


class YamlParser(BaseParser):
    """``application/yaml`` (also ``application/x-yaml`` and ``text/yaml``) under the rules
    above. A stream of several documents (``---``) parses to a list, which the batch endpoint
    accepts."""

    media_type = "application/yaml"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        text = _text(stream, parser_context, "Malformed YAML")
        try:
            check_yaml_events(yaml.parse(text, Loader=_BoundedYamlLoader))
            documents = [d for d in yaml.load_all(text, Loader=_BoundedYamlLoader) if d is not None]
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            # ValueError/OverflowError: scalars YAML accepts but Python cannot build (2026-02-30).
            raise ParseError(f"Malformed YAML: {str(exc)[:300]}") from None
        except RecursionError:
            raise ParseError("Malformed YAML: nested too deeply.") from None
        if not documents:
            raise ParseError("Empty YAML document.")
        document = documents[0] if len(documents) == 1 else documents
        check_document(document)
        return document


class XYamlParser(YamlParser):
    media_type = "application/x-yaml"


class TextYamlParser(YamlParser):
    media_type = "text/yaml"
