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

The double is put together from one module per concept: the buckets, objects and uploads it
holds (``oss_double_store``), its fault rules (``oss_double_faults``), what it reads from a
request and how it states an error (``oss_double_protocol``), and its request handler
(``oss_double_handler``: reading and answering in ``oss_double_exchange``, the operations in
``oss_double_object_requests`` and ``oss_double_multipart_requests``). Tests and benchmarks
import ``OssDouble``, ``MIN_PART_SIZE`` and ``crc64`` from here.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from odl.harness.loopback_server import LoopbackServer
from odl.harness.oss_double_faults import FaultInjection
from odl.harness.oss_double_handler import OssRequestHandler
from odl.harness.oss_double_store import BucketStore, crc64

__all__ = ["MIN_PART_SIZE", "OssDouble", "crc64"]

logger = logging.getLogger(__name__)

MIN_PART_SIZE = 100 * 1024
"""OSS's smallest part size (every part of a multipart upload but the last)."""


class OssDouble(BucketStore, FaultInjection, LoopbackServer):
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
        LoopbackServer.__init__(self, OssRequestHandler, port)
        self._lock = threading.Lock()
        BucketStore.__init__(self, self._lock, auto_create_buckets)
        FaultInjection.__init__(self, self._lock)
        self.require_access_key_id = require_access_key_id
        self.min_part_size = min_part_size
        self._stopping = threading.Event()
        self.requests_log: list[tuple[str, str, str, int, str]] = []
        self.request_count = 0
        self.method_counts: dict[str, int] = {}
        self.operation_counts: dict[str, int] = {}

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

    # ------------------------------------------------------------------ counters
    def _count(self, method: str, operation: str) -> None:
        with self._lock:
            self.request_count += 1
            self.method_counts[method] = self.method_counts.get(method, 0) + 1
            self.operation_counts[operation] = self.operation_counts.get(operation, 0) + 1
