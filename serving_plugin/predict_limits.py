"""Bounds on ``/predict`` request bodies, and reading a body within them.

``PredictLimits`` holds the ``odl-serve`` flags (``--max_body_bytes``,
``--max_inflight_requests``, ``--max_inflight_bytes``, ``--body_timeout_s``). ``PredictGate``
counts the requests and body bytes in flight (a declared ``Content-Length`` is reserved when
the request arrives, a chunked body's bytes as they arrive) and hands freed heap memory back
to the OS after large bodies (``MemoryTrimmer``). ``BodyReader`` reads one body chunk by chunk
and stops with ``BodyRefused`` (413, 503 or 408) as soon as a bound is passed, so a body never
occupies more than ``max_body_bytes`` in the process and all bodies together never more than
``max_inflight_bytes``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import anyio
from starlette.requests import ClientDisconnect, Request

from serving_plugin.serving_metrics import ServingMetrics

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
MAX_INFLIGHT_REQUESTS = 64
MAX_INFLIGHT_BYTES = 64 << 20
BODY_TIMEOUT_SECS = 30.0
RETRY_AFTER_SECS = 1
# Bodies up to this size are parsed on the event loop; larger ones in the thread pool.
INLINE_PARSE_BYTES = 64 << 10
# A refusal sent before the body is read keeps the connection when the declared body is at
# most this many times --max_body_bytes: uvicorn then reads and discards the rest (nothing
# is buffered), so a client that writes its whole body before reading still gets the answer.
# A longer or unknown (chunked) remainder closes the connection: no one can make the server
# drain gigabytes.
DRAIN_FACTOR = 4
# Freed heap pages go back to the OS (glibc malloc_trim) once bodies of at least
# INLINE_PARSE_BYTES totalling this many bytes were released and less than this is in flight.
TRIM_AFTER_BYTES = 1 << 20
_REFUSAL_LOG_INTERVAL_SECS = 10.0


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


class MemoryTrimmer:
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


class PredictGate:
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
        self._released = 0  # bytes of bodies >= INLINE_PARSE_BYTES released since a trim
        self.trimmer = MemoryTrimmer()

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

        The trim runs once at least ``TRIM_AFTER_BYTES`` of bodies of ``INLINE_PARSE_BYTES``
        or more were released and less than ``TRIM_AFTER_BYTES`` stays in flight.
        """
        if held <= 0:
            return
        self.bytes -= held
        self._m.inflight_bytes.set(self.bytes)
        if held >= INLINE_PARSE_BYTES:
            self._released += held
        if self._released >= TRIM_AFTER_BYTES and self.bytes < TRIM_AFTER_BYTES:
            self._released = 0
            self.trimmer.request()


class BodyRefused(Exception):
    """Reading a body stopped: answer ``status`` with ``message`` (and close the connection)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class RateLimitedLog:
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


class BodyReader:
    """Reads one ``/predict`` body chunk by chunk under the service's limits.

    Args:
        gate: the service's in-flight accounting.
        held: bytes already reserved for this request (its declared ``Content-Length``).
    """

    def __init__(self, gate: PredictGate, held: int) -> None:
        self.gate = gate
        self.held = held
        self.received = 0

    async def read(self, request: Request) -> bytes:
        """The whole body.

        Raises:
            BodyRefused: over ``max_body_bytes`` (413), over ``max_inflight_bytes`` (503),
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
                            raise BodyRefused(
                                413, "body_too_large", f"body exceeds {limits.max_body_bytes} "
                                "bytes (--max_body_bytes)")
                        if self.received > self.held:
                            if not self.gate.reserve(self.received - self.held):
                                raise BodyRefused(
                                    503, "inflight_bytes", "too many request bytes in flight "
                                    f"(--max_inflight_bytes {limits.max_inflight_bytes}); "
                                    "retry later")
                            self.held = self.received
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
            return b"".join(chunks)
        except TimeoutError:
            raise BodyRefused(408, "body_timeout", "the body did not arrive within "
                               f"{limits.body_timeout_s:g} s (--body_timeout_s)") from None
        finally:
            chunks.clear()
