"""Run ids and run names: what the store accepts, and how any name a person reads is shown.

A run id becomes a file name (the trainer's `<checkpoint dir>/<run id>.pt`), so it is a name,
never a path: RUN_ID_RULE, checked where a run starts or resumes (RunWriter.start) and before
any path is built from an id (`check_run_id`). A run name is what the operator who approves a
ramp reads: at most MAX_NAME_CHARS and free of characters that cannot be seen (control and
format characters: bidirectional overrides such as U+202E can make one run read as another).
Names stored by older versions may be anything, so every place that shows a name or an id
shows `display_name(...)`: hidden characters as visible `\\u202e` text, the length bounded;
where the text is Markdown (a page title), `markdown_literal(...)` of it, so `**x**` reads as typed.
"""

from __future__ import annotations

import re
import unicodedata

from rampwatch.store.errors import InvalidNameError

RUN_ID_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a leading dot or '..' cannot pass
RUN_ID_RULE_TEXT = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
MAX_NAME_CHARS = 200
# Unicode categories a reader cannot see: control (Cc: NUL, ESC, newline), format (Cf: the
# bidirectional marks, embeddings, overrides and isolates, zero-width characters, BOM), line and
# paragraph separators (Zl, Zp).
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def check_run_id(run_id) -> str:
    """run_id itself if it is a name by RUN_ID_RULE; else InvalidNameError (a ValueError)."""
    if isinstance(run_id, str) and RUN_ID_RULE.fullmatch(run_id):
        return run_id
    raise InvalidNameError(
        f"run id {_quoted(run_id)} is not a name: use {RUN_ID_RULE_TEXT} (it names files, "
        "so it cannot be a path)"
    )


def check_run_name(name) -> str | None:
    """name itself (None: the dashboard shows the run id) if a person can read all of it."""
    if name is None:
        return None
    problem = name_problem(name, MAX_NAME_CHARS)
    if problem is not None:
        raise InvalidNameError(f"run name {_quoted(name)} {problem}: choose another name")
    return name


def name_problem(name, limit: int) -> str | None:
    """Why `name` cannot be shown as it is (too long, a hidden character), or None."""
    if not isinstance(name, str):
        return f"must be a string, not {type(name).__name__}"
    if len(name) > limit:
        return f"is {len(name):,} characters long, more than {limit}"
    hidden = next((c for c in name if _hidden(c)), None)
    if hidden is not None:
        return f"holds the invisible character U+{ord(hidden):04X}"
    return None


def display_name(name, limit: int = MAX_NAME_CHARS) -> str:
    """name as it may be shown: hidden characters as `\\u202e`, at most `limit` characters (cut
    with '…'). Reads only the first `limit` characters, so a 1 MB name costs nothing."""
    text = "" if name is None else str(name)
    head = text[: limit + 1]
    shown = "".join(_escape(c) if _hidden(c) else c for c in head)
    if len(shown) <= limit and len(head) == len(text):
        return shown
    return shown[: limit - 1] + "…"


# CommonMark lets a backslash escape any ASCII punctuation; Streamlit's directives (:red[..],
# :emoji:, $math$) start at punctuation too, so escaping all of it leaves only the typed text.
_MARKDOWN_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def markdown_literal(text: str) -> str:
    """text as Markdown that renders as exactly these characters (no emphasis, link, HTML)."""
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", text)


def _hidden(c: str) -> bool:
    return unicodedata.category(c) in HIDDEN_CATEGORIES


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\u{n:04x}" if n <= 0xFFFF else f"\\U{n:08x}"


def _quoted(value) -> str:
    """A refused id or name in a one-line message: escaped and short."""
    return f"'{display_name(value, 60)}'" if isinstance(value, str) else repr(value)[:60]
