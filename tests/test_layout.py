"""The import rules of docs/ARCHITECTURE.md, enforced by walking every module's imports."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("store", "advisor", "trainer", "pages")

# package -> packages of ours it may import
ALLOWED = {
    "store": set(),
    "advisor": set(),
    "trainer": {"store", "advisor"},
    "pages": {"store", "advisor"},
    "app": {"store", "advisor", "pages"},
    "bench": {"store", "advisor", "trainer"},
}
# third-party modules a pure package must not touch
FORBIDDEN_THIRD_PARTY = {
    "store": {"torch", "streamlit", "plotly"},
    "advisor": {"torch", "streamlit", "plotly", "duckdb", "pandas", "pyarrow"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _owner(path: Path) -> str:
    rel = path.relative_to(REPO)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _sources():
    for top in (*PACKAGES, "bench"):
        yield from (REPO / top).rglob("*.py")
    yield REPO / "app.py"


def test_import_rules():
    broken = []
    for path in _sources():
        if not path.exists():
            continue
        owner = _owner(path)
        ours = _imports(path) & set(PACKAGES)
        for pkg in ours - ALLOWED[owner] - {owner}:
            broken.append(f"{path.relative_to(REPO)} imports {pkg}")
        for mod in _imports(path) & FORBIDDEN_THIRD_PARTY.get(owner, set()):
            broken.append(f"{path.relative_to(REPO)} imports {mod} ({owner}/ must not)")
    assert not broken, "import rules of docs/ARCHITECTURE.md broken:\n" + "\n".join(broken)


def test_nothing_imports_pages_but_app():
    for path in _sources():
        if path.exists() and _owner(path) not in ("pages", "app"):
            assert "pages" not in _imports(path), f"{path} imports pages"
