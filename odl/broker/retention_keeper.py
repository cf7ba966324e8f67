"""Gives every topic on a broker the retention it does not set itself (run by ``odl-kafka up``).

A real Kafka broker has defaults for topics created without retention settings of their own
(``log.retention.bytes``, ``log.retention.hours``, ``log.segment.bytes``). The embedded
broker has none that can be set: such a topic keeps every record for 7 days (``retention.ms``
604800000, ``retention.bytes`` -1, ``segment.bytes`` 1 GiB), all of it in memory. The keeper
stands in for those defaults. Every ``interval`` seconds it looks for topics it has not seen
(every topic again each ``recheck_secs``) and sets, with the standard IncrementalAlterConfigs
request, each of ``retention.bytes`` and ``retention.ms`` that the topic does not set itself
(and ``segment.bytes`` with ``retention.bytes``), to the values of its
:class:`~odl.kafka.topic_admin.Retention`.
Internal topics (``__`` names) are left alone. The broker then enforces them as any Kafka
broker does.

The settings it made are recorded in a state file, so a keeper started later with other
values updates them, and only them: a value a user set on a topic stays.

Records written before the keeper reached a topic lie in a segment of the broker's default
size: the age limit applies to them at once, the size limit once further records roll that
segment (on the embedded broker, with the next writes).

As a process (what ``odl-kafka up`` starts, logging to ``<data-dir>/retention_keeper.log``)::

    python -m odl.broker.retention_keeper --bootstrap 127.0.0.1:9092 --retention_mb 32
        --retention_hours 24 [--broker_pid PID] [--state FILE] [--interval 1]

It exits 0 on SIGTERM / SIGINT or once the broker process ``--broker_pid`` has ended.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from odl.kafka.client_settings import admin_config
from odl.kafka.topic_admin import (
    DEFAULT_RETENTION_HOURS,
    DEFAULT_RETENTION_MB,
    RETENTION_KEYS,
    Retention,
    TopicAdminError,
    set_topic_configs,
    topic_configs,
)

logger = logging.getLogger(__name__)

_ERROR_LOG_INTERVAL_SECS = 30.0


class RetentionKeeper:
    """Sets a default retention on the topics of one broker that do not set their own.

    Args:
        bootstrap: comma separated ``host:port`` list.
        retention: the size and age limits to give.
        state_path: JSON file recording the settings this keeper (or an earlier one) made;
            None keeps them in memory only.
        interval: seconds between looks for new topics.
        recheck_secs: seconds between looks at every topic (a topic deleted and created
            again under the same name is seen then).
        extra: librdkafka settings (SASL/SSL) for the admin client.
    """

    def __init__(
        self,
        bootstrap: str,
        retention: Retention,
        state_path: str | os.PathLike[str] | None = None,
        interval: float = 1.0,
        recheck_secs: float = 30.0,
        extra: Mapping[str, str] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.retention = retention
        self.state_path = Path(state_path) if state_path is not None else None
        self.interval = interval
        self.recheck_secs = recheck_secs
        self._extra = dict(extra or {})
        self._admin = AdminClient(admin_config(bootstrap, self._extra))
        self._seen: set[str] = set()
        self._applied: dict[str, dict[str, str]] = self._load_state()

    def _load_state(self) -> dict[str, dict[str, str]]:
        if self.state_path is None:
            return {}
        try:
            applied = json.loads(self.state_path.read_text()).get("applied", {})
        except (OSError, ValueError, AttributeError):
            return {}
        return {str(t): {str(k): str(v) for k, v in kv.items()} for t, kv in applied.items()
                if isinstance(kv, dict)}

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        doc = {"pid": os.getpid(), "retention": self.retention.as_dict(),
               "applied": self._applied}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.state_path)

    def apply_once(self, all_topics: bool = True) -> dict[str, dict[str, str]]:
        """Looks at the broker's topics once and sets what they lack.

        Args:
            all_topics: look at every topic; False: only at topics not seen before.

        Returns:
            ``{topic: {config: value}}`` for each topic changed now.

        Raises:
            TopicAdminError: the broker did not answer or refused a change.
        """
        try:
            names = sorted(self._admin.list_topics(timeout=5.0).topics)
        except KafkaException as exc:
            raise TopicAdminError(f"no metadata from {self.bootstrap}: {exc}") from exc
        names = [t for t in names if not t.startswith("__") and (all_topics or t not in self._seen)]
        if not names:
            return {}
        desired = self.retention.topic_config()
        changed: dict[str, dict[str, str]] = {}
        for topic, current in topic_configs(self.bootstrap, names, RETENTION_KEYS,
                                            extra=self._extra).items():
            mine = self._applied.get(topic, {})
            update = {}
            for key, value in desired.items():
                now, on_topic = current.get(key, (None, False))
                if now == value or (on_topic and mine.get(key) != now):
                    continue  # already right, or the topic's own setting
                update[key] = value
            if "retention.bytes" not in update and "retention.bytes" not in mine:
                update.pop("segment.bytes", None)  # sized for a limit the topic does not get
            if update:
                set_topic_configs(self.bootstrap, topic, update, extra=self._extra)
                self._applied[topic] = {**mine, **update}
                changed[topic] = update
                logger.info("topic %s: set %s", topic,
                            ", ".join(f"{k}={v}" for k, v in sorted(update.items())))
            self._seen.add(topic)
        if changed:
            self._save_state()
        return changed

    def run(self, stop: threading.Event, alive: Callable[[], bool] = lambda: True) -> None:
        """Applies the retention until ``stop`` is set or ``alive()`` turns False.

        The state file is written after the first complete pass (with this process's PID:
        ``odl-kafka up`` waits for it). Broker errors are logged (at most every 30 s) and
        retried next interval.
        """
        logger.info("keeping retention %s on the topics of %s", self.retention.describe(),
                    self.bootstrap)
        last_full = None
        last_error_log = -_ERROR_LOG_INTERVAL_SECS
        while not stop.is_set() and alive():
            full = last_full is None or time.monotonic() - last_full >= self.recheck_secs
            try:
                self.apply_once(all_topics=full)
                if last_full is None:
                    self._save_state()
                if full:
                    last_full = time.monotonic()
            except TopicAdminError as exc:
                if time.monotonic() - last_error_log >= _ERROR_LOG_INTERVAL_SECS:
                    last_error_log = time.monotonic()
                    logger.warning("retention not applied yet (retrying): %s", exc)
            stop.wait(self.interval)


def process_alive(pid: int, create_time: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if given, was started at ``create_time``."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 0.01
    except psutil.Error:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The keeper process's argument parser."""
    p = argparse.ArgumentParser(prog="python -m odl.broker.retention_keeper",
                                description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", required=True, help="broker host:port")
    p.add_argument("--retention_mb", "--retention-mb", type=float, default=DEFAULT_RETENTION_MB,
                   help="size limit per partition in MiB (0 = none)")
    p.add_argument("--retention_hours", "--retention-hours", type=float,
                   default=DEFAULT_RETENTION_HOURS, help="age limit in hours (0 = none)")
    p.add_argument("--broker_pid", "--broker-pid", type=int,
                   help="exit once this process has ended")
    p.add_argument("--state", help="JSON file recording the settings made")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between looks")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the keeper process.

    Returns:
        0 when stopped, 2 on bad arguments.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        retention = Retention.from_flags(args.retention_mb, args.retention_hours)
    except ValueError as exc:
        print(f"retention_keeper: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    broker: tuple[int, float] | None = None
    if args.broker_pid:
        try:
            broker = (args.broker_pid, psutil.Process(args.broker_pid).create_time())
        except psutil.Error:
            logger.error("broker pid %d is not running", args.broker_pid)
            return 0

    def alive() -> bool:
        return broker is None or process_alive(*broker)

    RetentionKeeper(args.bootstrap, retention, args.state, args.interval).run(stop, alive)
    logger.info("retention keeper stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
