"""``odl-kafka``: run the embedded Kafka-compatible broker in the background.

Commands::

    odl-kafka up     [--port 9092] [--data-dir .odl/kafka]   start detached, print bootstrap
    odl-kafka down   [--data-dir .odl/kafka]                 SIGTERM it (data is saved)
    odl-kafka status [--data-dir .odl/kafka]                 exit 0 if running, 1 if not

Errors (port taken, already running, broker does not come up) exit 2 with one line on stderr.

``<data-dir>/broker.json`` (written by ``up``, removed by ``down``), one JSON object::

    {"pid": 12345,                  # broker process id
     "host": "127.0.0.1",
     "port": 9092,
     "bootstrap": "127.0.0.1:9092",
     "data_dir": "/abs/path",       # absolute data directory
     "started_at": 1767225600.123}  # unix seconds

Next to it the broker keeps ``kafka.json`` (its data) and ``broker.log`` (its output).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from odl.broker.embedded_broker import BrokerError, EmbeddedBroker, port_in_use
from odl.broker.topic_admin import TopicAdminError, end_offsets_many, list_topics

logger = logging.getLogger(__name__)

STATE_NAME = "broker.json"
DEFAULT_DATA_DIR = ".odl/kafka"


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """Reads ``broker.json`` from ``data_dir`` (``None`` if absent or unreadable)."""
    try:
        return json.loads((data_dir / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None


def pid_is_broker(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) ``noida-db`` process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
            return b"noida-db" in (proc / "cmdline").read_bytes()
        except OSError:
            return False
    return True


def running_state(data_dir: Path) -> dict[str, Any] | None:
    """The recorded state if its broker process is alive, else ``None``."""
    state = read_state(data_dir)
    if state and isinstance(state.get("pid"), int) and pid_is_broker(state["pid"]):
        return state
    return None


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_is_broker(pid):
            return True
        time.sleep(0.05)
    return not pid_is_broker(pid)


def cmd_up(args: argparse.Namespace) -> int:
    """Starts a detached broker and records it in ``broker.json``."""
    data_dir = Path(args.data_dir)
    state = running_state(data_dir)
    if state:
        raise CliError(
            f"a broker is already running for {data_dir} "
            f"(pid {state['pid']}, {state.get('bootstrap')}); run 'odl-kafka down' first"
        )
    if args.port and port_in_use(args.port, args.host):
        raise CliError(f"port {args.host}:{args.port} is already in use")
    broker = EmbeddedBroker(args.port, data_dir, host=args.host, new_session=True)
    try:
        broker.start(timeout=args.timeout)
    except BrokerError as exc:
        lines = str(exc).splitlines()
        last = next((ln for ln in reversed(lines[1:]) if "GLIBC" not in ln), "")
        raise CliError(f"{lines[0]} {last} (log: {broker.log_path})".strip()) from exc
    state = {
        "pid": broker.pid,
        "host": broker.host,
        "port": broker.port,
        "bootstrap": broker.bootstrap,
        "data_dir": str(data_dir.resolve()),
        "started_at": round(time.time(), 3),
    }
    tmp = data_dir / (STATE_NAME + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, data_dir / STATE_NAME)
    print(broker.bootstrap)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """SIGTERMs the recorded broker, waits for it, SIGKILLs it after the timeout."""
    data_dir = Path(args.data_dir)
    state = read_state(data_dir)
    if state is None:
        print(f"no broker running for {data_dir}")
        return 0
    pid = state.get("pid")
    if not isinstance(pid, int) or not pid_is_broker(pid):
        (data_dir / STATE_NAME).unlink(missing_ok=True)
        print(f"no broker running for {data_dir} (stale {STATE_NAME} removed)")
        return 0
    os.kill(pid, signal.SIGTERM)
    if _wait_gone(pid, args.timeout):
        how = "stopped"
    else:
        os.kill(pid, signal.SIGKILL)
        if not _wait_gone(pid, 5.0):
            raise CliError(f"broker pid {pid} survived SIGKILL")
        how = f"killed (no exit {args.timeout:.0f}s after SIGTERM; unsaved data lost)"
    (data_dir / STATE_NAME).unlink(missing_ok=True)
    print(f"broker pid {pid} ({state.get('bootstrap')}) {how}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Prints whether the broker runs, its address and its topics' end offsets."""
    data_dir = Path(args.data_dir)
    state = running_state(data_dir)
    if state is None:
        print(f"not running ({data_dir})")
        return 1
    bootstrap = state["bootstrap"]
    print("running")
    print(f"pid: {state['pid']}")
    print(f"bootstrap: {bootstrap}")
    print(f"data dir: {state.get('data_dir', data_dir)}")
    try:
        topics = {t: n for t, n in list_topics(bootstrap, args.timeout).items()}
        user_topics = sorted(t for t in topics if not t.startswith("__"))
        offsets = end_offsets_many(bootstrap, user_topics, args.timeout)
    except TopicAdminError as exc:
        print(f"broker not answering: {exc}")
        return 1
    print(f"topics: {len(user_topics)}")
    for topic in user_topics:
        ends = offsets[topic]
        listed = " ".join(f"{p}:{o}" for p, o in ends.items())
        print(
            f"  {topic}  partitions={topics[topic]}  messages={sum(ends.values())}  "
            f"end_offsets={listed}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``odl-kafka`` argument parser."""
    parser = argparse.ArgumentParser(prog="odl-kafka", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, timeout: float) -> None:
        p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="broker data directory")
        p.add_argument("--timeout", type=float, default=timeout, help="seconds to wait")

    up = sub.add_parser("up", help="start the broker in the background")
    up.add_argument("--port", type=int, default=9092, help="Kafka port (0 = any free port)")
    up.add_argument("--host", default="127.0.0.1", help="address to bind")
    common(up, 15.0)
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the broker (its data is saved)")
    common(down, 10.0)
    down.set_defaults(func=cmd_down)
    status = sub.add_parser("status", help="show the broker and its topics")
    common(status, 5.0)
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``odl-kafka``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success (``status``: running), 1 if ``status`` finds no broker, 2 on errors.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"odl-kafka: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"odl-kafka: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
