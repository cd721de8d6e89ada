"""The e2e tests' browser and dashboard: Debian chromium through Playwright, the dashboard as a
real process, and the operator's clicks.

Debian's chromium is driven through `executable_path` (no downloaded browser); tests without it
are skipped (`needs_chromium`). Playwright is imported inside the functions, as the tests do, so
that collecting the tests needs no Playwright.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
TOKEN = "e2e-operator-token"
# what the card answers a click with: a refusal, the confirmation, or the command's own line
ANSWER = re.compile(r"^Not submitted|^Ramp #\d+ .*(submitted|is pending|was claimed|applied at)")

needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Debian chromium not installed (scripts/setup.sh installs it)",
)


def wait_http(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"the dashboard did not listen on port {port} within {timeout:.0f} s")


def start_dashboard(procs, *where: str, token: str = TOKEN) -> tuple[subprocess.Popen, int]:
    """`rampwatch dashboard WHERE… --port PORT` (WHERE: `--db FILE` or a directory) as a child of
    the `procs` fixture, with `token` as its operator token; returns the process and its port
    once it listens (60 s at most)."""
    port = free_port()
    app = procs.spawn(
        ["-m", "rampwatch", "dashboard", *where, "--port", str(port)],
        env=child_env(RAMPWATCH_TOKEN=token),
    )
    wait_http(port, 60)
    return app, port


@contextlib.contextmanager
def chromium() -> Iterator:
    """Debian's chromium launched through Playwright; the browser and Playwright are closed on
    the way out, whatever the test did."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def sign_in(page, operator: str, token: str) -> None:
    """Type the operator's name and token beside the card's buttons; each commits on Enter."""
    from playwright.sync_api import expect

    # a page that just loaded reruns its script once more while it connects: wait it out
    expect(page.get_by_role("button", name=re.compile(r"^Approve"))).to_be_visible(timeout=60_000)
    for label, value in (("Operator", operator), ("Operator token", token)):
        box = page.get_by_label(label, exact=True)
        box.fill(value, timeout=60_000)
        box.press("Enter")
    page.wait_for_timeout(1500)  # the rerun that stores them


def press_approve(page, how: str, within_s: float = 120) -> str:
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
