"""The OSS test double's contents: buckets, their objects and multipart uploads, in memory.

``StoredBucket`` holds ``StoredObject`` s by key and unfinished ``MultipartUpload`` s (with
their ``StoredPart`` s) by upload id. ``BucketStore`` is the part of the double that owns the
buckets: the test helpers that look at or write them directly, and what the request handler
uses to find a bucket (404 ``NoSuchBucket``, or created on first use) and to name a new
upload. ``crc64`` is OSS's ``x-oss-hash-crc64ecma``; ``md5_digest`` gives OSS's ETags and
``Content-MD5``.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import crcmod  # oss2's own dependency: the same CRC-64/XZ that oss2 checks

from odl.harness.oss_double_protocol import OssError

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


def md5_digest(data: bytes) -> bytes:
    """The binary MD5 of ``data``: OSS's ETags and ``Content-MD5``."""
    return hashlib.md5(data).digest()  # noqa: S324 - OSS's ETag and Content-MD5, not security


@dataclass
class StoredObject:
    """An object: its bytes and what OSS answers about it."""

    data: bytes
    etag: str
    crc: int
    modified: float
    content_type: str = "application/octet-stream"
    meta: dict[str, str] = field(default_factory=dict)
    kind: str = "Normal"  # Normal | Multipart | Appendable
    content_md5: Optional[str] = None  # base64, Normal objects only


def normal_object(data: bytes, content_type: str = "application/octet-stream",
                  meta: Optional[dict[str, str]] = None) -> StoredObject:
    """A ``Normal`` object (PutObject's): MD5 ETag, CRC64, ``Content-MD5``, now."""
    digest = md5_digest(data)
    return StoredObject(data, digest.hex().upper(), crc64(data), time.time(), content_type,
                        dict(meta or {}), "Normal", base64.b64encode(digest).decode())


@dataclass
class StoredPart:
    """One uploaded part of a multipart upload."""

    data: bytes
    etag: str
    crc: int
    modified: float


@dataclass
class MultipartUpload:
    """A multipart upload neither completed nor aborted."""

    key: str
    upload_id: str
    initiated: float
    content_type: str
    meta: dict[str, str]
    parts: dict[int, StoredPart] = field(default_factory=dict)


@dataclass
class StoredBucket:
    """A bucket: its objects by key and its unfinished uploads by upload id."""

    created: float
    objects: dict[str, StoredObject] = field(default_factory=dict)
    uploads: dict[str, MultipartUpload] = field(default_factory=dict)


class BucketStore:
    """The buckets of the OSS test double, guarded by the double's lock.

    Args:
        lock: the double's one lock (it also guards fault rules and counters).
        auto_create_buckets: create a bucket on its first use; when False an unknown bucket is
            404 ``NoSuchBucket`` until ``create_bucket`` or ``oss2.Bucket.create_bucket``.
    """

    def __init__(self, lock: threading.Lock, auto_create_buckets: bool) -> None:
        self._lock = lock
        self.auto_create_buckets = auto_create_buckets
        self._buckets: dict[str, StoredBucket] = {}
        self._upload_seq = itertools.count(1)

    # ------------------------------------------------------------------ test helpers
    def create_bucket(self, name: str) -> None:
        """Creates a bucket (with ``auto_create_buckets`` they are also created on first use)."""
        with self._lock:
            self._buckets.setdefault(name, StoredBucket(time.time()))

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
            o = self._buckets.get(bucket, StoredBucket(0.0)).objects.get(key)
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
            b = self._buckets.setdefault(bucket, StoredBucket(time.time()))
            b.objects[key] = normal_object(bytes(data), content_type,
                                           {k.lower(): v for k, v in (meta or {}).items()})

    def incomplete_uploads(self, bucket: str) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of multipart uploads neither completed nor aborted."""
        with self._lock:
            b = self._buckets.get(bucket)
            if b is None:
                return []
            return sorted((u.key, u.upload_id) for u in b.uploads.values())

    # ------------------------------------------------------------------ state, for the handler
    def _bucket(self, name: str, create: bool = False) -> StoredBucket:
        """The bucket (caller holds the lock); 404 ``NoSuchBucket`` when it does not exist."""
        b = self._buckets.get(name)
        if b is None:
            if not (create or self.auto_create_buckets):
                raise OssError(404, "NoSuchBucket", "The specified bucket does not exist.",
                               extra={"BucketName": name})
            b = self._buckets[name] = StoredBucket(time.time())
        return b

    def _new_upload_id(self) -> str:
        # sorts in the order uploads were started, as ListMultipartUploads pages need
        return f"{next(self._upload_seq):08X}{uuid.uuid4().hex[:24].upper()}"
