"""End to end, in a real browser: a training run and the dashboard as real processes; the
operator waits for the recommendation, clicks Approve, and sees the trainer apply the ramp.

Debian's chromium driven by Playwright (`executable_path`, no downloaded browser). The final
screenshot is kept in artifacts/ as the test's artifact.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from tests.procs import REPO, child_env, free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "artifacts"
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
TOKEN = "e2e-operator-token"
# what the card answers a click with: a refusal, the confirmation, or the command's own line
ANSWER = re.compile(r"^Not submitted|^Ramp #\d+ .*(submitted|is pending|was claimed|applied at)")


def _wait_http(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"the dashboard did not listen on port {port} within {timeout:.0f} s")


def _sign_in(page, operator: str, token: str) -> None:
    """Type the operator's name and token beside the card's buttons; each commits on Enter."""
    from playwright.sync_api import expect

    # a page that just loaded reruns its script once more while it connects: wait it out
    expect(page.get_by_role("button", name=re.compile(r"^Approve"))).to_be_visible(timeout=60_000)
    for label, value in (("Operator", operator), ("Operator token", token)):
        box = page.get_by_label(label, exact=True)
        box.fill(value, timeout=60_000)
        box.press("Enter")
    page.wait_for_timeout(1500)  # the rerun that stores them


def _press_approve(page, how: str, within_s: float = 120) -> str:
    """Press Approve as an operator would, until the card answers with a command or a reason
    other than the override's; returns that answer. The advisor's verdict can flip back to "not
    yet" between two refreshes of a noisy tiny run, and then Approve is on hold behind the
    override. The card reruns every 5 s (the page's default refresh), so an element can move or
    be replaced under the pointer: each try is short, and the page is looked at again after it,
    for `within_s` (a loaded machine's reruns take seconds each). Every click must be answered
    (issue 23): a click without an answer fails here. On failure: what each try met, the page's
    text, and a screenshot in artifacts/."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect

    override = page.get_by_role("checkbox", name=re.compile("^Ramp before the advisor is ready"))
    approve = page.get_by_role("button", name=re.compile(r"^Approve"))
    answer = page.get_by_text(ANSWER)
    tries: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if override.count() and not override.first.is_checked():
                tries.append("ticked the override")
                page.get_by_text("Ramp before the advisor is ready").first.click(timeout=5_000)
                page.wait_for_timeout(1500)  # the rerun that stores it
                continue  # look again: that rerun may have changed the verdict
            getattr(approve, how)(timeout=5_000)
        except PlaywrightTimeout as e:
            tries.append(f"timeout: {str(e).splitlines()[0][:120]}")
            page.wait_for_timeout(1000)
            continue
        expect(answer.first).to_be_visible(timeout=30_000)  # no silent drop
        text = answer.first.inner_text()
        if "tick the override first" not in text:
            return text
        tries.append("answered: tick the override first")
        page.wait_for_timeout(1000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "e2e-approve-not-pressed.png"), full_page=True)
    raise AssertionError(
        f"Approve could not be pressed within {within_s:.0f} s; tries: {tries}; "
        f"page: {page.inner_text('body')[:2000]}"
    )


def _ramp_events(db: Path, run_id: str) -> list:
    return [e for e in reader.events(db, run_id) if e.kind == M.EVENT_RAMP]


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Debian chromium not installed (scripts/setup.sh installs it)",
)
def test_approve_ramp_in_browser(tmp_path, procs):
    from playwright.sync_api import expect, sync_playwright

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
    port = free_port()
    app = procs.spawn(
        ["-m", "rampwatch", "dashboard", "--db", str(db), "--port", str(port)],
        env=child_env(RAMPWATCH_TOKEN=TOKEN),
    )
    _wait_http(port, 60)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        try:
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
            _sign_in(intruder, "mallory", "not-the-token")
            _press_approve(intruder, "click")
            # the refusal arrives with the rerun that the click starts: under a loaded machine
            # (two test workers beside a trainer) that rerun can take longer than Playwright's 5 s;
            # the card keeps it for card.ERROR_SECONDS, through the page's refreshes
            expect(
                intruder.get_by_text(
                    re.compile("Not submitted: the operator token is missing or wrong")
                )
            ).to_be_visible(timeout=30_000)
            assert commands.list_commands(db, run_id) == []
            intruder.close()

            _sign_in(page, "e2e-operator", TOKEN)
            _press_approve(page, "dblclick")  # impatient: still one command (asserted below)
            applied = page.get_by_text(re.compile(r"applied at step \d+"))
            expect(applied).to_be_visible(timeout=90_000)
            page.screenshot(path=str(ARTIFACTS / "e2e-approved.png"), full_page=True)
            shown_step = int(re.search(r"applied at step (\d+)", applied.first.inner_text())[1])
        finally:
            browser.close()
    events = _ramp_events(db, run_id)
    assert events, "the page says applied but the database has no ramp event"
    [cmd] = commands.list_commands(db, run_id)
    assert cmd.actor == "e2e-operator (dashboard, token)"  # who approved, in the command log
    assert events[-1].step == shown_step
    assert trainer.poll() is None, "the trainer died"
    assert app.poll() is None, "the dashboard died"


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Debian chromium not installed (scripts/setup.sh installs it)",
)
def test_checkout_deep_link_runs_the_whole_app(tmp_path, procs):
    """`streamlit run app.py` from a checkout: on a fresh server whose first request is
    /compare, Streamlit runs pages/compare.py by itself; it must still show the app's sidebar
    and the Compare page, not a bare script."""
    from playwright.sync_api import expect, sync_playwright

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
    _wait_http(port, 60)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/compare", wait_until="domcontentloaded")
            expect(page.get_by_role("heading", name="Compare runs")).to_be_visible(timeout=60_000)
            sidebar = page.get_by_test_id("stSidebar")
            expect(sidebar.get_by_text(f"Database: {db}")).to_be_visible()
            expect(sidebar.get_by_role("link", name="Runs")).to_be_visible()
            expect(page.get_by_text("Page not found")).to_have_count(0)
        finally:
            browser.close()
