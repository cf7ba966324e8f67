"""Publishes the trainer's changed parameters as delta versions (EasyRec's incremental save).

The train loop calls ``maybe_publish`` after every step. When the sparse part is due
(``sparse_save_steps`` / ``sparse_save_secs``) it takes the rows the ``DeltaTracker`` saw
since the last sparse publish and copies their CURRENT values out of the live tables
(``index_select``, wide tables cut to their used width); when the dense part is due it
copies every dense variable listed in ``DENSE_UPDATE_VARIABLES``. That snapshot (version =
global step) is handed to a background thread that encodes it (``publisher.delta_codec``)
and sends it through a sink (Kafka topic or files), so the train loop only pays for the
copies.

Back-pressure: at most one snapshot waits for the sender. When a new snapshot is due while
one is still waiting, the two are merged (union of rows, newer values and header win), so
the newest state is always what goes out next and memory stays bounded; ``status()`` shows
the backlog and how many versions were merged. A failed send (broker down) is retried
with the failed snapshot merged into whatever became due meanwhile.

Lost versions: a broker that loses acknowledged messages (the embedded broker drops the last
few on a restart; unclean leader election does the same in Kafka) shows up as a version
acknowledged at an offset at or below the previous one. The publisher then republishes every
row it ever published, with the dense variables, in its next version, so serving (which
continues at the new log end) converges again; ``status()["delta_topic_truncations"]`` counts it.

A version's header carries the input positions after its last trained batch, and the min/max
event time and Kafka produce time of all samples trained since the previous version. Times
outside ``[0, 2**63)`` ms (which the int64 header fields cannot hold) are written as 0,
"unknown"; the feature builder already rejects event times outside a sane window.

Failures: a sink error (broker down, a version not acknowledged) is counted and retried. A
sink fenced by a newer trainer (``DeltaSinkFenced``) stops the publisher with ``fenced`` set,
and the trainer exits with code 3 (not restarted by the systemd unit). Any
other exception in the sender thread (a bug, never a broker condition) would repeat on every
retry, so it stops the publisher instead: ``fatal_error`` says why, ``status()`` shows it,
and the trainer stops with a non-zero exit code (without a checkpoint, as after a crash) so
its supervisor restarts it. The thread never dies silently.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from confluent_kafka import KafkaException
from prometheus_client import CollectorRegistry, Counter, Gauge

from publisher.delta_codec import IdMaps, VersionHeader, encode_version, write_id_maps
from publisher.delta_tracker import DeltaTracker
from publisher.fs_sink import FsSink
from publisher.kafka_sink import DeltaSinkError, DeltaSinkFenced, KafkaSink

logger = logging.getLogger(__name__)

_RETRY_SECS = 1.0
_ERROR_LOG_INTERVAL_SECS = 10.0
_INT64_MAX = (1 << 63) - 1


def _header_time(value: int | None) -> int:
    """A time for an int64 header field: the value, or 0 (unknown) when it does not fit."""
    if value is None or not 0 <= value <= _INT64_MAX:
        return 0
    return int(value)


class ParameterSource(Protocol):
    """What the publisher reads from the train module."""

    def embedding_tables(self) -> dict[str, torch.Tensor]:
        """Table name -> live weight tensor."""

    def dense_parameters(self) -> dict[str, torch.Tensor]:
        """Dense variable name -> live tensor."""


class DeltaSink(Protocol):
    """Where encoded versions go (``KafkaSink``, ``FsSink``)."""

    description: str

    def send(self, version: int, generation: str, chunks: list[bytes],
             timeout: float = 30.0) -> int:
        """Publishes all chunks; returns the last chunk's offset (-1 when none)."""

    def close(self, timeout: float = 5.0) -> None:
        """Releases resources."""


@dataclass
class _Snapshot:
    version: int
    has_dense: bool
    has_sparse: bool
    dense: dict[int, np.ndarray]
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]
    event_range: list[int] | None
    produce_range: list[int] | None
    positions: list[tuple[str, int, int]]
    publish_time_ms: int
    taken_at: float
    merged: int = 0
    rows: int = field(default=0)

    def count_rows(self) -> None:
        self.rows = sum(len(ids) for ids, _ in self.sparse.values())


def _merge_range(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    if a is None:
        return None if b is None else list(b)
    if b is None:
        return list(a)
    return [min(a[0], b[0]), max(a[1], b[1])]


def _merge(old: _Snapshot, new: _Snapshot) -> _Snapshot:
    """One snapshot with old's and new's content; new's values and header win."""
    sparse = dict(old.sparse)
    for tid, (ids, values) in new.sparse.items():
        if tid not in sparse:
            sparse[tid] = (ids, values)
            continue
        old_ids, old_values = sparse[tid]
        all_ids = np.concatenate([ids, old_ids])
        all_values = np.concatenate([values, old_values])
        uniq, first = np.unique(all_ids, return_index=True)  # first occurrence = newer value
        sparse[tid] = (uniq, all_values[first])
    dense = dict(old.dense)
    dense.update(new.dense)
    out = _Snapshot(
        version=new.version,
        has_dense=old.has_dense or new.has_dense,
        has_sparse=old.has_sparse or new.has_sparse,
        dense=dense,
        sparse=sparse,
        event_range=_merge_range(old.event_range, new.event_range),
        produce_range=_merge_range(old.produce_range, new.produce_range),
        positions=new.positions,
        publish_time_ms=new.publish_time_ms,
        taken_at=old.taken_at,
        merged=old.merged + new.merged + 1,
    )
    out.count_rows()
    return out


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
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


class IncrementalPublisher:
    """Snapshots touched rows and dense variables every N steps / seconds and sends them.

    Args:
        module: the train module (``embedding_tables()``, ``dense_parameters()``).
        id_maps: ids and published widths of variables and tables.
        tracker: the touched-rows tracker registered on the module.
        sink: where encoded versions go.
        generation: the trainer generation id.
        model_name: model name written into every version.
        sparse_save_steps: sparse part every N steps (0 = not by steps).
        dense_save_steps: dense part every N steps (0 = not by steps).
        sparse_save_secs: sparse part every N seconds (0 = not by time).
        dense_save_secs: dense part every N seconds (0 = not by time).
        value_type: ``"fp32"`` or ``"fp16"``.
        max_chunk_bytes: chunk size limit.
        input_topic: input topic name written into the positions.
        registry: Prometheus registry for the metrics (the trainer's).
        start_step: global step at start (the first version is due N steps later).
        send_timeout: seconds to wait for one version's acknowledgements.
    """

    def __init__(
        self,
        module: ParameterSource,
        id_maps: IdMaps,
        tracker: DeltaTracker,
        sink: DeltaSink,
        generation: str,
        model_name: str,
        sparse_save_steps: int = 0,
        dense_save_steps: int = 0,
        sparse_save_secs: float = 0.0,
        dense_save_secs: float = 0.0,
        value_type: str = "fp32",
        max_chunk_bytes: int = 900_000,
        input_topic: str = "",
        registry: CollectorRegistry | None = None,
        start_step: int = 0,
        send_timeout: float = 30.0,
    ) -> None:
        self.module = module
        self.id_maps = id_maps
        self.tracker = tracker
        self.sink = sink
        self.generation = generation
        self.model_name = model_name
        self.sparse_save_steps = int(sparse_save_steps)
        self.dense_save_steps = int(dense_save_steps)
        self.sparse_save_secs = float(sparse_save_secs)
        self.dense_save_secs = float(dense_save_secs)
        self.value_type = value_type
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.input_topic = input_topic
        self.send_timeout = send_timeout
        self._metrics = _Metrics(registry)
        now = time.monotonic()
        self._last_sparse = (int(start_step), now)
        self._last_dense = (int(start_step), now)
        self._last_version = int(start_step)
        self._event_range: list[int] | None = None
        self._produce_range: list[int] | None = None
        self._cond = threading.Condition()
        self._pending: _Snapshot | None = None
        self._in_flight: _Snapshot | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_error_log = 0.0
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
        }
        self._snapshot_secs_total = 0.0
        self._published_rows: dict[str, torch.Tensor] = {}  # table -> rows ever published
        self._republish_all = False
        self.fatal_error: str | None = None
        self.fenced = False  # the sink was taken over by a newer trainer (fatal_error says so)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the sender thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="odl-delta-publisher",
                                            daemon=True)
            self._thread.start()

    def flush(self, timeout: float = 30.0, step: int | None = None,
              positions: Mapping[int, int] | None = None) -> bool:
        """Publishes a final version (when anything changed) and waits until all are sent.

        Then stops the sender thread.

        Args:
            timeout: seconds to wait for the sink.
            step: the current global step (None: no final version).
            positions: the current input positions.

        Returns:
            True when everything due was published.
        """
        if step is not None and (step != self._last_version or self._republish_all):
            self._snapshot(int(step), positions or {}, dense=True, sparse=True)
        deadline = time.monotonic() + timeout
        ok = True
        with self._cond:
            while self._pending is not None or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    ok = False
                    break
                self._cond.wait(min(left, 0.2))
            self._stop = True
            self._cond.notify_all()
        if not ok:
            logger.warning("delta publisher: stopping with unpublished versions (%s)",
                           self._status["last_error"] or "sink too slow")
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        self.sink.close()
        return ok

    def sync(self, step: int, positions: Mapping[int, int], timeout: float = 10.0) -> bool:
        """Publishes a version at ``step`` (when anything changed) and waits until it is sent.

        The trainer calls this before writing a checkpoint, so every checkpoint equals a
        fully published version (the crash-recovery point; see ``publisher.delta_recovery``).
        Unlike ``flush`` the sender keeps running.

        Args:
            step: the current global step.
            positions: the current input positions.
            timeout: seconds to wait for the sink.

        Returns:
            True when every version up to ``step`` was acknowledged by the sink.
        """
        dense_due = self._last_dense[0] != step
        sparse_due = self._last_sparse[0] != step
        if dense_due or sparse_due:  # both parts current at ``step``, like ``flush``
            self._snapshot(int(step), positions, dense=dense_due, sparse=sparse_due)
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.2))
        return True

    # ------------------------------------------------------------------ train loop side
    def note_times(self, event_time_ms: tuple[int, int] | None = None,
                   produce_time_ms: tuple[int, int] | None = None) -> None:
        """Adds a batch's event / produce time range to the next version's header."""
        if event_time_ms is not None:
            self._event_range = _merge_range(self._event_range, list(event_time_ms))
        if produce_time_ms is not None:
            self._produce_range = _merge_range(self._produce_range, list(produce_time_ms))

    def maybe_publish(
        self,
        step: int,
        positions: Mapping[int, int],
        event_time_ms: tuple[int, int] | None = None,
        produce_time_ms: tuple[int, int] | None = None,
    ) -> bool:
        """Called after every training step; snapshots a version when one is due.

        Args:
            step: the global step after the step.
            positions: next offset per input partition after the step's batch.
            event_time_ms: ``(min, max)`` event time of the step's samples, unix ms.
            produce_time_ms: ``(min, max)`` Kafka produce time of the step's records, unix ms.

        Returns:
            True when a version was snapshotted and queued.
        """
        self.note_times(event_time_ms, produce_time_ms)
        if step == self._last_version:
            return False
        now = time.monotonic()
        sparse_due = bool(
            (self.sparse_save_steps and step - self._last_sparse[0] >= self.sparse_save_steps)
            or (self.sparse_save_secs and now - self._last_sparse[1] >= self.sparse_save_secs))
        dense_due = bool(
            (self.dense_save_steps and step - self._last_dense[0] >= self.dense_save_steps)
            or (self.dense_save_secs and now - self._last_dense[1] >= self.dense_save_secs))
        if not (sparse_due or dense_due):
            return False
        self._snapshot(step, positions, dense=dense_due, sparse=sparse_due)
        return True

    def publish_if_behind(self, step: int, positions: Mapping[int, int]) -> bool:
        """Publishes the current state when steps were trained since the last version.

        The trainer calls this when its input is idle: steps-based publishing alone would
        hold back the last steps of a burst until more data arrives.

        Args:
            step: the current global step.
            positions: next offset per input partition.

        Returns:
            True when a version was snapshotted and queued.
        """
        if step == self._last_version:
            return False
        self._snapshot(step, positions, dense=True, sparse=True)
        return True

    @torch.no_grad()
    def _snapshot(self, step: int, positions: Mapping[int, int], dense: bool,
                  sparse: bool) -> None:
        t0 = time.perf_counter()
        now = time.monotonic()
        sparse_out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        republish, self._republish_all = self._republish_all, False
        if republish:
            dense = sparse = True
        if sparse:
            touched = self.tracker.take()
            tables = self.module.embedding_tables()
            for name, ids in touched.items():
                if name not in self._published_rows:
                    self._published_rows[name] = torch.zeros(int(tables[name].shape[0]),
                                                              dtype=torch.bool)
                self._published_rows[name][ids.cpu()] = True
            if republish:
                touched = {name: mask.nonzero().flatten()
                           for name, mask in self._published_rows.items()}
                logger.warning("delta version %d republishes all %d rows ever published (the "
                               "broker lost acknowledged versions)", step,
                               sum(len(v) for v in touched.values()))
            for name, ids in touched.items():
                info = self.id_maps.tables.get(name)
                if info is None:
                    continue
                weight = tables[name]
                rows = weight.index_select(0, ids.to(weight.device))[:, : info.dim]
                sparse_out[info.id] = (ids.cpu().numpy().astype(np.int64, copy=False),
                                       rows.cpu().numpy())
            self._last_sparse = (step, now)
        dense_out: dict[int, np.ndarray] = {}
        if dense:
            params = self.module.dense_parameters()
            for name, info in self.id_maps.dense.items():
                dense_out[info.id] = params[name].detach().to("cpu", copy=True).numpy()
            self._last_dense = (step, now)
        snap = _Snapshot(
            version=int(step),
            has_dense=dense,
            has_sparse=sparse,
            dense=dense_out,
            sparse=sparse_out,
            event_range=self._event_range,
            produce_range=self._produce_range,
            positions=[(self.input_topic, int(p), int(o)) for p, o in sorted(positions.items())],
            publish_time_ms=int(time.time() * 1000),
            taken_at=now,
        )
        snap.count_rows()
        self._event_range = self._produce_range = None
        self._last_version = int(step)
        self._snapshot_secs_total += time.perf_counter() - t0
        with self._cond:
            if self._pending is None:
                self._pending = snap
            else:
                self._pending = _merge(self._pending, snap)
                self._metrics.merged.inc()
                self._status["versions_merged"] += 1
            self._metrics.backlog.set(1)
            self._cond.notify_all()

    # ------------------------------------------------------------------ sender side
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
                    self._pending = snap if self._pending is None else _merge(snap,
                                                                              self._pending)
                    self._metrics.backlog.set(1)
                self._cond.notify_all()
                if not ok:
                    self._cond.wait(_RETRY_SECS)
                    if self._stop:
                        return

    def _send(self, snap: _Snapshot) -> bool:
        kind = "both" if snap.has_dense and snap.has_sparse else (
            "dense" if snap.has_dense else "sparse")
        header = VersionHeader(
            model_name=self.model_name,
            version=snap.version,
            generation=self.generation,
            kind=kind,
            min_event_time_ms=_header_time(snap.event_range[0] if snap.event_range else 0),
            max_event_time_ms=_header_time(snap.event_range[1] if snap.event_range else 0),
            min_produce_time_ms=_header_time(
                snap.produce_range[0] if snap.produce_range else 0),
            max_produce_time_ms=_header_time(
                snap.produce_range[1] if snap.produce_range else 0),
            positions=snap.positions,
            publish_time_ms=snap.publish_time_ms,
        )
        try:
            chunks = encode_version(header, snap.dense, snap.sparse, self.value_type,
                                    self.max_chunk_bytes)
            offset = self.sink.send(snap.version, self.generation, chunks, self.send_timeout)
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
        prev = self._status["last_offset"]
        if prev is not None and 0 <= offset <= prev:
            self._status["delta_topic_truncations"] += 1
            self._republish_all = True
            logger.error("delta version %d landed at offset %d, at or below the previous "
                         "version's offset %d: the broker lost acknowledged versions; the next "
                         "version republishes every row", snap.version, offset, prev)
        nbytes = sum(len(c) for c in chunks)
        latency = time.monotonic() - snap.taken_at
        bpv = 2 if self.value_type == "fp16" else 4
        floor = sum(len(ids) * (8 + bpv * v.shape[1]) for ids, v in snap.sparse.values()) + sum(
            a.size * bpv for a in snap.dense.values())
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

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        """Publisher state for the trainer's ``/status``."""
        with self._cond:
            pending = self._pending
            out = dict(self._status)
            out["backlog_versions"] = 1 if pending is not None else 0
            out["backlog_rows"] = pending.rows if pending is not None else 0
            out["republish_pending"] = self._republish_all
            out["sending"] = self._in_flight.version if self._in_flight is not None else None
        out["fatal_error"] = self.fatal_error
        out["snapshot_secs_total"] = round(self._snapshot_secs_total, 3)
        sink_status = getattr(self.sink, "status", None)
        if callable(sink_status):  # the Kafka sink: broker_error, producer_restarts
            out.update(sink_status())
        return out


# ---------------------------------------------------------------------------- wiring


def published_table_dims(module: Any) -> dict[str, tuple[int, int]]:
    """Table name -> ``(num_rows, published dim)``; wide tables use wide_output_dim.

    Args:
        module: a ``TrainModule``.

    Returns:
        The table sizes as published.
    """
    layout = getattr(module.model, "layout", None)
    wide = set(layout.wide_tables) if layout is not None else set()
    out = {}
    for name, w in module.embedding_tables().items():
        dim = int(w.shape[1])
        if name in wide:
            dim = int(layout.wide_output_dim)
        out[name] = (int(w.shape[0]), dim)
    return out


def dense_variable_shapes(module: ParameterSource) -> dict[str, tuple[int, ...]]:
    """Floating-point dense variables (parameters and buffers) -> shape."""
    return {name: tuple(t.shape) for name, t in module.dense_parameters().items()
            if t.is_floating_point()}


def build_delta_sink(config: Any) -> DeltaSink:
    """The sink of ``train_config.incr_save_config`` (Kafka topic or directory).

    Args:
        config: the pipeline config (``EasyRecConfig``).

    Returns:
        A ``KafkaSink`` (its transactional producer not yet claimed) or an ``FsSink``.
    """
    isc = config.train_config.incr_save_config
    if isc.WhichOneof("incr_update") == "kafka":
        return KafkaSink(isc.kafka.server, isc.kafka.topic, dict(isc.kafka.kafka_config),
                         max_chunk_bytes=isc.max_chunk_bytes,
                         fence=isc.kafka.fence_producers)
    directory = isc.fs.incr_save_dir
    if not os.path.isabs(directory):
        directory = os.path.join(config.model_dir, directory)
    return FsSink(directory)


def build_publisher(
    config: Any,
    module: Any,
    generation: str,
    registry: CollectorRegistry | None = None,
    start_step: int = 0,
    sink: DeltaSink | None = None,
) -> IncrementalPublisher:
    """Builds the publisher of a pipeline config with ``train_config.incr_save_config``.

    Writes ``DENSE_UPDATE_VARIABLES`` and ``embed_name_to_ids.txt`` into ``model_dir``,
    registers the tracker as the module's touched-rows hook and starts the sender thread.

    Args:
        config: the pipeline config (``EasyRecConfig``).
        module: the ``TrainModule``.
        generation: the trainer generation id.
        registry: the trainer's Prometheus registry.
        start_step: the global step the trainer starts from.
        sink: the sink to publish through (default: ``build_delta_sink(config)``).

    Returns:
        The running publisher.
    """
    isc = config.train_config.incr_save_config
    id_maps = write_id_maps(config.model_dir, dense_variable_shapes(module),
                            published_table_dims(module))
    tables = module.embedding_tables()
    tracker = DeltaTracker(module.feature_tables(),
                           {name: int(w.shape[0]) for name, w in tables.items()})
    module.set_touched_rows_hook(tracker.record)
    if sink is None:
        sink = build_delta_sink(config)
    model_name = isc.model_name or os.path.basename(os.path.normpath(config.model_dir))
    value_type = "fp16" if isc.value_type == isc.FP16 else "fp32"
    pub = IncrementalPublisher(
        module, id_maps, tracker, sink, generation, model_name,
        sparse_save_steps=isc.sparse_save_steps,
        dense_save_steps=isc.dense_save_steps,
        sparse_save_secs=isc.sparse_save_secs,
        dense_save_secs=isc.dense_save_secs,
        value_type=value_type,
        max_chunk_bytes=isc.max_chunk_bytes,
        input_topic=config.kafka_train_input.topic,
        registry=registry,
        start_step=start_step,
    )
    pub.start()
    logger.info("delta publisher: %s, sparse every %d steps / %ds, dense every %d steps / %ds, "
                "%s, %d tables, %d dense variables", sink.description, isc.sparse_save_steps,
                isc.sparse_save_secs, isc.dense_save_steps, isc.dense_save_secs, value_type,
                len(id_maps.tables), len(id_maps.dense))
    return pub
