"""Approve is guarded on the server: the operator token and a typed name for every write, a
click on a held button refused, no writes with Streamlit's agent API on, and `rampwatch
dashboard` refusing to serve writes off loopback without a token (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rampwatch.dashboard import guard
from rampwatch.store import commands
from tests import seed
from tests.procs import child_env, free_port, kill_group


@pytest.fixture
def live(db_path):
    run = seed.live_run(db_path)
    yield run
    run.close()


def _flash_errors(at) -> list[str]:
    return [str(e.value) for e in at.error if str(e.value).startswith("Not submitted")]


@pytest.mark.parametrize(
    "operator,token,why",
    [
        (None, None, "operator"),  # nothing typed
        ("alice", None, "no operator token reached the dashboard"),
        ("alice", "guessed", "token is wrong"),
        ("", seed.TOKEN, "type your name"),
    ],
)
def test_approve_without_the_right_token_and_name_writes_nothing(
    live, monkeypatch, operator, token, why
):
    at = seed.sign_in(seed.app(monkeypatch, live.db), operator, token)
    at.run()
    at.button(key="approve").click().run()
    assert not at.exception
    assert commands.list_commands(live.db, live.run_id) == []
    [msg] = _flash_errors(at)
    assert why in msg, msg


def test_a_refusal_stays_on_the_card_through_refreshes(live, monkeypatch):
    """The live page refreshes every few seconds, and a refresh can interrupt the rerun that a
    click started: a refusal shown for one rerun only can vanish before the operator reads it.
    It stays for card.ERROR_SECONDS, then goes."""
    from rampwatch.dashboard import card

    at = seed.sign_in(seed.app(monkeypatch, live.db), "alice", "guessed")
    at.run()
    at.button(key="approve").click().run()
    at.run()  # the next refresh
    at.run()
    [msg] = _flash_errors(at)
    assert "token is wrong" in msg
    monkeypatch.setattr(card, "ERROR_SECONDS", 0.0)
    at.run()
    assert _flash_errors(at) == []


def test_editing_the_token_clears_the_refusal(live, monkeypatch):
    """The refusal was about the token typed before: a corrected one is not shown as wrong."""
    at = seed.sign_in(seed.app(monkeypatch, live.db), "alice", "guessed")
    at.run()
    at.button(key="approve").click().run()
    assert _flash_errors(at)
    at.text_input(key="rw_token").input(seed.TOKEN).run()
    assert _flash_errors(at) == []
    assert commands.list_commands(live.db, live.run_id) == []  # typing sends nothing


def test_a_server_without_a_token_cannot_write(live, monkeypatch):
    """`streamlit run app.py` with no RAMPWATCH_TOKEN: Approve says how to get one."""
    at = seed.sign_in(seed.app(monkeypatch, live.db, token=None), token="anything")
    at.run()
    at.button(key="approve").click().run()
    assert commands.list_commands(live.db, live.run_id) == []
    [msg] = _flash_errors(at)
    assert "has no operator token" in msg and "rampwatch dashboard" in msg


def test_click_on_an_approve_on_hold_is_refused(live, monkeypatch):
    """A click on Approve while another operator's ramp is open (on hold, a second ramp waits
    for the first): no second command, and the reason on the card."""
    other = seed.sign_in(seed.app(monkeypatch, live.db))
    other.run()
    other.button(key="approve").click().run()
    [first] = commands.list_commands(live.db, live.run_id)
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()  # the card reads the command
    at.button(key="approve").click().run()
    assert [c.command_id for c in commands.list_commands(live.db, live.run_id)] == [
        first.command_id
    ]
    [msg] = _flash_errors(at)
    assert f"already waiting on ramp #{first.command_id}" in msg
    assert not at.exception


def test_cancel_needs_the_token_too(live, monkeypatch):
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()
    at.button(key="approve").click().run()
    [c] = commands.list_commands(live.db, live.run_id)
    at.text_input(key="rw_token").input("wrong").run()
    at.button(key="cancel_command").click().run()
    assert commands.get(live.db, c.command_id).status == "pending"
    assert any("token is wrong" in str(e.value) for e in at.error)


@pytest.fixture
def agent_api_on():
    from streamlit import config

    config.set_option("server.enableAgentApi", True)
    yield
    config.set_option("server.enableAgentApi", False)


def test_agent_api_on_means_no_writes(live, monkeypatch, agent_api_on):
    from rampwatch.dashboard import store_access

    at = seed.app(monkeypatch, live.db)
    assert "approve" not in {b.key for b in at.button}
    assert any("agent API is on" in str(w.value) for w in at.warning)
    with pytest.raises(store_access.CommandError, match="agent API"):
        store_access.submit_ramp(
            live.db, live.run_id, seed.RAMP_PAYLOAD, operator="alice", token=seed.TOKEN
        )


def _dashboard(*args: str, env=None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rampwatch", "dashboard", *args],
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_off_loopback_without_a_token_refuses_to_start(db_path):
    env = child_env()
    env.pop(guard.TOKEN_ENV, None)
    r = _dashboard("--db", str(db_path), "--host", "0.0.0.0", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "refusing to serve Approve on 0.0.0.0 without an operator token" in r.stderr
    r = _dashboard(
        "--db",
        str(db_path),
        "--host",
        "127.0.0.1",
        "--",
        "--server.enableAgentApi",
        "true",
        env=env,
    )
    assert r.returncode == 2 and "agent API" in r.stderr


def test_loopback_prints_a_fresh_token_and_off_loopback_takes_yours(db_path, tmp_path):
    """Started for real: the printed token is the one the server holds (its environment)."""
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    for args, expect_printed in (
        (["--host", "127.0.0.1"], True),
        (["--host", "0.0.0.0", "--token-file", str(token_file)], False),
    ):
        env = child_env()
        env.pop(guard.TOKEN_ENV, None)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rampwatch",
                "dashboard",
                "--db",
                str(db_path),
                "--port",
                str(free_port()),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            first = proc.stdout.readline()
            if expect_printed:
                assert first.startswith("Operator token"), first
                printed = first.rsplit(" ", 1)[1].strip()
                assert len(printed) >= 20
            deadline = time.monotonic() + 30  # until the CLI has exec'd Streamlit
            while b"streamlit" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            held = [
                e.split(b"=", 1)[1].decode()
                for e in environ
                if e.startswith(guard.TOKEN_ENV.encode() + b"=")
            ]
            assert held == [printed if expect_printed else "from-a-file"]
        finally:
            kill_group(proc)


# ---------------------------------------------------------------- refused writes leave a trace

WRONG = "guessed-wrong-token-0123456789"  # what a guesser typed: never written anywhere


def _every_byte_beside(db) -> bytes:
    """The database, its WAL, the lock file and every spool file: all that the store wrote."""
    out = b""
    for p in sorted(db.parent.rglob("*")):
        if p.is_file():
            out += p.read_bytes()
    return out


def _token_pieces(token: str, size: int = 6) -> set[bytes]:
    return {token[i : i + size].encode() for i in range(len(token) - size + 1)}


def test_a_refused_approve_is_recorded_with_the_name_and_never_the_token(live, monkeypatch):
    """Random tokens, so that no 6-character piece of them is in the file by chance."""
    from rampwatch import store

    server, wrong = guard.new_token(), guard.new_token()
    at = seed.sign_in(seed.app(monkeypatch, live.db, token=server), "alice", wrong)
    at.run()
    at.button(key="approve").click().run()
    assert commands.list_commands(live.db, live.run_id) == []
    [r] = store.list_refusals(live.db, live.run_id)
    assert (r.run_id, r.action, r.operator, r.client) == (live.run_id, "approve", "alice", None)
    assert "token is wrong" in r.reason and "ramp to" in r.detail
    # a token pasted into the name field is not recorded either, nor a piece of one
    for name in (server, f"bob {wrong[:8]}"):
        at.text_input(key="rw_operator").input(name).run()
        at.button(key="approve").click().run()
        assert store.list_refusals(live.db, live.run_id)[0].operator == guard.WITHHELD
    live.close()  # the spool's last records reach the file, and the file is checkpointed
    everything = _every_byte_beside(live.db)
    for token in (wrong, server):
        leaked = [p for p in _token_pieces(token) if p in everything]
        assert leaked == [], (token, leaked)


def test_the_refusal_is_shown_on_the_live_page(live, monkeypatch):
    at = seed.sign_in(seed.app(monkeypatch, live.db), "mallory", WRONG)
    at.run()
    at.button(key="approve").click().run()
    at.run()
    [box] = [e for e in at.expander if str(e.label).startswith("Refused writes")]
    assert box.label == "Refused writes (1)"
    [table] = [d.value for d in box.dataframe]
    assert table["operator"].tolist() == ["mallory"]
    assert "token is wrong" in table["reason"].iloc[0]
    assert WRONG not in seed.texts(at)


def test_repeated_refusals_cool_down_then_the_right_token_works(live, monkeypatch):
    from rampwatch import store

    now = [1000.0]
    monkeypatch.setattr(guard.THROTTLE, "clock", lambda: now[0])
    at = seed.sign_in(seed.app(monkeypatch, live.db), "alice", WRONG)
    at.run()
    for _ in range(guard.MAX_REFUSALS):
        at.button(key="approve").click().run()
        now[0] += 1.0
    assert len(store.list_refusals(live.db, live.run_id)) == guard.MAX_REFUSALS
    # the next attempt, even with the right token, is refused without being checked
    at.text_input(key="rw_token").input(seed.TOKEN).run()
    at.button(key="approve").click().run()
    [msg] = _flash_errors(at)
    wait = int(guard.COOLDOWN_S) - 1  # the last refusal was a second ago
    assert f"too many refused attempts: wait {wait} s" in msg, msg
    assert commands.list_commands(live.db, live.run_id) == []
    assert len(store.list_refusals(live.db, live.run_id)) == guard.MAX_REFUSALS  # not one per try
    now[0] += guard.COOLDOWN_S
    at.button(key="approve").click().run()
    [c] = commands.list_commands(live.db, live.run_id)
    assert c.actor == guard.actor("alice")


def test_a_refused_cancel_is_recorded(live, monkeypatch):
    """A Cancel with a wrong token is recorded like a refused Approve, naming the command. (A
    click on Approve on hold is the card's to answer, not the guard's: the operator was let in.)"""
    from rampwatch import store

    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()
    at.button(key="approve").click().run()
    [c] = commands.list_commands(live.db, live.run_id)
    at.text_input(key="rw_token").input(WRONG).run()
    at.button(key="cancel_command").click().run()
    [cancel] = store.list_refusals(live.db, live.run_id)
    assert cancel.action == "cancel" and cancel.detail == f"cancel ramp #{c.command_id}"
    assert "token is wrong" in cancel.reason
    assert commands.get(live.db, c.command_id).status == "pending"


def test_the_throttle_counts_within_its_window_per_client():
    """Refusals spread wider than WINDOW_S never start a cooldown; one client's cooldown is
    not another's; a write that passes forgets the client's refusals."""
    now = [0.0]
    t = guard.Throttle(clock=lambda: now[0])
    for _ in range(3 * guard.MAX_REFUSALS):
        t.refused("a")
        now[0] += guard.WINDOW_S / (guard.MAX_REFUSALS - 1)
    assert t.wait("a") == 0
    for _ in range(guard.MAX_REFUSALS - 1):
        t.refused("b")
    t.passed("b")
    t.refused("b")
    assert t.wait("b") == 0
    for _ in range(guard.MAX_REFUSALS):
        t.refused("c")
    assert t.wait("c") == guard.COOLDOWN_S and t.wait("a") == 0
    now[0] += guard.COOLDOWN_S
    assert t.wait("c") == 0
