"""Optional bearer-token protection of the HTTP APIs (trainer status and serving).

Both servers bind 127.0.0.1 unless ``--status_host`` / ``--host`` says otherwise. When a
token is configured, every request except ``GET /healthz`` (load balancers and systemd
watchdogs probe it without credentials) must carry ``Authorization: Bearer <token>``;
anything else gets ``401``. The token comes from ``--auth_token_file PATH`` (the file's
contents, surrounding whitespace removed) or else the ``ODL_AUTH_TOKEN`` environment
variable; it is never logged. Binding a non-loopback address without a token logs a loud
warning: the status and prediction APIs would then be open to the network.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Optional

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "ODL_AUTH_TOKEN"
OPEN_PATHS = ("/healthz",)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class AuthConfigError(ValueError):
    """The token file is missing, unreadable or empty (CLIs exit with code 2)."""


def resolve_auth_token(token_file: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The bearer token to require, or None for no authentication.

    Args:
        token_file: path of a file holding the token (wins over the environment).
        environ: environment to read ``ODL_AUTH_TOKEN`` from (default ``os.environ``).

    Returns:
        The token, or None when neither source gives one.

    Raises:
        AuthConfigError: ``token_file`` cannot be read or holds only whitespace.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"--auth_token_file: cannot read {token_file}: "
                                  f"{exc.__class__.__name__}") from None
        if not token:
            raise AuthConfigError(f"--auth_token_file: {token_file} is empty")
        return token
    env = os.environ if environ is None else environ
    token = env.get(AUTH_TOKEN_ENV, "").strip()
    return token or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts local connections (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, token: Optional[str], what: str) -> bool:
    """Logs a loud warning when ``host`` is not loopback and no token protects the API.

    Args:
        host: the bind address.
        token: the configured token (None = none).
        what: the API's name for the message (e.g. "odl-train status API").

    Returns:
        True when the warning was logged.
    """
    if token or is_loopback(host):
        return False
    logger.warning(
        "SECURITY: the %s binds %s, reachable from the network, WITHOUT authentication; "
        "anyone who can connect can read it%s. Give --auth_token_file or set %s, or bind "
        "127.0.0.1.", what, host, " and call /predict" if "serv" in what else "",
        AUTH_TOKEN_ENV)
    return True


class BearerAuthMiddleware:
    """ASGI middleware requiring ``Authorization: Bearer <token>`` on every HTTP request.

    Args:
        app: the wrapped ASGI application.
        token: the expected token.
        open_paths: paths answered without a token.
    """

    def __init__(self, app: ASGIApp, token: str, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        if not token:
            raise ValueError("empty token")
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answers 401 unless the request may pass, else hands it to the wrapped app."""
        if scope.get("type") != "http" or scope.get("path") in self._open:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value
                break
        if given and hmac.compare_digest(given.strip(), self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": {"error": "missing or wrong bearer token"
                                      if given else "authorization required: send "
                                      "'Authorization: Bearer <token>'"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="odl"')]})
        await send({"type": "http.response.body", "body": body})


def protect(app: ASGIApp, token: Optional[str]) -> ASGIApp:
    """Wraps ``app`` with :class:`BearerAuthMiddleware` when ``token`` is set.

    Args:
        app: an ASGI application.
        token: the token, or None to leave the app open.

    Returns:
        The protected (or unchanged) application.
    """
    return BearerAuthMiddleware(app, token) if token else app
