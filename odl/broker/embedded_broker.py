"""An embedded Kafka-wire-compatible broker for development, tests and demos.

It runs the ``noida-db`` binary shipped in the ``noida-db`` PyPI package (Kafka service only),
started directly so we hold its PID::

    noida-db start --only kafka --kafka-port P --host 127.0.0.1 --data-dir D

The broker answers metadata within ~0.1 s of starting; ``start()`` waits for that. SIGTERM
stops it and saves its data (``D/kafka.json``, written only on a clean stop: after SIGKILL the
records produced since the last start are lost). Its stdout/stderr are appended to
``D/broker.log`` (it always prints a harmless glibc "weak version GLIBC_2.39" warning).

Quirk: the broker ignores fetch size limits, so consumers need ``receive.message.max.bytes``
at its maximum, which ``odl.kafka.client_settings.consumer_config`` sets. A consumer far behind gets
its whole backlog in one response (244 MB in 0.6-0.7 s on an idle broker); more than 2 GiB
cannot be sent at all.

Memory: the broker keeps every record in RAM, 1.6-2.1 MiB of RSS per MB kept, and 4.4-5.4 MiB
while it saves (below). It honours the topic configs ``retention.bytes``, ``retention.ms`` and
``segment.bytes`` as Kafka does (within about a second of the writes that exceed them) and
gives the memory back; its defaults for a topic without them keep everything for 7 days.
``odl-kafka up`` gives such topics a size and age limit
(``odl.broker.retention_keeper``); this class does not.

Quirk: a moment after any write (a produce, an offset commit, a topic change) its ``autosave``
thread rewrites the whole data file, about 4 bytes of JSON per byte of stored record (123 MB
for 120k records of 250 bytes) at roughly 0.5 s of CPU per 100 MB. A stream written
continuously therefore keeps the broker busy at most of a core, and anything timed right after
a bulk produce shares the machine with that save. Benchmarks call
:meth:`EmbeddedBroker.wait_until_idle` before timing. Real Kafka appends to segment files and
has no such cost.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from importlib.resources import files
from pathlib import Path
from types import TracebackType

import psutil
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from odl.kafka.client_settings import admin_config

logger = logging.getLogger(__name__)

LOG_NAME = "broker.log"


class BrokerError(RuntimeError):
    """The embedded broker could not be found, started or reached."""


def broker_binary() -> Path:
    """Path of the ``noida-db`` executable inside the installed ``noida_db`` package.

    Raises:
        BrokerError: the package or its binary is missing.
    """
    try:
        path = Path(str(files("noida_db").joinpath("noida-db")))
    except ModuleNotFoundError as exc:
        raise BrokerError("the noida-db package is not installed (pip install noida-db)") from exc
    if not path.is_file():
        raise BrokerError(f"noida-db binary not found at {path}")
    if not os.access(path, os.X_OK):
        os.chmod(path, 0o755)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something is bound to ``host:port`` (TIME_WAIT sockets do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def _accepts(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_for_metadata(bootstrap: str, timeout: float) -> bool:
    """Polls ``bootstrap`` until it answers a metadata request or ``timeout`` passes."""
    admin = AdminClient(admin_config(bootstrap, {"socket.connection.setup.timeout.ms": "1000"}))
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            admin.list_topics(timeout=min(max(remaining, 0.1), 1.0))
            return True
        except KafkaException:
            time.sleep(0.05)


def wait_process_idle(
    pid: int, quiet_secs: float = 1.0, max_cpu: float = 0.05, timeout: float = 120.0
) -> bool:
    """Waits until process ``pid`` has used almost no CPU for ``quiet_secs``.

    Args:
        pid: the process (e.g. a broker started by ``odl-kafka up``).
        quiet_secs: length of the quiet window.
        max_cpu: most CPU (cores) it may use in that window to count as idle.
        timeout: seconds to wait at most.

    Returns:
        True once idle; False on timeout or when the process is gone.
    """
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return False

    def cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    deadline = time.monotonic() + timeout
    try:
        window_start, cpu_start = time.monotonic(), cpu()
    except psutil.Error:
        return False
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            now, used = time.monotonic(), cpu() - cpu_start
        except psutil.Error:
            return False
        if used > max_cpu * quiet_secs:
            window_start, cpu_start = now, used + cpu_start
        elif now - window_start >= quiet_secs:
            return True
    logger.warning("process %d still busy after %.0fs", pid, timeout)
    return False


class EmbeddedBroker:
    """A ``noida-db`` Kafka broker child process bound to one local port.

    Args:
        port: TCP port; 0 picks a free one at ``start()``.
        data_dir: where the broker keeps its data and ``broker.log``.
        host: address to bind; keep the default (never bind beyond loopback in tests).
        new_session: start the process in its own session, so it survives its parent
            (used by ``odl-kafka up``).
    """

    def __init__(
        self,
        port: int = 0,
        data_dir: str | os.PathLike[str] = ".odl/kafka",
        host: str = "127.0.0.1",
        new_session: bool = False,
    ) -> None:
        self.port = int(port)
        self.data_dir = Path(data_dir)
        self.host = host
        self.new_session = new_session
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """The ``host:port`` clients connect to."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the broker process, or ``None`` before ``start()``."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """Where the broker's output goes."""
        return self.data_dir / LOG_NAME

    def is_running(self) -> bool:
        """Whether the broker process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 15.0) -> EmbeddedBroker:
        """Starts the broker and waits until it answers a metadata request.

        Args:
            timeout: seconds to wait for the broker to come up.

        Returns:
            ``self``.

        Raises:
            BrokerError: the port is taken, the process exited or it did not answer in time
                (the message includes the tail of its log).
        """
        if self.is_running():
            raise BrokerError(f"broker already running (pid {self.pid})")
        binary = broker_binary()
        if self.port == 0:
            self.port = free_port(self.host)
        elif port_in_use(self.port, self.host):
            raise BrokerError(f"port {self.host}:{self.port} is already in use")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(binary),
            "start",
            "--only",
            "kafka",
            "--kafka-port",
            str(self.port),
            "--host",
            self.host,
            "--data-dir",
            str(self.data_dir.resolve()),
        ]
        logger.info("starting embedded broker on %s (data %s)", self.bootstrap, self.data_dir)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.new_session,
                close_fds=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            # A plain TCP probe first: librdkafka logs every refused connection.
            if not _accepts(self.host, self.port):
                time.sleep(0.02)
                continue
            if wait_for_metadata(self.bootstrap, min(1.0, deadline - time.monotonic())):
                if self._proc.poll() is None:
                    logger.info("embedded broker up: %s pid %d", self.bootstrap, self._proc.pid)
                    return self
                break
        code = self._proc.poll()
        if code is None:
            self.stop(timeout=5.0)
            reason = f"did not answer metadata within {timeout:.0f}s"
        else:
            reason = f"exited with code {code}"
        self._proc = None
        raise BrokerError(
            f"embedded broker on {self.bootstrap} {reason}; log tail ({self.log_path}):\n"
            + log_tail(self.log_path)
        )

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stops the broker: SIGTERM (it saves its data), then SIGKILL after ``timeout``.

        Args:
            timeout: seconds to wait after SIGTERM.

        Returns:
            The exit code, or ``None`` if it was not started.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "broker pid %d ignored SIGTERM for %.0fs; killing", proc.pid, timeout
                )
                proc.kill()
                proc.wait(timeout=5.0)
        logger.info("embedded broker %s stopped (code %s)", self.bootstrap, proc.returncode)
        return proc.returncode

    def wait_until_idle(
        self, quiet_secs: float = 1.0, max_cpu: float = 0.05, timeout: float = 120.0
    ) -> bool:
        """Waits until the broker has used almost no CPU for ``quiet_secs`` (its save is done).

        Args:
            quiet_secs: length of the quiet window.
            max_cpu: most CPU (cores) the broker may use in that window to count as idle.
            timeout: seconds to wait at most.

        Returns:
            True once idle; False on timeout or when the broker is not running.
        """
        if self._proc is None or not self.is_running():
            return False
        return wait_process_idle(self._proc.pid, quiet_secs, max_cpu, timeout)

    def __enter__(self) -> EmbeddedBroker:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
