"""``odl-kafka``: run the embedded Kafka-compatible broker in the background.

Commands::

    odl-kafka up     [--port 9092] [--data-dir .odl/kafka]     start detached, print bootstrap
                     [--retention_mb 32] [--retention_hours 24]
    odl-kafka down   [--data-dir .odl/kafka] [--timeout 60]    SIGTERM it (data is saved)
    odl-kafka status [--data-dir .odl/kafka]                   exit 0 if running, 1 if not
    odl-kafka create-topic NAME [--partitions 1] [--retention_mb 32] [--retention_hours 24]
                     [--config K=V ...] [--data-dir .odl/kafka | --bootstrap H:P]

The broker keeps every record in memory. ``up`` also starts a retention keeper
(``odl.broker.retention_keeper``) that gives every topic on the broker, whoever creates it,
``--retention_mb`` MiB per partition and ``--retention_hours`` hours (0 = no limit) unless
the topic sets its own retention; ``create-topic`` creates a topic with its own. Changing
``up``'s values (down, then up) updates the topics that had the old defaults.

Errors (port taken, already running, broker does not come up) exit 2 with one line on stderr.

``<data-dir>/broker.json`` (written by ``up``, removed by ``down``), one JSON object::

    {"pid": 12345,                  # broker process id
     "host": "127.0.0.1",
     "port": 9092,
     "bootstrap": "127.0.0.1:9092",
     "data_dir": "/abs/path",       # absolute data directory
     "started_at": 1767225600.123,  # unix seconds
     "retention": {"retention_bytes": 33554432, "retention_ms": 86400000},  # -1: no limit
     "retention_keeper_pid": 12346}

Next to it the broker keeps ``kafka.json`` (its data) and ``broker.log`` (its output), and the
keeper ``retention_keeper.json`` (the settings it made) and ``retention_keeper.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

import odl
from odl.broker.embedded_broker import BrokerError, EmbeddedBroker, log_tail, port_in_use
from odl.kafka.topic_admin import (
    DEFAULT_RETENTION_HOURS,
    DEFAULT_RETENTION_MB,
    Retention,
    TopicAdminError,
    create_topic,
    describe_retention,
    list_topics,
    topic_configs,
    watermarks_many,
)

logger = logging.getLogger(__name__)

STATE_NAME = "broker.json"
KEEPER_STATE_NAME = "retention_keeper.json"
KEEPER_LOG_NAME = "retention_keeper.log"
KEEPER_MODULE = "odl.broker.retention_keeper"
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
    return _pid_runs(pid, b"noida-db")


def pid_is_keeper(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) retention keeper process."""
    return _pid_runs(pid, KEEPER_MODULE.encode())


def _pid_runs(pid: int, marker: bytes) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line contains ``marker``."""
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
            return marker in (proc / "cmdline").read_bytes()
        except OSError:
            return False
    return True


def running_state(data_dir: Path) -> dict[str, Any] | None:
    """The recorded state if its broker process is alive, else ``None``."""
    state = read_state(data_dir)
    if state and isinstance(state.get("pid"), int) and pid_is_broker(state["pid"]):
        return state
    return None


def _wait_gone(pid: int, timeout: float, marker: bytes = b"noida-db") -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_runs(pid, marker):
            return True
        time.sleep(0.05)
    return not _pid_runs(pid, marker)


def _retention(args: argparse.Namespace) -> Retention:
    try:
        return Retention.from_flags(args.retention_mb, args.retention_hours)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def start_keeper(broker: EmbeddedBroker, args: argparse.Namespace, timeout: float) -> int:
    """Starts the retention keeper for ``broker`` detached and waits for its first pass.

    Args:
        broker: the running broker (its address, PID and data directory).
        args: the ``up`` arguments (``retention_mb``, ``retention_hours``).
        timeout: seconds to wait for the keeper's first pass over the topics.

    Returns:
        The keeper's PID.

    Raises:
        CliError: it exited or did not finish a first pass within ``timeout``.
    """
    data_dir = broker.data_dir
    state_file = data_dir / KEEPER_STATE_NAME
    env = dict(os.environ)
    root = str(Path(odl.__file__).resolve().parents[1])  # this odl, installed or not
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", KEEPER_MODULE, "--bootstrap", broker.bootstrap,
           "--retention_mb", str(args.retention_mb), "--retention_hours",
           str(args.retention_hours), "--broker_pid", str(broker.pid), "--state",
           str(state_file.resolve())]
    log_path = data_dir / KEEPER_LOG_NAME
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CliError(f"retention keeper exited with code {proc.returncode}: "
                           f"{log_tail(log_path, 1)} (log: {log_path})")
        try:
            if json.loads(state_file.read_text()).get("pid") == proc.pid:
                return proc.pid  # its first pass is done
        except (OSError, ValueError, AttributeError):
            pass
        time.sleep(0.05)
    proc.terminate()
    raise CliError(f"retention keeper did not reach the broker within {timeout:.0f}s "
                   f"(log: {log_path})")


def cmd_up(args: argparse.Namespace) -> int:
    """Starts a detached broker and its retention keeper, and records them in ``broker.json``."""
    data_dir = Path(args.data_dir)
    retention = _retention(args)
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
    try:
        keeper_pid = start_keeper(broker, args, args.timeout)
    except (CliError, OSError):
        broker.stop()
        raise
    state = {
        "pid": broker.pid,
        "host": broker.host,
        "port": broker.port,
        "bootstrap": broker.bootstrap,
        "data_dir": str(data_dir.resolve()),
        "started_at": round(time.time(), 3),
        "retention": retention.as_dict(),
        "retention_keeper_pid": keeper_pid,
    }
    tmp = data_dir / (STATE_NAME + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, data_dir / STATE_NAME)
    print(broker.bootstrap)
    return 0


def _stop_keeper(state: dict[str, Any]) -> None:
    """SIGTERMs the recorded retention keeper (SIGKILL after 5 s)."""
    pid = state.get("retention_keeper_pid")
    marker = KEEPER_MODULE.encode()
    if not isinstance(pid, int) or not _pid_runs(pid, marker):
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, 5.0, marker):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5.0, marker)


def cmd_down(args: argparse.Namespace) -> int:
    """SIGTERMs the keeper and the broker, waits for them, SIGKILLs them after the timeout."""
    data_dir = Path(args.data_dir)
    state = read_state(data_dir)
    if state is None:
        print(f"no broker running for {data_dir}")
        return 0
    _stop_keeper(state)
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
    """Prints whether the broker runs, its address, memory, retention and topics."""
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
        print(f"memory: {psutil.Process(state['pid']).memory_info().rss / 2**20:.0f} MiB RSS")
    except psutil.Error:
        pass
    keeper = state.get("retention_keeper_pid")
    if isinstance(state.get("retention"), dict):
        defaults = Retention(**state["retention"]).describe()
        alive = isinstance(keeper, int) and pid_is_keeper(keeper)
        print(f"default retention: {defaults} "
              + (f"(keeper pid {keeper})" if alive else "(keeper NOT running)"))
    try:
        topics = {t: n for t, n in list_topics(bootstrap, args.timeout).items()}
        user_topics = sorted(t for t in topics if not t.startswith("__"))
        marks = watermarks_many(bootstrap, user_topics, args.timeout)
        configs = topic_configs(bootstrap, user_topics, timeout=args.timeout)
    except TopicAdminError as exc:
        print(f"broker not answering: {exc}")
        return 1
    print(f"topics: {len(user_topics)}")
    for topic in user_topics:
        parts = marks[topic]
        kept = sum(high - low for low, high in parts.values())
        starts = " ".join(f"{p}:{low}" for p, (low, _high) in parts.items())
        ends = " ".join(f"{p}:{high}" for p, (_low, high) in parts.items())
        retention = describe_retention({k: v for k, (v, _own) in configs.get(topic, {}).items()})
        print(
            f"  {topic}  partitions={topics[topic]}  messages={kept}  "
            f"start_offsets={starts}  end_offsets={ends}  retention: {retention}"
        )
    return 0


def cmd_create_topic(args: argparse.Namespace) -> int:
    """Creates a topic with its own retention (left unchanged if it exists)."""
    retention = _retention(args)
    config: dict[str, str] = {}
    for item in args.config or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--config expects key=value, got {item!r}")
        config[key.strip()] = value
    bootstrap = args.bootstrap
    if not bootstrap:
        state = running_state(Path(args.data_dir))
        if state is None:
            raise CliError(f"no broker running for {args.data_dir} (give --bootstrap)")
        bootstrap = state["bootstrap"]
    try:
        existed = args.topic in list_topics(bootstrap, args.timeout)
        count = create_topic(bootstrap, args.topic, args.partitions, config=config,
                             timeout=args.timeout, retention=retention)
    except TopicAdminError as exc:
        raise CliError(str(exc)) from exc
    if existed:
        print(f"topic {args.topic} exists ({count} partitions); left unchanged")
    else:
        print(f"created topic {args.topic} ({count} partitions, retention "
              f"{retention.describe()})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``odl-kafka`` argument parser."""
    parser = argparse.ArgumentParser(prog="odl-kafka", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, timeout: float) -> None:
        p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="broker data directory")
        p.add_argument("--timeout", type=float, default=timeout, help="seconds to wait")

    def retention(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--retention_mb", "--retention-mb", type=float,
                       default=DEFAULT_RETENTION_MB,
                       help=f"{what}: MiB kept per partition (0 = no size limit; "
                            f"default {DEFAULT_RETENTION_MB:g})")
        p.add_argument("--retention_hours", "--retention-hours", type=float,
                       default=DEFAULT_RETENTION_HOURS,
                       help=f"{what}: hours a record is kept (0 = no age limit; "
                            f"default {DEFAULT_RETENTION_HOURS:g})")

    up = sub.add_parser("up", help="start the broker in the background")
    up.add_argument("--port", type=int, default=9092, help="Kafka port (0 = any free port)")
    up.add_argument("--host", default="127.0.0.1", help="address to bind")
    retention(up, "topics without their own retention")
    common(up, 15.0)
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the broker (its data is saved)")
    common(down, 60.0)
    down.set_defaults(func=cmd_down)
    status = sub.add_parser("status", help="show the broker and its topics")
    common(status, 5.0)
    status.set_defaults(func=cmd_status)
    create = sub.add_parser("create-topic", help="create a topic with its own retention")
    create.add_argument("topic", help="topic name")
    create.add_argument("--partitions", type=int, default=1, help="partitions (default 1)")
    retention(create, "this topic")
    create.add_argument("--config", nargs="+", action="extend", default=[], metavar="K=V",
                        help="more topic configs (win over the retention flags)")
    create.add_argument("--bootstrap", help="broker host:port (default: the one odl-kafka runs)")
    common(create, 30.0)
    create.set_defaults(func=cmd_create_topic)
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
