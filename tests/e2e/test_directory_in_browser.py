"""End to end, in a real browser: `rampwatch dashboard DIR` on a team's directory of three
files — a running run whose writer lives in a child process, a finished file that holds a run
of the same id, a file of garbage bytes. The Runs page names the damaged file; the address
`/?db=FILE&run=ID` (the live page) opens the live run of that file; Approve there reaches its writer.

Debian's chromium driven by Playwright (`executable_path`), through tests/e2e/browser.py.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from rampwatch.store import commands
from tests import seed
from tests.e2e.browser import (
    ARTIFACTS,
    TOKEN,
    chromium,
    needs_chromium,
    press_approve,
    sign_in,
    start_dashboard,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
LIVE_FILE, DONE_FILE, RUN = "node-a/runs.duckdb", "node-b/runs.duckdb", "live-a"


@needs_chromium
def test_approve_from_a_directory_of_databases(tmp_path, procs):
    from playwright.sync_api import expect

    root = tmp_path / "team"
    for node in ("node-a", "node-b"):
        (root / node).mkdir(parents=True)
    seed.finished_run(root / DONE_FILE, 16, name="twin", run_id=RUN, steps=50)
    (root / "broken.duckdb").write_bytes(b"\x00garbage" * 1000)
    writer = procs.spawn(
        ["tests/store_child.py", "seeded", str(root / LIVE_FILE), "--run-id", RUN],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == f"READY {RUN}"
    app, port = start_dashboard(procs, str(root))
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(f"http://127.0.0.1:{port}/runs", wait_until="domcontentloaded")
        expect(
            page.get_by_text(re.compile(r"^broken\.duckdb is not a DuckDB database"))
        ).to_be_visible(timeout=60_000)
        page.goto(
            f"http://127.0.0.1:{port}/?db={LIVE_FILE}&run={RUN}",
            wait_until="domcontentloaded",
        )
        expect(page.get_by_text("Ramp now.")).to_be_visible(timeout=60_000)
        expect(page.get_by_text(LIVE_FILE).first).to_be_visible(timeout=10_000)
        try:
            sign_in(page, "e2e-operator", TOKEN)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "e2e-directory-failed.png"), full_page=True)
            print(page.inner_text("body")[:3000])
            raise
        press_approve(page, "click")
        claimed = page.get_by_text(re.compile(r"Ramp #\d+ .*was claimed"))
        expect(claimed).to_be_visible(timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "e2e-directory-approved.png"), full_page=True)
    [cmd] = commands.list_commands(root / LIVE_FILE, RUN)
    assert cmd.status == "claimed" and cmd.actor == "e2e-operator (dashboard, token)"
    assert commands.list_commands(root / DONE_FILE, RUN) == []  # not the twin's file
    line = writer.stdout.readline()
    assert line.startswith(f"CLAIMED {cmd.command_id} "), line
    assert app.poll() is None, "the dashboard died"
