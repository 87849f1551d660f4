"""Request bodies in YAML, the way people write job specs."""

from __future__ import annotations

from typing import Any

import yaml
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser, JSONParser


class YamlParser(BaseParser):
    """``application/yaml`` (also ``application/x-yaml`` and ``text/yaml``). A stream of several
    documents (``---``) parses to a list, which the batch endpoint accepts. Only plain data is
    built (``safe_load``): no Python objects from tags."""

    media_type = "application/yaml"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        try:
            text = stream.read().decode((parser_context or {}).get("encoding") or "utf-8")
            documents = [d for d in yaml.safe_load_all(text) if d is not None]
        except LookupError:
            raise ParseError("Unknown charset; send YAML in UTF-8.") from None
        except (yaml.YAMLError, UnicodeDecodeError, ValueError, OverflowError) as exc:
            # ValueError/OverflowError: scalars YAML accepts but Python cannot build
            # (2026-02-30, integers of thousands of digits).
            raise ParseError(f"Malformed YAML: {str(exc)[:300]}") from None
        except RecursionError:
            raise ParseError("Malformed YAML: nested too deeply.") from None
        if not documents:
            raise ParseError("Empty YAML document.")
        return documents[0] if len(documents) == 1 else documents


class XYamlParser(YamlParser):
    media_type = "application/x-yaml"


class TextYamlParser(YamlParser):
    media_type = "text/yaml"


class StrictJsonParser(JSONParser):
    """DRF's JSON parser, plus a clean 400 for documents nested deeply enough to exhaust the
    parser's recursion (DRF's own answer would be a 500)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error: nested too deeply.") from None
