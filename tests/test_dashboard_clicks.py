"""Every Approve click makes exactly one command or says on the card why not.

The live page reruns every few seconds, so a click can land on a button that the server's last
rerun drew differently: disabled (the verdict flipped to "not yet", a command opened) or not at
all. Streamlit then skips the button's callback (it reads the previous run's widget metadata), and
a card that relied on the callback alone dropped the click without a word (issue 23, item 1).
"""

from __future__ import annotations

import pytest

from rampwatch.dashboard import card
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed


@pytest.fixture
def live(db_path):
    run = seed.live_run(db_path)
    yield run
    run.close()


def _messages(at) -> list[str]:
    return [str(e.value) for kind in (at.error, at.info, at.success) for e in kind]


def _refusals(at) -> list[str]:
    return [m for m in _messages(at) if m.startswith("Not submitted")]


def test_a_click_on_hold_says_why(db_path, monkeypatch):
    """The verdict says "not yet" and the override is not ticked: Approve is on hold, yet drawn
    enabled (a disabled copy would swallow the click of a browser that still showed the
    enabled one), and a click gets the reason."""
    run = seed.live_run(db_path, ramp_due=False)
    try:
        at = seed.sign_in(seed.app(monkeypatch, db_path))
        at.run()
        assert "On hold: tick the override first" in seed.texts(at)
        at.button(key="approve").click().run()
        assert not at.exception
        assert commands.list_commands(db_path, run.run_id) == []
        [msg] = _refusals(at)
        assert "tick the override first" in msg, msg
    finally:
        run.close()


def test_a_double_click_makes_one_command_and_says_so(live, monkeypatch):
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()
    at.button(key="approve").click().run()
    [c] = commands.list_commands(live.db, live.run_id)
    at.button(key="approve").click().run()  # the second click of a double-click
    assert [x.command_id for x in commands.list_commands(live.db, live.run_id)] == [c.command_id]
    assert any(f"ramp #{c.command_id}" in m.lower() for m in _messages(at)), _messages(at)
    at.button(key="approve").click().run()  # a third, once the card knows of the command
    assert len(commands.list_commands(live.db, live.run_id)) == 1
    assert not _refusals(at)  # this session's own command is this approval, not a refusal
    said = _messages(at)
    assert any(f"Ramp #{c.command_id} is already submitted by you" in m for m in said), said


def test_a_click_interrupted_by_a_refresh_is_sent_by_the_next_rerun(live, monkeypatch):
    """The click's callback records the approval; the card sends it, showing "Sending…" until
    the store answers. A refresh that interrupts the rerun in between sends it instead, once."""
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()
    with monkeypatch.context() as m:  # the click's rerun is cut short before it sends
        m.setattr(card, "send_pending", lambda slot: None)
        at.button(key="approve").click().run()
    assert commands.list_commands(live.db, live.run_id) == []
    assert card.SENDING in at.session_state
    at.run()  # the next refresh
    [c] = commands.list_commands(live.db, live.run_id)
    assert card.SENDING not in at.session_state
    assert any(f"Ramp #{c.command_id}" in m for m in _messages(at))
    at.run()
    assert len(commands.list_commands(live.db, live.run_id)) == 1


def test_operator_and_token_are_kept_while_the_card_hides_them(live, monkeypatch):
    """After a ramp is applied the card hides its controls until the run's next step; the
    operator's name and token must still be there when they come back."""
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()
    at.button(key="approve").click().run()
    [c] = commands.list_commands(live.db, live.run_id)
    commands.claim(live.db, c.command_id, actor="trainer:test")
    commands.apply(live.db, c.command_id, step=399, actor="trainer:test")
    at.run()
    assert "approve" not in {b.key for b in at.button}  # until the run's next step
    live.writer.log(400, {M.PER_DEVICE_BATCH: 8, M.ACCUM: 4, M.BATCH_SEQS: 32})
    assert live.writer.flush()
    at.run()
    at.button(key="approve").click().run()
    assert not _refusals(at), _refusals(at)
    [_, second] = commands.list_commands(live.db, live.run_id)
    assert second.status == "pending" and second.actor == "alice (dashboard, token)"
