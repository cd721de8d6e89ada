"""Twenty Approve clicks at random moments of the page's refresh, with the cores busy: each makes
exactly one command or shows its reason on the card; none vanishes (issue 23, item 1).

A seeded running run whose writer stays alive in a child process (the card says "Ramp now" and
nothing claims the commands), the real dashboard, Debian's chromium. After each command the test
cancels it through the store, as a trainer's refusal would end it, and waits for the card to say
so before the next click.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from rampwatch.store import commands
from tests.e2e.browser import TOKEN, chromium, needs_chromium, sign_in, start_dashboard
from tests.procs import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
CLICKS = 20
REFRESH_S = 2  # the page's fastest refresh: the most reruns for a click to land in

# the seeded run, kept alive: a heartbeat every second until the test kills it
LIVE_RUN = """
import sys, time
from tests import seed
run = seed.live_run(sys.argv[1], name="click-run")
print(run.run_id, flush=True)
while True:
    time.sleep(1)
    run.writer.flush()
"""
BUSY = "import time\nend = time.monotonic() + 540\nwhile time.monotonic() < end: pass\n"


@needs_chromium
def test_every_click_makes_a_command_or_says_why(tmp_path, procs):
    import subprocess

    from playwright.sync_api import expect

    db = tmp_path / "runs.duckdb"
    writer = procs.spawn(["-c", LIVE_RUN, str(db)], stdout=subprocess.PIPE, text=True)
    run_id = writer.stdout.readline().strip()
    assert run_id, "the seeded run did not start"
    for _ in range(2):  # two busy loops, bounded in time, beside the dashboard and the browser
        procs.spawn(["-c", BUSY])
    _, port = start_dashboard(procs, "--db", str(db))
    rng = random.Random(23)
    outcomes: list[str] = []
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
        expect(page.get_by_text("Ramp now.")).to_be_visible(timeout=120_000)
        page.get_by_label("Refresh").click()
        page.get_by_role("option", name=f"{REFRESH_S} s").click()
        sign_in(page, "clicker", TOKEN)
        approve = page.get_by_role("button", name=re.compile(r"^Approve"))
        refusal = page.get_by_text(re.compile(r"^Not submitted"))
        for i in range(CLICKS):
            before = len(commands.list_commands(db, run_id))
            page.wait_for_timeout(rng.uniform(0, REFRESH_S * 1000))
            approve.click(timeout=30_000)
            deadline = time.monotonic() + 30
            outcome = None
            while outcome is None and time.monotonic() < deadline:
                cmds = commands.list_commands(db, run_id)
                if len(cmds) > before:
                    outcome = f"command {cmds[-1].command_id}"
                elif refusal.count():
                    outcome = "reason: " + refusal.first.inner_text()
                else:
                    page.wait_for_timeout(100)
            if outcome is None:
                page.screenshot(path=str(tmp_path / "vanished.png"), full_page=True)
                pytest.fail(f"click {i + 1} of {CLICKS} made no command and no reason")
            outcomes.append(outcome)
            cmds = commands.list_commands(db, run_id)
            assert len(cmds) <= before + 1, f"click {i + 1} made {len(cmds) - before} commands"
            if outcome.startswith("command"):
                cid = cmds[-1].command_id
                expect(page.get_by_text(f"Ramp #{cid}").first).to_be_visible(timeout=30_000)
                commands.cancel(db, cid, actor="test:e2e")
                expect(page.get_by_text(re.compile(rf"Ramp #{cid} .*was cancelled"))).to_be_visible(
                    timeout=30_000
                )
            else:  # editing the token clears the refusal, so the next one is seen anew
                box = page.get_by_label("Operator token", exact=True)
                # a value unlike the box's, whatever it holds: retyping the same token is no
                # edit (no on_change), and the refusal would stay its 30 s
                box.fill("-")
                box.press("Enter")
                expect(refusal).to_have_count(0, timeout=30_000)
                box.fill(TOKEN)
                box.press("Enter")
    made = [o for o in outcomes if o.startswith("command")]
    every = commands.list_commands(db, run_id)
    # on a failure: what each click said, and each command's state and times
    assert len(every) == len(made), (
        outcomes,
        [(c.command_id, c.status, c.actor, c.created_at, c.updated_at) for c in every],
    )
    assert len(made) >= CLICKS // 2, outcomes  # the card says "Ramp now": most clicks send
    wait_until(lambda: writer.poll() is None, timeout=1)
