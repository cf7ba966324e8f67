"""The serving process: base model + delta replay + HTTP API (FastAPI on uvicorn).

Endpoints (bound to 127.0.0.1 unless told otherwise; with a token, all but /healthz and
the page's code at / need ``Authorization: Bearer <token>``, see ``odl.http.auth``)::

    GET /           the live dashboard page (``serving_plugin.serving_dashboard``): version,
                    freshness, replay lag, /predict rate and latency, rejected versions
    GET /history    its figures over time (``odl.http.metric_history``; ``?since=<unix s>``)

    POST /predict   body: records as in the training stream, one or many:
                    * text: one CSV (or JSON) record per line;
                    * JSON: one object (a record: its keys are input field names), an
                      array of objects (or of CSV strings), or exactly {"records": [...]} /
                      {"instances": [...]}.
                    The label columns may be omitted (dummy 0s are filled in).
                    200 {"probabilities": [...], "outputs": {name: [...]}, "version": v,
                    "generation": g}: one probability per record and output ("outputs",
                    by the model's output names: one per task of a multi-task model);
                    "probabilities" is the first output's
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
    GET /metrics    Prometheus text (own registry; freshness and odl_serving_healthy are
                    refreshed at each scrape)

Request bodies are read by the endpoint itself, chunk by chunk, under
``serving_plugin.predict_limits.PredictLimits``: a body never occupies more than
``max_body_bytes`` in this process, and all bodies being read or answered together never
more than ``max_inflight_bytes``. ``serving_plugin.predict_body`` turns a body into records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from odl.http.dashboard_page import dashboard_html
from odl.http.latency_window import LatencyWindow
from odl.http.metric_history import HistorySampler, MetricHistory
from odl.http.server import BackgroundHttpServer
from publisher.delta_stream import OTHER_MODEL_REASON
from publisher.model_identity import model_of_generation
from serving_plugin.delta_replayer import DeltaReplayer
from serving_plugin.export_reader import ExportLoadError, KafkaReplaySource, read_kafka_txt
from serving_plugin.pass_delta_follower import PassDeltaFollower, base_day_of
from serving_plugin.predict_body import RequestError, content_length, split_body
from serving_plugin.predict_limits import (
    DRAIN_FACTOR,
    INLINE_PARSE_BYTES,
    RETRY_AFTER_SECS,
    BodyReader,
    BodyRefused,
    PredictGate,
    PredictLimits,
    RateLimitedLog,
)
from serving_plugin.serving_dashboard import HISTORY_INTERVAL_S, SERVING_LAYOUT, history_point
from serving_plugin.serving_metrics import ServingMetrics
from serving_plugin.serving_model import ServingModel
from serving_plugin.serving_tier import DiskTierSettings

logger = logging.getLogger(__name__)


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
        delta_dir: a file stream's ``model_save_path``: apply its day/pass deltas after the
            base's day (:mod:`serving_plugin.pass_delta_follower`) instead of the delta topic.
        delta_after_day: the base's day (``YYYYMMDD``); default: from the export's path
            (``<root>/<day>/base/...``).
        delta_poll_secs: seconds between two looks for new delta directories.
        disk_tier: serve the large dynamic tables from RAM and local disk
            (``serving_plugin.serving_tier``; None: every row in RAM).
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
        delta_dir: str = "",
        delta_after_day: str = "",
        delta_poll_secs: float = 5.0,
        disk_tier: Optional[DiskTierSettings] = None,
    ) -> None:
        self.started = time.time()
        self.limits = limits or PredictLimits()
        self.metrics = ServingMetrics()
        self.model = ServingModel.load(export_dir, verify=verify, disk_tier=disk_tier)
        self.input_fields: list[str] = self.model.feature_builder.parser.field_names
        self.metrics.version.set(self.model.state.version)
        self.source = read_kafka_txt(self.model.path)
        if server_override:
            self.source.server = server_override
        self.replayer: Optional[DeltaReplayer] = None
        self.follower: Optional[PassDeltaFollower] = None
        if replay and delta_dir:
            after = delta_after_day or base_day_of(self.model.path)
            if not after:
                raise ExportLoadError(
                    f"{self.model.path} is not a day base (<root>/<YYYYMMDD>/base/...): say "
                    "after which day the deltas of --delta_dir apply (--delta_after_day)")
            applier = DeltaReplayer(self.model, KafkaReplaySource("", "", 0), self.metrics)
            self.follower = PassDeltaFollower(applier, delta_dir, after, delta_poll_secs)
        elif replay and self.source.topic and self.source.server:
            self.replayer = DeltaReplayer(self.model, self.source, self.metrics, kafka_extra,
                                          fetch_interval_ms=fetch_interval_ms)
        elif replay:
            logger.warning("kafka.txt of %s names no delta topic: serving the base only",
                           self.model.path)
        self.gate = PredictGate(self.limits, self.metrics)
        # the dashboard: /predict times between two history points, the history itself
        self.predict_times = LatencyWindow()
        self.history = MetricHistory(HISTORY_INTERVAL_S)
        self._sampler = HistorySampler(
            self.history, lambda: history_point(self.status(), self.predict_times.take()),
            name="serving-history")
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
        if self.follower is not None:
            self.follower.start()
        self._http = BackgroundHttpServer(self.app, host=host, port=port, auth_token=auth_token,
                                          name="odl-serve prediction API")
        bound = self._http.start()
        self._sampler.start()
        self._http.stop_with(self._sampler.stop)
        return bound

    def stop(self) -> None:
        """Stops the HTTP server and the replay."""
        self.stopped = True
        if self._http is not None:
            self._http.stop()
        if self.replayer is not None:
            self.replayer.stop()
        if self.follower is not None:
            self.follower.stop()
        self.model.close()

    def status(self) -> dict[str, Any]:
        """The /status document."""
        st = self.model.state
        now = time.time()
        freshness = None if st.newest_event_time is None else now - st.newest_event_time
        if freshness is not None:
            self.metrics.freshness.set(freshness)
        r = self.replayer or (self.follower.replayer if self.follower is not None else None)
        h = st.last_header
        return {
            "base_export": self.model.origin,
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
            "republish_rewinds": r.republish_rewinds if r else 0,
            "rejected_by_reason": dict(r.rejected) if r else {},
            "last_reject": r.last_error if r else None,
            "pending_versions": r.assembler.pending_versions if r else 0,
            # topic ownership: only the base's model is applied (another model's versions are
            # rejected as other_model); of its generations the newest owns the topic, and
            # versions of the generations it superseded are rejected as fenced_generation
            "model_id": r.reader.model if r else model_of_generation(st.generation or ""),
            "other_model_versions_rejected": (r.rejected.get(OTHER_MODEL_REASON, 0)
                                              if r else 0),
            "owner_generation": r.fence.owner if r else st.generation,
            "superseded_generations": r.fence.superseded[-10:] if r else [],
            "broker_error": r.broker_error if r else None,
            "broker_error_since": r.broker_error_since if r else None,
            "state": self.state(),
            "uptime_seconds": now - self.started,
            "dynamic_tables": self.model.dynamic_status() or None,
            "pass_deltas": self.follower.status() if self.follower is not None else None,
        }

    def state(self) -> str:
        """``serving``, ``waiting_for_broker`` (delta broker unreachable) or ``stopped``."""
        if self.stopped:
            return "stopped"
        if self.replayer is not None and self.replayer.broker_error is not None:
            return "waiting_for_broker"
        return "serving"

    def health(self) -> tuple[bool, str]:
        """(healthy, reason) for /healthz; also sets the ``odl_serving_healthy`` gauge."""
        state = self.state()
        if state == "waiting_for_broker" and self.replayer is not None:
            ok, reason = False, f"waiting_for_broker: {self.replayer.broker_error}"
        else:
            ok, reason = state == "serving", state
        self.metrics.healthy.set(1 if ok else 0)
        return ok, reason

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
        bad = np.flatnonzero(~np.isfinite(probs.reshape(len(probs), -1)).all(axis=1))
        if bad.size:  # extreme (finite) inputs can overflow the network
            raise RequestError(
                f"{bad.size} of {len(records)} records give a non-finite prediction (numeric "
                "values out of the model's range)",
                rejected=[{"index": int(i), "reason": "non_finite_prediction"}
                          for i in bad[:100]])
        names = self.model.outputs
        columns = [probs] if probs.ndim == 1 else [probs[:, i] for i in range(probs.shape[1])]
        return {"probabilities": columns[0].tolist(),
                "outputs": {n: c.tolist() for n, c in zip(names, columns, strict=True)},
                "version": version, "generation": generation}


def build_app(service: ServingService) -> FastAPI:
    """The FastAPI app of a serving service."""
    app = FastAPI(title="odl serving", docs_url=None, redoc_url=None, openapi_url=None)
    m = service.metrics
    gate = service.gate
    limits = service.limits
    refusal_log = RateLimitedLog(logging.WARNING)
    disconnect_log = RateLimitedLog(logging.INFO)

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
        if unread is None or unread > DRAIN_FACTOR * limits.max_body_bytes:
            headers["Connection"] = "close"
        return error(status, message, headers=headers)

    async def answer(request: Request, reader: BodyReader) -> Response:
        t0 = time.perf_counter()
        try:
            body = await reader.read(request)
        except BodyRefused as exc:  # chunked, or stalled: the rest is unknown
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
            if len(body) > INLINE_PARSE_BYTES:
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
        seconds = time.perf_counter() - t0
        m.latency.observe(seconds)
        service.predict_times.add(seconds)
        return JSONResponse(out)

    @app.post("/predict")
    async def predict(request: Request) -> Response:
        try:
            declared = content_length(request)
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
        reader = BodyReader(gate, 0)
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

    page = dashboard_html(SERVING_LAYOUT, service.history.interval_s)

    @app.get("/")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/history")
    async def history_points(since: Optional[float] = None) -> JSONResponse:
        return JSONResponse(service.history.to_json(since))

    @app.get("/metrics")
    def metrics() -> Response:
        service.status()  # refreshes the freshness gauge
        service.health()  # and odl_serving_healthy
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app
