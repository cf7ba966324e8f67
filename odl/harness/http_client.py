"""The harness's HTTP client for the trainer's and serving's endpoints.

``http_request`` answers with the status, headers and body whatever the status (tests check
401s, 413s, 503s); ``get_json`` and ``post_json`` are the two shortcuts everything else uses.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class HttpReply:
    """One HTTP answer.

    Attributes:
        status: the status code.
        body: the body.
        headers: the response headers, names in lower case.
    """

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body parsed as JSON.

        Raises:
            ValueError: the body is not JSON.
        """
        return json.loads(self.body)


def http_request(
    url: str,
    body: Optional[bytes] = None,
    headers: Optional[Mapping[str, str]] = None,
    method: Optional[str] = None,
    timeout: float = 30.0,
) -> HttpReply:
    """Sends one request; an error status is an answer like any other.

    Args:
        url: the URL.
        body: the request body (None: a GET unless ``method`` says otherwise).
        headers: request headers.
        method: the method (default: POST with a body, GET without).
        timeout: socket timeout in seconds.

    Returns:
        The answer.

    Raises:
        OSError: no answer (connection refused, timeout).
    """
    req = urllib.request.Request(url, data=body, headers=dict(headers or {}), method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return HttpReply(r.status, r.read(), _lower_case(r.headers.items()))
    except urllib.error.HTTPError as exc:
        with exc:
            return HttpReply(exc.code, exc.read(), _lower_case(exc.headers.items()))


def _lower_case(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in items}


def get_json(url: str, timeout: float = 5.0) -> Optional[Any]:
    """GETs a JSON document.

    Args:
        url: the URL.
        timeout: socket timeout in seconds.

    Returns:
        The document of a 2xx answer; None when the server is unreachable, answers with an
        error status or not with JSON (e.g. while it starts).
    """
    try:
        reply = http_request(url, timeout=timeout)
        return reply.json() if 200 <= reply.status < 300 else None
    except (OSError, ValueError):
        return None


def post_json(url: str, body: bytes, content_type: str = "text/plain",
              timeout: float = 30.0) -> Any:
    """POSTs a body and returns the JSON answer.

    Args:
        url: the URL.
        body: the request body.
        content_type: its ``Content-Type``.
        timeout: socket timeout in seconds.

    Returns:
        The answer's JSON document.

    Raises:
        RuntimeError: the answer has an error status.
        OSError: no answer.
    """
    reply = http_request(url, body, {"Content-Type": content_type}, "POST", timeout)
    if not 200 <= reply.status < 300:
        raise RuntimeError(f"POST {url}: {reply.status} {reply.body[:200]!r}")
    return reply.json()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
