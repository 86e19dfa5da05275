"""Layering of `ferrum_server`: the tools (`ferrum_server.tools`: the `ferrum-executor` command
line, demo, generate, bench) import the core; the core never imports the tools, and the tools
import one another without a cycle. Read from the source with `ast`, lazy imports included."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"
PACKAGE = SERVER / "ferrum_server"
TOOLS = "ferrum_server.tools"
# `python -m ferrum_server` is the program's entry point, like the console script: the one
# module outside the tools that may (and must) reach into them. Nothing imports it.
ENTRY_POINTS = {"ferrum_server.__main__"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(SERVER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_tools(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def _imports(path: Path) -> set[str]:
    """Every module name an import statement anywhere in the file may load (absolute)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            names.add(origin)
            # `from package import name` may load the submodule package.name.
            names.update(f"{origin}.{alias.name}" for alias in node.names)
    return names


def _core_files() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not _is_tools(_module(path)) and _module(path) not in ENTRY_POINTS
    ]


def test_the_walk_sees_the_core_and_the_tools() -> None:
    core = {_module(p) for p in _core_files()}
    assert {"ferrum_server.cli", "ferrum_server.server_process", "ferrum_server.app"} <= core
    tools = {_module(p) for p in (PACKAGE / "tools").rglob("*.py")}
    assert {"ferrum_server.tools.cli", "ferrum_server.tools.bench.harness"} <= tools


def test_the_core_never_imports_the_tools() -> None:
    offenders: dict[str, list[str]] = {}
    for path in _core_files():
        found = sorted(name for name in _imports(path) if _is_tools(name))
        # Also a module named in a string: importlib.import_module("..."), `python -m ...`.
        found += sorted(
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _is_tools(node.value.split()[0] if node.value.split() else "")
        )
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"the core imports the tools: {offenders}"


def test_the_tools_import_one_another_without_a_cycle() -> None:
    """Since the core never imports the tools, a cycle through a tool lies within the tools."""
    files = {_module(p): p for p in sorted((PACKAGE / "tools").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for imported in _imports(path):
            # `from a.b import c`: a.b.c when c is a module of the tools, else a.b.
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            # A module's own package (`__init__`) runs before it anyway; not an edge back.
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets

    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # The graph is not empty: the command line reaches every tool.
    assert {
        "ferrum_server.tools.demo",
        "ferrum_server.tools.generate",
        "ferrum_server.tools.bench.cli",
    } <= graph["ferrum_server.tools.cli"]


def test_the_console_script_is_the_tools_command_line() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"ferrum-executor": "ferrum_server.tools.cli:main"}
    assert "from ferrum_server.tools.cli import main" in (PACKAGE / "__main__.py").read_text()
