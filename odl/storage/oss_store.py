"""OSS through the ``oss2`` SDK: retries with backoff, multipart uploads, health counters.

Contract:

* Transient errors (network errors and timeouts, HTTP 5xx, 429 and the throttling codes
  ``SlowDown`` / ``ServiceUnavailable`` / ``RequestTimeout``, CRC mismatches) are retried with
  exponential backoff (0.2 s doubling, capped at 5 s) for up to ``retry_seconds`` per
  operation (``ODL_OSS_RETRY_SECONDS``, default 30). While OSS is known to be failing (the last
  operation failed after its retries) an operation makes one attempt only, so a trainer whose
  checkpoint upload fails is not stalled again at every later checkpoint; the first success
  makes it patient again.
* Permanent errors (403 access denied, a missing bucket, bad requests) raise at once.
* A missing object raises ``FileNotFoundError``; every other failure raises
  :class:`StorageError` whose message names the operation, the ``oss://`` path and the OSS
  error code, never a credential.
* Files above ``multipart_threshold`` (``ODL_OSS_MULTIPART_THRESHOLD``, default 16 MiB) go as
  multipart uploads of ``part_size`` (``ODL_OSS_PART_SIZE``, default 8 MiB) parts, up to
  ``ODL_OSS_UPLOAD_THREADS`` (default 4) at a time, each part retried on its own; a failed
  upload is aborted (and any upload left by a crash is aborted by
  :meth:`OssStore.abort_uploads`, which the checkpoint cleanup calls). Downloads of such
  files are ranged GETs of the same size, as many at a time.
* :func:`oss_health` reports requests, retries, failures, bytes and the last error for
  ``/status`` and ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from odl.storage.oss_credentials import OssCredentials, oss_credentials
from odl.storage.storage_path import OSS_SCHEME, OssLocation

if TYPE_CHECKING:  # oss2 is imported when OSS is first used: a process without OSS paths
    import oss2  # starts 0.3 s faster
    from oss2.models import PartInfo

logger = logging.getLogger(__name__)
# oss2 logs every non-2xx answer at INFO (a missing OSS_STOP_SIGNAL every poll); the
# failures that matter are logged here, once, with the operation and path
logging.getLogger("oss2").setLevel(logging.WARNING)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "RequestTimeout",
                              "InternalError", "Throttling", "TooManyRequests"})
_MIB = 1024 * 1024


class StorageError(RuntimeError):
    """An object-store operation failed.

    Attributes:
        transient: the failure was of a kind that retries can fix (OSS down, throttled).
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


def _is_transient(exc: oss2.exceptions.OssError) -> bool:
    import oss2

    if isinstance(exc, (oss2.exceptions.RequestError, oss2.exceptions.InconsistentError)):
        return True
    status = int(getattr(exc, "status", 0) or 0)
    return status >= 500 or status == 429 or getattr(exc, "code", "") in _TRANSIENT_CODES


def _describe(exc: BaseException) -> str:
    import oss2

    if isinstance(exc, oss2.exceptions.RequestError):
        return f"network error: {type(exc.exception).__name__}"
    if isinstance(exc, oss2.exceptions.OssError):
        code = getattr(exc, "code", "") or ""
        msg = getattr(exc, "message", "") or ""
        return f"HTTP {exc.status} {code} {msg}".strip()
    return f"{type(exc).__name__}: {exc}"


class OssStats:
    """Counters of one store, read by ``/status`` and ``/metrics`` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.retries = 0
        self.failures = 0
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.healthy = True
        self.last_error: Optional[str] = None
        self.last_error_time: Optional[float] = None

    def add(self, **deltas: int) -> None:
        """Adds to counters by name."""
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def failed(self, text: str, transient: bool) -> None:
        """Records an operation that failed after its retries."""
        with self._lock:
            self.failures += 1
            self.last_error = text
            self.last_error_time = time.time()
            if transient:
                self.healthy = False

    def succeeded(self) -> None:
        """Records a successful operation."""
        with self._lock:
            if not self.healthy:
                logger.info("OSS reachable again")
            self.healthy = True

    def snapshot(self) -> dict[str, Any]:
        """The counters as a JSON-able dict."""
        with self._lock:
            return {
                "healthy": self.healthy, "requests": self.requests, "retries": self.retries,
                "failures": self.failures, "bytes_uploaded": self.bytes_uploaded,
                "bytes_downloaded": self.bytes_downloaded, "last_error": self.last_error,
                "last_error_time": self.last_error_time,
            }


class OssStore:
    """OSS operations on ``OssLocation``s with the retry contract of the module docstring.

    Args:
        credentials: who to be and where (default: :func:`oss_credentials`).
        retry_seconds: retry budget per operation while OSS is healthy.
        timeout_seconds: connect/read timeout of one request.
        part_size: multipart part size in bytes.
        multipart_threshold: files above this many bytes go multipart.
    """

    def __init__(self, credentials: Optional[OssCredentials] = None,
                 retry_seconds: Optional[float] = None,
                 timeout_seconds: Optional[float] = None,
                 part_size: Optional[int] = None,
                 multipart_threshold: Optional[int] = None) -> None:
        import oss2

        self.credentials = credentials or oss_credentials()
        self.retry_seconds = (retry_seconds if retry_seconds is not None
                              else _env_float("ODL_OSS_RETRY_SECONDS", 30.0))
        self.timeout_seconds = (timeout_seconds if timeout_seconds is not None
                                else _env_float("ODL_OSS_TIMEOUT_SECONDS", 10.0))
        self.part_size = int(part_size or _env_float("ODL_OSS_PART_SIZE", 8 * _MIB))
        self.multipart_threshold = int(multipart_threshold
                                       or _env_float("ODL_OSS_MULTIPART_THRESHOLD", 16 * _MIB))
        self.upload_threads = int(_env_float("ODL_OSS_UPLOAD_THREADS", 4))
        c = self.credentials
        self._auth = (oss2.StsAuth(c.access_key_id, c.access_key_secret, c.security_token)
                      if c.security_token else oss2.Auth(c.access_key_id, c.access_key_secret))
        self._session = oss2.Session()
        self._buckets: dict[str, oss2.Bucket] = {}
        self._lock = threading.Lock()
        self.stats = OssStats()

    def __repr__(self) -> str:
        return f"OssStore({self.credentials.describe()})"

    def _bucket(self, name: str) -> oss2.Bucket:
        import oss2

        with self._lock:
            b = self._buckets.get(name)
            if b is None:
                # no client CRC64: checkpoints and exports are verified end to end against
                # their manifests' sha256 after every download, which CRC would only repeat
                b = oss2.Bucket(self._auth, self.credentials.endpoint, name,
                                session=self._session, connect_timeout=self.timeout_seconds,
                                enable_crc=False)
                self._buckets[name] = b
            return b

    def _call(self, what: str, loc: OssLocation, fn: Callable[[oss2.Bucket], T]) -> T:
        """Runs ``fn(bucket)`` with the retry contract; ``what`` names it in errors."""
        import oss2

        bucket = self._bucket(loc.bucket)
        budget = self.retry_seconds if self.stats.healthy else 0.0
        deadline = time.monotonic() + budget
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            self.stats.add(requests=1)
            try:
                out = fn(bucket)
            except oss2.exceptions.NoSuchKey as exc:
                self.stats.succeeded()
                raise FileNotFoundError(f"{OSS_SCHEME}{loc.bucket}/{loc.key}") from exc
            except oss2.exceptions.OssError as exc:
                transient = _is_transient(exc)
                text = f"{what} {OSS_SCHEME}{loc.bucket}/{loc.key}: {_describe(exc)}"
                if transient and time.monotonic() + delay < deadline:
                    if attempt == 1:
                        logger.warning("%s; retrying for up to %.0fs", text, budget)
                    self.stats.add(retries=1)
                    time.sleep(delay * (0.75 + 0.5 * random.random()))
                    delay = min(delay * 2, 5.0)
                    continue
                self.stats.failed(text, transient)
                if transient and attempt > 1:
                    text += f" (after {attempt} attempts)"
                raise StorageError(text, transient) from exc
            self.stats.succeeded()
            return out

    # ---------------------------------------------------------------- reads
    def get(self, loc: OssLocation) -> bytes:
        """An object's bytes (``FileNotFoundError`` when missing)."""
        data = self._call("reading", loc, lambda b: b.get_object(loc.key).read())
        self.stats.add(bytes_downloaded=len(data))
        return data

    def get_to_file(self, loc: OssLocation, local_path: str) -> None:
        """Downloads an object to a local file (written in place; callers rename).

        Objects above the multipart threshold are fetched as ``part_size`` ranges, up to
        ``upload_threads`` at a time, each retried on its own.
        """
        size = self._call("checking", loc,
                          lambda b: b.get_object_meta(loc.key).content_length)
        if size is None or size <= self.multipart_threshold:
            self._call("downloading", loc, lambda b: b.get_object_to_file(loc.key, local_path))
            self.stats.add(bytes_downloaded=os.path.getsize(local_path))
            return
        with open(local_path, "wb") as f:
            f.truncate(size)

        def fetch(start: int) -> None:
            end = min(start + self.part_size, size) - 1
            data = self._call(f"downloading bytes {start}-{end} of", loc,
                              lambda b: b.get_object(loc.key, byte_range=(start, end)).read())
            if len(data) != end - start + 1:
                raise StorageError(f"downloading {loc.key}: range {start}-{end} returned "
                                   f"{len(data)} bytes", transient=True)
            fd = os.open(local_path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, start)
            finally:
                os.close(fd)
            self.stats.add(bytes_downloaded=len(data))

        with ThreadPoolExecutor(max_workers=self.upload_threads,
                                thread_name_prefix="oss-download") as pool:
            list(pool.map(fetch, range(0, size, self.part_size)))

    def exists(self, loc: OssLocation) -> bool:
        """Whether the object exists."""
        return self._call("checking", loc, lambda b: b.object_exists(loc.key))

    def list(self, loc: OssLocation, recursive: bool = False) -> tuple[list[str], list[str]]:
        """Lists under a directory prefix.

        Args:
            loc: the directory (its key is used as a prefix ending in ``/``).
            recursive: list every key below (no sub-directories reported).

        Returns:
            ``(sub_directory_names, object_names)`` relative to the prefix (recursive: object
            paths relative to it).
        """
        import oss2

        prefix = loc.dir_prefix

        def run(b: oss2.Bucket) -> tuple[list[str], list[str]]:
            dirs, files = [], []
            for info in oss2.ObjectIteratorV2(b, prefix=prefix,
                                              delimiter="" if recursive else "/"):
                rel = info.key[len(prefix):]
                if info.is_prefix():
                    dirs.append(rel.rstrip("/"))
                elif rel:
                    files.append(rel)
            return dirs, files

        return self._call("listing", loc, run)

    # ---------------------------------------------------------------- writes
    def put(self, loc: OssLocation, data: bytes) -> None:
        """Writes one object (atomic: readers see the old or the new one)."""
        self._call("writing", loc, lambda b: b.put_object(loc.key, data))
        self.stats.add(bytes_uploaded=len(data))

    def put_file(self, loc: OssLocation, local_path: str) -> None:
        """Uploads a local file, multipart above the threshold."""
        import oss2
        from oss2.models import PartInfo

        size = os.path.getsize(local_path)
        if size <= self.multipart_threshold:
            with open(local_path, "rb") as f:
                data = f.read()
            self.put(loc, data)
            return
        upload_id = self._call("starting a multipart upload of", loc,
                               lambda b: b.init_multipart_upload(loc.key).upload_id)
        count = (size + self.part_size - 1) // self.part_size

        def upload(number: int) -> PartInfo:
            with open(local_path, "rb") as f:
                f.seek((number - 1) * self.part_size)
                chunk = f.read(self.part_size)
            res = self._call(f"uploading part {number} of", loc,
                             lambda b: b.upload_part(loc.key, upload_id, number, chunk))
            self.stats.add(bytes_uploaded=len(chunk))
            return PartInfo(number, res.etag)

        try:
            with ThreadPoolExecutor(max_workers=max(1, min(self.upload_threads, count)),
                                    thread_name_prefix="oss-upload") as pool:
                parts = list(pool.map(upload, range(1, count + 1)))
            self._call("completing the multipart upload of", loc,
                       lambda b: b.complete_multipart_upload(loc.key, upload_id, parts))
        except BaseException:
            try:
                self._bucket(loc.bucket).abort_multipart_upload(loc.key, upload_id)
            except oss2.exceptions.OssError as exc:
                logger.info("could not abort the multipart upload of %s (%s); a later cleanup "
                            "aborts it", loc.key, _describe(exc))
            raise

    def delete(self, bucket: str, keys: list[str]) -> None:
        """Deletes objects (missing ones are fine), in batches of 1000."""
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            self._call("deleting", OssLocation(bucket, batch[0]),
                       lambda b, batch=batch: b.batch_delete_objects(batch))

    def abort_uploads(self, loc: OssLocation, older_than_seconds: float = 0.0) -> int:
        """Aborts multipart uploads under a prefix started more than ``older_than`` ago.

        Returns:
            How many were aborted.
        """
        import oss2

        prefix = loc.dir_prefix
        now = time.time()

        def run(b: oss2.Bucket) -> int:
            n = 0
            for up in oss2.MultipartUploadIterator(b, prefix=prefix):
                if now - float(up.initiation_date or 0) >= older_than_seconds:
                    b.abort_multipart_upload(up.key, up.upload_id)
                    n += 1
            return n

        return self._call("aborting uploads under", loc, run)

    def iter_keys(self, loc: OssLocation) -> Iterator[str]:
        """Every key under a directory prefix (full keys)."""
        _dirs, files = self.list(loc, recursive=True)
        for rel in files:
            yield loc.dir_prefix + rel


_store_lock = threading.Lock()
_store: Optional[OssStore] = None


def oss_store() -> OssStore:
    """This process's store, created on first use from :func:`oss_credentials`.

    Raises:
        odl.storage.oss_credentials.OssCredentialsError: credentials or endpoint missing.
    """
    global _store
    with _store_lock:
        creds = oss_credentials()
        if _store is None or _store.credentials != creds:
            _store = OssStore(creds)
            logger.info("OSS: %s", creds.describe())
        return _store


def reset_oss_store() -> None:
    """Drops the process's store (the next use builds one from the current settings)."""
    global _store
    with _store_lock:
        _store = None


def oss_health() -> Optional[dict[str, Any]]:
    """The store's counters, None when this process has not used OSS."""
    with _store_lock:
        return None if _store is None else _store.stats.snapshot()
