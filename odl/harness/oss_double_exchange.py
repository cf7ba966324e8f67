"""One HTTP exchange of the OSS test double: reading a request body, answering, logging.

``OssExchange`` is the base of the double's request handler. It reads bodies (plain or
chunked, or only their first bytes for a connection dropped mid-upload), answers in one write
with an ``x-oss-request-id``, writes OSS error documents (for HEAD, base64 in ``x-oss-err``),
closes connections without an answer (status -1), and records every request in the double's
``requests_log`` once, before its answer leaves. It also holds what object and multipart
requests share: user metadata from headers, ``x-oss-forbid-overwrite`` and listing page sizes.
"""

from __future__ import annotations

import base64
import logging
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Optional
from xml.sax.saxutils import escape

from odl.harness.oss_double_protocol import MAX_KEYS, OssError
from odl.harness.oss_double_store import StoredBucket

if TYPE_CHECKING:
    from odl.harness.oss_double import OssDouble

logger = logging.getLogger(__name__)


class OssExchange(BaseHTTPRequestHandler):
    """Reads, answers and logs one request of the OSS test double (``owner``: the double)."""

    owner: OssDouble
    protocol_version = "HTTP/1.1"
    _path = ""
    _query_text = ""
    _request_id = ""
    _swallow = False
    _status = 0
    _key_id = ""
    _logged = True

    def version_string(self) -> str:
        """The ``Server`` header OSS sends."""
        return "AliyunOSS"

    # ---------------------------------------------------------------- logging
    def log_message(self, fmt: str, *args: object) -> None:
        """Sends the HTTP server's messages to the module logger (debug)."""
        logger.debug("oss double: " + fmt, *args)

    def log_request(self, code: object = "-", size: object = "-") -> None:
        """Logs one answered request (debug), its query redacted."""
        logger.debug("oss double: %s %s%s -> %s", self.command, self._path,
                     f"?{self._query_text}" if self._query_text else "", code)

    # ---------------------------------------------------------------- plumbing
    def _read_body(self, limit: Optional[int] = None) -> Optional[bytes]:
        """The request body (at most ``limit`` bytes); None when the client went away."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while limit is None or len(out) < limit:
                line = self.rfile.readline()
                if not line:
                    return None
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                chunk = self.rfile.read(size)
                if len(chunk) < size:
                    return None
                out += chunk
                self.rfile.readline()
            return bytes(out[:limit])
        n = int(self.headers.get("Content-Length") or 0)
        want = n if limit is None else min(n, limit)
        data = self.rfile.read(want) if want else b""
        if len(data) < want:
            return None
        return data

    def _record(self, status: int) -> None:
        """Logs this request once, before its answer leaves (a client never sees it first)."""
        self._status = status
        if not self._logged:
            self._logged = True
            with self.owner._lock:
                self.owner.requests_log.append((self.command, self._path, self._query_text,
                                                status, self._key_id))

    def _send(self, status: int, body: bytes = b"",
              headers: Optional[dict[str, str]] = None) -> None:
        if self._swallow:  # drop_next(applied=True): carried out, never answered
            return self._close_unanswered()
        self._record(status)
        headers = dict(headers or {})
        try:
            self.send_response(status)
            self.send_header("x-oss-request-id", self._request_id)
            if "Content-Length" not in headers:
                headers["Content-Length"] = str(len(body))
            for k, v in headers.items():
                self.send_header(k, v)
            # headers and body in one write: two small writes meet the client's delayed ACK
            # (Nagle) and cost 40 ms a request
            self._headers_buffer.append(b"\r\n")
            if body and self.command != "HEAD":
                self._headers_buffer.append(body)
            self.flush_headers()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
            self.close_connection = True

    def _error(self, reply: OssError) -> None:
        extra = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in reply.extra.items())
        host = escape(self.headers.get("Host", "127.0.0.1"))
        xml = ('<?xml version="1.0" encoding="UTF-8"?>\n'
               f"<Error><Code>{escape(reply.code)}</Code>"
               f"<Message>{escape(reply.message or reply.code)}</Message>"
               f"<RequestId>{self._request_id}</RequestId><HostId>{host}</HostId>{extra}"
               "</Error>").encode()
        headers = dict(reply.headers)
        if reply.status == 304:  # never a body
            self._send(304, b"", headers)
        elif self.command == "HEAD":  # no body: OSS puts the document in x-oss-err
            headers.update({"x-oss-err": base64.b64encode(xml).decode(), "Content-Length": "0"})
            self._send(reply.status, b"", headers)
        else:
            headers["Content-Type"] = "application/xml"
            self._send(reply.status, xml, headers)

    def _xml(self, text: str, headers: Optional[dict[str, str]] = None) -> None:
        self._send(200, ('<?xml version="1.0" encoding="UTF-8"?>\n' + text).encode(),
                   {"Content-Type": "application/xml", **(headers or {})})

    def _close_unanswered(self) -> None:
        self._record(-1)
        self.close_connection = True

    # ---------------------------------------------------------------- shared by operations
    @staticmethod
    def _meta_from(headers: dict[str, str]) -> dict[str, str]:
        """The user metadata (``x-oss-meta-*`` headers) a request sets."""
        return {k: v for k, v in headers.items() if k.startswith("x-oss-meta-")}

    def _forbid_overwrite(self, b: StoredBucket, key: str, headers: dict[str, str]) -> None:
        """409 ``FileAlreadyExists`` when ``x-oss-forbid-overwrite`` and ``key`` exists."""
        if headers.get("x-oss-forbid-overwrite", "").lower() == "true" and key in b.objects:
            raise OssError(409, "FileAlreadyExists", "The object you specified already exists "
                           "and can not be overwritten.")

    @staticmethod
    def _max(query: dict[str, str], name: str, default: int) -> int:
        """A listing's page size from the query (1..1000); 400 ``InvalidArgument`` otherwise."""
        raw = query.get(name) or str(default)
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if not 0 < value <= MAX_KEYS:
            raise OssError(400, "InvalidArgument", f"{name} must be between 1 and 1000.",
                           extra={"ArgumentName": name, "ArgumentValue": raw})
        return value
