"""The `rampwatch` command: one entry point for every tool, from any directory.

    rampwatch dashboard [DIR …] [--db PATH …] [--read-only] [--host H] [--port P] [-- flags…]
    rampwatch train …                 the reference trainer (rampwatch/trainer/cli.py)
    rampwatch plan …                  batch tiers that fit in memory (rampwatch/advisor/cli.py);
                                      --db DB [--run RUN]: a run's tier table, as its card shows it
    rampwatch info | recover | upgrade DB,  rampwatch export DB [RUN]   (rampwatch/store/cli.py)
    rampwatch compact DB --keep-last-steps N | --before-step S [--run RUN] [--dry-run]
    rampwatch info DIR                each database under DIR: its runs or its problem

Owns the dispatch and the rule that every mistake on the command line is one line on stderr and
exit 2, never a traceback or a usage screen; and that a closed standard output (`| head`) ends
the command quietly with 141, as SIGPIPE would. Each subcommand's options live beside its code;
heavy imports (torch, streamlit) happen only inside the subcommand that needs them, so a
viewer's install without torch runs the dashboard and the database commands.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path

from rampwatch.advisor import cli as plan_cli
from rampwatch.dashboard import guard
from rampwatch.store import cli as store_cli
from rampwatch.store import errors as store_errors
from rampwatch.store.db_files import database_files
from rampwatch.trainer import cli as train_cli

APP = Path(__file__).resolve().parent / "dashboard" / "app.py"


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line naming the command and where to read more."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rampwatch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    d = sub.add_parser(
        "dashboard",
        help="serve the dashboard (Streamlit) on a database, or a directory of them",
        description="Serve the dashboard. Anything after `--` goes to "
        "`streamlit run` unchanged (e.g. -- --theme.base dark).",
    )
    d.add_argument(
        "dirs",
        nargs="*",
        metavar="DIR",
        help="a directory of Rampwatch databases: every *.duckdb file in it and below it, "
        "listed again on each page load (a .duckdb file may be named here too)",
    )
    d.add_argument(
        "--db",
        action="append",
        default=[],
        help="a Rampwatch DuckDB file, or a directory of them; repeat it for several "
        "(default $RAMPWATCH_DB)",
    )
    d.add_argument(
        "--read-only",
        action="store_true",
        help="no Approve, nothing written: for a shared or public view",
    )
    d.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    d.add_argument("--port", type=int, default=8501)
    d.add_argument(
        "--token-file",
        help="file whose first line is the operator token (default "
        "$RAMPWATCH_TOKEN; on 127.0.0.1 a fresh token is printed when neither is set)",
    )
    train_cli.add_arguments(
        sub.add_parser("train", help="train a GPT preset, logging every step to the database")
    )
    plan_cli.add_arguments(
        sub.add_parser("plan", help="batch tiers (×2, ×4, ×8) and whether each fits in memory")
    )
    store_cli.add_commands(sub)
    for command in sub.choices.values():  # a mistake is reported by the subcommand's parser
        command.set_defaults(command_parser=command)
    return parser


def _dashboard(args: argparse.Namespace, streamlit_flags: list[str]) -> int:
    refuse = args.command_parser.error  # one line, exit 2
    if importlib.util.find_spec("streamlit") is None:
        refuse(
            "Streamlit is not installed here; install the dashboard with "
            "`pip install 'rampwatch[dashboard]'`"
        )
    if not args.read_only and _agent_api_requested(streamlit_flags):
        refuse(
            "Streamlit's agent API is another way to drive the page: Rampwatch does not "
            "serve Approve with it; drop it or add --read-only"
        )
    if not 0 < args.port < 65536:
        refuse(f"--port must be 1-65535, got {args.port}")
    try:
        _try_listening(args.host, args.port)
    except OSError as e:
        refuse(_cannot_listen(args.host, args.port, e))
    try:
        paths = [*_checked_dirs(args.dirs), *args.db]  # a --db file may not exist yet: it waits
    except ValueError as e:
        refuse(str(e))
    env = dict(os.environ)
    env.pop(guard.TOKEN_ENV, None)
    if not args.read_only:
        try:
            env[guard.TOKEN_ENV] = _operator_token(args)
        except ValueError as e:
            refuse(str(e))
    app_args = [a for p in paths for a in ("--db", str(Path(p).expanduser().absolute()))]
    app_args += ["--read-only"] if args.read_only else []
    hosts = []  # Host names a browser may use: a DNS-rebinding page's name is refused
    if guard.is_loopback(args.host) and not any("allowedHosts" in f for f in streamlit_flags):
        for name in guard.LOOPBACK_NAMES:
            hosts += ["--server.allowedHosts", name]
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        args.host,
        "--server.port",
        str(args.port),
        "--server.headless",
        "true",
        "--server.fileWatcherType",
        "none",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "viewer",
        *hosts,
        *streamlit_flags,
        "--",
        *app_args,
    ]
    sys.stdout.flush()
    os.execve(sys.executable, command, env)  # Streamlit owns the process (and Ctrl-C) now


def _checked_dirs(dirs: list[str]) -> list[str]:
    """The DIR arguments, each an existing directory that can be listed, or a file; ValueError
    naming the first that is neither. One without databases yet is served (they may appear)."""
    for d in dirs:
        p = Path(d).expanduser()
        if p.is_file():
            continue
        if not p.is_dir():
            raise ValueError(
                f"{d}: no such directory (name a directory of Rampwatch databases, or a "
                ".duckdb file with --db)"
            )
        try:
            found = database_files(p)
        except OSError as e:
            raise ValueError(f"cannot list the directory {d}: {e.strerror}") from None
        if not found:
            print(
                f"{d}: no *.duckdb files yet; the dashboard lists them as they appear", flush=True
            )
    return dirs


def _try_listening(host: str, port: int) -> None:
    """Bind, and let go of, every address Streamlit will listen on for host (as Tornado's
    bind_sockets does), so that a port in use is one line here, not Streamlit's log and exit 1."""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Tornado's listener
            try:
                s.bind(address)
            except OSError as e:  # "localhost" on a machine without IPv6: Tornado skips it
                if not (family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL):
                    raise


def _cannot_listen(host: str, port: int, e: OSError) -> str:
    if isinstance(e, socket.gaierror):
        return f"--host {host}: not an address of this machine ({e.strerror})"
    if e.errno == errno.EADDRINUSE:
        return (
            f"--port {port}: {host}:{port} is already in use (another dashboard?); stop that "
            "server or pick another --port"
        )
    return f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port"


def _agent_api_requested(flags: list[str]) -> bool:
    """--server.enableAgentApi [true] or =true among the Streamlit flags."""
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name == "--server.enableAgentApi":
            value = value if eq else (flags[i + 1] if i + 1 < len(flags) else "true")
            return value.strip().lower() not in ("false", "0", "no", "off")
    return False


def _operator_token(args: argparse.Namespace) -> str:
    """The token every write must present: from --token-file, else $RAMPWATCH_TOKEN, else a
    fresh one printed here, which only a dashboard on loopback may make up for itself."""
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip().splitlines()[:1]
        except OSError as e:
            raise ValueError(f"cannot read --token-file {args.token_file}: {e.strerror}") from None
        if not token or not token[0].strip():
            raise ValueError(
                f"--token-file {args.token_file} is empty: put the token on its first line"
            )
        return token[0].strip()
    token = guard.server_token()
    if token:
        return token
    if not guard.is_loopback(args.host):
        raise ValueError(
            f"refusing to serve Approve on {args.host} without an operator token: "
            f"set {guard.TOKEN_ENV} or pass --token-file FILE, or serve --read-only"
        )
    token = guard.new_token()
    print(f"Operator token (type it beside Approve; new each start): {token}", flush=True)
    return token


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status (2 for any mistake on the command line)."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a traceback
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """Standard output's reader went away (`rampwatch info DB | head -2`): stop quietly, with
    the status a tool killed by SIGPIPE gets (128 + 13); neither the file nor the command is at
    fault, so there is nothing to say."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit, too
    return 128 + signal.SIGPIPE


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    streamlit_flags: list[str] = []
    if argv[:1] == ["dashboard"] and "--" in argv:
        cut = argv.index("--")
        argv, streamlit_flags = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "dashboard":
        return _dashboard(args, streamlit_flags)
    if args.command == "train":
        try:
            train_cli.resolve_defaults(args)
        except ValueError as e:
            args.command_parser.error(str(e))
        return train_cli.run(args)
    if args.command == "plan":
        return plan_cli.run(args) if args.db is None else _plan_run(args)
    return store_cli.run(args)


def _plan_run(args: argparse.Namespace) -> int:
    """`rampwatch plan --db DB [--run RUN]`: the run's tier table, read as the live page's card
    reads it (dashboard/live_data.py read_snapshot, recommend.card_of; no Streamlit session)."""
    from rampwatch.dashboard import live_data, recommend  # no Streamlit: plain reads and math

    plan_cli.check_db_args(args)

    def show() -> int:
        run_id = store_cli.pick_run(args.db, args.run, "with --run RUN")
        card = recommend.card_of(live_data.read_snapshot(args.db, run_id))
        if card.current is None:  # one line, exit 2, as for any run the command cannot read
            raise store_errors.StoreError(f"run {run_id}: {card.problems[0]}")
        head = {"run_id": run_id, "now": card.current.describe(), "memory": card.memory_note}
        notes = [*card.problems, *card.table_notes]
        if args.json:
            print(plan_cli.tier_table_json(head, card.table, notes))
        else:
            lines = [f"run {run_id}: now {head['now']}", head["memory"]]
            print(plan_cli.tier_table_text(lines, card.table, notes))
        return 0

    return store_cli.guarded("plan", args.db, show)


if __name__ == "__main__":
    sys.exit(main())
