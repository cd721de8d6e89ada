"""Run names that deceive or stall, on every page (AppTest on seeded databases, issue 23 item 6).

Older versions stored any name, so the pages must show what is there safely: a right-to-left
override (U+202E) that would make one run's name read as another run's id is shown as the
visible text `\\u202e`, and a 1 MB name is cut to a bounded label, in the sidebar's run picker,
the live page's title, the Runs table and export picker, and Compare's picker, legend and
tables.
"""

from __future__ import annotations

import unicodedata

import pytest

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store.naming import markdown_literal
from tests import seed

BOUND = 500  # a label holds a name and an id (each at most 200 characters) and a status


def _hidden(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]


def _safe(text) -> bool:
    return len(str(text)) <= BOUND and not _hidden(str(text))


@pytest.fixture
def deceiving(db_path):
    """Three finished runs: `liar`, named so that it reads as `victim`'s id, `huge` with a 1 MB
    name, and `victim`, named as the trainer names it."""
    victim = seed.finished_run(db_path, 64)
    liar = seed.finished_run(db_path, 16)
    huge = seed.finished_run(db_path, 32)
    _stored_by_an_older_version(db_path, liar, "\u202e" + victim[::-1])
    _stored_by_an_older_version(db_path, huge, "N" * 1_000_000)
    return db_path, liar, huge, victim


def _stored_by_an_older_version(db, run_id: str, name: str) -> None:
    with store.write_connection(db) as con:
        con.execute("UPDATE runs SET name = ? WHERE run_id = ?", [name, run_id])


def _labels(widget) -> list[str]:
    return [str(o) for o in widget.options]


def _check_liar_and_huge(labels: list[str], liar: str | None) -> None:
    """liar: the id the label must show beside the escaped name (None: a label without ids)."""
    assert all(_safe(x) for x in labels), [x[:80] for x in labels]
    assert any(x.startswith("\\u202e") and (liar or "") in x for x in labels), labels
    assert any("N" * 100 in x and "…" in x for x in labels), [x[:80] for x in labels]


def test_sidebar_picker_and_live_title(deceiving, monkeypatch):
    db, liar, huge, _ = deceiving
    at = seed.app(monkeypatch, db)
    assert not at.exception, [e.message for e in at.exception]
    _check_liar_and_huge(_labels(at.sidebar.selectbox(key="run_picker")), liar)
    at.sidebar.selectbox(key="run_picker").set_value(liar).run()
    assert [t.value for t in at.title] == [markdown_literal("\\u202e" + deceiving[3][::-1])]
    at.sidebar.selectbox(key="run_picker").set_value(huge).run()
    assert not at.exception
    assert all(_safe(t.value) for t in at.title) and "N" * 100 in at.title[0].value
    assert all(_safe(x) for x in seed.texts(at).splitlines())


def test_runs_table_and_export_picker(deceiving, monkeypatch):
    db, liar, huge, _ = deceiving
    at = seed.app(monkeypatch, db, page="views/runs.py")
    assert not at.exception, [e.message for e in at.exception]
    table = next(d.value for d in at.dataframe if "status" in d.value.columns)
    names = dict(zip(table["run id"], table["name"], strict=True))
    assert all(_safe(n) for n in names.values())
    assert names[liar].startswith("\\u202e") and names[huge].endswith("…")
    _check_liar_and_huge(_labels(at.selectbox(key="export_run")), liar)


def test_compare_picker_legend_and_tables(deceiving, monkeypatch):
    db = deceiving[0]
    at = seed.app(monkeypatch, db, page="views/compare.py")
    assert not at.exception, [e.message for e in at.exception]
    _check_liar_and_huge(_labels(at.multiselect(key="compare_runs")), None)
    legend = [n for n in seed.trace_names(seed.figures(at)["loss by step"])]
    assert len(legend) == 3 and all(_safe(n) for n in legend), [n[:80] for n in legend]
    assert any(n.startswith("\\u202e") for n in legend)
    for d in at.dataframe:  # the config diff names runs in its columns, the target table in rows
        cells = [*map(str, d.value.columns), *map(str, d.value.to_numpy().ravel())]
        assert all(_safe(c) for c in cells), [c[:80] for c in cells if not _safe(c)]
    assert all(_safe(x) for x in seed.texts(at).splitlines())


@pytest.mark.parametrize(
    "operator",
    ["\u202eecila", "al\nice", "al\x00ice", "a" * 65, "a" * 1_000_000],
    ids=lambda s: f"{ascii(s[:8])}-{len(s)}",
)
def test_a_hiding_or_long_operator_name_is_refused_on_the_server(db_path, monkeypatch, operator):
    """The Operator field's max_chars=64 is the browser's: a scripted client sends what it
    likes, so submit and cancel check the typed name again before anything is written."""
    from rampwatch.dashboard import store_access

    monkeypatch.setenv("RAMPWATCH_TOKEN", seed.TOKEN)
    live = seed.with_command(db_path, "pending")
    try:
        before = commands.list_commands(db_path, live.run_id)
        with pytest.raises(store_access.CommandError, match="operator name must be printable"):
            store_access.submit_ramp(
                db_path, live.run_id, seed.RAMP_PAYLOAD, operator=operator, token=seed.TOKEN
            )
        with pytest.raises(store_access.CommandError, match="operator name must be printable"):
            store_access.cancel_command(
                db_path, live.command_id, operator=operator, token=seed.TOKEN
            )
        assert commands.list_commands(db_path, live.run_id) == before  # still one, pending
        assert before[0].status == "pending"
    finally:
        live.close()


# Markdown a name could carry, and Streamlit's own directives (colour, emoji, math).
MARKDOWN_NAME = "**bold** _it_ [link](http://x.test) `code` # h <b>t</b> :red[r] :smile: $x^2$ ~s~"


def test_a_name_with_markdown_reads_as_typed_in_the_live_title(db_path, monkeypatch):
    """The title is Markdown: a name with emphasis, a link or a colour directive must render as
    the characters that were typed, not as formatting (rendered here by CommonMark, as
    Streamlit's react-markdown renders it, plus its ':' and '$' directives)."""
    from markdown_it import MarkdownIt

    run = seed.finished_run(db_path, 16)
    _stored_by_an_older_version(db_path, run, MARKDOWN_NAME)
    at = seed.app(monkeypatch, db_path)
    at.sidebar.selectbox(key="run_picker").set_value(run).run()
    assert not at.exception
    [title] = [t.value for t in at.title]
    html = MarkdownIt("commonmark").render(title)
    assert html.startswith("<p>") and "<strong>" not in html and "<a " not in html, html
    text = html.removeprefix("<p>").removesuffix("</p>\n")
    text = text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    assert text == MARKDOWN_NAME
    # Streamlit's directives start at an unescaped ':' or '$'
    assert all(title[i - 1] == "\\" for i, c in enumerate(title) if c in ":$")
