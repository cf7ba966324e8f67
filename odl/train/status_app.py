"""The trainer's HTTP status API (FastAPI).

Endpoints:
    GET /status   state, global step, samples, rates, checkpoint, progressive metrics,
                  per-partition position / high watermark / lag.
    GET /offsets  the positions the trained model covers (next offset per partition).
    GET /healthz  200 {"ok": true} while healthy, 503 with the reason otherwise.
    GET /metrics  Prometheus text exposition.
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
    def status() -> dict:
        return provider.status()

    @app.get("/offsets")
    def offsets() -> dict:
        return provider.offsets()

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, reason = provider.health()
        return JSONResponse({"ok": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
