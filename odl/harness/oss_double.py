"""A loopback test double of Alibaba Cloud OSS for the real ``oss2`` SDK, with fault injection.

``OssDouble`` serves OSS's REST API from memory on 127.0.0.1, path-style
(``http://127.0.0.1:PORT/<bucket>/<key>?<sub-resources>``: what ``oss2`` sends for an IP or
``localhost`` endpoint, the key percent-encoded with ``/`` as ``%2F``). It answers what
``oss2`` 2.19 sends and parses (``oss2/api.py``, ``models.py``, ``xml_utils.py``,
``exceptions.py``, ``resumable.py``, ``iterators.py``):

* objects: PutObject (``Content-MD5`` checked when sent), GetObject (one ``Range``, OSS's
  rules: an invalid or out-of-size range returns the whole object with 200 unless
  ``x-oss-range-behavior: standard``, then the end is clipped and a start past the end is 416
  ``InvalidRange``; ``If-Match`` / ``If-None-Match`` / ``If-(Un)Modified-Since``), HeadObject,
  GetObjectMeta (``HEAD ?objectMeta``, what ``Bucket.object_exists`` sends), DeleteObject (204,
  missing keys too), DeleteMultipleObjects (``POST ?delete``: XML body, quiet mode, at most
  1000 keys, url-encoded keys in the answer), CopyObject (``x-oss-copy-source``, metadata
  directive COPY or REPLACE), AppendObject (``POST ?append&position=``), and
  ``x-oss-forbid-overwrite``;
* listings: ListObjects (v1: prefix, delimiter, marker, max-keys <= 1000, CommonPrefixes,
  IsTruncated / NextMarker, ``encoding-type=url``) and ListObjectsV2 (``list-type=2``: opaque
  continuation-token, start-after, KeyCount, fetch-owner);
* multipart uploads: InitiateMultipartUpload (``POST ?uploads``), UploadPart (``PUT
  ?partNumber&uploadId``, 1..10000), CompleteMultipartUpload (the XML part list must be in
  ascending order and name uploaded parts with their ETags; every part but the last at least
  ``min_part_size``, 100 KiB as on OSS; the object's ETag is ``MD5(part MD5s)-N``),
  AbortMultipartUpload, ListMultipartUploads (``GET ?uploads``, paginated with key and upload-id
  markers) and ListParts (``GET ?uploadId``, paginated: ``oss2.resumable_upload`` calls it
  before it uploads and when it resumes);
* buckets: created on first use (or with ``create_bucket``; ``auto_create_buckets=False``
  makes unknown buckets 404 ``NoSuchBucket``); PutBucket and DeleteBucket (409
  ``BucketNotEmpty``);
* headers ``oss2`` reads: ``x-oss-request-id`` (also the error document's ``RequestId``),
  ``ETag``, ``Content-Length``, ``Content-Type``, ``Last-Modified``, ``Content-Range``,
  ``x-oss-object-type``, ``x-oss-next-append-position`` and ``x-oss-hash-crc64ecma``: the
  object's (or part's) CRC-64/XZ, which ``oss2`` checks by default (``enable_crc=True``) after
  put, append, upload-part, complete-multipart and whole-object downloads;
* errors as OSS error documents (``<Error><Code>..</Code><Message>..</Message><RequestId>..
  </RequestId><HostId>..</HostId></Error>``) with OSS's status, so ``oss2`` raises its own
  classes (``NoSuchKey``, ``NoSuchUpload``, ``NoSuchBucket``, ``InvalidArgument``,
  ``ServerError`` ...); for HEAD the document travels base64 in ``x-oss-err`` as OSS does.

A sub-resource or header the double does not model (ACLs, tagging, symlinks, versioning,
UploadPartCopy, image processing, server-side encryption ...) is 400 ``NotImplemented``:
loud, never silently accepted.

Every request is logged in ``requests_log`` as ``(method, "/bucket/key", query, status,
access_key_id)``. The AccessKey id is read from the ``Authorization`` header (``OSS id:sig``,
``OSS2 AccessKeyId:id,..``, ``OSS4-HMAC-SHA256 Credential=id/..``) or a signed URL's
parameters; the signature is never checked. The secret never reaches a server; signatures
and STS tokens in a query are logged as ``REDACTED``. ``require_access_key_id`` makes any
other id 403 ``InvalidAccessKeyId`` (no id: 403 ``AccessDenied``). Status -1 in the log is a
connection closed without an answer (an injected drop, or a client that went away mid-body:
then, as on OSS, nothing is stored).

Faults (thread-safe, for retry and crash tests), each limited by ``methods``, OSS
``operations`` (``"UploadPart"`` ...), an object ``key_prefix`` and ``skip`` (let that many
matching requests through first): ``fail_next`` (an error status and code: 5xx, 503
``SlowDown`` / 429 throttling, 403 ...), ``delay_next`` (answer late: client timeouts, slow
uploads), ``drop_next`` (close the connection without an answer: after the whole request,
after ``read_bytes`` of its body, i.e. mid-upload, or after carrying it out, i.e. a lost
acknowledgement), ``set_down`` (every request 503 until lifted). Counters:
``request_count``, ``method_counts``, ``operation_counts``, ``faults_injected``.

What the double does not prove: that request signatures, STS tokens, RAM and bucket policies
and ACLs are right (it accepts any signature); real consistency, latency, bandwidth, request
size limits and throttling thresholds (throttling here is only what a test injects); OSS's
exact behaviour for rarely used corners (the part-too-small error code is S3's
``EntityTooSmall``; continuation tokens are the double's own); server-side encryption,
versioning, storage classes, lifecycle rules, cross-region replication, virtual-hosted
(bucket-in-host) addressing and HTTPS. It proves that odl's code drives the real SDK
correctly through the operations above, that data round-trip byte-exact with OSS's CRC64 and
ETag rules, and that odl survives the injected faults.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.utils import formatdate, parsedate_to_datetime
from http.server import BaseHTTPRequestHandler
from typing import Optional
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

import crcmod  # oss2's own dependency: the same CRC-64/XZ that oss2 checks

from odl.harness.loopback_server import LoopbackServer

logger = logging.getLogger(__name__)

MIN_PART_SIZE = 100 * 1024
"""OSS's smallest part size (every part of a multipart upload but the last)."""

_MAX_KEYS = 1000
_MAX_KEY_BYTES = 1023
_MAX_PART_NUMBER = 10000
_REDACTED_PARAMS = {"signature", "x-oss-signature", "security-token", "x-oss-security-token"}
# query parameters that ask for something the double serves or may ignore
_KNOWN_PARAMS = {
    "encoding-type", "prefix", "delimiter", "marker", "max-keys", "list-type",
    "continuation-token", "start-after", "fetch-owner", "uploads", "uploadId", "partNumber",
    "key-marker", "upload-id-marker", "max-uploads", "part-number-marker", "max-parts",
    "delete", "append", "position", "objectMeta", "response-content-type",
    "response-content-disposition", "response-cache-control", "response-expires",
    "response-content-encoding", "response-content-language", "sequential",
    # signed URLs
    "OSSAccessKeyId", "Expires", "Signature", "security-token", "x-oss-signature-version",
    "x-oss-expires", "x-oss-access-key-id", "x-oss-additional-headers", "x-oss-signature",
    "x-oss-credential", "x-oss-date", "x-oss-security-token",
}
# request headers whose meaning the double does not model
_UNMODELLED_HEADERS = ("x-oss-server-side-encryption", "x-oss-server-side-data-encryption",
                       "x-oss-server-side-encryption-key-id", "x-oss-copy-source-range",
                       "x-oss-symlink-target", "x-oss-tagging", "x-oss-process")

_crc64 = crcmod.mkCrcFun(0x142F0E1EBA9EA3693, initCrc=0, rev=True, xorOut=0xFFFFFFFFFFFFFFFF)


def crc64(data: bytes, crc: int = 0) -> int:
    """CRC-64/XZ (ECMA-182, reflected), OSS's ``x-oss-hash-crc64ecma``.

    Args:
        data: bytes to checksum.
        crc: the CRC of the bytes before ``data`` (to continue a checksum).

    Returns:
        The CRC as an unsigned 64-bit integer.
    """
    return _crc64(data, crc)


def _md5(data: bytes) -> bytes:
    return hashlib.md5(data).digest()  # noqa: S324 - OSS's ETag and Content-MD5, not security


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


def _http_date(ts: float) -> str:
    return formatdate(ts, usegmt=True)


@dataclass
class _Object:
    data: bytes
    etag: str
    crc: int
    modified: float
    content_type: str = "application/octet-stream"
    meta: dict[str, str] = field(default_factory=dict)
    kind: str = "Normal"  # Normal | Multipart | Appendable
    content_md5: Optional[str] = None  # base64, Normal objects only


def _normal_object(data: bytes, content_type: str = "application/octet-stream",
                   meta: Optional[dict[str, str]] = None) -> _Object:
    digest = _md5(data)
    return _Object(data, digest.hex().upper(), crc64(data), time.time(), content_type,
                   dict(meta or {}), "Normal", base64.b64encode(digest).decode())


@dataclass
class _Part:
    data: bytes
    etag: str
    crc: int
    modified: float


@dataclass
class _Upload:
    key: str
    upload_id: str
    initiated: float
    content_type: str
    meta: dict[str, str]
    parts: dict[int, _Part] = field(default_factory=dict)


@dataclass
class _Bucket:
    created: float
    objects: dict[str, _Object] = field(default_factory=dict)
    uploads: dict[str, _Upload] = field(default_factory=dict)


@dataclass
class _Rule:
    kind: str  # "fail" | "delay" | "drop"
    remaining: int
    methods: Optional[frozenset[str]]
    operations: Optional[frozenset[str]]
    key_prefix: Optional[str]
    skip: int = 0
    status: int = 503
    code: str = "ServiceUnavailable"
    seconds: float = 0.0
    read_bytes: Optional[int] = None
    applied: bool = False
    message: str = "The service is unavailable."

    def matches(self, method: str, operation: str, key: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and (self.operations is None or operation in self.operations)
                and (self.key_prefix is None or key.startswith(self.key_prefix)))


class _Reply(Exception):
    """An OSS error answer, raised inside an operation."""

    def __init__(self, status: int, code: str, message: str,
                 headers: Optional[dict[str, str]] = None,
                 extra: Optional[dict[str, str]] = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.extra = extra or {}


def _frozen(items: Optional[Iterable[str]], upper: bool = False) -> Optional[frozenset[str]]:
    if items is None:
        return None
    if isinstance(items, str):
        items = (items,)
    return frozenset(i.upper() if upper else i for i in items)


def _access_key_id(headers: dict[str, str], query: dict[str, str]) -> str:
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


def _redacted_query(raw: str) -> str:
    parts = []
    for item in raw.split("&") if raw else []:
        name = unquote(item.partition("=")[0])
        parts.append(f"{item.partition('=')[0]}=REDACTED" if name.lower() in _REDACTED_PARAMS
                     else item)
    return "&".join(parts)


def _operation(method: str, key: str, query: dict[str, str]) -> str:
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


def _parse_range(spec: str, size: int, standard: bool) -> Optional[tuple[int, int]]:
    """OSS's reading of a ``Range`` header: ``(first, last)``, or ``None`` for the whole object.

    Raises:
        _Reply: 416 ``InvalidRange`` (several ranges; or, with ``standard``, a start past the
            end).
    """
    if not spec.startswith("bytes="):
        return None
    spec = spec[6:].strip()
    if "," in spec:
        raise _Reply(416, "InvalidRange", "The requested range cannot be satisfied "
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
            raise _Reply(416, "InvalidRange", "The requested range cannot be satisfied.")
        return None
    if last is None:
        return first, size - 1
    if last < first:
        return None
    if last >= size:
        return (first, size - 1) if standard else None
    return first, last


class OssDouble(LoopbackServer):
    """In-memory OSS on loopback (see the module docstring).

    Use it as a context manager or with ``start()`` / ``stop()``; ``endpoint`` is
    ``http://127.0.0.1:PORT`` and it is ready when ``start`` returns.

    Args:
        port: port to bind (0: a free one).
        require_access_key_id: when set, requests signed with another AccessKey id get 403
            ``InvalidAccessKeyId`` (unsigned ones 403 ``AccessDenied``).
        auto_create_buckets: create a bucket on its first use; when False an unknown bucket is
            404 ``NoSuchBucket`` until ``create_bucket`` or ``oss2.Bucket.create_bucket``.
        min_part_size: smallest size of every part but the last at CompleteMultipartUpload
            (OSS: 100 KiB; 0 disables the check).
    """

    def __init__(self, port: int = 0, require_access_key_id: Optional[str] = None,
                 auto_create_buckets: bool = True, min_part_size: int = MIN_PART_SIZE) -> None:
        super().__init__(_Handler, port)
        self.require_access_key_id = require_access_key_id
        self.auto_create_buckets = auto_create_buckets
        self.min_part_size = min_part_size
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._buckets: dict[str, _Bucket] = {}
        self._rules: list[_Rule] = []
        self._down = False
        self._upload_seq = itertools.count(1)
        self.requests_log: list[tuple[str, str, str, int, str]] = []
        self.request_count = 0
        self.method_counts: dict[str, int] = {}
        self.operation_counts: dict[str, int] = {}
        self.faults_injected = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> OssDouble:
        """Starts serving on 127.0.0.1; ready when this returns."""
        self._stopping.clear()
        super().start()
        logger.debug("OSS double on %s", self.endpoint)
        return self

    def stop(self) -> None:
        """Stops serving; requests held by ``delay_next`` are released at once."""
        self._stopping.set()
        super().stop()

    # ------------------------------------------------------------------ faults
    def _add_rule(self, rule: _Rule) -> None:
        with self._lock:
            if rule.remaining <= 0:  # n=0 clears every rule of that kind
                self._rules = [r for r in self._rules if r.kind != rule.kind]
            else:
                self._rules.append(rule)

    def fail_next(self, n: int, status: int = 503, code: str = "ServiceUnavailable",
                  methods: Optional[Iterable[str]] = None, key_prefix: Optional[str] = None,
                  *, operations: Optional[Iterable[str]] = None, skip: int = 0,
                  message: str = "injected by the OSS test double") -> None:
        """The next ``n`` matching requests get this OSS error (``n=0`` clears every fail rule).

        Args:
            n: how many requests.
            status: HTTP status (503, 500, 429, 403 ...).
            code: OSS error code (``ServiceUnavailable``, ``SlowDown``, ``InternalError``,
                ``AccessDenied`` ...).
            methods: only these HTTP methods (``("PUT",)``).
            key_prefix: only object requests whose key starts with this.
            operations: only these OSS operations (``("UploadPart",)``; see
                ``operation_counts`` for the names).
            skip: let this many matching requests through first.
            message: the error document's ``Message``.
        """
        self._add_rule(_Rule("fail", n, _frozen(methods, True), _frozen(operations),
                             key_prefix, skip, status=status, code=code, message=message))

    def delay_next(self, n: int, seconds: float, methods: Optional[Iterable[str]] = None,
                   key_prefix: Optional[str] = None, *,
                   operations: Optional[Iterable[str]] = None, skip: int = 0) -> None:
        """The next ``n`` matching requests are answered ``seconds`` late (``n=0`` clears).

        The request is read first, then the answer waits: past the client's timeout ``oss2``
        raises ``RequestError`` (the operation is still carried out, as on a slow OSS).
        """
        self._add_rule(_Rule("delay", n, _frozen(methods, True), _frozen(operations),
                             key_prefix, skip, seconds=seconds))

    def drop_next(self, n: int, methods: Optional[Iterable[str]] = None,
                  key_prefix: Optional[str] = None, *,
                  operations: Optional[Iterable[str]] = None, skip: int = 0,
                  read_bytes: Optional[int] = None, applied: bool = False) -> None:
        """The next ``n`` matching requests lose their connection, with no answer (``n=0`` clears).

        Args:
            n: how many requests.
            methods: only these HTTP methods.
            key_prefix: only object requests whose key starts with this.
            operations: only these OSS operations.
            skip: let this many matching requests through first.
            read_bytes: read at most this many bytes of the body, then close (a connection
                lost mid-upload); None reads the whole request first. Nothing is stored.
            applied: carry the request out, then close without answering (a lost
                acknowledgement: the object exists, the client saw an error).
        """
        self._add_rule(_Rule("drop", n, _frozen(methods, True), _frozen(operations),
                             key_prefix, skip, read_bytes=read_bytes, applied=applied))

    def clear_faults(self) -> None:
        """Removes every fault rule and ends an outage."""
        with self._lock:
            self._rules = []
            self._down = False

    def set_down(self, down: bool) -> None:
        """While down, every request gets 503 ``ServiceUnavailable``."""
        with self._lock:
            self._down = down

    def _take_faults(self, method: str, operation: str, key: str) -> list[_Rule]:
        """The rules (at most one of each kind) that apply to this request; counts them."""
        hit: list[_Rule] = []
        with self._lock:
            if self._down:
                self.faults_injected += 1
                return [_Rule("fail", 1, None, None, None, code="ServiceUnavailable")]
            kinds: set[str] = set()
            for rule in list(self._rules):
                if rule.kind in kinds or not rule.matches(method, operation, key):
                    continue
                if rule.skip > 0:
                    rule.skip -= 1
                    continue
                rule.remaining -= 1
                if rule.remaining <= 0:
                    self._rules.remove(rule)
                kinds.add(rule.kind)
                hit.append(rule)
            self.faults_injected += len(hit)
        return hit

    def _count(self, method: str, operation: str) -> None:
        with self._lock:
            self.request_count += 1
            self.method_counts[method] = self.method_counts.get(method, 0) + 1
            self.operation_counts[operation] = self.operation_counts.get(operation, 0) + 1

    # ------------------------------------------------------------------ test helpers
    def create_bucket(self, name: str) -> None:
        """Creates a bucket (with ``auto_create_buckets`` they are also created on first use)."""
        with self._lock:
            self._buckets.setdefault(name, _Bucket(time.time()))

    def buckets(self) -> list[str]:
        """The names of the buckets that exist."""
        with self._lock:
            return sorted(self._buckets)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """The objects of a bucket under a key prefix, ``{key: bytes}`` in key order."""
        with self._lock:
            b = self._buckets.get(bucket)
            if b is None:
                return {}
            return {k: b.objects[k].data for k in sorted(b.objects) if k.startswith(prefix)}

    def object_info(self, bucket: str, key: str) -> Optional[dict[str, object]]:
        """An object's metadata: etag, crc64, size, content_type, meta, type, last_modified."""
        with self._lock:
            o = self._buckets.get(bucket, _Bucket(0.0)).objects.get(key)
            if o is None:
                return None
            return {"etag": o.etag, "crc64": o.crc, "size": len(o.data),
                    "content_type": o.content_type, "meta": dict(o.meta), "type": o.kind,
                    "last_modified": o.modified}

    def put(self, bucket: str, key: str, data: bytes,
            content_type: str = "application/octet-stream",
            meta: Optional[dict[str, str]] = None) -> None:
        """Writes an object directly (``meta``: ``{"x-oss-meta-name": value}``)."""
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket(time.time()))
            b.objects[key] = _normal_object(bytes(data), content_type,
                                            {k.lower(): v for k, v in (meta or {}).items()})

    def incomplete_uploads(self, bucket: str) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of multipart uploads neither completed nor aborted."""
        with self._lock:
            b = self._buckets.get(bucket)
            if b is None:
                return []
            return sorted((u.key, u.upload_id) for u in b.uploads.values())

    # ------------------------------------------------------------------ state, for the handler
    def _bucket(self, name: str, create: bool = False) -> _Bucket:
        """The bucket (caller holds the lock); 404 ``NoSuchBucket`` when it does not exist."""
        b = self._buckets.get(name)
        if b is None:
            if not (create or self.auto_create_buckets):
                raise _Reply(404, "NoSuchBucket", "The specified bucket does not exist.",
                             extra={"BucketName": name})
            b = self._buckets[name] = _Bucket(time.time())
        return b

    def _new_upload_id(self) -> str:
        # sorts in the order uploads were started, as ListMultipartUploads pages need
        return f"{next(self._upload_seq):08X}{uuid.uuid4().hex[:24].upper()}"


class _Handler(BaseHTTPRequestHandler):
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
        return "AliyunOSS"

    # ---------------------------------------------------------------- logging
    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug("oss double: " + fmt, *args)

    def log_request(self, code: object = "-", size: object = "-") -> None:
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

    def _error(self, reply: _Reply) -> None:
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

    # ---------------------------------------------------------------- one request
    def _handle(self) -> None:
        o = self.owner
        self._status = 0
        self._swallow = False
        self._logged = False
        self._request_id = uuid.uuid4().hex[:24].upper()
        parts = urlsplit(self.path)
        self._path = unquote(parts.path)
        self._query_text = _redacted_query(parts.query)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        bucket, _, key = self._path.lstrip("/").partition("/")
        method = self.command
        headers = {k.lower(): v for k, v in self.headers.items()}
        key_id = self._key_id = _access_key_id(headers, query)
        operation = _operation(method, key, query)
        o._count(method, operation)
        try:
            faults = o._take_faults(method, operation, key)
            drop = next((r for r in faults if r.kind == "drop"), None)
            if drop is not None and not drop.applied:
                body = self._read_body(drop.read_bytes)
                logger.debug("oss double: dropping %s %s after %s body bytes", method,
                             self._path, "?" if body is None else len(body))
                return self._close_unanswered()
            body = self._read_body()
            if body is None:  # the client went away mid-body: nothing is stored
                logger.debug("oss double: %s %s: the client closed mid-body", method, self._path)
                return self._close_unanswered()
            for rule in faults:
                if rule.kind == "delay":
                    o._stopping.wait(rule.seconds)
            if drop is not None:
                self._swallow = True
            fail = next((r for r in faults if r.kind == "fail"), None)
            try:
                if fail is not None:
                    raise _Reply(fail.status, fail.code, fail.message)
                self._authorize(key_id)
                self._check_request(bucket, key, query, headers, body)
                self._dispatch(operation, bucket, key, query, headers, body)
            except _Reply as reply:
                self._error(reply)
            except Exception as exc:  # a bug in the double: say so, loudly
                logger.exception("oss double: %s %s failed", method, self._path)
                self._error(_Reply(500, "InternalError", f"OSS test double bug: {exc!r}"))
        finally:
            self._record(self._status)  # when an exception escaped before any answer

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815

    def _authorize(self, key_id: str) -> None:
        required = self.owner.require_access_key_id
        if not required or key_id == required:
            return
        if not key_id:
            raise _Reply(403, "AccessDenied", "You have no right to access this object because "
                         "of bucket acl.")
        raise _Reply(403, "InvalidAccessKeyId", "The OSS Access Key Id you provided does not "
                     "exist in our records.", extra={"OSSAccessKeyId": key_id})

    def _check_request(self, bucket: str, key: str, query: dict[str, str],
                       headers: dict[str, str], body: bytes) -> None:
        if not bucket:
            raise _Reply(400, "NotImplemented", "service-level requests (ListBuckets ...) are "
                         "not modelled by the OSS test double")
        unknown = sorted(set(query) - _KNOWN_PARAMS)
        if unknown:
            raise _Reply(400, "NotImplemented", f"sub-resource {unknown[0]!r} is not modelled "
                         "by the OSS test double")
        for name in _UNMODELLED_HEADERS:
            if name in headers:
                raise _Reply(400, "NotImplemented", f"header {name} is not modelled by the "
                             "OSS test double")
        if key:
            if len(key.encode()) > _MAX_KEY_BYTES or key[0] in "/\\":
                raise _Reply(400, "InvalidObjectName", "The specified object is not valid.")
        md5 = headers.get("content-md5")
        if md5 is not None and base64.b64encode(_md5(body)).decode() != md5.strip():
            raise _Reply(400, "InvalidDigest", "The Content-MD5 you specified was invalid.")

    def _dispatch(self, operation: str, bucket: str, key: str, query: dict[str, str],
                  headers: dict[str, str], body: bytes) -> None:
        handler: Optional[Callable[..., None]] = {
            "PutObject": self._put_object, "GetObject": self._get_object,
            "HeadObject": self._get_object, "GetObjectMeta": self._get_object_meta,
            "DeleteObject": self._delete_object, "AppendObject": self._append_object,
            "DeleteMultipleObjects": self._delete_many, "ListObjects": self._list_objects,
            "ListObjectsV2": self._list_objects,
            "InitiateMultipartUpload": self._initiate_upload, "UploadPart": self._upload_part,
            "CompleteMultipartUpload": self._complete_upload,
            "AbortMultipartUpload": self._abort_upload, "ListParts": self._list_parts,
            "ListMultipartUploads": self._list_uploads, "PutBucket": self._put_bucket,
            "DeleteBucket": self._delete_bucket,
        }.get(operation)
        if handler is None:
            raise _Reply(400, "NotImplemented", f"{self.command} with these parameters is not "
                         "modelled by the OSS test double")
        handler(bucket, key, query, headers, body)

    # ---------------------------------------------------------------- objects
    @staticmethod
    def _meta_from(headers: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k.startswith("x-oss-meta-")}

    @staticmethod
    def _object_headers(obj: _Object) -> dict[str, str]:
        h = {"ETag": f'"{obj.etag}"', "Content-Type": obj.content_type,
             "Last-Modified": _http_date(obj.modified), "x-oss-object-type": obj.kind,
             "x-oss-storage-class": "Standard", "x-oss-hash-crc64ecma": str(obj.crc),
             "Accept-Ranges": "bytes", **obj.meta}
        if obj.content_md5:
            h["Content-MD5"] = obj.content_md5
        return h

    def _forbid_overwrite(self, b: _Bucket, key: str, headers: dict[str, str]) -> None:
        if headers.get("x-oss-forbid-overwrite", "").lower() == "true" and key in b.objects:
            raise _Reply(409, "FileAlreadyExists", "The object you specified already exists "
                         "and can not be overwritten.")

    def _put_object(self, bucket: str, key: str, query: dict[str, str],
                    headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        source = headers.get("x-oss-copy-source")
        with o._lock:
            b = o._bucket(bucket)
            self._forbid_overwrite(b, key, headers)
            if source is None:
                obj = _normal_object(body, headers.get("content-type",
                                                       "application/octet-stream"),
                                     self._meta_from(headers))
                b.objects[key] = obj
            else:
                obj = self._copy(b, key, source, headers)
        if source is None:
            return self._send(200, headers={"ETag": f'"{obj.etag}"',
                                            "x-oss-hash-crc64ecma": str(obj.crc),
                                            "Content-MD5": obj.content_md5 or ""})
        self._xml(f'<CopyObjectResult><ETag>"{obj.etag}"</ETag>'
                  f"<LastModified>{_iso(obj.modified)}</LastModified></CopyObjectResult>",
                  {"x-oss-hash-crc64ecma": str(obj.crc)})

    def _copy(self, b: _Bucket, key: str, source: str, headers: dict[str, str]) -> _Object:
        """CopyObject (the caller holds the lock)."""
        o = self.owner
        path = unquote(source.split("?", 1)[0]).lstrip("/")
        sbucket, _, skey = path.partition("/")
        src = o._bucket(sbucket).objects.get(skey)
        if src is None:
            raise _Reply(404, "NoSuchKey", "The specified key does not exist.",
                         extra={"Key": skey})
        directive = headers.get("x-oss-metadata-directive", "COPY").upper()
        if directive == "REPLACE":
            content_type = headers.get("content-type", "application/octet-stream")
            meta = self._meta_from(headers)
        else:
            content_type, meta = src.content_type, dict(src.meta)
        obj = _Object(src.data, src.etag, src.crc, time.time(), content_type, meta, src.kind,
                      src.content_md5)
        b.objects[key] = obj
        return obj

    def _append_object(self, bucket: str, key: str, query: dict[str, str],
                       headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        try:
            position = int(query.get("position", ""))
        except ValueError:
            raise _Reply(400, "InvalidArgument", "position is not an integer.") from None
        with o._lock:
            b = o._bucket(bucket)
            old = b.objects.get(key)
            length = len(old.data) if old is not None else 0
            if old is not None and old.kind != "Appendable":
                raise _Reply(409, "ObjectNotAppendable", "The object is not appendable.")
            if position != length:
                raise _Reply(409, "PositionNotEqualToLength", "Position is not equal to file "
                             "length.", headers={"x-oss-next-append-position": str(length)})
            if old is None:
                obj = _Object(body, "", crc64(body), time.time(),
                              headers.get("content-type", "application/octet-stream"),
                              self._meta_from(headers), "Appendable")
            else:
                obj = _Object(old.data + body, "", crc64(body, old.crc), time.time(),
                              old.content_type, old.meta, "Appendable")
            obj.etag = _md5(obj.data).hex().upper()
            b.objects[key] = obj
        self._send(200, headers={"ETag": f'"{obj.etag}"', "x-oss-hash-crc64ecma": str(obj.crc),
                                 "x-oss-next-append-position": str(len(obj.data))})

    def _lookup(self, bucket: str, key: str) -> _Object:
        o = self.owner
        with o._lock:
            obj = o._bucket(bucket).objects.get(key)
        if obj is None:
            raise _Reply(404, "NoSuchKey", "The specified key does not exist.",
                         extra={"Key": key})
        return obj

    def _check_conditions(self, obj: _Object, headers: dict[str, str]) -> None:
        etag = f'"{obj.etag}"'

        def when(name: str) -> Optional[float]:
            try:
                return parsedate_to_datetime(headers[name]).timestamp() if name in headers \
                    else None
            except (TypeError, ValueError):
                return None

        modified = int(obj.modified)
        if "if-match" in headers and headers["if-match"].strip() not in (etag, obj.etag, "*"):
            raise _Reply(412, "PreconditionFailed", "At least one of the pre-conditions you "
                         "specified did not hold.")
        since = when("if-unmodified-since")
        if since is not None and modified > since:
            raise _Reply(412, "PreconditionFailed", "At least one of the pre-conditions you "
                         "specified did not hold.")
        if "if-none-match" in headers and headers["if-none-match"].strip() in (etag, obj.etag,
                                                                               "*"):
            raise _Reply(304, "NotModified", "Not Modified")
        since = when("if-modified-since")
        if since is not None and modified <= since:
            raise _Reply(304, "NotModified", "Not Modified")

    def _get_object(self, bucket: str, key: str, query: dict[str, str],
                    headers: dict[str, str], body: bytes) -> None:
        obj = self._lookup(bucket, key)
        self._check_conditions(obj, headers)
        out = self._object_headers(obj)
        for name in ("content-type", "content-disposition", "cache-control", "expires",
                     "content-encoding", "content-language"):
            if f"response-{name}" in query:
                out["-".join(w.capitalize() for w in name.split("-"))] = query[f"response-{name}"]
        size = len(obj.data)
        if self.command == "HEAD":
            out["Content-Length"] = str(size)
            return self._send(200, b"", out)
        standard = headers.get("x-oss-range-behavior", "").lower() == "standard"
        rng = _parse_range(headers.get("range", ""), size, standard)
        if rng is None:
            return self._send(200, obj.data, out)
        first, last = rng
        out["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._send(206, obj.data[first:last + 1], out)

    def _get_object_meta(self, bucket: str, key: str, query: dict[str, str],
                         headers: dict[str, str], body: bytes) -> None:
        obj = self._lookup(bucket, key)
        self._send(200, b"", {"ETag": f'"{obj.etag}"', "Content-Length": str(len(obj.data)),
                              "Last-Modified": _http_date(obj.modified)})

    def _delete_object(self, bucket: str, key: str, query: dict[str, str],
                       headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        with o._lock:
            o._bucket(bucket).objects.pop(key, None)
        self._send(204)

    def _delete_many(self, bucket: str, key: str, query: dict[str, str],
                     headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            raise _Reply(400, "MalformedXML", "The XML you provided was not well-formed.") \
                from None
        quiet = (root.findtext("Quiet") or "false").strip().lower() == "true"
        keys = [n.findtext("Key") or "" for n in root.findall("Object")]
        if root.tag != "Delete" or not keys or len(keys) > _MAX_KEYS:
            raise _Reply(400, "MalformedXML", "The XML you provided was not well-formed or "
                         "names no key, or more than 1000.")
        with o._lock:
            objs = o._bucket(bucket).objects
            for k in keys:
                objs.pop(k, None)
        url = query.get("encoding-type") == "url"

        def enc(s: str) -> str:
            return quote(s, safe="/") if url else escape(s)

        deleted = "" if quiet else "".join(f"<Deleted><Key>{enc(k)}</Key></Deleted>"
                                           for k in keys)
        encoding = "<EncodingType>url</EncodingType>" if url else ""
        self._xml(f"<DeleteResult>{encoding}{deleted}</DeleteResult>")

    # ---------------------------------------------------------------- listings
    @staticmethod
    def _max(query: dict[str, str], name: str, default: int) -> int:
        raw = query.get(name) or str(default)
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if not 0 < value <= _MAX_KEYS:
            raise _Reply(400, "InvalidArgument", f"{name} must be between 1 and 1000.",
                         extra={"ArgumentName": name, "ArgumentValue": raw})
        return value

    def _list_objects(self, bucket: str, key: str, query: dict[str, str],
                      headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        v2 = query.get("list-type") == "2"
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = self._max(query, "max-keys", 100)
        url = query.get("encoding-type") == "url"
        token = query.get("continuation-token", "")
        if v2 and token:
            try:
                after = base64.urlsafe_b64decode(token.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise _Reply(400, "InvalidArgument", "The continuation token is not valid.",
                             extra={"ArgumentName": "continuation-token",
                                    "ArgumentValue": token}) from None
        else:
            after = query.get("start-after" if v2 else "marker", "")
        with o._lock:
            objs = o._bucket(bucket).objects
            names = sorted(k for k in objs if k.startswith(prefix))
            start = bisect.bisect_right(names, after)
            # (name, object or None for a common prefix), up to one past the page
            entries: list[tuple[str, Optional[_Object]]] = []
            for k in names[start:]:
                if delimiter:
                    i = k.find(delimiter, len(prefix))
                    if i >= 0:
                        p = k[: i + len(delimiter)]
                        # a prefix already returned (the marker) or just returned: skip
                        if p == after or (entries and entries[-1][0] == p):
                            continue
                        entries.append((p, None))
                        if len(entries) > max_keys:
                            break
                        continue
                entries.append((k, objs[k]))
                if len(entries) > max_keys:
                    break
        truncated = len(entries) > max_keys
        entries = entries[:max_keys]

        def enc(s: str) -> str:
            return quote(s, safe="/") if url else escape(s)

        owner = "<Owner><ID>oss-double</ID><DisplayName>oss-double</DisplayName></Owner>"
        with_owner = not v2 or query.get("fetch-owner") == "true"
        out = ["<ListBucketResult>", f"<Name>{escape(bucket)}</Name>",
               f"<Prefix>{enc(prefix)}</Prefix>"]
        if v2:
            if query.get("start-after"):
                out.append(f"<StartAfter>{enc(query['start-after'])}</StartAfter>")
            if token:
                out.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
        else:
            out.append(f"<Marker>{enc(query.get('marker', ''))}</Marker>")
        out += [f"<MaxKeys>{max_keys}</MaxKeys>", f"<Delimiter>{enc(delimiter)}</Delimiter>",
                f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if url:
            out.append("<EncodingType>url</EncodingType>")
        if truncated:
            last = entries[-1][0]
            if v2:
                out.append("<NextContinuationToken>"
                           f"{base64.urlsafe_b64encode(last.encode()).decode()}"
                           "</NextContinuationToken>")
            else:
                out.append(f"<NextMarker>{enc(last)}</NextMarker>")
        if v2:
            out.append(f"<KeyCount>{len(entries)}</KeyCount>")
        for name, obj in entries:
            if obj is None:
                out.append(f"<CommonPrefixes><Prefix>{enc(name)}</Prefix></CommonPrefixes>")
            else:
                out.append(f"<Contents><Key>{enc(name)}</Key>"
                           f"<LastModified>{_iso(obj.modified)}</LastModified>"
                           f'<ETag>"{obj.etag}"</ETag><Type>{obj.kind}</Type>'
                           f"<Size>{len(obj.data)}</Size><StorageClass>Standard</StorageClass>"
                           f"{owner if with_owner else ''}</Contents>")
        out.append("</ListBucketResult>")
        self._xml("".join(out))

    # ---------------------------------------------------------------- multipart
    def _initiate_upload(self, bucket: str, key: str, query: dict[str, str],
                         headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        with o._lock:
            b = o._bucket(bucket)
            self._forbid_overwrite(b, key, headers)
            uid = o._new_upload_id()
            b.uploads[uid] = _Upload(key, uid, time.time(),
                                     headers.get("content-type", "application/octet-stream"),
                                     self._meta_from(headers))
        self._xml(f"<InitiateMultipartUploadResult><Bucket>{escape(bucket)}</Bucket>"
                  f"<Key>{escape(key)}</Key><UploadId>{uid}</UploadId>"
                  "</InitiateMultipartUploadResult>")

    def _upload(self, b: _Bucket, key: str, query: dict[str, str]) -> _Upload:
        """The upload a request names (the caller holds the lock); 404 NoSuchUpload."""
        up = b.uploads.get(query.get("uploadId", ""))
        if up is None or up.key != key:
            raise _Reply(404, "NoSuchUpload", "The specified upload does not exist. The upload "
                         "ID may be invalid, or the upload may have been aborted or completed.",
                         extra={"UploadId": query.get("uploadId", "")})
        return up

    def _upload_part(self, bucket: str, key: str, query: dict[str, str],
                     headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        raw = query.get("partNumber", "")
        try:
            number = int(raw)
        except ValueError:
            number = 0
        if not 1 <= number <= _MAX_PART_NUMBER:
            raise _Reply(400, "InvalidArgument", "Part number must be an integer between 1 and "
                         "10000, inclusive.", extra={"ArgumentName": "partNumber",
                                                     "ArgumentValue": raw})
        if "x-oss-copy-source" in headers:
            raise _Reply(400, "NotImplemented", "UploadPartCopy is not modelled by the OSS "
                         "test double")
        part = _Part(body, _md5(body).hex().upper(), crc64(body), time.time())
        with o._lock:
            self._upload(o._bucket(bucket), key, query).parts[number] = part
        self._send(200, headers={"ETag": f'"{part.etag}"', "x-oss-hash-crc64ecma": str(part.crc),
                                 "Content-MD5": base64.b64encode(_md5(body)).decode()})

    def _complete_upload(self, bucket: str, key: str, query: dict[str, str],
                         headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        try:
            root = ElementTree.fromstring(body)
            wanted = [(int(n.findtext("PartNumber") or ""),
                       (n.findtext("ETag") or "").strip().strip('"').upper())
                      for n in root.findall("Part")]
        except (ElementTree.ParseError, ValueError):
            raise _Reply(400, "MalformedXML", "The XML you provided was not well-formed.") \
                from None
        if root.tag != "CompleteMultipartUpload" or not wanted:
            raise _Reply(400, "MalformedXML", "The XML you provided was not well-formed or "
                         "names no part.")
        numbers = [n for n, _e in wanted]
        if numbers != sorted(set(numbers)):
            raise _Reply(400, "InvalidPartOrder", "The list of parts was not in ascending "
                         "order. The parts list must be specified in order by part number.")
        with o._lock:
            b = o._bucket(bucket)
            up = self._upload(b, key, query)
            self._forbid_overwrite(b, key, headers)
            chosen = []
            for n, etag in wanted:
                part = up.parts.get(n)
                if part is None or part.etag != etag:
                    raise _Reply(400, "InvalidPart", "One or more of the specified parts could "
                                 "not be found or the specified entity tag might not have "
                                 "matched the part's entity tag.",
                                 extra={"PartNumber": str(n), "ETag": etag})
                chosen.append(part)
            for n, part in zip(numbers[:-1], chosen[:-1], strict=True):
                if len(part.data) < o.min_part_size:
                    raise _Reply(400, "EntityTooSmall", f"part {n} is {len(part.data)} bytes; "
                                 f"every part but the last must be at least "
                                 f"{o.min_part_size} bytes.",
                                 extra={"PartNumber": str(n)})
            data = b"".join(p.data for p in chosen)
            # OSS's multipart ETag: MD5 of the parts' binary MD5s, "-", the number of parts
            etag = (_md5(b"".join(bytes.fromhex(p.etag) for p in chosen)).hex().upper()
                    + f"-{len(chosen)}")
            obj = _Object(data, etag, crc64(data), time.time(), up.content_type,
                          dict(up.meta), "Multipart")
            b.objects[key] = obj
            del b.uploads[up.upload_id]
        self._xml(f"<CompleteMultipartUploadResult><Location>{escape(self._path)}</Location>"
                  f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                  f'<ETag>"{etag}"</ETag></CompleteMultipartUploadResult>',
                  {"x-oss-hash-crc64ecma": str(obj.crc), "ETag": f'"{etag}"'})

    def _abort_upload(self, bucket: str, key: str, query: dict[str, str],
                      headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        with o._lock:
            b = o._bucket(bucket)
            del b.uploads[self._upload(b, key, query).upload_id]
        self._send(204)

    def _list_parts(self, bucket: str, key: str, query: dict[str, str],
                    headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        max_parts = self._max(query, "max-parts", 1000)
        try:
            marker = int(query.get("part-number-marker") or 0)
        except ValueError:
            marker = 0
        with o._lock:
            up = self._upload(o._bucket(bucket), key, query)
            numbers = sorted(n for n in up.parts if n > marker)
            page = [(n, up.parts[n]) for n in numbers[:max_parts]]
        truncated = len(numbers) > max_parts
        next_marker = page[-1][0] if page else marker
        parts = "".join(f"<Part><PartNumber>{n}</PartNumber>"
                        f"<LastModified>{_iso(p.modified)}</LastModified>"
                        f'<ETag>"{p.etag}"</ETag><HashCrc64ecma>{p.crc}</HashCrc64ecma>'
                        f"<Size>{len(p.data)}</Size></Part>" for n, p in page)
        self._xml(f"<ListPartsResult><Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                  f"<UploadId>{up.upload_id}</UploadId>"
                  f"<PartNumberMarker>{marker}</PartNumberMarker>"
                  f"<NextPartNumberMarker>{next_marker}</NextPartNumberMarker>"
                  f"<MaxParts>{max_parts}</MaxParts>"
                  f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
                  f"{parts}</ListPartsResult>")

    def _list_uploads(self, bucket: str, key: str, query: dict[str, str],
                      headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        key_marker = query.get("key-marker", "")
        id_marker = query.get("upload-id-marker", "")
        max_uploads = self._max(query, "max-uploads", 1000)
        url = query.get("encoding-type") == "url"
        with o._lock:
            items = sorted((u.key, u.upload_id, u.initiated)
                           for u in o._bucket(bucket).uploads.values()
                           if u.key.startswith(prefix))
        # after the markers: a later key, or the marker's key with a later upload id
        items = [it for it in items if it[0] > key_marker
                 or (id_marker and it[0] == key_marker and it[1] > id_marker)]
        entries: list[tuple[str, Optional[str], float]] = []
        for k, uid, t in items:
            if delimiter:
                i = k.find(delimiter, len(prefix))
                if i >= 0:
                    p = k[: i + len(delimiter)]
                    if p != key_marker and not any(e[0] == p and e[1] is None
                                                   for e in entries[-1:]):
                        entries.append((p, None, 0.0))
                    if len(entries) > max_uploads:
                        break
                    continue
            entries.append((k, uid, t))
            if len(entries) > max_uploads:
                break
        truncated = len(entries) > max_uploads
        entries = entries[:max_uploads]
        next_key, next_id = (entries[-1][0], entries[-1][1] or "") if truncated else ("", "")

        def enc(s: str) -> str:
            return quote(s, safe="/") if url else escape(s)

        body_xml = "".join(
            f"<CommonPrefixes><Prefix>{enc(k)}</Prefix></CommonPrefixes>" if uid is None else
            f"<Upload><Key>{enc(k)}</Key><UploadId>{uid}</UploadId>"
            f"<StorageClass>Standard</StorageClass><Initiated>{_iso(t)}</Initiated></Upload>"
            for k, uid, t in entries)
        self._xml(f"<ListMultipartUploadsResult><Bucket>{escape(bucket)}</Bucket>"
                  + ("<EncodingType>url</EncodingType>" if url else "")
                  + f"<KeyMarker>{enc(key_marker)}</KeyMarker>"
                  f"<UploadIdMarker>{escape(id_marker)}</UploadIdMarker>"
                  f"<NextKeyMarker>{enc(next_key)}</NextKeyMarker>"
                  f"<NextUploadIdMarker>{next_id}</NextUploadIdMarker>"
                  f"<Delimiter>{enc(delimiter)}</Delimiter><Prefix>{enc(prefix)}</Prefix>"
                  f"<MaxUploads>{max_uploads}</MaxUploads>"
                  f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
                  f"{body_xml}</ListMultipartUploadsResult>")

    # ---------------------------------------------------------------- buckets
    def _put_bucket(self, bucket: str, key: str, query: dict[str, str],
                    headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        with o._lock:
            o._bucket(bucket, create=True)
        self._send(200, headers={"Location": f"/{bucket}"})

    def _delete_bucket(self, bucket: str, key: str, query: dict[str, str],
                       headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        with o._lock:
            b = o._bucket(bucket)
            if b.objects or b.uploads:
                raise _Reply(409, "BucketNotEmpty", "The bucket you tried to delete is not "
                             "empty.", extra={"BucketName": bucket})
            del o._buckets[bucket]
        self._send(204)
