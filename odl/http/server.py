"""Runs an ASGI app (FastAPI) on uvicorn in a background thread of a daemon process.

Used by the trainer's status API and by serving. Binds 127.0.0.1 unless told otherwise; port
0 picks a free port, readable from :attr:`BackgroundHttpServer.port` once started. With an
auth token every endpoint but ``/healthz`` requires ``Authorization: Bearer <token>``
(``odl.http.auth``); binding a non-loopback address without one logs a loud warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

import uvicorn

from odl.http.auth import protect, warn_if_exposed

logger = logging.getLogger(__name__)


class BackgroundHttpServer:
    """A uvicorn server in a daemon thread.

    Args:
        app: the ASGI application.
        host: address to bind (127.0.0.1 by default).
        port: port to bind (0 = any free port).
        auth_token: bearer token required on every endpoint but ``/healthz`` (None = open).
        name: what the API is, for log messages.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 auth_token: Optional[str] = None, name: str = "http API") -> None:
        warn_if_exposed(host, auth_token, name)
        config = uvicorn.Config(
            protect(app, auth_token), host=host, port=port, log_level="warning",
            access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        # uvicorn installs signal handlers only in the main thread; make sure it never does.
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.run, name="http-server", daemon=True)
        self.host = host
        self.port = port
        self.auth = bool(auth_token)
        self._on_stop: list[Callable[[], None]] = []

    def stop_with(self, fn: Callable[[], None]) -> None:
        """Calls ``fn`` when the server stops (a helper thread serving its pages, say)."""
        self._on_stop.append(fn)

    def start(self, timeout: float = 10.0) -> int:
        """Starts serving and waits until the socket is bound.

        Args:
            timeout: seconds to wait for the server to come up.

        Returns:
            The bound port.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"http server on {self.host}:{self.port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"http server on {self.host}:{self.port} did not start")
            time.sleep(0.02)
        sockets = [s for srv in self._server.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1]
        logger.info("serving http on %s:%d (%s)", self.host, self.port,
                    "bearer token required" if self.auth else "no authentication")
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the server and joins its thread."""
        for fn in self._on_stop:
            fn()
        self._server.should_exit = True
        self._thread.join(timeout)
