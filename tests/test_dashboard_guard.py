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
        ("alice", None, "token is missing or wrong"),
        ("alice", "guessed", "token is missing or wrong"),
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
    assert "token is missing or wrong" in msg
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
    """A click on Approve while a ramp is open (on hold, a second ramp waits for the first):
    no second command, and the reason on the card."""
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.run()
    at.button(key="approve").click().run()
    [first] = commands.list_commands(live.db, live.run_id)
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
    assert any("token is missing or wrong" in str(e.value) for e in at.error)


@pytest.fixture
def agent_api_on():
    from streamlit import config

    config.set_option("server.enableAgentApi", True)
    yield
    config.set_option("server.enableAgentApi", False)


def test_agent_api_on_means_no_writes(live, monkeypatch, agent_api_on):
    from rampwatch.dashboard import data

    at = seed.app(monkeypatch, live.db)
    assert "approve" not in {b.key for b in at.button}
    assert any("agent API is on" in str(w.value) for w in at.warning)
    with pytest.raises(data.CommandError, match="agent API"):
        data.submit_ramp(
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
