"""The constants the prose quotes are the code's: the schema version, the spool's record size and
file names, the run-id rule, the layout's modules. A docs sentence that drifts from the code
fails here, not in a reader's hands (issue 24: ARCHITECTURE once said version 4 and 32-byte records in metrics.bin)."""

from __future__ import annotations

import re

from rampwatch.store import naming, schema, spool, spool_format
from tests.procs import REPO

ARCHITECTURE = (REPO / "docs" / "ARCHITECTURE.md").read_text()
README = (REPO / "README.md").read_text()


def test_the_schema_version_quoted_is_the_code_s():
    quoted = re.findall(r"CURRENT_VERSION = (\d+)", ARCHITECTURE)
    assert quoted and {int(v) for v in quoted} == {schema.CURRENT_VERSION}, quoted


def test_the_spool_s_record_size_and_file_names_are_the_code_s():
    sizes = {
        int(n) for n in re.findall(r"(\d+)-byte (?:little-endian |checked )?records", ARCHITECTURE)
    }
    legacy = 32  # format 1, still read: the prose names it as such
    assert sizes - {legacy} == {spool_format.RECORD.itemsize}, sizes
    for name in (spool.BIN, spool.NAMES, spool.RECORDS):
        assert name in ARCHITECTURE, name
    for old in spool.LEGACY_FILES:  # format 1's names appear only where format 1 is meant
        for line in ARCHITECTURE.splitlines():
            if old in line:
                assert "format 1" in line or "Format 1" in line, line


def test_the_run_id_rule_quoted_is_the_code_s():
    pattern = naming.RUN_ID_RULE.pattern
    assert pattern in ARCHITECTURE
    assert "1–64 letters, digits" in README and naming.RUN_ID_RULE.fullmatch("a" * 64)
    assert not naming.RUN_ID_RULE.fullmatch("a" * 65)


def _layout_block() -> str:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layout and import rules", 1)[1]
    return section.split("```", 2)[1]  # the tree drawn in the section's first code block


def test_the_layout_lists_every_module_of_the_package_and_no_other():
    """docs/ARCHITECTURE.md's tree names each module of rampwatch/ under its package (a module
    may be named in passing, "(also outbox.py, …)"), and no module that does not exist."""
    listed, package = set(), ""
    for line in _layout_block().strip().splitlines()[1:]:  # [0]: "rampwatch/"
        if re.match(r"^\S", line):
            break  # the checkout's entry points, benches, tests: outside the package
        m = re.match(r"^  (\w+)/", line)
        if m:
            package = m.group(1) + "/"
        elif re.match(r"^  \S", line):  # a top-level module, drawn before the packages
            package = ""
        sub = "views/" if line.lstrip().startswith("views/") else ""
        for name in re.findall(r"(?<![\w/])([\w/]*\w\.py)\b", line):
            listed.add(name if "/" in name else package + sub + name)  # "monitor/memplan.py"
    pkg = REPO / "rampwatch"
    actual = {str(p.relative_to(pkg)) for p in pkg.rglob("*.py")}
    inits = {p for p in actual if p.endswith("__init__.py") and p != "__init__.py"}
    assert sorted(actual - inits - listed) == [], "modules missing from the layout"
    assert sorted(listed - actual) == [], "modules in the layout that do not exist"


def test_the_trial_copies_rule_quoted_is_the_code_s():
    from rampwatch.monitor.trial_snapshot import COPIES, HOST_SHARE

    words, prose = {3: "three", 4: "four", 5: "five"}, " ".join(README.split())
    assert f"A trial holds up to {words[COPIES]} copies" in prose
    assert f"while {words[COPIES]} take at most half of what the kernel" in prose
    assert HOST_SHARE == 0.5  # "half"
