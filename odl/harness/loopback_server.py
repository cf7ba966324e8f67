"""What the cloud test doubles share: a threaded HTTP server on 127.0.0.1, started and stopped.

``LoopbackServer`` runs ``handler`` (a ``BaseHTTPRequestHandler`` subclass whose ``owner``
attribute is set to the server object) in daemon threads; ``endpoint`` is
``http://127.0.0.1:PORT``. It is ready when ``start`` returns. ``run_in_child`` starts a double
in a process of its own (for benchmarks, so the double's Python does not share this process's
interpreter lock) and returns the process and its endpoint.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


class LoopbackServer:
    """A threaded HTTP server on loopback serving ``handler`` with ``owner = self``.

    Args:
        handler: the request handler class.
        port: port to bind (0: a free one).
    """

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self._handler = handler
        self._port = port
        self._server: Optional[ThreadingHTTPServer] = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self):  # noqa: ANN201 - returns the subclass
        """Starts serving; ready when this returns."""
        handler = type("Handler", (self._handler,), {"owner": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True,
                         name=type(self).__name__).start()
        return self

    def stop(self) -> None:
        """Stops serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):  # noqa: ANN204 - returns the subclass
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_in_child(setup: str) -> tuple[subprocess.Popen, str]:
    """Starts a double in a child process; it stops when its stdin is closed.

    Args:
        setup: Python statements that leave a started double in ``d`` (imports included).

    Returns:
        ``(process, endpoint)``.
    """
    code = f"import sys\n{setup}\nprint(d.endpoint, flush=True)\nsys.stdin.read()\nd.stop()\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()
