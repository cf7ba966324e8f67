"""The trainer's HTTP status API (FastAPI).

Endpoints:
    GET /status   state, global step, samples, rates, checkpoint, progressive metrics,
                  per-partition position / high watermark / lag.
    GET /offsets  the positions the trained model covers (next offset per partition).
    GET /healthz  200 {"ok": true} while healthy, 503 with the reason otherwise.
    GET /metrics  Prometheus text exposition.

The JSON endpoints are ``async``: they run on the server's event loop thread instead of a
worker thread. The provider's methods are cheap (no I/O, short locks, cached progressive
metrics), and skipping the threadpool hop saves two GIL hand-offs per request, which is most of
the latency while the training threads keep the GIL busy.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class TrainerStatusProvider(Protocol):
    """What the status API asks the trainer."""

    def status(self) -> dict:
        """The full status document."""
        ...

    def offsets(self) -> dict:
        """Trained positions."""
        ...

    def health(self) -> tuple[bool, str]:
        """(healthy, reason)."""
        ...


def build_status_app(provider: TrainerStatusProvider, registry: CollectorRegistry) -> FastAPI:
    """Builds the status app.

    Args:
        provider: the trainer.
        registry: the Prometheus registry with the trainer's metrics.

    Returns:
        The FastAPI application.
    """
    app = FastAPI(title="odl trainer", docs_url=None, redoc_url=None, openapi_url=None)

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
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
