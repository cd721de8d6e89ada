"""End to end, in a real browser: the reference trainer and the dashboard as real processes; the
operator presses "Test ×2 … first" on the live card, the trainer runs the trial from a snapshot,
and the card shows its result (the verdict and the per-branch table).

A short Δ (--trial-delta-tokens: 4 control steps of test-tiny's 4 × 2 per device) keeps the
whole trial to seconds. The final screenshot is out/trial_card.png.
"""

from __future__ import annotations

import re

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from tests.e2e.browser import TOKEN, chromium, needs_chromium, sign_in, start_dashboard
from tests.procs import REPO
from tests.trainer_runs import trainer_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SHOT = REPO / "out" / "trial_card.png"
DELTA = 4 * 8 * 128  # tokens per arm: 4 steps of the control (4 × 2 sequences of 128 tokens)


def _press(page, button, answer, attempts: int = 8) -> str:
    """Click as an operator would until the card answers; the card reruns every 5 s, so an
    element can be replaced under the pointer: each try is short, then the page is looked at
    again. Returns the answer's text (a click without one fails here)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect

    for _ in range(attempts):
        try:
            button.click(timeout=5_000)
        except PlaywrightTimeout:
            page.wait_for_timeout(1000)
            continue
        expect(answer.first).to_be_visible(timeout=30_000)
        return answer.first.inner_text()
    raise AssertionError(f"the button could not be pressed in {attempts} tries")


@needs_chromium
def test_test_first_runs_a_trial_and_the_card_shows_its_result(tmp_path, procs):
    from playwright.sync_api import expect

    db, run_id = tmp_path / "runs.duckdb", "e2e-trial"
    trainer = procs.spawn(
        trainer_args(
            db,
            tmp_path / "ckpt",
            "--run-id",
            run_id,
            "--per-device-batch",
            "4",
            "--accum",
            "2",
            "--no-plan",
            "--steps",
            "100000",
            "--total-tokens",
            "1000000000",
            "--checkpoint-every",
            "0",
            "--trial-delta-tokens",
            str(DELTA),
            "--trial-eval-batch",
            "64",
        )
    )
    app, port = start_dashboard(procs, "--db", str(db))
    SHOT.parent.mkdir(exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 2200})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
        sign_in(page, "e2e-operator", TOKEN)
        test_first = page.get_by_role("button", name=re.compile(r"^Test ×2\b.* first$"))
        expect(test_first).to_be_visible(timeout=60_000)
        answer = page.get_by_text(re.compile(r"^Not submitted|^Trial #\d+ "))
        said = _press(page, test_first, answer)
        assert not said.startswith("Not submitted"), said
        # the result on the card: the verdict, the per-branch table, what was kept
        kept = page.get_by_text(
            re.compile(r"^Kept (the control \(×1\)|branch ×\d+): the run continued")
        )
        try:
            expect(kept).to_be_visible(timeout=120_000)
        except AssertionError:
            page.screenshot(path=str(SHOT), full_page=True)
            pytest.fail(
                f"no trial result on the card within 120 s (screenshot: {SHOT}):\n"
                + page.inner_text("body")[-3000:]
            )
        expect(page.locator("[data-testid=stDataFrame]:visible").first).to_be_visible(
            timeout=10_000
        )
        page.get_by_role("heading", name="Ramp trials").scroll_into_view_if_needed()
        page.mouse.move(0, 0)  # no tooltip over the card
        page.wait_for_timeout(1500)  # the chart's first paint
        page.screenshot(path=str(SHOT), full_page=True)
        card_text = page.inner_text("body")
    [cmd] = commands.list_commands(db, run_id)
    assert (cmd.kind, cmd.status) == ("trial", "applied")
    assert cmd.actor == "e2e-operator (dashboard, token)"
    [end] = [e for e in reader.events(db, run_id) if e.kind == M.EVENT_TRIAL_END]
    assert end.step == cmd.applied_step
    assert f"from step {end.data['continue_step']:,}" in card_text
    assert end.message.split(".")[0] in card_text  # the verdict's summary, as the loop wrote it
    assert trainer.poll() is None, "the trainer died"
    assert app.poll() is None, "the dashboard died"
