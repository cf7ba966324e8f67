"""Optional bearer-token protection of the HTTP APIs (trainer status and serving).

Both servers bind 127.0.0.1 unless ``--status_host`` / ``--host`` says otherwise. When a
token is configured, every request except ``GET /healthz`` (load balancers and systemd
watchdogs probe it without credentials) and ``GET /`` (the dashboard page's code, which
holds no figures and asks for the token itself: ``odl.http.dashboard_page``) must carry
``Authorization: Bearer <token>`` (the scheme in any letter case); anything else gets
``401``. The token comes from ``--auth_token_file PATH`` (the file's contents, surrounding
whitespace removed; a regular file of at most 4 KiB) or else the ``ODL_AUTH_TOKEN``
environment variable; it is never logged. Binding a non-loopback address without a token
logs a loud warning: the status and prediction APIs would then be open to the network.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Optional

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "ODL_AUTH_TOKEN"
OPEN_PATHS = ("/healthz", "/")
MAX_TOKEN_FILE_BYTES = 4096
# A 401 keeps the connection (the server discards the unread body) up to this body size.
DRAIN_BYTES = 1 << 20

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class AuthConfigError(ValueError):
    """The token file is missing, unreadable, too large or empty (CLIs exit with code 2)."""


def _read_token_file(path: str) -> str:
    """The contents of a token file, read with a cap (see :func:`resolve_auth_token`).

    Raises:
        AuthConfigError: not a regular readable file, larger than ``MAX_TOKEN_FILE_BYTES``,
            not UTF-8, or only whitespace.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
        fd = os.open(path, flags)
    except OSError as exc:
        raise AuthConfigError(f"--auth_token_file: cannot read {path}: "
                              f"{exc.__class__.__name__}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthConfigError(f"--auth_token_file: {path} is not a regular file")
        if st.st_size > MAX_TOKEN_FILE_BYTES:
            raise AuthConfigError(f"--auth_token_file: {path} is larger than "
                                  f"{MAX_TOKEN_FILE_BYTES} bytes")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)  # one more: a file that grew
    except OSError as exc:
        raise AuthConfigError(f"--auth_token_file: cannot read {path}: "
                              f"{exc.__class__.__name__}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise AuthConfigError(f"--auth_token_file: {path} is larger than "
                              f"{MAX_TOKEN_FILE_BYTES} bytes")
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise AuthConfigError(f"--auth_token_file: {path} is not UTF-8 text") from None
    if not token:
        raise AuthConfigError(f"--auth_token_file: {path} is empty")
    return token


def resolve_auth_token(token_file: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The bearer token to require, or None for no authentication.

    Args:
        token_file: path of a file holding the token (wins over the environment). It must be
            a regular file of at most ``MAX_TOKEN_FILE_BYTES`` (4 KiB) of UTF-8 text.
        environ: environment to read ``ODL_AUTH_TOKEN`` from (default ``os.environ``).

    Returns:
        The token, or None when neither source gives one.

    Raises:
        AuthConfigError: ``token_file`` cannot be read, is not a regular file, is larger
            than 4 KiB, is not UTF-8, or holds only whitespace.
    """
    if token_file:
        return _read_token_file(token_file)
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


def bearer_token(value: bytes) -> Optional[bytes]:
    """The credentials of an ``Authorization: Bearer <token>`` header value.

    The scheme is matched case-insensitively (``bearer``, ``BEARER``), as HTTP defines
    authentication schemes; spaces and tabs around the parts are ignored.

    Args:
        value: the raw header value.

    Returns:
        The token, or None when the scheme is not Bearer or no token follows it.
    """
    parts = value.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip()


class BearerAuthMiddleware:
    """ASGI middleware requiring ``Authorization: Bearer <token>`` on every HTTP request.

    The scheme is case-insensitive; the token is compared in constant time. A refused
    request whose body is chunked, longer than ``DRAIN_BYTES`` or awaited with
    ``Expect: 100-continue`` has its connection closed, so that body is never read; a shorter
    one is discarded by the server.

    Args:
        app: the wrapped ASGI application.
        token: the expected token.
        open_paths: paths answered without a token.
    """

    def __init__(self, app: ASGIApp, token: str, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        if not token:
            raise ValueError("empty token")
        self.app = app
        self._expected = token.encode()
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answers 401 unless the request may pass, else hands it to the wrapped app."""
        if scope.get("type") != "http" or scope.get("path") in self._open:
            await self.app(scope, receive, send)
            return
        given: Optional[bytes] = None
        close = False
        for name, value in scope.get("headers") or ():
            name = name.lower()
            if name == b"authorization" and given is None:
                given = value
            elif name == b"transfer-encoding" or (name == b"expect"
                                                 and b"100-continue" in value.lower()):
                close = True
            elif name == b"content-length" and (not value.strip().isdigit()
                                                 or int(value) > DRAIN_BYTES):
                close = True
        token = bearer_token(given) if given else None
        if token is not None and hmac.compare_digest(token, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": {"error": "missing or wrong bearer token"
                                      if given else "authorization required: send "
                                      "'Authorization: Bearer <token>'"}}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b'Bearer realm="odl"')]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
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
