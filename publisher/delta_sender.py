"""Sends delta snapshots from a background thread: encoding, retries, fatal errors, status.

The publisher hands each snapshot to ``DeltaSender.submit``; the sender's thread encodes it
(``publisher.delta_encoder``) and sends it through the sink (``publisher.delta_sink``), so the
train loop only pays for the copies.

Back-pressure: at most one snapshot waits for the sender. A snapshot submitted while another
is still waiting is merged into it (``merge_snapshots``: union of rows, newer values and
header win), so the newest state is always what goes out next and memory stays bounded;
``status()`` shows the backlog and how many versions were merged.

Retries: a failed send (broker down, a version not acknowledged, a file not written) is
counted, logged at most every ``_ERROR_LOG_INTERVAL_SECS``, and retried after
``_RETRY_SECS`` with the failed snapshot merged into whatever was submitted meanwhile.

Lost versions: a broker that loses acknowledged messages (the embedded broker drops the last
few on a restart; unclean leader election does the same in Kafka) shows up as a version
acknowledged at an offset at or below the previous one. The sender then asks for a
republish (``take_republish_request``): the next snapshot carries every row ever published,
with the dense variables, and is sent as a *full* version; ``status()["delta_topic_truncations"]``
counts it. Once a full version is acknowledged, every later version of the generation names
it (``VersionHeader.last_full_version`` / ``last_full_offset``, the offset of its first
chunk): a replayer whose position was past the shortened log's end, and which the refilled
log let read on from there, skipped the full version, and goes back to it
(``serving_plugin.delta_replayer``). Serving converges either way.

Fatal errors: a sink fenced by a newer trainer (``DeltaSinkFenced``) stops the sender with
``fenced`` set. Any other exception in the thread (a bug, never a broker condition) would
repeat on every retry, so it stops the sender too, with ``fatal_error`` saying why; the
trainer acts on both. The thread never dies silently.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from confluent_kafka import KafkaException
from prometheus_client import CollectorRegistry, Counter, Gauge

from publisher.delta_encoder import encode_version
from publisher.delta_sink import DeltaSink, DeltaSinkError, DeltaSinkFenced
from publisher.version_snapshot import VersionSnapshot, merge_snapshots

logger = logging.getLogger(__name__)

_RETRY_SECS = 1.0
_ERROR_LOG_INTERVAL_SECS = 10.0


class _Metrics:
    """The sender's Prometheus series."""

    def __init__(self, registry: Optional[CollectorRegistry]) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.versions = Counter("odl_delta_versions_published", "Delta versions published",
                                registry=r)
        self.bytes = Counter("odl_delta_bytes_published", "Delta bytes published", registry=r)
        self.rows = Counter("odl_delta_rows_published", "Embedding rows published", registry=r)
        self.failures = Counter("odl_delta_publish_failures", "Failed delta sends", registry=r)
        self.merged = Counter("odl_delta_versions_merged",
                              "Versions merged into a later one because the sink was behind",
                              registry=r)
        self.last_version = Gauge("odl_delta_last_version", "Last published version",
                                  registry=r)
        self.latency = Gauge("odl_delta_publish_latency_seconds",
                             "Snapshot to acknowledged, last version", registry=r)
        self.backlog = Gauge("odl_delta_backlog_versions",
                             "Versions waiting for the sink (0 or 1, merged)", registry=r)


class DeltaSender:
    """Encodes and sends snapshots on a background thread (see the module docstring).

    Args:
        sink: where encoded versions go.
        generation: the trainer generation id.
        model_name: model name written into every version.
        value_type: ``"fp32"`` or ``"fp16"``.
        max_chunk_bytes: chunk size limit.
        send_timeout: seconds to wait for one version's acknowledgements.
        registry: Prometheus registry for the metrics (the trainer's).

    Attributes:
        fatal_error: why the sender stopped for good, or None.
        fenced: the sink was taken over by a newer trainer (``fatal_error`` says so).
    """

    def __init__(
        self,
        sink: DeltaSink,
        generation: str,
        model_name: str,
        value_type: str = "fp32",
        max_chunk_bytes: int = 900_000,
        send_timeout: float = 30.0,
        registry: Optional[CollectorRegistry] = None,
    ) -> None:
        self.sink = sink
        self.generation = generation
        self.model_name = model_name
        self.value_type = value_type
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.send_timeout = send_timeout
        self._metrics = _Metrics(registry)
        self._cond = threading.Condition()
        self._pending: Optional[VersionSnapshot] = None
        self._in_flight: Optional[VersionSnapshot] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._last_error_log = 0.0
        self._republish_all = False
        self._last_full: Optional[tuple[int, int]] = None  # (version, first chunk's offset)
        self._status: dict[str, Any] = {
            "sink": sink.description,
            "generation": generation,
            "value_type": value_type,
            "last_version": None,
            "last_kind": None,
            "last_publish_time": None,
            "last_bytes": 0,
            "last_rows": 0,
            "last_variables": 0,
            "last_chunks": 0,
            "last_offset": None,
            "last_latency_ms": None,
            "last_floor_ratio": None,
            "versions_published": 0,
            "bytes_published": 0,
            "rows_published": 0,
            "versions_merged": 0,
            "failures": 0,
            "last_error": None,
            "delta_topic_truncations": 0,
            "last_full_version": None,
        }
        self.fatal_error: Optional[str] = None
        self.fenced = False

    # ------------------------------------------------------------------ the publisher's side
    def start(self) -> None:
        """Starts the sender thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="odl-delta-publisher",
                                            daemon=True)
            self._thread.start()

    def submit(self, snap: VersionSnapshot) -> None:
        """Queues a snapshot, merging it into the one still waiting, if any.

        Args:
            snap: the snapshot.
        """
        with self._cond:
            if self._pending is None:
                self._pending = snap
            else:
                self._pending = merge_snapshots(self._pending, snap)
                self._metrics.merged.inc()
                self._status["versions_merged"] += 1
            self._metrics.backlog.set(1)
            self._cond.notify_all()

    def wait_sent(self, deadline: float) -> bool:
        """Waits until every submitted snapshot is sent.

        Args:
            deadline: ``time.monotonic()`` value to give up at.

        Returns:
            True when nothing is waiting or in flight; False at the deadline, or when the
            thread is not running.
        """
        with self._cond:
            while self._pending is not None or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.2))
        return True

    def stop(self, deadline: float) -> None:
        """Stops the thread once the current send ends (what still waits is dropped).

        Args:
            deadline: ``time.monotonic()`` value after which joining takes at most 1 s more.
        """
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)

    def take_republish_request(self) -> bool:
        """Whether the next snapshot must republish every row (the request is cleared)."""
        with self._cond:
            requested, self._republish_all = self._republish_all, False
        return requested

    @property
    def republish_requested(self) -> bool:
        """A republish is requested and not yet taken."""
        return self._republish_all

    @property
    def last_error(self) -> Optional[str]:
        """The last send's error, or None after a successful send."""
        return self._status["last_error"]

    def status(self) -> dict[str, Any]:
        """Counters, the last version, the backlog and the fatal error."""
        with self._cond:
            pending = self._pending
            out = dict(self._status)
            out["backlog_versions"] = 1 if pending is not None else 0
            out["backlog_rows"] = pending.rows if pending is not None else 0
            out["republish_pending"] = self._republish_all
            out["sending"] = self._in_flight.version if self._in_flight is not None else None
        out["fatal_error"] = self.fatal_error
        return out

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._send_loop()
        except DeltaSinkFenced as exc:
            self.fenced = True
            self.fatal_error = str(exc)
            self._status["last_error"] = self.fatal_error
            logger.error("%s", self.fatal_error)
            with self._cond:
                self._in_flight = None
                self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - recorded: the trainer acts on it
            self.fatal_error = f"delta publisher stopped: {type(exc).__name__}: {exc}"
            self._status["last_error"] = self.fatal_error
            self._status["failures"] += 1
            self._metrics.failures.inc()
            logger.error("%s", self.fatal_error, exc_info=exc)
            with self._cond:
                self._in_flight = None
                self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._pending is None:
                    return
                snap, self._pending = self._pending, None
                self._in_flight = snap
                self._metrics.backlog.set(0)
            ok = self._send(snap)
            with self._cond:
                self._in_flight = None
                if not ok:
                    self._pending = (snap if self._pending is None
                                     else merge_snapshots(snap, self._pending))
                    self._metrics.backlog.set(1)
                self._cond.notify_all()
                if not ok:
                    self._cond.wait(_RETRY_SECS)
                    if self._stop:
                        return

    def _send(self, snap: VersionSnapshot) -> bool:
        kind = snap.kind
        try:
            header = snap.header(self.model_name, self.generation, self._last_full)
            chunks = encode_version(header, snap.dense, snap.sparse, self.value_type,
                                    self.max_chunk_bytes, snap.deletes)
            sent = self.sink.send(snap.version, self.generation, chunks, self.send_timeout)
        except DeltaSinkFenced:
            raise  # not retried: another trainer owns the topic now
        except (DeltaSinkError, OSError, KafkaException, RuntimeError) as exc:
            # never let the sender thread die: anything the sink raises is retried
            self._status["failures"] += 1
            self._status["last_error"] = str(exc)
            self._metrics.failures.inc()
            now = time.monotonic()
            if now - self._last_error_log >= _ERROR_LOG_INTERVAL_SECS:
                self._last_error_log = now
                logger.warning("delta version %d not published (%s); retrying", snap.version,
                               exc)
            return False
        offset = sent.last
        prev = self._status["last_offset"]
        if snap.full and sent.first >= 0:  # later versions name it (see the module doc)
            self._last_full = (snap.version, sent.first)
            self._status["last_full_version"] = snap.version
        if prev is not None and 0 <= offset <= prev:
            self._status["delta_topic_truncations"] += 1
            self._republish_all = True
            logger.error("delta version %d landed at offset %d, at or below the previous "
                         "version's offset %d: the broker lost acknowledged versions; the next "
                         "version republishes every row", snap.version, offset, prev)
        nbytes = sum(len(c) for c in chunks)
        latency = time.monotonic() - snap.taken_at
        floor = snap.payload_floor_bytes(2 if self.value_type == "fp16" else 4)
        st = self._status
        st.update({
            "last_version": snap.version,
            "last_kind": kind,
            "last_publish_time": time.time(),
            "last_bytes": nbytes,
            "last_rows": snap.rows,
            "last_variables": len(snap.dense),
            "last_chunks": len(chunks),
            "last_offset": offset if offset >= 0 else None,
            "last_latency_ms": round(latency * 1000, 1),
            "last_floor_ratio": round(nbytes / floor, 4) if floor else None,
            "last_error": None,
        })
        st["versions_published"] += 1
        st["bytes_published"] += nbytes
        st["rows_published"] += snap.rows
        m = self._metrics
        m.versions.inc()
        m.bytes.inc(nbytes)
        m.rows.inc(snap.rows)
        m.last_version.set(snap.version)
        m.latency.set(latency)
        logger.debug("published delta version %d (%s): %d rows, %d variables, %d bytes in %d "
                     "chunks, offset %s", snap.version, kind, snap.rows, len(snap.dense), nbytes,
                     len(chunks), offset)
        return True
