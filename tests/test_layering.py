"""Dependencies point one way: portal → scheduling → clusters → foundation; a scheduler plugin
sees only the framework, the snapshot and the choices; and no module imports itself back through
any chain of imports, function-local ones included."""

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
# framework, snapshot and timeline (numpy over the snapshot), the choices modules, numpy and the
# standard library, and nothing else (no models, no cache, no adapters, no other plugin).
PLUGINS = ("scheduling", "engine", "plugins")
PLUGIN_MAY_IMPORT = {
    "scheduling.engine.framework",
    "scheduling.engine.snapshot",
    "scheduling.engine.timeline",
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


# No import circle anywhere in the project. An import hidden inside a function still closes a
# circle (it only delays it), so every import statement counts, wherever it stands.
APPS = ("foundation", "clusters", "scheduling", "portal")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for app in APPS:
        for path in (root / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the project modules it imports (``from a import b`` is ``a.b`` when ``b`` is a
    module, else ``a``)."""
    modules = project_modules(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = (
                    ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
                    if node.level
                    else node.module or ""
                )
                targets |= {known(f"{base}.{alias.name}") or known(base) for alias in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circle_anywhere():
    assert import_circles() == []


def test_the_circle_check_sees_through_function_local_imports(tmp_path):
    (tmp_path / "scheduling" / "dispatch").mkdir(parents=True)
    (tmp_path / "scheduling" / "__init__.py").write_text("")
    (tmp_path / "scheduling" / "dispatch" / "__init__.py").write_text("")
    (tmp_path / "scheduling" / "wakeup.py").write_text(
        "def ring():\n    from scheduling.tasks import drain\n"  # hidden in a function
    )
    (tmp_path / "scheduling" / "tasks.py").write_text("from scheduling.dispatch import outbox\n")
    (tmp_path / "scheduling" / "dispatch" / "outbox.py").write_text("from ..wakeup import ring\n")
    (tmp_path / "scheduling" / "models.py").write_text("import os\n")
    assert import_circles(tmp_path) == [
        ["scheduling.dispatch.outbox", "scheduling.tasks", "scheduling.wakeup"]
    ]
