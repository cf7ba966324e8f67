"""The serving process: base model + delta replay + HTTP API (FastAPI on uvicorn).

Endpoints (bound to 127.0.0.1 unless told otherwise; with a token, all but /healthz need
``Authorization: Bearer <token>``, see ``odl.http.auth``)::

    POST /predict   body: records as in the training stream, one or many:
                    * text: one CSV (or JSON) record per line;
                    * JSON: one object (a record: its keys are input field names), an
                      array of objects (or of CSV strings), or exactly {"records": [...]} /
                      {"instances": [...]}.
                    The label column may be omitted (a dummy 0 is filled in).
                    200 {"probabilities": [...], "version": v, "generation": g}
                    400 {"detail": {"error": str, "rejected": [{"index", "reason"}]}} when
                    the body or any record is malformed (unknown JSON keys included);
                    413 when too large (refused by Content-Length before any of the body
                    is read, or as soon as a chunked body passes the limit); 503 with
                    Retry-After when the in-flight bounds are reached; 408 when the body
                    arrives too slowly. Never 5xx for bad input.
    GET /status     base export, version / generation applied, versions applied, last apply
                    time, freshness, lag to the delta topic end, rejected messages
    GET /healthz    200 {"ok": true, "state": ...} once the base is loaded; 503 when stopped
                    or while the delta broker is unreachable (state "waiting_for_broker":
                    /predict keeps answering with the last applied version)
    GET /metrics    Prometheus text (own registry)

Request bodies are read by the endpoint itself, chunk by chunk, under :class:`PredictLimits`:
a body never occupies more than ``max_body_bytes`` in this process, and all bodies being read
or answered together never more than ``max_inflight_bytes``.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from odl.http.server import BackgroundHttpServer
from serving_plugin.delta_replayer import DeltaReplayer
from serving_plugin.export_reader import read_kafka_txt
from serving_plugin.serving_metrics import ServingMetrics
from serving_plugin.serving_model import ServingModel

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
MAX_INFLIGHT_REQUESTS = 64
MAX_INFLIGHT_BYTES = 64 << 20
BODY_TIMEOUT_SECS = 30.0
MAX_RECORDS = 100_000
RETRY_AFTER_SECS = 1
# Bodies up to this size are parsed on the event loop; larger ones in the thread pool.
_INLINE_PARSE_BYTES = 64 << 10
# A refusal sent before the body is read keeps the connection when the declared body is at
# most this many times --max_body_bytes: uvicorn then reads and discards the rest (nothing
# is buffered), so a client that writes its whole body before reading still gets the answer.
# A longer or unknown (chunked) remainder closes the connection: no one can make the server
# drain gigabytes.
_DRAIN_FACTOR = 4
# Freed heap pages go back to the OS (glibc malloc_trim) once bodies of at least
# _INLINE_PARSE_BYTES totalling this many bytes were released and less than this is in flight.
TRIM_AFTER_BYTES = 1 << 20
_REFUSAL_LOG_INTERVAL_SECS = 10.0
_LIST_KEYS = ("records", "instances")
_MAX_NAMED_KEYS = 10


class RequestError(ValueError):
    """A /predict body that cannot be turned into records (answered with 400 / 413)."""

    def __init__(self, message: str, status: int = 400,
                 rejected: Optional[list[dict]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.rejected = rejected or []


@dataclass(frozen=True)
class PredictLimits:
    """Bounds on ``/predict`` request bodies (the ``odl-serve`` flags of the same names).

    Attributes:
        max_body_bytes: largest body accepted (413 above it).
        max_inflight_requests: most ``/predict`` requests being read or answered at once
            (503 with ``Retry-After`` above it).
        max_inflight_bytes: most body bytes held by all ``/predict`` requests together (a
            request's declared ``Content-Length`` is reserved when it arrives, a chunked
            body's bytes as they arrive; 503 with ``Retry-After`` above it).
        body_timeout_s: longest time to receive one body (408 after it; 0 = no limit).

    Raises:
        ValueError: a bound that is not positive, or ``max_inflight_bytes`` below
            ``max_body_bytes`` (a largest body could never be accepted); the message names
            the flag.
    """

    max_body_bytes: int = MAX_BODY_BYTES
    max_inflight_requests: int = MAX_INFLIGHT_REQUESTS
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES
    body_timeout_s: float = BODY_TIMEOUT_SECS

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_inflight_requests", "max_inflight_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name} must be at least 1, not {getattr(self, name)}")
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(f"--max_inflight_bytes ({self.max_inflight_bytes}) must be at "
                             f"least --max_body_bytes ({self.max_body_bytes})")
        if not self.body_timeout_s >= 0:
            raise ValueError(f"--body_timeout_s must be >= 0, not {self.body_timeout_s}")


def _quoted(keys: Collection[str]) -> str:
    """Up to ``_MAX_NAMED_KEYS`` keys, quoted and shortened, for an error message."""
    names = list(keys)
    shown = ", ".join(json.dumps(k[:64]) for k in names[:_MAX_NAMED_KEYS])
    more = len(names) - _MAX_NAMED_KEYS
    return shown + (f" and {more} more" if more > 0 else "")


def _unknown_keys(obj: dict, fields: Optional[frozenset[str]]) -> list[str]:
    """The keys of a JSON record that are not input fields (none when fields is None)."""
    if fields is None:
        return []
    return [k for k in obj if k not in fields]


def _wrapper_items(doc: dict, fields: Optional[frozenset[str]]) -> Optional[list]:
    """The record list of a ``{"records": [...]}`` / ``{"instances": [...]}`` body.

    Returns:
        The list, or None when ``doc`` is a record rather than a wrapper.

    Raises:
        RequestError: a wrapper with other keys, or whose value is not an array.
    """
    keys = [k for k in doc if k in _LIST_KEYS and (fields is None or k not in fields)]
    if not keys:
        return None
    key = keys[0]
    extra = [k for k in doc if k != key]
    if extra:
        raise RequestError(f'a {{"{key}": [...]}} body takes no other keys; unexpected: '
                           f"{_quoted(extra)}")
    items = doc[key]
    if not isinstance(items, list):
        raise RequestError(f'"{key}" must be a JSON array of records, not '
                           f"{type(items).__name__}")
    return items


def _check_record_keys(records: list[bytes], objects: dict[int, dict],
                       fields: Optional[Collection[str]]) -> None:
    """Rejects JSON records that are empty or have keys that are not input fields.

    Args:
        records: the raw records (for the count in the message).
        objects: record index -> the decoded JSON object of that record.
        fields: the input field names (None = no check).

    Raises:
        RequestError: 400 listing the offending records and naming the unknown keys.
    """
    if fields is None:
        return
    known = frozenset(fields)
    rejected: list[dict] = []
    unknown: set[str] = set()
    for i, obj in objects.items():
        if not obj:
            rejected.append({"index": i, "reason": "empty"})
            continue
        bad = _unknown_keys(obj, known)
        if bad:
            unknown.update(bad)
            rejected.append({"index": i, "reason": "unknown_fields"})
    if not rejected:
        return
    n_empty = len(rejected) - sum(r["reason"] == "unknown_fields" for r in rejected)
    parts = []
    if unknown:
        parts.append(f"keys that are not input fields: {_quoted(sorted(unknown))} (the input "
                     f"fields are {_quoted(fields)})")
    if n_empty:
        parts.append(f"{n_empty} empty JSON object{'s' if n_empty > 1 else ''} (no fields)")
    raise RequestError(f"{len(rejected)} of {len(records)} records rejected: "
                       + "; ".join(parts),
                       rejected=sorted(rejected, key=lambda r: r["index"])[:100])


def split_body(body: bytes, max_bytes: int = MAX_BODY_BYTES,
               fields: Optional[Collection[str]] = None) -> list[bytes]:
    """Turns a /predict body into raw records (see the module docstring).

    Args:
        body: the request body.
        max_bytes: the largest body accepted.
        fields: the model's input field names: JSON records with other keys (or none) are
            rejected; None skips the check.

    Returns:
        The records, each as the training stream would carry it.

    Raises:
        RequestError: empty, undecodable, oversized or oddly shaped body, unknown keys.
    """
    if len(body) > max_bytes:
        raise RequestError(f"body of {len(body)} bytes exceeds {max_bytes}", 413)
    known = frozenset(fields) if fields is not None else None
    text = body.strip()
    if not text:
        raise RequestError("empty body: send CSV lines or JSON records")
    records: list[bytes]
    objects: dict[int, dict] = {}
    if text[:1] in (b"[", b"{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        if doc is None:
            if text[:1] != b"{":
                raise RequestError("body is not valid JSON")
            # Newline-delimited JSON records: lines that decode to objects are checked here,
            # the others are left to the record parser (bad_json).
            records = [ln for ln in text.splitlines() if ln.strip()]
            for i, ln in enumerate(records):
                try:
                    obj = json.loads(ln)
                except (ValueError, RecursionError):
                    continue
                if isinstance(obj, dict):
                    objects[i] = obj
        else:
            items: Any = doc
            if isinstance(doc, dict):
                items = _wrapper_items(doc, known)
                if items is None:
                    items = [doc]
            elif not isinstance(doc, list):
                items = [doc]
            records = []
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    objects[i] = item
                    records.append(json.dumps(item).encode("utf-8"))
                elif isinstance(item, str):
                    records.append(item.encode("utf-8"))
                else:
                    raise RequestError(f"record {i} is a {type(item).__name__}; expected a JSON "
                                       "object or a CSV string")
    else:
        records = [ln for ln in text.splitlines() if ln.strip()]
    if not records:
        raise RequestError("no records in the body")
    if len(records) > MAX_RECORDS:
        raise RequestError(f"{len(records)} records exceed the limit of {MAX_RECORDS}", 413)
    _check_record_keys(records, objects, fields)
    return records


class _MemoryTrimmer:
    """Hands freed heap memory back to the OS after large bodies (glibc ``malloc_trim``).

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in its heaps,
    so a burst of large bodies would leave the process's RSS near its peak for good
    (``bench/predict_upload_flood.py`` measures it). ``malloc_trim(0)`` runs in a worker
    thread (a few ms; ctypes releases the GIL), at most one at a time. A no-op where the C
    library has no ``malloc_trim`` (musl, macOS).
    """

    def __init__(self) -> None:
        try:
            self._trim = ctypes.CDLL(None).malloc_trim
            self._trim.argtypes = [ctypes.c_size_t]
            self._trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            self._trim = None
        self._pending = False
        self._lock = threading.Lock()
        self.trims = 0

    @property
    def available(self) -> bool:
        """Whether the C library has ``malloc_trim``."""
        return self._trim is not None

    def request(self) -> None:
        """Schedules one trim in the default executor unless one is pending (event loop)."""
        if self._trim is None:
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        asyncio.get_running_loop().run_in_executor(None, self._run)

    def _run(self) -> None:
        with self._lock:
            self._pending = False
        t0 = time.perf_counter()
        assert self._trim is not None
        self._trim(0)
        self.trims += 1
        logger.debug("malloc_trim after a large /predict body took %.1f ms",
                     (time.perf_counter() - t0) * 1e3)


class _PredictGate:
    """In-flight ``/predict`` requests and body bytes (touched on the event loop only).

    Args:
        limits: the bounds.
        metrics: the service's metrics (the in-flight gauges are kept here).
    """

    def __init__(self, limits: PredictLimits, metrics: ServingMetrics) -> None:
        self.limits = limits
        self._m = metrics
        self.requests = 0
        self.bytes = 0
        self._released = 0  # bytes of bodies >= _INLINE_PARSE_BYTES released since a trim
        self.trimmer = _MemoryTrimmer()

    def enter(self) -> bool:
        """Admits one request unless ``max_inflight_requests`` are in flight."""
        if self.requests >= self.limits.max_inflight_requests:
            return False
        self.requests += 1
        self._m.inflight_requests.set(self.requests)
        return True

    def leave(self, reserved: int) -> None:
        """Ends an admitted request, releasing its ``reserved`` body bytes."""
        self.requests -= 1
        self._m.inflight_requests.set(self.requests)
        self.release(reserved)

    def reserve(self, more: int) -> bool:
        """Reserves ``more`` body bytes; False when that would pass the bound."""
        if self.bytes + more > self.limits.max_inflight_bytes:
            return False
        self.bytes += more
        self._m.inflight_bytes.set(self.bytes)
        return True

    def release(self, held: int) -> None:
        """Releases the ``held`` bytes of one request; trims the heap after large ones.

        The trim runs once at least ``TRIM_AFTER_BYTES`` of bodies of ``_INLINE_PARSE_BYTES``
        or more were released and less than ``TRIM_AFTER_BYTES`` stays in flight.
        """
        if held <= 0:
            return
        self.bytes -= held
        self._m.inflight_bytes.set(self.bytes)
        if held >= _INLINE_PARSE_BYTES:
            self._released += held
        if self._released >= TRIM_AFTER_BYTES and self.bytes < TRIM_AFTER_BYTES:
            self._released = 0
            self.trimmer.request()


class _BodyRefused(Exception):
    """Reading a body stopped: answer ``status`` with ``message`` (and close the connection)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class _RateLimitedLog:
    """Logs one line per interval and how many were left out in between."""

    def __init__(self, level: int, interval: float = _REFUSAL_LOG_INTERVAL_SECS) -> None:
        self._level = level
        self._interval = interval
        self._last: Optional[float] = None
        self._skipped = 0

    def log(self, msg: str, *args: object) -> None:
        """Logs ``msg % args`` unless a line went out less than an interval ago."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self._interval:
            self._skipped += 1
            return
        more = f" ({self._skipped} more since the last such line)" if self._skipped else ""
        self._last, self._skipped = now, 0
        logger.log(self._level, msg + "%s", *args, more)


class ServingService:
    """Loads the newest export, replays its delta topic, and serves the HTTP API.

    Args:
        export_dir: an export or a parent of exports (the newest complete one is used).
        replay: replay the delta topic named in ``kafka.txt`` (when it names one).
        kafka_extra: extra librdkafka settings for the delta consumer.
        server_override: delta bootstrap servers instead of ``kafka.txt``'s.
        verify: check embedding shard checksums at load.
        fetch_interval_ms: delta consumer fetch pacing (0 = librdkafka's own).
        limits: bounds on ``/predict`` bodies (default :class:`PredictLimits`).
    """

    def __init__(
        self,
        export_dir: str,
        replay: bool = True,
        kafka_extra: Optional[Mapping[str, str]] = None,
        server_override: str = "",
        verify: bool = True,
        fetch_interval_ms: int = 10,
        limits: Optional[PredictLimits] = None,
    ) -> None:
        self.started = time.time()
        self.limits = limits or PredictLimits()
        self.metrics = ServingMetrics()
        self.model = ServingModel.load(export_dir, verify=verify)
        self.input_fields: list[str] = self.model.feature_builder.parser.field_names
        self.metrics.version.set(self.model.state.version)
        self.source = read_kafka_txt(self.model.path)
        if server_override:
            self.source.server = server_override
        self.replayer: Optional[DeltaReplayer] = None
        if replay and self.source.topic and self.source.server:
            self.replayer = DeltaReplayer(self.model, self.source, self.metrics, kafka_extra,
                                          fetch_interval_ms=fetch_interval_ms)
        elif replay:
            logger.warning("kafka.txt of %s names no delta topic: serving the base only",
                           self.model.path)
        self.gate = _PredictGate(self.limits, self.metrics)
        self.app = build_app(self)
        self._http: Optional[BackgroundHttpServer] = None
        self.stopped = False

    def start(self, host: str = "127.0.0.1", port: int = 0,
              auth_token: Optional[str] = None) -> int:
        """Starts replay and the HTTP server; returns the bound port.

        Args:
            host: bind address.
            port: port (0 = any free port).
            auth_token: bearer token required on every endpoint but /healthz (None = open).
        """
        if self.replayer is not None:
            self.replayer.start()
        self._http = BackgroundHttpServer(self.app, host=host, port=port, auth_token=auth_token,
                                          name="odl-serve prediction API")
        return self._http.start()

    def stop(self) -> None:
        """Stops the HTTP server and the replay."""
        self.stopped = True
        if self._http is not None:
            self._http.stop()
        if self.replayer is not None:
            self.replayer.stop()

    def status(self) -> dict[str, Any]:
        """The /status document."""
        st = self.model.state
        now = time.time()
        freshness = None if st.newest_event_time is None else now - st.newest_event_time
        if freshness is not None:
            self.metrics.freshness.set(freshness)
        r = self.replayer
        h = st.last_header
        return {
            "base_export": self.model.path,
            "base_version": int(self.model.signature.get("global_step", 0)),
            "version": st.version,
            "generation": st.generation,
            "versions_applied": st.versions_applied,
            "rows_applied": st.rows_applied,
            "last_apply_time": st.last_apply_time,
            "newest_event_time": st.newest_event_time,
            "freshness_seconds": freshness,
            "last_version_publish_time": (h.publish_time_ms / 1000.0
                                          if h is not None and h.publish_time_ms else None),
            "delta_topic": self.source.topic,
            "replay_start_offset": self.source.offset,
            "next_offset": r.next_offset if r else None,
            "end_offset": r.end_offset if r else None,
            "lag_messages": r.lag if r else None,
            "messages_read": r.messages if r else 0,
            "rejected_messages": r.rejected_total if r else 0,
            "offset_resets": r.offset_resets if r else 0,
            "rejected_by_reason": dict(r.rejected) if r else {},
            "last_reject": r.last_error if r else None,
            "pending_versions": r.assembler.pending_versions if r else 0,
            # topic ownership: the newest generation on the delta topic owns it; versions of
            # the generations it superseded are rejected as fenced_generation
            "owner_generation": r.fence.owner if r else st.generation,
            "superseded_generations": r.fence.superseded[-10:] if r else [],
            "broker_error": r.broker_error if r else None,
            "broker_error_since": r.broker_error_since if r else None,
            "state": self.state(),
            "uptime_seconds": now - self.started,
        }

    def state(self) -> str:
        """``serving``, ``waiting_for_broker`` (delta broker unreachable) or ``stopped``."""
        if self.stopped:
            return "stopped"
        if self.replayer is not None and self.replayer.broker_error is not None:
            return "waiting_for_broker"
        return "serving"

    def health(self) -> tuple[bool, str]:
        """(healthy, reason) for /healthz."""
        state = self.state()
        if state == "waiting_for_broker" and self.replayer is not None:
            return False, f"waiting_for_broker: {self.replayer.broker_error}"
        return state == "serving", state

    def predict_body(self, body: bytes) -> dict[str, Any]:
        """Answers one /predict body.

        Raises:
            RequestError: malformed body or records.
        """
        records = split_body(body, self.limits.max_body_bytes, self.input_fields)
        try:
            batch, rejected = self.model.build(records)
        except (ValueError, TypeError, UnicodeError) as exc:  # the parser should not raise
            logger.warning("unexpected error parsing a /predict body: %s", exc)
            raise RequestError(f"records could not be parsed: {exc}") from exc
        if rejected:
            raise RequestError(
                f"{len(rejected)} of {len(records)} records are malformed",
                rejected=[{"index": int(i), "reason": r} for i, r in rejected[:100]])
        assert batch is not None
        probs, version, generation = self.model.predict_versioned(batch)
        bad = np.flatnonzero(~np.isfinite(probs))
        if bad.size:  # extreme (finite) inputs can overflow the network
            raise RequestError(
                f"{bad.size} of {len(records)} records give a non-finite prediction (numeric "
                "values out of the model's range)",
                rejected=[{"index": int(i), "reason": "non_finite_prediction"}
                          for i in bad[:100]])
        return {"probabilities": probs.tolist(), "version": version, "generation": generation}




class _BodyReader:
    """Reads one ``/predict`` body chunk by chunk under the service's limits.

    Args:
        gate: the service's in-flight accounting.
        held: bytes already reserved for this request (its declared ``Content-Length``).
    """

    def __init__(self, gate: _PredictGate, held: int) -> None:
        self.gate = gate
        self.held = held
        self.received = 0

    async def read(self, request: Request) -> bytes:
        """The whole body.

        Raises:
            _BodyRefused: over ``max_body_bytes`` (413), over ``max_inflight_bytes`` (503),
                or slower than ``body_timeout_s`` (408).
            ClientDisconnect: the client went away before the body was complete.
        """
        limits = self.gate.limits
        chunks: list[bytes] = []
        try:
            with anyio.fail_after(limits.body_timeout_s or None):
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    chunk = message.get("body", b"")
                    if chunk:
                        self.received += len(chunk)
                        if self.received > limits.max_body_bytes:
                            raise _BodyRefused(
                                413, "body_too_large", f"body exceeds {limits.max_body_bytes} "
                                "bytes (--max_body_bytes)")
                        if self.received > self.held:
                            if not self.gate.reserve(self.received - self.held):
                                raise _BodyRefused(
                                    503, "inflight_bytes", "too many request bytes in flight "
                                    f"(--max_inflight_bytes {limits.max_inflight_bytes}); "
                                    "retry later")
                            self.held = self.received
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
            return b"".join(chunks)
        except TimeoutError:
            raise _BodyRefused(408, "body_timeout", "the body did not arrive within "
                               f"{limits.body_timeout_s:g} s (--body_timeout_s)") from None
        finally:
            chunks.clear()


def _content_length(request: Request) -> Optional[int]:
    """The declared ``Content-Length`` (None when absent, e.g. a chunked body).

    Raises:
        RequestError: not a non-negative integer (uvicorn's parser normally refuses first).
    """
    value = request.headers.get("content-length")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise RequestError("Content-Length is not an integer") from None
    if n < 0:
        raise RequestError("Content-Length is negative")
    return n


def build_app(service: ServingService) -> FastAPI:
    """The FastAPI app of a serving service."""
    app = FastAPI(title="odl serving", docs_url=None, redoc_url=None, openapi_url=None)
    m = service.metrics
    gate = service.gate
    limits = service.limits
    refusal_log = _RateLimitedLog(logging.WARNING)
    disconnect_log = _RateLimitedLog(logging.INFO)

    def error(status: int, message: str, rejected: Optional[list[dict]] = None,
              headers: Optional[dict[str, str]] = None) -> JSONResponse:
        m.requests.labels(str(status)).inc()
        return JSONResponse({"detail": {"error": message, "rejected": rejected or []}},
                            status_code=status, headers=headers)

    def refuse(status: int, reason: str, message: str, unread: Optional[int]) -> JSONResponse:
        """A 408 / 413 / 503 answer, closing the connection unless ``unread`` is small.

        ``unread``: body bytes still to come (None = unknown: a chunked or partly read body).
        """
        m.refused.labels(reason).inc()
        refusal_log.log("/predict refused with %d (%s): %s", status, reason, message)
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(RETRY_AFTER_SECS)
        if unread is None or unread > _DRAIN_FACTOR * limits.max_body_bytes:
            headers["Connection"] = "close"
        return error(status, message, headers=headers)

    async def answer(request: Request, reader: _BodyReader) -> Response:
        t0 = time.perf_counter()
        try:
            body = await reader.read(request)
        except _BodyRefused as exc:  # chunked, or stalled: the rest is unknown
            return refuse(exc.status, exc.reason, str(exc), None)
        except ClientDisconnect:
            m.requests.labels("499").inc()
            m.client_disconnects.inc()
            client = request.client
            disconnect_log.log("/predict client %s disconnected after %d bytes of the body "
                               "(499)", f"{client.host}:{client.port}" if client else "?",
                               reader.received)
            return Response(status_code=499)
        try:
            if len(body) > _INLINE_PARSE_BYTES:
                out = await run_in_threadpool(service.predict_body, body)
            else:
                out = service.predict_body(body)
        except RequestError as exc:
            if exc.status == 413:
                m.refused.labels("too_many_records").inc()
            return error(exc.status, str(exc), exc.rejected)
        finally:
            del body
        m.requests.labels("200").inc()
        m.records.inc(len(out["probabilities"]))
        m.latency.observe(time.perf_counter() - t0)
        return JSONResponse(out)

    @app.post("/predict")
    async def predict(request: Request) -> Response:
        try:
            declared = _content_length(request)
        except RequestError as exc:
            return error(400, str(exc), headers={"Connection": "close"})
        # A client waiting for "100 Continue" may never send the body it declared: after an
        # early answer the connection cannot be told apart from its next request.
        unread = (None if "100-continue" in request.headers.get("expect", "").lower()
                  else declared)
        if declared is not None and declared > limits.max_body_bytes:
            return refuse(413, "body_too_large",
                          f"body of {declared} bytes (Content-Length) exceeds "
                          f"{limits.max_body_bytes} (--max_body_bytes)", unread)
        if not gate.enter():
            return refuse(503, "inflight_requests",
                          f"{limits.max_inflight_requests} /predict requests in flight "
                          "(--max_inflight_requests); retry later", unread)
        reader = _BodyReader(gate, 0)
        try:
            if declared:
                if not gate.reserve(declared):
                    return refuse(503, "inflight_bytes",
                                  "too many request bytes in flight (--max_inflight_bytes "
                                  f"{limits.max_inflight_bytes}); retry later", unread)
                reader.held = declared
            return await answer(request, reader)
        finally:  # the body is gone with answer()'s frame: release its bytes (maybe trim)
            gate.leave(reader.held)

    @app.get("/status")
    def status() -> JSONResponse:
        return JSONResponse(service.status())

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, reason = service.health()
        return JSONResponse({"ok": ok, "reason": reason, "version": service.model.state.version},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        service.status()  # refreshes the freshness gauge
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app
