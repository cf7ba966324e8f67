"""The OSS test double's request handler: one request from arrival to answer.

``OssRequestHandler`` names the OSS operation a request asks for, counts it, carries out the
fault rules that apply (drop, delay, fail), checks the AccessKey id, refuses what the double
does not model (400 ``NotImplemented``: unknown sub-resources and headers, service-level
requests) and invalid keys and ``Content-MD5``, then hands the request to its object or
multipart operation.
"""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Callable
from typing import Optional
from urllib.parse import parse_qsl, unquote, urlsplit

from odl.harness.oss_double_multipart_requests import MultipartRequests
from odl.harness.oss_double_object_requests import ObjectRequests
from odl.harness.oss_double_protocol import (
    OssError,
    access_key_id,
    redacted_query,
    request_operation,
)
from odl.harness.oss_double_store import md5_digest

logger = logging.getLogger(__name__)

_MAX_KEY_BYTES = 1023  # OSS's longest object key, UTF-8
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


class OssRequestHandler(ObjectRequests, MultipartRequests):
    """Serves one request of the OSS test double (``owner``: the double)."""

    def _handle(self) -> None:
        o = self.owner
        self._status = 0
        self._swallow = False
        self._logged = False
        self._request_id = uuid.uuid4().hex[:24].upper()
        parts = urlsplit(self.path)
        self._path = unquote(parts.path)
        self._query_text = redacted_query(parts.query)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        bucket, _, key = self._path.lstrip("/").partition("/")
        method = self.command
        headers = {k.lower(): v for k, v in self.headers.items()}
        key_id = self._key_id = access_key_id(headers, query)
        operation = request_operation(method, key, query)
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
                    raise OssError(fail.status, fail.code, fail.message)
                self._authorize(key_id)
                self._check_request(bucket, key, query, headers, body)
                self._dispatch(operation, bucket, key, query, headers, body)
            except OssError as reply:
                self._error(reply)
            except Exception as exc:  # a bug in the double: say so, loudly
                logger.exception("oss double: %s %s failed", method, self._path)
                self._error(OssError(500, "InternalError", f"OSS test double bug: {exc!r}"))
        finally:
            self._record(self._status)  # when an exception escaped before any answer

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815

    def _authorize(self, key_id: str) -> None:
        required = self.owner.require_access_key_id
        if not required or key_id == required:
            return
        if not key_id:
            raise OssError(403, "AccessDenied", "You have no right to access this object because "
                           "of bucket acl.")
        raise OssError(403, "InvalidAccessKeyId", "The OSS Access Key Id you provided does not "
                       "exist in our records.", extra={"OSSAccessKeyId": key_id})

    def _check_request(self, bucket: str, key: str, query: dict[str, str],
                       headers: dict[str, str], body: bytes) -> None:
        if not bucket:
            raise OssError(400, "NotImplemented", "service-level requests (ListBuckets ...) are "
                           "not modelled by the OSS test double")
        unknown = sorted(set(query) - _KNOWN_PARAMS)
        if unknown:
            raise OssError(400, "NotImplemented", f"sub-resource {unknown[0]!r} is not modelled "
                           "by the OSS test double")
        for name in _UNMODELLED_HEADERS:
            if name in headers:
                raise OssError(400, "NotImplemented", f"header {name} is not modelled by the "
                               "OSS test double")
        if key:
            if len(key.encode()) > _MAX_KEY_BYTES or key[0] in "/\\":
                raise OssError(400, "InvalidObjectName", "The specified object is not valid.")
        md5 = headers.get("content-md5")
        if md5 is not None and base64.b64encode(md5_digest(body)).decode() != md5.strip():
            raise OssError(400, "InvalidDigest", "The Content-MD5 you specified was invalid.")

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
            raise OssError(400, "NotImplemented", f"{self.command} with these parameters is not "
                           "modelled by the OSS test double")
        handler(bucket, key, query, headers, body)
