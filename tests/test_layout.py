"""The import rules of docs/ARCHITECTURE.md, enforced by walking every module's imports (no
import cycle inside a package among them); and the checkout's front door (app.py, pages/,
trainer/) holding no logic of its own."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "rampwatch"
SUBPACKAGES = ("store", "advisor", "monitor", "trainer", "dashboard", "integrations")

# owner -> subpackages of rampwatch it may import
ALLOWED = {
    # store: advisor/tiers.py's Tier and RAMP_MAX_FACTOR check a ramp command (one home for what
    # a tier is); advisor imports nothing of ours, so this makes no cycle
    "store": {"advisor"},
    "advisor": set(),
    "monitor": {"store", "advisor"},
    "trainer": {"store", "advisor", "monitor"},
    "integrations": {"store", "advisor", "monitor"},
    "dashboard": {"store", "advisor"},
    "rampwatch": {"monitor", "store", "advisor", "trainer", "dashboard"},  # cli: guard.py only
    "bench": {"store", "advisor", "monitor", "trainer", "dashboard"},
}
# third-party modules a package must not touch
FORBIDDEN_THIRD_PARTY = {
    "store": {"torch", "streamlit", "plotly", "pandas"},
    "advisor": {"torch", "streamlit", "plotly", "duckdb", "pandas", "pyarrow"},
    "dashboard": {"torch"},
    "integrations": {"streamlit", "plotly"},
    "rampwatch": {"torch", "streamlit", "plotly"},  # a viewer's install has neither torch
}
FRONT_DOOR = [
    REPO / "app.py",
    *sorted((REPO / "pages").glob("*.py")),
    *sorted((REPO / "trainer").glob("*.py")),
]


def _imported_modules(path: Path) -> set[str]:
    """Every absolute module name imported anywhere in the file (dotted, as written)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if node.module == "rampwatch":  # from rampwatch import store
                found.update(f"rampwatch.{alias.name}" for alias in node.names)
    return found


def _ours(modules: set[str]) -> set[str]:
    """The rampwatch subpackages among imported modules (rampwatch.cli counts as 'rampwatch')."""
    out = set()
    for m in modules:
        parts = m.split(".")
        if parts[0] == "rampwatch" and len(parts) > 1:
            out.add(parts[1] if parts[1] in SUBPACKAGES else "rampwatch")
    return out


def _owner(path: Path) -> str:
    if path.is_relative_to(PACKAGE):
        rel = path.relative_to(PACKAGE)
        return rel.parts[0] if len(rel.parts) > 1 else "rampwatch"
    return path.relative_to(REPO).parts[0]


def _sources():
    yield from PACKAGE.rglob("*.py")
    yield from (REPO / "bench").rglob("*.py")


def test_import_rules():
    broken = []
    for path in _sources():
        owner = _owner(path)
        modules = _imported_modules(path)
        for pkg in _ours(modules) - ALLOWED[owner] - {owner}:
            broken.append(f"{path.relative_to(REPO)} imports rampwatch.{pkg}")
        tops = {m.split(".")[0] for m in modules}
        for mod in tops & FORBIDDEN_THIRD_PARTY.get(owner, set()):
            broken.append(f"{path.relative_to(REPO)} imports {mod} ({owner} must not)")
    assert not broken, "import rules of docs/ARCHITECTURE.md broken:\n" + "\n".join(broken)


def test_no_generic_top_level_imports():
    """Code in the package imports ours only as rampwatch.*: a bare `store` or `trainer` would
    work from a checkout and break in an install."""
    bare = {"store", "advisor", "monitor", "trainer", "dashboard", "pages", "app"}
    bad = [
        f"{p.relative_to(REPO)} imports {m}"
        for p in _sources()
        for m in _imported_modules(p)
        if m.split(".")[0] in bare
    ]
    assert not bad, "\n".join(bad)


def test_front_door_is_thin():
    """app.py, pages/*.py and trainer/*.py are docstring, imports of rampwatch and one call."""
    assert FRONT_DOOR and all(p.exists() for p in FRONT_DOOR)
    for path in FRONT_DOOR:
        tree = ast.parse(path.read_text(), filename=str(path))
        body = [
            n
            for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        ]
        imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        rest = [n for n in body if n not in imports]
        assert all(
            isinstance(n, ast.Import)
            and n.names[0].name == "sys"
            or isinstance(n, ast.ImportFrom)
            and n.module.startswith("rampwatch")
            for n in imports
        ), f"{path.name} imports more than rampwatch"
        assert len(rest) <= 1 and all(isinstance(n, ast.Expr) for n in rest), (
            f"{path.relative_to(REPO)} has logic of its own"
        )


def test_nothing_outside_the_repository_is_cited():
    """Docs and comments point inside the repository (a clone has no ../shared/)."""
    hits = []
    for path in REPO.rglob("*"):
        if (
            path.suffix in (".py", ".md", ".sh", ".toml", ".txt")
            and ".venv" not in path.parts
            and ".git" not in path.parts
            and path.is_file()
        ):
            text = path.read_text(errors="replace")
            if "DESIGN.md" in text or "../shared" in text:
                hits.append(str(path.relative_to(REPO)))
    hits = [h for h in hits if h != "tests/test_layout.py"]
    assert not hits, f"cite a path outside the repository: {hits}"


def _module_name(path: Path, top: Path = REPO) -> str:
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(node: ast.AST):
    """Every import statement under `node`, in functions too (a late import still runs), but
    not in the body of `if TYPE_CHECKING:` (it never runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for statement in child.orelse:
                yield from _runtime_imports(ast.Module(body=[statement], type_ignores=[]))
        else:
            yield from _runtime_imports(child)


def _imports_within(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file at `path` (module `name`) imports at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from . import x, from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module mod; `from mod import name` imports mod
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        found.update(t for t in targets if t in modules and t != name)
    return found


def _import_graph(package: Path, top: Path = REPO) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (package: a folder under top)."""
    names = {path: _module_name(path, top) for path in sorted(package.rglob("*.py"))}
    modules = set(names.values())
    return {name: _imports_within(path, name, modules) for path, name in names.items()}


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every simple cycle of the graph as "a → b → … → a", each once, from its smallest module
    (the graphs are a few dozen modules with few edges: a plain search is enough)."""
    found = []

    def extend(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == path[0]:
                found.append(" → ".join([*path, nxt]))
            elif nxt > path[0] and nxt not in path:
                extend([*path, nxt])

    for start in sorted(graph):
        extend([start])
    return found


def test_no_import_cycle_inside_a_package():
    """No package's modules import each other in a circle, late imports in functions included:
    a cycle works only by the order of first imports, and breaks when that order changes."""
    cycles = [
        cycle
        for package in [*(PACKAGE / p for p in SUBPACKAGES), REPO / "bench"]
        for cycle in _cycles(_import_graph(package))
    ]
    assert not cycles, "import cycles inside a package:\n" + "\n".join(cycles)


def test_cycle_finder_sees_late_relative_and_module_imports(tmp_path):
    """It counts what runs (an import in a function, a relative one, `from pkg import mod`)
    and skips what never does (under `if TYPE_CHECKING:`)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .c import X\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nX = 1\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    assert _cycles(_import_graph(pkg, tmp_path)) == []
    (pkg / "c.py").write_text("X = 1\nif X:\n    from pkg.a import f\n")
    assert _cycles(_import_graph(pkg, tmp_path)) == ["pkg.a → pkg.b → pkg.c → pkg.a"]
