"""End to end, in a real browser: a training run and the dashboard as real processes; the
operator waits for the recommendation, clicks Approve, and sees the trainer apply the ramp.

Debian's chromium driven by Playwright (`executable_path`, no downloaded browser). The final
screenshot is kept in artifacts/ as the test's artifact.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from tests.e2e.browser import (
    ARTIFACTS,
    TOKEN,
    chromium,
    needs_chromium,
    press_approve,
    sign_in,
    start_dashboard,
    wait_http,
)
from tests.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _ramp_events(db: Path, run_id: str) -> list:
    return [e for e in reader.events(db, run_id) if e.kind == M.EVENT_RAMP]


@needs_chromium
def test_approve_ramp_in_browser(tmp_path, procs):
    from playwright.sync_api import expect

    db = tmp_path / "runs.duckdb"
    run_id = "e2e-run"
    # A tiny per-device batch: the noise scale crosses the batch within the first minute.
    trainer = procs.spawn(
        [
            "-m",
            "trainer",
            "train",
            "--db",
            str(db),
            "--preset",
            "test-tiny",
            "--run-id",
            run_id,
            "--per-device-batch",
            "2",
            "--accum",
            "2",
            "--steps",
            "100000",
            "--total-tokens",
            "1000000000",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "0",
            "--val-every",
            "0",
            "--hysteresis-steps",
            "10",
            "--min-estimates",
            "20",
            "--progress",
            "off",
        ]
    )
    app, port = start_dashboard(procs, "--db", str(db))
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
        approve = page.get_by_role("button", name=re.compile(r"^Approve"))
        try:
            # the advisor's verdict, not just an enabled button: the noise scale has crossed
            expect(page.get_by_text("Ramp now.")).to_be_visible(timeout=120_000)
            expect(approve).to_be_enabled(timeout=10_000)
        except AssertionError:
            print(page.inner_text("body")[:3000])
            page.screenshot(path=str(ARTIFACTS / "e2e-no-recommendation.png"), full_page=True)
            pytest.fail(
                "no approvable recommendation on the live page within 120 s "
                f"(trainer alive: {trainer.poll() is None}); screenshot in artifacts/"
            )
        # another client, without the token: refused on the server, nothing written
        intruder = browser.new_page(viewport={"width": 1400, "height": 1600})
        intruder.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
        sign_in(intruder, "mallory", "not-the-token")
        press_approve(intruder, "click")
        # the refusal arrives with the rerun that the click starts: under a loaded machine
        # (two test workers beside a trainer) that rerun can take longer than Playwright's 5 s;
        # the card keeps it for card.ERROR_SECONDS, through the page's refreshes
        expect(
            intruder.get_by_text(re.compile("Not submitted: the operator token is wrong"))
        ).to_be_visible(timeout=30_000)
        assert commands.list_commands(db, run_id) == []
        intruder.close()

        # a token left with Tab never reaches the server (Streamlit's password field sends it
        # on Enter, or when focus leaves the field: Tab lands on its show-password button);
        # the refusal says to press Enter, and nothing is written
        page.get_by_role("textbox", name="Operator", exact=True).fill("e2e-operator")
        page.get_by_role("textbox", name="Operator", exact=True).press("Enter")
        page.get_by_role("textbox", name="Operator token").fill(TOKEN)
        page.get_by_role("textbox", name="Operator token").press("Tab")
        press_approve(page, "click")
        expect(
            page.get_by_text(re.compile("Not submitted: no operator token reached the dashboard"))
        ).to_be_visible(timeout=30_000)
        assert "press Enter in its field" in page.inner_text("body")
        assert commands.list_commands(db, run_id) == []

        sign_in(page, "e2e-operator", TOKEN)
        press_approve(page, "dblclick")  # impatient: still one command (asserted below)
        applied = page.get_by_text(re.compile(r"applied at step \d+"))
        expect(applied).to_be_visible(timeout=90_000)
        page.screenshot(path=str(ARTIFACTS / "e2e-approved.png"), full_page=True)
        shown_step = int(re.search(r"applied at step (\d+)", applied.first.inner_text())[1])
    events = _ramp_events(db, run_id)
    assert events, "the page says applied but the database has no ramp event"
    [cmd] = commands.list_commands(db, run_id)
    assert cmd.actor == "e2e-operator (dashboard, token)"  # who approved, in the command log
    assert events[-1].step == shown_step
    assert trainer.poll() is None, "the trainer died"
    assert app.poll() is None, "the dashboard died"


@needs_chromium
def test_checkout_deep_link_runs_the_whole_app(tmp_path, procs):
    """`streamlit run app.py` from a checkout: on a fresh server whose first request is
    /compare, Streamlit runs pages/compare.py by itself; it must still show the app's sidebar
    and the Compare page, not a bare script."""
    from playwright.sync_api import expect

    from tests import seed

    db = tmp_path / "runs.duckdb"
    seed.finished_run(db, 16, name="deep-link-run")
    port = free_port()
    procs.spawn(
        [
            "-m",
            "streamlit",
            "run",
            "app.py",
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--",
            "--db",
            str(db),
        ]
    )
    wait_http(port, 60)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/compare", wait_until="domcontentloaded")
        expect(page.get_by_role("heading", name="Compare runs")).to_be_visible(timeout=60_000)
        sidebar = page.get_by_test_id("stSidebar")
        expect(sidebar.get_by_text(f"Database: {db}")).to_be_visible()
        expect(sidebar.get_by_role("link", name="Runs")).to_be_visible()
        expect(page.get_by_text("Page not found")).to_have_count(0)
