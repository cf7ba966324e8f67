"""The trainer's HTTP status API (FastAPI).

Endpoints:
    GET /         the live dashboard page (``odl.train.trainer_dashboard``); open, it asks
                  for the token itself and shows nothing without it.
    GET /history  the dashboard's figures over time (``odl.http.metric_history``);
                  ``?since=<unix s>`` for the points after that time only.
    GET /status   state, global step, samples, rates, checkpoint, progressive metrics,
                  per-partition position / high watermark / lag.
    GET /offsets  the positions the trained model covers (next offset per partition).
    GET /healthz  200 {"ok": true} while healthy, 503 with the reason otherwise.
    GET /metrics  Prometheus text exposition (``odl_healthy`` refreshed at each scrape).

The JSON endpoints are ``async``: they run on the server's event loop thread instead of a
worker thread. The provider's methods are cheap (no I/O, short locks, cached progressive
metrics), and skipping the threadpool hop saves two GIL hand-offs per request, which is most of
the latency while the training threads keep the GIL busy.
"""

from __future__ import annotations

from typing import Optional, Protocol

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from odl.http.dashboard_page import dashboard_html
from odl.http.metric_history import MetricHistory
from odl.train.trainer_dashboard import TRAINER_LAYOUT


class TrainerStatusProvider(Protocol):
    """What the status API asks the trainer."""

    def status(self) -> dict:
        """The full status document."""
        ...

    def offsets(self) -> dict:
        """Trained positions."""
        ...

    def health(self) -> tuple[bool, str]:
        """(healthy, reason); also sets the ``odl_healthy`` gauge."""
        ...


def build_status_app(provider: TrainerStatusProvider, registry: CollectorRegistry,
                     history: Optional[MetricHistory] = None) -> FastAPI:
    """Builds the status app.

    Args:
        provider: the trainer.
        registry: the Prometheus registry with the trainer's metrics.
        history: the dashboard's history (default: an empty one).

    Returns:
        The FastAPI application.
    """
    app = FastAPI(title="odl trainer", docs_url=None, redoc_url=None, openapi_url=None)
    history = history if history is not None else MetricHistory()
    page = dashboard_html(TRAINER_LAYOUT, history.interval_s)

    @app.get("/")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/history")
    async def history_points(since: Optional[float] = None) -> JSONResponse:
        return JSONResponse(history.to_json(since))

    @app.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(provider.status())

    @app.get("/offsets")
    async def offsets() -> JSONResponse:
        return JSONResponse(provider.offsets())

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok, reason = provider.health()
        return JSONResponse({"ok": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        provider.health()  # refreshes odl_healthy
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
