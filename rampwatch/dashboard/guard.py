"""Who may write from the dashboard: the operator token, checked on the server for every write.

A disabled button is not a check (a scripted WebSocket client can send the click anyway), and
Streamlit's Host and Origin checks do not stop a DNS-rebinding page on loopback. So every write
(Approve, Cancel) needs the operator token, which the server holds in RAMPWATCH_TOKEN (set by
`rampwatch dashboard`, which prints a fresh one on loopback or takes yours) and compares in
constant time, plus a typed operator name that goes into the command log. A shared token is not
an identity: for real identity put the dashboard behind `st.login` or a proxy that sets a user
header, and TLS. Streamlit-free, so the command line and the tests share it.

A refused write is recorded (store_access.py, into the store), with the operator name as typed
unless it holds a piece of a token (`recordable_name`), and the refusals slow a client down: after
MAX_REFUSALS within WINDOW_S, its writes are refused unchecked for COOLDOWN_S (`THROTTLE`,
in this process's memory: a restart forgets it). Tokens are random, 144 bits (`new_token`),
so the cooldown is not what stops guessing; it keeps a script from filling the audit table
and the log with tries.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import secrets
import threading
import time

TOKEN_ENV = "RAMPWATCH_TOKEN"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_OPERATOR_CHARS = 64
MAX_REFUSALS = 5  # refused writes from one client within WINDOW_S start its cooldown
WINDOW_S = 60.0
COOLDOWN_S = 30.0  # then every write from it is refused, without a look at its token
WITHHELD = "(withheld: it contains part of a token)"
_PIECE = 4  # a typed name sharing this many characters in a row with a token is not recorded


def server_token(env=None) -> str | None:
    """The token this dashboard process requires for writes, or None (no writes possible)."""
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return token or None


def new_token() -> str:
    return secrets.token_urlsafe(18)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refusal(presented: str | None, operator: str | None, expected: str | None) -> str | None:
    """Why a write with this token and operator name is refused, or None when it may go ahead."""
    if expected is None:
        return (
            "this dashboard has no operator token, so it cannot write: start it with "
            "`rampwatch dashboard` (which prints one) or set RAMPWATCH_TOKEN"
        )
    name = (operator or "").strip()
    if not name:
        return "type your name as operator: it is recorded with the command"
    if len(name) > MAX_OPERATOR_CHARS or not name.isprintable():
        return f"the operator name must be printable and at most {MAX_OPERATOR_CHARS} characters"
    if not (presented or "").strip():
        # Streamlit 1.67's password field sends what was typed on Enter, or when focus leaves
        # the field; Tab lands on its own show-password button, which sends nothing
        return (
            "no operator token reached the dashboard: type the one `rampwatch dashboard` "
            "printed at start (or RAMPWATCH_TOKEN) and press Enter in its field (a Tab from "
            "it does not send it)"
        )
    if not hmac.compare_digest(presented.strip().encode(), expected.encode()):
        return (
            "the operator token is wrong: use the one `rampwatch dashboard` printed at start "
            "(or RAMPWATCH_TOKEN)"
        )
    return None


def actor(operator: str) -> str:
    """How the command log names a dashboard operator."""
    return f"{operator.strip()} (dashboard, token)"


def recordable_name(operator: str | None, *tokens: str | None) -> str | None:
    """The operator name as typed, fit to record: WITHHELD when it shares _PIECE characters in
    a row with a token (one pasted in the wrong field), never a token, a prefix or a hash."""
    name = (operator or "").strip()
    if not name:
        return None
    for token in tokens:
        token = (token or "").strip()
        n = min(_PIECE, len(token))
        if n and any(token[i : i + n] in name for i in range(len(token) - n + 1)):
            return WITHHELD
    return name[:MAX_OPERATOR_CHARS]


def cooldown_refusal(seconds: float) -> str:
    return (
        f"too many refused attempts: wait {math.ceil(seconds)} s (after {MAX_REFUSALS} "
        f"refusals within {WINDOW_S:.0f} s, this client's writes are refused for "
        f"{COOLDOWN_S:.0f} s)"
    )


class Throttle:
    """Refusals per client (its address, or a stand-in where none is known) and cooldowns."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()  # Streamlit runs each session's script in its own thread
        self._refused: dict[str, list[float]] = {}  # client → times of its recent refusals
        self._until: dict[str, float] = {}  # client → end of its cooldown

    def wait(self, client: str) -> float:
        """Seconds left of the client's cooldown; 0 when it may try."""
        with self._lock:
            return max(0.0, self._until.get(client, 0.0) - self.clock())

    def refused(self, client: str) -> None:
        """Count one refusal; the MAX_REFUSALS-th within WINDOW_S starts a cooldown."""
        with self._lock:
            now = self.clock()
            self._forget(now)
            recent = [t for t in self._refused.get(client, []) if now - t < WINDOW_S]
            recent.append(now)
            if len(recent) >= MAX_REFUSALS:
                self._until[client] = now + COOLDOWN_S
                recent = []  # after the cooldown, MAX_REFUSALS more tries
            self._refused[client] = recent

    def passed(self, client: str) -> None:
        """A write went through: the client's earlier refusals no longer count."""
        with self._lock:
            self._refused.pop(client, None)

    def _forget(self, now: float) -> None:
        """Drop clients with nothing recent, so many addresses cannot grow this without bound."""
        for c in [c for c, ts in self._refused.items() if not ts or now - ts[-1] >= WINDOW_S]:
            del self._refused[c]
        for c in [c for c, end in self._until.items() if end <= now]:
            del self._until[c]

    def reset(self) -> None:
        with self._lock:
            self._refused.clear()
            self._until.clear()


THROTTLE = Throttle()
