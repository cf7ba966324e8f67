"""The serving process: base model + delta replay + HTTP API (FastAPI on uvicorn).

Endpoints (bound to 127.0.0.1 unless told otherwise; with a token, all but /healthz need
``Authorization: Bearer <token>``, see ``odl.http_auth``)::

    POST /predict   body: records as in the training stream, one or many:
                    * text: one CSV (or JSON) record per line;
                    * JSON: one object (a record), an array of objects (or of CSV strings),
                      or {"records": [...]} / {"instances": [...]}.
                    The label column may be omitted (a dummy 0 is filled in).
                    200 {"probabilities": [...], "version": v, "generation": g}
                    400 {"detail": {"error": str, "rejected": [{"index", "reason"}]}} when
                    the body or any record is malformed; 413 when too large. Never 5xx for
                    bad input.
    GET /status     base export, version / generation applied, versions applied, last apply
                    time, freshness, lag to the delta topic end, rejected messages
    GET /healthz    200 {"ok": true, "state": ...} once the base is loaded; 503 when stopped
                    or while the delta broker is unreachable (state "waiting_for_broker":
                    /predict keeps answering with the last applied version)
    GET /metrics    Prometheus text (own registry)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from odl.http_server import BackgroundHttpServer
from serving_plugin.delta_replayer import DeltaReplayer
from serving_plugin.serving_metrics import ServingMetrics
from serving_plugin.serving_model import ServingModel, read_kafka_txt

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
MAX_RECORDS = 100_000
_LIST_KEYS = ("records", "instances")


class RequestError(ValueError):
    """A /predict body that cannot be turned into records (answered with 400 / 413)."""

    def __init__(self, message: str, status: int = 400,
                 rejected: Optional[list[dict]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.rejected = rejected or []


def split_body(body: bytes) -> list[bytes]:
    """Turns a /predict body into raw records (see the module docstring).

    Args:
        body: the request body.

    Returns:
        The records, each as the training stream would carry it.

    Raises:
        RequestError: empty, undecodable or oddly shaped body.
    """
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}", 413)
    text = body.strip()
    if not text:
        raise RequestError("empty body: send CSV lines or JSON records")
    records: list[bytes]
    if text[:1] in (b"[", b"{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        if doc is None:
            if text[:1] == b"{":  # newline-delimited JSON records
                records = [ln for ln in text.splitlines() if ln.strip()]
            else:
                raise RequestError("body is not valid JSON")
        else:
            if isinstance(doc, dict) and len(doc) == 1 and next(iter(doc)) in _LIST_KEYS:
                doc = doc[next(iter(doc))]
            items = doc if isinstance(doc, list) else [doc]
            records = []
            for i, item in enumerate(items):
                if isinstance(item, dict):
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
    return records


class ServingService:
    """Loads the newest export, replays its delta topic, and serves the HTTP API.

    Args:
        export_dir: an export or a parent of exports (the newest complete one is used).
        replay: replay the delta topic named in ``kafka.txt`` (when it names one).
        kafka_extra: extra librdkafka settings for the delta consumer.
        server_override: delta bootstrap servers instead of ``kafka.txt``'s.
        verify: check embedding shard checksums at load.
        fetch_interval_ms: delta consumer fetch pacing (0 = librdkafka's own).
    """

    def __init__(
        self,
        export_dir: str,
        replay: bool = True,
        kafka_extra: Optional[Mapping[str, str]] = None,
        server_override: str = "",
        verify: bool = True,
        fetch_interval_ms: int = 10,
    ) -> None:
        self.started = time.time()
        self.metrics = ServingMetrics()
        self.model = ServingModel.load(export_dir, verify=verify)
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
        records = split_body(body)
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


def build_app(service: ServingService) -> FastAPI:
    """The FastAPI app of a serving service."""
    app = FastAPI(title="odl serving", docs_url=None, redoc_url=None, openapi_url=None)
    m = service.metrics

    @app.post("/predict")
    async def predict(request: Request) -> JSONResponse:
        t0 = time.perf_counter()
        body = await request.body()
        try:
            if len(body) > 64 << 10:
                out = await run_in_threadpool(service.predict_body, body)
            else:
                out = service.predict_body(body)
        except RequestError as exc:
            m.requests.labels(str(exc.status)).inc()
            return JSONResponse({"detail": {"error": str(exc), "rejected": exc.rejected}},
                                status_code=exc.status)
        m.requests.labels("200").inc()
        m.records.inc(len(out["probabilities"]))
        m.latency.observe(time.perf_counter() - t0)
        return JSONResponse(out)

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
