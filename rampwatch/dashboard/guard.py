"""Who may write from the dashboard: the operator token, checked on the server for every write.

A disabled button is not a check (a scripted WebSocket client can send the click anyway), and
Streamlit's Host and Origin checks do not stop a DNS-rebinding page on loopback. So every write
(Approve, Cancel) needs the operator token, which the server holds in RAMPWATCH_TOKEN (set by
`rampwatch dashboard`, which prints a fresh one on loopback or takes yours) and compares in
constant time, plus a typed operator name that goes into the command log. A shared token is not
an identity: for real identity put the dashboard behind `st.login` or a proxy that sets a user
header, and TLS. Streamlit-free, so the command line and the tests share it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets

TOKEN_ENV = "RAMPWATCH_TOKEN"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_OPERATOR_CHARS = 64


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
    if not presented or not hmac.compare_digest(presented.strip().encode(), expected.encode()):
        return (
            "the operator token is missing or wrong: use the one `rampwatch dashboard` "
            "printed at start (or RAMPWATCH_TOKEN)"
        )
    return None


def actor(operator: str) -> str:
    """How the command log names a dashboard operator."""
    return f"{operator.strip()} (dashboard, token)"
