"""What the OSS test double reads from a request and how it states an error.

The OSS operation a request asks for (``request_operation``), the AccessKey id it was signed
with (``access_key_id``), its query string with signatures and STS tokens redacted
(``redacted_query``), OSS's reading of a ``Range`` header (``parse_range``), OSS's time formats,
and ``OssError``: an OSS error answer (status, code, message, extra headers and error-document
fields), raised wherever a request cannot be served.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from typing import Optional
from urllib.parse import unquote

MAX_KEYS = 1000
"""The most keys, uploads or parts one listing or one DeleteMultipleObjects takes."""

_REDACTED_PARAMS = {"signature", "x-oss-signature", "security-token", "x-oss-security-token"}


def iso_time(ts: float) -> str:
    """A time as OSS writes it in XML bodies (``2024-01-31T12:00:00.000Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


def http_date(ts: float) -> str:
    """A time as OSS writes it in headers (``Last-Modified``)."""
    return formatdate(ts, usegmt=True)


class OssError(Exception):
    """An OSS error answer, raised inside an operation."""

    def __init__(self, status: int, code: str, message: str,
                 headers: Optional[dict[str, str]] = None,
                 extra: Optional[dict[str, str]] = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.extra = extra or {}


def access_key_id(headers: dict[str, str], query: dict[str, str]) -> str:
    """The AccessKey id of a request: its ``Authorization`` header or signed-URL parameters."""
    auth = headers.get("authorization", "").strip()
    if auth.startswith("OSS "):
        return auth[4:].split(":", 1)[0]
    if auth.startswith("OSS2 "):
        for item in auth[5:].split(","):
            name, _, value = item.strip().partition(":")
            if name == "AccessKeyId":
                return value
    if auth.startswith("OSS4-HMAC-SHA256 "):
        for item in auth[len("OSS4-HMAC-SHA256 "):].split(","):
            name, _, value = item.strip().partition("=")
            if name == "Credential":
                return value.split("/", 1)[0]
    if "x-oss-credential" in query:
        return query["x-oss-credential"].split("/", 1)[0]
    return query.get("OSSAccessKeyId") or query.get("x-oss-access-key-id") or ""


def redacted_query(raw: str) -> str:
    """A raw query string with signatures and STS tokens replaced by ``REDACTED``."""
    parts = []
    for item in raw.split("&") if raw else []:
        name = unquote(item.partition("=")[0])
        parts.append(f"{item.partition('=')[0]}=REDACTED" if name.lower() in _REDACTED_PARAMS
                     else item)
    return "&".join(parts)


def request_operation(method: str, key: str, query: dict[str, str]) -> str:
    """The OSS API operation a request asks for (``"Unsupported"`` when none)."""
    if not key:
        if method == "GET" and "uploads" in query:
            return "ListMultipartUploads"
        if method == "GET":
            return "ListObjectsV2" if query.get("list-type") == "2" else "ListObjects"
        if method == "POST" and "delete" in query:
            return "DeleteMultipleObjects"
        return {"PUT": "PutBucket", "DELETE": "DeleteBucket"}.get(method, "Unsupported")
    if "uploadId" in query:
        if method == "PUT":
            return "UploadPart"
        return {"POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload",
                "GET": "ListParts"}.get(method, "Unsupported")
    if method == "POST":
        if "uploads" in query:
            return "InitiateMultipartUpload"
        if "append" in query:
            return "AppendObject"
        return "Unsupported"
    if method == "HEAD":
        return "GetObjectMeta" if "objectMeta" in query else "HeadObject"
    return {"GET": "GetObject", "PUT": "PutObject", "DELETE": "DeleteObject"}.get(
        method, "Unsupported")


def parse_range(spec: str, size: int, standard: bool) -> Optional[tuple[int, int]]:
    """OSS's reading of a ``Range`` header: ``(first, last)``, or ``None`` for the whole object.

    Raises:
        OssError: 416 ``InvalidRange`` (several ranges; or, with ``standard``, a start past the
            end).
    """
    if not spec.startswith("bytes="):
        return None
    spec = spec[6:].strip()
    if "," in spec:
        raise OssError(416, "InvalidRange", "The requested range cannot be satisfied "
                       "(OSS serves one range per request).")
    a, sep, b = spec.partition("-")
    try:
        first = int(a) if a.strip() else None
        last = int(b) if b.strip() else None
    except ValueError:
        return None
    if not sep or (first is None and last is None):
        return None
    if first is None:  # bytes=-n: the last n bytes
        assert last is not None
        if last <= 0 or size == 0:
            return None
        if last > size:
            return (0, size - 1) if standard else None
        return size - last, size - 1
    if first >= size:
        if standard:
            raise OssError(416, "InvalidRange", "The requested range cannot be satisfied.")
        return None
    if last is None:
        return first, size - 1
    if last < first:
        return None
    if last >= size:
        return (first, size - 1) if standard else None
    return first, last
