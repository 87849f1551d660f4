"""Dependencies point one way: portal → scheduling → clusters → foundation."""

from __future__ import annotations

import ast
import sys
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


# A plugin sees the job and the snapshot and returns a value: it may import the engine's
# framework and snapshot, the choices modules, numpy and the standard library, and nothing else
# (no models, no cache, no adapters, no other plugin).
PLUGINS = ("scheduling", "engine", "plugins")
PLUGIN_MAY_IMPORT = {
    "scheduling.engine.framework",
    "scheduling.engine.snapshot",
    "scheduling.choices",
    "clusters.choices",
    "numpy",
}


def plugin_may_import(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or any(
        module == allowed or module.startswith(f"{allowed}.") for allowed in PLUGIN_MAY_IMPORT
    )


def imported_modules(path: Path, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """Every module a file imports, function-local imports included; a relative import is
    resolved against ``package``, and ``from a import b`` counts as ``a.b`` unless ``a`` itself
    may be imported."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(
                [*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]
                if node.level
                else [node.module or ""]
            )
            if plugin_may_import(base):
                found.append((node.lineno, base))
            else:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return sorted(found)


def plugin_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.joinpath(*PLUGINS).rglob("*.py")):
        for lineno, module in imported_modules(path, PLUGINS):
            if not plugin_may_import(module):
                bad.append(f"{path.relative_to(root)}:{lineno} imports {module}")
    return bad


def test_plugins_import_only_the_framework_the_snapshot_the_choices_numpy_and_the_stdlib():
    assert plugin_violations() == []


def test_the_plugin_check_catches_a_forbidden_import(tmp_path):
    plugins = tmp_path.joinpath(*PLUGINS)
    plugins.mkdir(parents=True)
    (plugins / "bad.py").write_text(
        "from __future__ import annotations\n"
        "import numpy as np\n"
        "from clusters.choices import NodeState\n"
        "from scheduling.engine.framework import JobView\n"
        "from scheduling.models import Job\n"
        "import django.db\n"
        "from . import gang\n"
        "from .. import cache\n"
        "def score():\n"
        "    from scheduling.engine.cycle.decide import select\n"
    )
    assert plugin_violations(tmp_path) == [
        "scheduling/engine/plugins/bad.py:5 imports scheduling.models.Job",
        "scheduling/engine/plugins/bad.py:6 imports django.db",
        "scheduling/engine/plugins/bad.py:7 imports scheduling.engine.plugins.gang",
        "scheduling/engine/plugins/bad.py:8 imports scheduling.engine.cache",
        "scheduling/engine/plugins/bad.py:10 imports scheduling.engine.cycle.decide.select",
    ]
