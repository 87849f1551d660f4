"""Dependencies point one way: portal → scheduling → clusters → foundation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "foundation": {"clusters", "scheduling", "portal"},
    "clusters": {"scheduling", "portal"},
    "scheduling": {"portal"},
}


def imported_packages(path: Path) -> set[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name.split(".")[0]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


def violations(app: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / app).rglob("*.py")):
        for lineno, package in imported_packages(path):
            if package in FORBIDDEN[app]:
                bad.append(f"{path.relative_to(root)}:{lineno} imports {package}")
    return bad


@pytest.mark.parametrize("app", sorted(FORBIDDEN))
def test_no_forbidden_imports(app):
    assert violations(app) == []


def test_the_check_catches_a_forbidden_import(tmp_path):
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "bad.py").write_text("import os\nfrom scheduling.models import Job\n")
    assert violations("clusters", tmp_path) == ["clusters/bad.py:2 imports scheduling"]
