"""The OSS test double's object, listing and bucket operations.

``ObjectRequests`` serves PutObject (and CopyObject), AppendObject, GetObject (one ``Range``,
conditional headers), HeadObject, GetObjectMeta, DeleteObject, DeleteMultipleObjects,
ListObjects (v1 and v2), PutBucket and DeleteBucket against the double's buckets; each answer
carries the headers ``oss2`` reads (ETag, ``x-oss-hash-crc64ecma`` ...), each refusal is an
``OssError``.
"""

from __future__ import annotations

import base64
import bisect
import time
from email.utils import parsedate_to_datetime
from typing import Optional
from urllib.parse import quote, unquote
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from odl.harness.oss_double_exchange import OssExchange
from odl.harness.oss_double_protocol import (
    MAX_KEYS,
    OssError,
    http_date,
    iso_time,
    parse_range,
)
from odl.harness.oss_double_store import (
    StoredBucket,
    StoredObject,
    crc64,
    md5_digest,
    normal_object,
)


class ObjectRequests(OssExchange):
    """Object, listing and bucket operations of the OSS test double's request handler."""

    # ---------------------------------------------------------------- objects
    @staticmethod
    def _object_headers(obj: StoredObject) -> dict[str, str]:
        h = {"ETag": f'"{obj.etag}"', "Content-Type": obj.content_type,
             "Last-Modified": http_date(obj.modified), "x-oss-object-type": obj.kind,
             "x-oss-storage-class": "Standard", "x-oss-hash-crc64ecma": str(obj.crc),
             "Accept-Ranges": "bytes", **obj.meta}
        if obj.content_md5:
            h["Content-MD5"] = obj.content_md5
        return h

    def _put_object(self, bucket: str, key: str, query: dict[str, str],
                    headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        source = headers.get("x-oss-copy-source")
        with o._lock:
            b = o._bucket(bucket)
            self._forbid_overwrite(b, key, headers)
            if source is None:
                obj = normal_object(body, headers.get("content-type",
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
                  f"<LastModified>{iso_time(obj.modified)}</LastModified></CopyObjectResult>",
                  {"x-oss-hash-crc64ecma": str(obj.crc)})

    def _copy(self, b: StoredBucket, key: str, source: str,
              headers: dict[str, str]) -> StoredObject:
        """CopyObject (the caller holds the lock)."""
        o = self.owner
        path = unquote(source.split("?", 1)[0]).lstrip("/")
        sbucket, _, skey = path.partition("/")
        src = o._bucket(sbucket).objects.get(skey)
        if src is None:
            raise OssError(404, "NoSuchKey", "The specified key does not exist.",
                           extra={"Key": skey})
        directive = headers.get("x-oss-metadata-directive", "COPY").upper()
        if directive == "REPLACE":
            content_type = headers.get("content-type", "application/octet-stream")
            meta = self._meta_from(headers)
        else:
            content_type, meta = src.content_type, dict(src.meta)
        obj = StoredObject(src.data, src.etag, src.crc, time.time(), content_type, meta, src.kind,
                           src.content_md5)
        b.objects[key] = obj
        return obj

    def _append_object(self, bucket: str, key: str, query: dict[str, str],
                       headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        try:
            position = int(query.get("position", ""))
        except ValueError:
            raise OssError(400, "InvalidArgument", "position is not an integer.") from None
        with o._lock:
            b = o._bucket(bucket)
            old = b.objects.get(key)
            length = len(old.data) if old is not None else 0
            if old is not None and old.kind != "Appendable":
                raise OssError(409, "ObjectNotAppendable", "The object is not appendable.")
            if position != length:
                raise OssError(409, "PositionNotEqualToLength", "Position is not equal to file "
                               "length.", headers={"x-oss-next-append-position": str(length)})
            if old is None:
                obj = StoredObject(body, "", crc64(body), time.time(),
                                   headers.get("content-type", "application/octet-stream"),
                                   self._meta_from(headers), "Appendable")
            else:
                obj = StoredObject(old.data + body, "", crc64(body, old.crc), time.time(),
                                   old.content_type, old.meta, "Appendable")
            obj.etag = md5_digest(obj.data).hex().upper()
            b.objects[key] = obj
        self._send(200, headers={"ETag": f'"{obj.etag}"', "x-oss-hash-crc64ecma": str(obj.crc),
                                 "x-oss-next-append-position": str(len(obj.data))})

    def _lookup(self, bucket: str, key: str) -> StoredObject:
        o = self.owner
        with o._lock:
            obj = o._bucket(bucket).objects.get(key)
        if obj is None:
            raise OssError(404, "NoSuchKey", "The specified key does not exist.",
                           extra={"Key": key})
        return obj

    def _check_conditions(self, obj: StoredObject, headers: dict[str, str]) -> None:
        etag = f'"{obj.etag}"'

        def when(name: str) -> Optional[float]:
            try:
                return parsedate_to_datetime(headers[name]).timestamp() if name in headers \
                    else None
            except (TypeError, ValueError):
                return None

        modified = int(obj.modified)
        if "if-match" in headers and headers["if-match"].strip() not in (etag, obj.etag, "*"):
            raise OssError(412, "PreconditionFailed", "At least one of the pre-conditions you "
                           "specified did not hold.")
        since = when("if-unmodified-since")
        if since is not None and modified > since:
            raise OssError(412, "PreconditionFailed", "At least one of the pre-conditions you "
                           "specified did not hold.")
        if "if-none-match" in headers and headers["if-none-match"].strip() in (etag, obj.etag,
                                                                               "*"):
            raise OssError(304, "NotModified", "Not Modified")
        since = when("if-modified-since")
        if since is not None and modified <= since:
            raise OssError(304, "NotModified", "Not Modified")

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
        rng = parse_range(headers.get("range", ""), size, standard)
        if rng is None:
            return self._send(200, obj.data, out)
        first, last = rng
        out["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._send(206, obj.data[first:last + 1], out)

    def _get_object_meta(self, bucket: str, key: str, query: dict[str, str],
                         headers: dict[str, str], body: bytes) -> None:
        obj = self._lookup(bucket, key)
        self._send(200, b"", {"ETag": f'"{obj.etag}"', "Content-Length": str(len(obj.data)),
                              "Last-Modified": http_date(obj.modified)})

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
            raise OssError(400, "MalformedXML", "The XML you provided was not well-formed.") \
                from None
        quiet = (root.findtext("Quiet") or "false").strip().lower() == "true"
        keys = [n.findtext("Key") or "" for n in root.findall("Object")]
        if root.tag != "Delete" or not keys or len(keys) > MAX_KEYS:
            raise OssError(400, "MalformedXML", "The XML you provided was not well-formed or "
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
                raise OssError(400, "InvalidArgument", "The continuation token is not valid.",
                               extra={"ArgumentName": "continuation-token",
                                      "ArgumentValue": token}) from None
        else:
            after = query.get("start-after" if v2 else "marker", "")
        with o._lock:
            objs = o._bucket(bucket).objects
            names = sorted(k for k in objs if k.startswith(prefix))
            start = bisect.bisect_right(names, after)
            # (name, object or None for a common prefix), up to one past the page
            entries: list[tuple[str, Optional[StoredObject]]] = []
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
                           f"<LastModified>{iso_time(obj.modified)}</LastModified>"
                           f'<ETag>"{obj.etag}"</ETag><Type>{obj.kind}</Type>'
                           f"<Size>{len(obj.data)}</Size><StorageClass>Standard</StorageClass>"
                           f"{owner if with_owner else ''}</Contents>")
        out.append("</ListBucketResult>")
        self._xml("".join(out))

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
                raise OssError(409, "BucketNotEmpty", "The bucket you tried to delete is not "
                               "empty.", extra={"BucketName": bucket})
            del o._buckets[bucket]
        self._send(204)
