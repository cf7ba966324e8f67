"""The OSS test double's multipart-upload operations.

``MultipartRequests`` serves InitiateMultipartUpload, UploadPart (part numbers 1..10000),
CompleteMultipartUpload (parts in ascending order, named with their ETags, every part but the
last at least the double's ``min_part_size``; the object's ETag is ``MD5(part MD5s)-N``),
AbortMultipartUpload, ListParts and ListMultipartUploads (both paginated).
"""

from __future__ import annotations

import base64
import time
from typing import Optional
from urllib.parse import quote
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from odl.harness.oss_double_exchange import OssExchange
from odl.harness.oss_double_protocol import OssError, iso_time
from odl.harness.oss_double_store import (
    MultipartUpload,
    StoredBucket,
    StoredObject,
    StoredPart,
    crc64,
    md5_digest,
)

_MAX_PART_NUMBER = 10000


class MultipartRequests(OssExchange):
    """Multipart-upload operations of the OSS test double's request handler."""

    # ---------------------------------------------------------------- multipart
    def _initiate_upload(self, bucket: str, key: str, query: dict[str, str],
                         headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        with o._lock:
            b = o._bucket(bucket)
            self._forbid_overwrite(b, key, headers)
            uid = o._new_upload_id()
            b.uploads[uid] = MultipartUpload(
                key, uid, time.time(), headers.get("content-type", "application/octet-stream"),
                self._meta_from(headers))
        self._xml(f"<InitiateMultipartUploadResult><Bucket>{escape(bucket)}</Bucket>"
                  f"<Key>{escape(key)}</Key><UploadId>{uid}</UploadId>"
                  "</InitiateMultipartUploadResult>")

    def _upload(self, b: StoredBucket, key: str, query: dict[str, str]) -> MultipartUpload:
        """The upload a request names (the caller holds the lock); 404 NoSuchUpload."""
        up = b.uploads.get(query.get("uploadId", ""))
        if up is None or up.key != key:
            raise OssError(404, "NoSuchUpload", "The specified upload does not exist. The upload "
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
            raise OssError(400, "InvalidArgument", "Part number must be an integer between 1 and "
                           "10000, inclusive.", extra={"ArgumentName": "partNumber",
                                                       "ArgumentValue": raw})
        if "x-oss-copy-source" in headers:
            raise OssError(400, "NotImplemented", "UploadPartCopy is not modelled by the OSS "
                           "test double")
        part = StoredPart(body, md5_digest(body).hex().upper(), crc64(body), time.time())
        with o._lock:
            self._upload(o._bucket(bucket), key, query).parts[number] = part
        self._send(200, headers={"ETag": f'"{part.etag}"', "x-oss-hash-crc64ecma": str(part.crc),
                                 "Content-MD5": base64.b64encode(md5_digest(body)).decode()})

    def _complete_upload(self, bucket: str, key: str, query: dict[str, str],
                         headers: dict[str, str], body: bytes) -> None:
        o = self.owner
        try:
            root = ElementTree.fromstring(body)
            wanted = [(int(n.findtext("PartNumber") or ""),
                       (n.findtext("ETag") or "").strip().strip('"').upper())
                      for n in root.findall("Part")]
        except (ElementTree.ParseError, ValueError):
            raise OssError(400, "MalformedXML", "The XML you provided was not well-formed.") \
                from None
        if root.tag != "CompleteMultipartUpload" or not wanted:
            raise OssError(400, "MalformedXML", "The XML you provided was not well-formed or "
                           "names no part.")
        numbers = [n for n, _e in wanted]
        if numbers != sorted(set(numbers)):
            raise OssError(400, "InvalidPartOrder", "The list of parts was not in ascending "
                           "order. The parts list must be specified in order by part number.")
        with o._lock:
            b = o._bucket(bucket)
            up = self._upload(b, key, query)
            self._forbid_overwrite(b, key, headers)
            chosen = []
            for n, etag in wanted:
                part = up.parts.get(n)
                if part is None or part.etag != etag:
                    raise OssError(400, "InvalidPart", "One or more of the specified parts could "
                                   "not be found or the specified entity tag might not have "
                                   "matched the part's entity tag.",
                                   extra={"PartNumber": str(n), "ETag": etag})
                chosen.append(part)
            for n, part in zip(numbers[:-1], chosen[:-1], strict=True):
                if len(part.data) < o.min_part_size:
                    raise OssError(400, "EntityTooSmall", f"part {n} is {len(part.data)} bytes; "
                                   f"every part but the last must be at least "
                                   f"{o.min_part_size} bytes.",
                                   extra={"PartNumber": str(n)})
            data = b"".join(p.data for p in chosen)
            # OSS's multipart ETag: MD5 of the parts' binary MD5s, "-", the number of parts
            etag = (md5_digest(b"".join(bytes.fromhex(p.etag) for p in chosen)).hex().upper()
                    + f"-{len(chosen)}")
            obj = StoredObject(data, etag, crc64(data), time.time(), up.content_type,
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
                        f"<LastModified>{iso_time(p.modified)}</LastModified>"
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
            f"<StorageClass>Standard</StorageClass><Initiated>{iso_time(t)}</Initiated></Upload>"
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
