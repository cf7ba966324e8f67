"""A loopback test double of Alibaba Cloud OSS for the real ``oss2`` SDK, with fault injection.

``OssDouble`` serves OSS's REST API, path-style (``http://127.0.0.1:PORT/<bucket>/<key>``,
which ``oss2`` uses for an IP endpoint), from memory, on 127.0.0.1:

* objects: PutObject, GetObject (with ``Range``), HeadObject / GetObjectMeta (a missing key is
  404 with the ``x-oss-err`` header ``oss2`` decodes into ``NoSuchKey``), DeleteObject,
  DeleteMultipleObjects (``POST ?delete``), CopyObject (``x-oss-copy-source``);
* listings: ListObjects (v1: prefix, delimiter, marker, max-keys) and ListObjectsV2
  (``list-type=2``: continuation-token, start-after, ``encoding-type=url``);
* multipart uploads: initiate (``POST ?uploads``), UploadPart, Complete (the part list and
  ETags are checked), Abort, ListMultipartUploads;
* errors as OSS error documents (``<Error><Code>..``) with ``x-oss-request-id``.

Buckets are created on first use. Every request is logged in ``requests_log`` as
``(method, "/bucket/key", query, status, access_key_id)``: the AccessKey id is read from the
``Authorization: OSS <id>:<signature>`` header; the signature is not checked and the secret is
never seen.

Faults (thread-safe, for retry and crash tests): ``fail_next`` (an error status and code: 5xx,
429 / ``SlowDown`` throttling, 403 ...), ``delay_next`` (answer late: client timeouts, slow
uploads), ``drop_next`` (read the request, close the connection without an answer),
``set_down`` (every request 503 until it is lifted). Each rule can be limited to methods and
a key prefix.

What the double does not prove: that request signatures, STS tokens, bucket policies and
ACLs are right (it accepts any); CRC64 checks (it sends no ``x-oss-hash-crc64ecma``, so
``oss2`` skips them); server-side encryption, versioning, storage classes; the real service's
latency, bandwidth, throttling thresholds and consistency behaviour. It proves that odl's code
drives the real SDK correctly through the operations above and survives the injected faults.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

logger = logging.getLogger(__name__)


@dataclass
class _Object:
    data: bytes
    etag: str
    modified: float
    content_type: str = "application/octet-stream"
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class _Upload:
    key: str
    initiated: float
    parts: dict[int, tuple[str, bytes]] = field(default_factory=dict)


@dataclass
class _Rule:
    kind: str  # "fail" | "delay" | "drop"
    remaining: int
    methods: Optional[tuple[str, ...]]
    key_prefix: Optional[str]
    status: int = 503
    code: str = "ServiceUnavailable"
    seconds: float = 0.0

    def matches(self, method: str, key: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and (self.key_prefix is None or key.startswith(self.key_prefix)))


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


def _etag(data: bytes) -> str:
    return hashlib.md5(data).hexdigest().upper()  # noqa: S324 - OSS's ETag, not security


class OssDouble:
    """In-memory OSS on loopback (see the module docstring).

    Args:
        port: port to bind (0: a free one).
        require_access_key_id: when set, requests signed with another AccessKey id get 403
            ``InvalidAccessKeyId``.
    """

    def __init__(self, port: int = 0, require_access_key_id: Optional[str] = None) -> None:
        self._port = port
        self.require_access_key_id = require_access_key_id
        self._lock = threading.Lock()
        self._buckets: dict[str, dict[str, _Object]] = {}
        self._uploads: dict[str, dict[str, _Upload]] = {}
        self._rules: list[_Rule] = []
        self._down = False
        self.requests_log: list[tuple[str, str, str, int, str]] = []
        self.request_count = 0
        self.faults_injected = 0
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OssDouble:
        """Starts serving; ready when this returns."""
        double = self

        class Handler(_Handler):
            owner = double

        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="oss-double")
        self._thread.start()
        logger.debug("OSS double on %s", self.endpoint)
        return self

    def stop(self) -> None:
        """Stops serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> OssDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults
    def _add_rule(self, rule: _Rule) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if r.kind != rule.kind
                           or (rule.remaining > 0)]
            if rule.remaining > 0:
                self._rules.append(rule)

    def fail_next(self, n: int, status: int = 503, code: str = "ServiceUnavailable",
                  methods: Optional[tuple[str, ...]] = None,
                  key_prefix: Optional[str] = None) -> None:
        """The next ``n`` matching requests get this error (``n=0`` clears every fail rule)."""
        self._add_rule(_Rule("fail", n, methods, key_prefix, status=status, code=code))

    def delay_next(self, n: int, seconds: float, methods: Optional[tuple[str, ...]] = None,
                   key_prefix: Optional[str] = None) -> None:
        """The next ``n`` matching requests are answered ``seconds`` late (``n=0`` clears)."""
        self._add_rule(_Rule("delay", n, methods, key_prefix, seconds=seconds))

    def drop_next(self, n: int, methods: Optional[tuple[str, ...]] = None,
                  key_prefix: Optional[str] = None) -> None:
        """The next ``n`` matching requests are read and the connection closed, no answer."""
        self._add_rule(_Rule("drop", n, methods, key_prefix))

    def set_down(self, down: bool) -> None:
        """While down, every request gets 503 ServiceUnavailable."""
        with self._lock:
            self._down = down

    def _faults_for(self, method: str, key: str) -> list[_Rule]:
        hit = []
        with self._lock:
            if self._down:
                self.faults_injected += 1
                return [_Rule("fail", 1, None, None)]
            for rule in list(self._rules):
                if rule.matches(method, key) and rule.kind not in {r.kind for r in hit}:
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._rules.remove(rule)
                    hit.append(rule)
            self.faults_injected += len(hit)
        return hit

    # ------------------------------------------------------------------ test helpers
    def create_bucket(self, name: str) -> None:
        """Creates a bucket (buckets are also created on first use)."""
        with self._lock:
            self._buckets.setdefault(name, {})

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """The objects of a bucket under a key prefix."""
        with self._lock:
            return {k: o.data for k, o in self._buckets.get(bucket, {}).items()
                    if k.startswith(prefix)}

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Writes an object directly."""
        with self._lock:
            self._buckets.setdefault(bucket, {})[key] = _Object(data, _etag(data), time.time())

    def incomplete_uploads(self, bucket: str) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of multipart uploads neither completed nor aborted."""
        with self._lock:
            return [(u.key, uid) for uid, u in self._uploads.get(bucket, {}).items()]


class _Handler(BaseHTTPRequestHandler):
    owner: OssDouble
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug("oss double: " + fmt, *args)

    # ---------------------------------------------------------------- plumbing
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: Optional[dict] = None,
              head: bool = False) -> None:
        self._status = status
        try:
            self.send_response(status)
            self.send_header("x-oss-request-id", uuid.uuid4().hex[:24].upper())
            self.send_header("Date", formatdate(usegmt=True))
            self.send_header("Server", "AliyunOSS")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and not head:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
            self.close_connection = True

    def _error(self, status: int, code: str, message: str = "", head: bool = False) -> None:
        xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>"
               f"<Message>{escape(message or code)}</Message><RequestId>double</RequestId>"
               f"<HostId>127.0.0.1</HostId></Error>").encode()
        if head:
            self._send(status, headers={"x-oss-err": base64.b64encode(xml).decode(),
                                        "Content-Length": "0"}, head=True)
        else:
            self._send(status, xml, {"Content-Type": "application/xml"})

    def _xml(self, text: str) -> None:
        self._send(200, ('<?xml version="1.0" encoding="UTF-8"?>\n' + text).encode(),
                   {"Content-Type": "application/xml"})

    def _handle(self) -> None:
        self._status = 0
        o = self.owner
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        bucket, _, key = path.lstrip("/").partition("/")
        method = self.command
        auth = self.headers.get("Authorization", "")
        key_id = auth[4:].split(":", 1)[0] if auth.startswith("OSS ") else ""
        with o._lock:
            o.request_count += 1
        body = self._body() if method in ("PUT", "POST") else b""
        try:
            faults = o._faults_for(method, key)
            for rule in faults:
                if rule.kind == "delay":
                    time.sleep(rule.seconds)
            if any(r.kind == "drop" for r in faults):
                self.close_connection = True
                self.connection.close()
                self._status = -1
                return
            fail = next((r for r in faults if r.kind == "fail"), None)
            if fail is not None:
                self._error(fail.status, fail.code, "injected by the test double",
                            head=method == "HEAD")
            elif o.require_access_key_id and key_id != o.require_access_key_id:
                self._error(403, "InvalidAccessKeyId", "The OSS Access Key Id you provided "
                            "does not exist in our records.", head=method == "HEAD")
            elif not bucket:
                self._error(400, "InvalidBucketName", "no bucket", head=method == "HEAD")
            else:
                self._dispatch(method, bucket, key, query, body)
        finally:
            with o._lock:
                o.requests_log.append((method, path, parts.query, self._status, key_id))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815

    # ---------------------------------------------------------------- operations
    def _dispatch(self, method: str, bucket: str, key: str, query: dict, body: bytes) -> None:
        o = self.owner
        with o._lock:
            objs = o._buckets.setdefault(bucket, {})
            uploads = o._uploads.setdefault(bucket, {})
        if not key:
            if method == "GET" and "uploads" in query:
                return self._list_uploads(uploads, query)
            if method == "GET":
                return self._list(objs, query)
            if method == "POST" and "delete" in query:
                return self._delete_many(objs, body)
            if method == "PUT":
                return self._send(200)
            return self._error(405, "MethodNotAllowed")
        if method == "POST" and "uploads" in query:
            uid = uuid.uuid4().hex.upper()
            with o._lock:
                uploads[uid] = _Upload(key, time.time())
            return self._xml(f"<InitiateMultipartUploadResult><Bucket>{bucket}</Bucket>"
                             f"<Key>{escape(key)}</Key><UploadId>{uid}</UploadId>"
                             "</InitiateMultipartUploadResult>")
        if "uploadId" in query:
            return self._multipart(method, bucket, key, query, body, objs, uploads)
        if method == "PUT":
            src = self.headers.get("x-oss-copy-source")
            if src:
                sbucket, _, skey = unquote(src).lstrip("/").partition("/")
                with o._lock:
                    so = o._buckets.get(sbucket, {}).get(skey)
                if so is None:
                    return self._error(404, "NoSuchKey", "copy source does not exist")
                body = so.data
            meta = {k: v for k, v in self.headers.items() if k.lower().startswith("x-oss-meta-")}
            obj = _Object(body, _etag(body), time.time(),
                          self.headers.get("Content-Type", "application/octet-stream"), meta)
            with o._lock:
                objs[key] = obj
            if src:
                return self._xml(f"<CopyObjectResult><ETag>\"{obj.etag}\"</ETag><LastModified>"
                                 f"{_iso(obj.modified)}</LastModified></CopyObjectResult>")
            return self._send(200, headers={"ETag": f'"{obj.etag}"'})
        with o._lock:
            obj = objs.get(key)
        if method == "DELETE":
            with o._lock:
                objs.pop(key, None)
            return self._send(204)
        if obj is None:
            return self._error(404, "NoSuchKey", "The specified key does not exist.",
                               head=method == "HEAD")
        headers = {"ETag": f'"{obj.etag}"', "Content-Type": obj.content_type,
                   "Last-Modified": formatdate(obj.modified, usegmt=True),
                   "x-oss-object-type": "Normal", **obj.meta}
        if method == "HEAD":
            headers["Content-Length"] = str(len(obj.data))
            return self._send(200, headers=headers, head=True)
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            n = len(obj.data)
            start = int(a) if a else max(0, n - int(b))
            end = min(int(b), n - 1) if a and b else n - 1
            if start >= n:
                return self._error(416, "InvalidRange")
            headers["Content-Range"] = f"bytes {start}-{end}/{n}"
            return self._send(206, obj.data[start:end + 1], headers)
        return self._send(200, obj.data, headers)

    def _list(self, objs: dict[str, _Object], query: dict) -> None:
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = int(query.get("max-keys") or 100)
        v2 = query.get("list-type") == "2"
        url = query.get("encoding-type") == "url"
        after = (query.get("continuation-token") or query.get("start-after", "")) if v2 \
            else query.get("marker", "")
        with self.owner._lock:
            keys = sorted(k for k in objs if k.startswith(prefix) and k > after)
            snapshot = {k: objs[k] for k in keys}
        entries: list[tuple[str, bool]] = []
        seen_prefixes: set[str] = set()
        for k in keys:
            if delimiter:
                i = k.find(delimiter, len(prefix))
                if i >= 0:
                    p = k[: i + len(delimiter)]
                    if p not in seen_prefixes:
                        seen_prefixes.add(p)
                        entries.append((p, True))
                    continue
            entries.append((k, False))
        truncated = len(entries) > max_keys
        entries = entries[:max_keys]

        def enc(s: str) -> str:
            return quote(s, safe="/") if url else escape(s)

        out = ["<ListBucketResult>", f"<Prefix>{enc(prefix)}</Prefix>",
               f"<MaxKeys>{max_keys}</MaxKeys>", f"<Delimiter>{enc(delimiter)}</Delimiter>",
               f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if url:
            out.append("<EncodingType>url</EncodingType>")
        if truncated:
            last = entries[-1][0]
            if last in seen_prefixes:  # skip everything below a rolled-up prefix
                last = last + "\uffff"
            out.append(f"<NextContinuationToken>{enc(last)}</NextContinuationToken>" if v2
                       else f"<NextMarker>{enc(last)}</NextMarker>")
        for name, is_prefix in entries:
            if is_prefix:
                out.append(f"<CommonPrefixes><Prefix>{enc(name)}</Prefix></CommonPrefixes>")
            else:
                obj = snapshot[name]
                out.append(f"<Contents><Key>{enc(name)}</Key><LastModified>"
                           f"{_iso(obj.modified)}</LastModified><ETag>\"{obj.etag}\"</ETag>"
                           f"<Type>Normal</Type><Size>{len(obj.data)}</Size>"
                           "<StorageClass>Standard</StorageClass></Contents>")
        out.append("</ListBucketResult>")
        self._xml("".join(out))

    def _delete_many(self, objs: dict[str, _Object], body: bytes) -> None:
        root = ElementTree.fromstring(body)
        quiet = (root.findtext("Quiet") or "false") == "true"
        keys = [n.findtext("Key") or "" for n in root.findall("Object")]
        with self.owner._lock:
            for k in keys:
                objs.pop(k, None)
        deleted = "" if quiet else "".join(
            f"<Deleted><Key>{quote(k, safe='/')}</Key></Deleted>" for k in keys)
        self._xml(f"<DeleteResult><EncodingType>url</EncodingType>{deleted}</DeleteResult>")

    def _list_uploads(self, uploads: dict[str, _Upload], query: dict) -> None:
        prefix = query.get("prefix", "")
        with self.owner._lock:
            items = sorted((u.key, uid, u.initiated) for uid, u in uploads.items()
                           if u.key.startswith(prefix))
        body = "".join(f"<Upload><Key>{escape(k)}</Key><UploadId>{uid}</UploadId>"
                       f"<Initiated>{_iso(t)}</Initiated></Upload>" for k, uid, t in items)
        self._xml("<ListMultipartUploadsResult><IsTruncated>false</IsTruncated>"
                  "<NextKeyMarker></NextKeyMarker><NextUploadIdMarker></NextUploadIdMarker>"
                  f"{body}</ListMultipartUploadsResult>")

    def _multipart(self, method: str, bucket: str, key: str, query: dict, body: bytes,
                   objs: dict[str, _Object], uploads: dict[str, _Upload]) -> None:
        o = self.owner
        uid = query["uploadId"]
        with o._lock:
            up = uploads.get(uid)
        if up is None or up.key != key:
            return self._error(404, "NoSuchUpload", "The specified upload does not exist.")
        if method == "PUT":
            number = int(query.get("partNumber", "0"))
            etag = _etag(body)
            with o._lock:
                up.parts[number] = (etag, body)
            return self._send(200, headers={"ETag": f'"{etag}"'})
        if method == "DELETE":
            with o._lock:
                uploads.pop(uid, None)
            return self._send(204)
        if method == "POST":
            root = ElementTree.fromstring(body)
            data = bytearray()
            for node in root.findall("Part"):
                n = int(node.findtext("PartNumber") or 0)
                etag = (node.findtext("ETag") or "").strip('"')
                part = up.parts.get(n)
                if part is None or part[0] != etag:
                    return self._error(400, "InvalidPart", f"part {n} is missing or its ETag "
                                                          "does not match")
                data += part[1]
            # like OSS, a multipart object's ETag is not the MD5 of its content
            etags = "".join(p[0] for _n, p in sorted(up.parts.items()))
            obj = _Object(bytes(data), _etag(etags.encode()) + f"-{len(up.parts)}", time.time())
            with o._lock:
                objs[key] = obj
                uploads.pop(uid, None)
            return self._xml(f"<CompleteMultipartUploadResult><Bucket>{bucket}</Bucket>"
                             f"<Key>{escape(key)}</Key><ETag>\"{obj.etag}\"</ETag>"
                             "</CompleteMultipartUploadResult>")
        return self._error(405, "MethodNotAllowed")
