"""The OSS test double answers the real ``oss2`` SDK as OSS does, faults included.

Every test drives the double through ``oss2`` itself (default ``enable_crc=True``, so the
SDK checks the double's CRC64 headers), except the one that cuts a request body short with a
raw socket.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import socket
import time
from urllib.parse import urlsplit

import oss2
import pytest

from odl.harness.oss_double import MIN_PART_SIZE, OssDouble, crc64

SECRET = "secret-never-on-the-wire"
KIB = 1024


@pytest.fixture
def double():
    with OssDouble() as d:
        yield d


def _bucket(double: OssDouble, key_id: str = "id", name: str = "bkt", **kw) -> oss2.Bucket:
    kw.setdefault("connect_timeout", 2)
    return oss2.Bucket(oss2.Auth(key_id, SECRET), double.endpoint, name, **kw)


@pytest.fixture
def bucket(double):
    return _bucket(double)


def _md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest().upper()  # noqa: S324


# ------------------------------------------------------------------ objects
def test_crc64_is_the_standard_crc64_xz_that_oss2_checks() -> None:
    assert crc64(b"123456789") == 0x995DC9BBDF1939FA  # the CRC-64/XZ check value
    c = oss2.utils.Crc64()
    c.update(b"hello world")
    assert crc64(b"hello world") == c.crc
    assert crc64(b"world", crc64(b"hello ")) == c.crc


def test_put_get_head_delete_with_crc_etag_and_metadata(double, bucket, tmp_path) -> None:
    data = bytes(range(256)) * 40
    res = bucket.put_object("a/b c+d%e?ü.json", data, headers={"x-oss-meta-Owner": "odl"})
    assert res.status == 200 and res.etag == _md5_hex(data) and res.crc == crc64(data)
    assert res.request_id and len(res.request_id) == 24
    got = bucket.get_object("a/b c+d%e?ü.json")
    assert got.read() == data and got.client_crc == got.server_crc == crc64(data)
    assert got.content_type == "application/json" and got.object_type == "Normal"
    head = bucket.head_object("a/b c+d%e?ü.json")
    assert head.content_length == len(data) and head.etag == _md5_hex(data)
    assert head.headers["x-oss-meta-owner"] == "odl" and head.last_modified > 0
    meta = bucket.get_object_meta("a/b c+d%e?ü.json")
    assert meta.content_length == len(data) and meta.etag == _md5_hex(data)
    bucket.get_object_to_file("a/b c+d%e?ü.json", str(tmp_path / "f"))  # checks the CRC
    assert (tmp_path / "f").read_bytes() == data
    assert double.objects("bkt") == {"a/b c+d%e?ü.json": data}
    for it in (oss2.ObjectIterator(bucket), oss2.ObjectIteratorV2(bucket)):  # url-encoded keys
        assert [o.key for o in it] == ["a/b c+d%e?ü.json"]
    assert bucket.delete_object("a/b c+d%e?ü.json").status == 204
    assert bucket.delete_object("a/never-there").status == 204
    assert double.objects("bkt") == {}
    assert ("PUT", "/bkt/a/b c+d%e?ü.json") in [(m, p) for m, p, *_ in double.requests_log]


def test_ranges_follow_oss_rules(bucket) -> None:
    bucket.put_object("r", b"0123456789")
    part = bucket.get_object("r", byte_range=(2, 4))
    assert part.status == 206 and part.read() == b"234"
    assert part.content_range == "bytes 2-4/10" and part.server_crc == crc64(b"0123456789")
    assert bucket.get_object("r", byte_range=(7, None)).read() == b"789"
    assert bucket.get_object("r", byte_range=(None, 3)).read() == b"789"
    # OSS: an end past the object is an invalid range: the whole object, 200 ...
    whole = bucket.get_object("r", byte_range=(5, 20))
    assert whole.status == 200 and whole.read() == b"0123456789"
    # ... unless the client asks for the standard behaviour
    std = {"x-oss-range-behavior": "standard"}
    assert bucket.get_object("r", byte_range=(5, 20), headers=std).read() == b"56789"
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.get_object("r", byte_range=(10, 20), headers=std)
    assert err.value.status == 416 and err.value.code == "InvalidRange"


def test_missing_keys_raise_nosuchkey_with_the_request_id(double, bucket) -> None:
    with pytest.raises(oss2.exceptions.NoSuchKey) as err:
        bucket.get_object("missing")
    assert err.value.status == 404 and err.value.request_id
    assert err.value.details["RequestId"] == err.value.request_id
    assert err.value.details["HostId"].startswith("127.0.0.1")
    with pytest.raises(oss2.exceptions.NoSuchKey):  # HEAD: the document is in x-oss-err
        bucket.head_object("missing")
    assert not bucket.object_exists("missing")
    bucket.put_object("here", b"1")
    assert bucket.object_exists("here")
    assert [s for m, _p, _q, s, _k in double.requests_log if m == "HEAD"] == [404, 404, 200]


def test_unknown_buckets_when_not_auto_created() -> None:
    with OssDouble(auto_create_buckets=False) as d:
        b = _bucket(d, name="nope")
        with pytest.raises(oss2.exceptions.NoSuchBucket):
            b.object_exists("k")
        with pytest.raises(oss2.exceptions.NoSuchBucket):
            b.put_object("k", b"x")
        b.create_bucket()
        b.put_object("k", b"x")
        with pytest.raises(oss2.exceptions.BucketNotEmpty):
            b.delete_bucket()
        b.delete_object("k")
        b.delete_bucket()
        assert d.buckets() == []
        d.create_bucket("made")
        _bucket(d, name="made").put_object("k", b"y")
        assert d.objects("made") == {"k": b"y"}


def test_batch_delete(double, bucket) -> None:
    for k in ("x/1", "x/2 sp", "x/3", "y/1"):
        double.put("bkt", k, b"v")
    res = bucket.batch_delete_objects(["x/1", "x/2 sp", "x/never"])
    assert res.deleted_keys == ["x/1", "x/2 sp", "x/never"]
    assert list(double.objects("bkt")) == ["x/3", "y/1"]
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.batch_delete_objects([f"k{i}" for i in range(1001)])
    assert err.value.status == 400 and err.value.code == "MalformedXML"


def test_copy_keeps_or_replaces_metadata(double, bucket) -> None:
    bucket.put_object("src.txt", b"payload", headers={"x-oss-meta-a": "1"})
    res = bucket.copy_object("bkt", "src.txt", "dir/copy")
    assert res.status == 200 and res.crc == crc64(b"payload")
    head = bucket.head_object("dir/copy")
    assert head.headers["x-oss-meta-a"] == "1" and head.content_type == "text/plain"
    assert bucket.get_object("dir/copy").read() == b"payload"
    bucket.update_object_meta("dir/copy", {"x-oss-meta-b": "2", "Content-Type": "a/b"})
    info = double.object_info("bkt", "dir/copy")
    assert info is not None and info["meta"] == {"x-oss-meta-b": "2"}
    assert info["content_type"] == "a/b"
    with pytest.raises(oss2.exceptions.NoSuchKey):
        bucket.copy_object("bkt", "nothing", "dir/copy2")


def test_forbid_overwrite_append_and_conditions(bucket) -> None:
    bucket.put_object("once", b"1")
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.put_object("once", b"2", headers={"x-oss-forbid-overwrite": "true"})
    assert err.value.status == 409 and err.value.code == "FileAlreadyExists"
    r1 = bucket.append_object("log", 0, b"abc", init_crc=0)  # oss2 checks the CRC chain
    r2 = bucket.append_object("log", r1.next_position, b"def", init_crc=r1.crc)
    assert r2.next_position == 6 and bucket.get_object("log").read() == b"abcdef"
    with pytest.raises(oss2.exceptions.PositionNotEqualToLength) as perr:
        bucket.append_object("log", 2, b"x")
    assert perr.value.next_position == 6
    with pytest.raises(oss2.exceptions.ObjectNotAppendable):
        bucket.append_object("once", 1, b"x")
    etag = bucket.head_object("once").etag
    with pytest.raises(oss2.exceptions.NotModified):
        bucket.get_object("once", headers={"If-None-Match": f'"{etag}"'})
    with pytest.raises(oss2.exceptions.PreconditionFailed):
        bucket.get_object("once", headers={"If-Match": '"0000"'})
    assert bucket.get_object("once", headers={"If-Match": f'"{etag}"'}).read() == b"1"


def test_unmodelled_requests_fail_loudly(bucket) -> None:
    bucket.put_object("k", b"x")
    with pytest.raises(oss2.exceptions.NotImplemented):
        bucket.get_object_acl("k")
    with pytest.raises(oss2.exceptions.NotImplemented):
        bucket.put_object("k", b"x", headers={"x-oss-server-side-encryption": "AES256"})
    with pytest.raises(oss2.exceptions.InvalidObjectName):
        bucket.put_object("/leading-slash", b"x")


# ------------------------------------------------------------------ listings
def _fill(double: OssDouble) -> list[str]:
    keys = [f"d/{i}.txt" for i in range(7)] + [f"d/sub/{i}" for i in range(5)] + [
        "d/zz/x", "e/1"]
    for k in keys:
        double.put("bkt", k, k.encode())
    return keys


def test_listing_with_prefix_delimiter_and_pages(double, bucket) -> None:
    _fill(double)
    want = [f"d/{i}.txt" for i in range(7)] + ["d/sub/", "d/zz/"]
    for max_keys in (1, 2, 3, 100):  # (bounded: a paging bug fails instead of looping)
        v1 = list(itertools.islice(
            oss2.ObjectIterator(bucket, prefix="d/", delimiter="/", max_keys=max_keys), 50))
        v2 = list(itertools.islice(
            oss2.ObjectIteratorV2(bucket, prefix="d/", delimiter="/", max_keys=max_keys), 50))
        assert [o.key for o in v1] == [o.key for o in v2] == want, max_keys
    first = [o for o in v1 if not o.is_prefix()][0]
    assert first.size == len(b"d/0.txt") and first.etag == _md5_hex(b"d/0.txt")
    assert first.type == "Normal" and first.last_modified > 0
    page = bucket.list_objects(prefix="d/", delimiter="/", max_keys=8)
    assert page.is_truncated and page.next_marker == "d/sub/"
    assert page.prefix_list == ["d/sub/"] and len(page.object_list) == 7
    rest = bucket.list_objects(prefix="d/", delimiter="/", marker=page.next_marker)
    assert not rest.is_truncated and rest.prefix_list == ["d/zz/"] and rest.object_list == []
    every = [o.key for o in oss2.ObjectIteratorV2(bucket, max_keys=4)]
    assert every == sorted(double.objects("bkt"))
    after = bucket.list_objects_v2(prefix="d/sub/", start_after="d/sub/2")
    assert [o.key for o in after.object_list] == ["d/sub/3", "d/sub/4"]
    with pytest.raises(oss2.exceptions.InvalidArgument):
        bucket.list_objects(max_keys=1001)


# ------------------------------------------------------------------ multipart
def test_explicit_multipart_checks_parts_etags_and_crc(double, bucket) -> None:
    p1, p2 = b"a" * MIN_PART_SIZE, b"b" * 1000
    uid = bucket.init_multipart_upload("m.bin").upload_id
    parts = []
    for n, data in ((1, p1), (2, p2)):
        res = bucket.upload_part("m.bin", uid, n, data)
        assert res.etag == _md5_hex(data) and res.crc == crc64(data)
        parts.append(oss2.models.PartInfo(n, res.etag, size=len(data), part_crc=res.crc))
    listed = bucket.list_parts("m.bin", uid)
    assert [(p.part_number, p.etag, p.size) for p in listed.parts] == [
        (1, parts[0].etag, len(p1)), (2, parts[1].etag, len(p2))]
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.complete_multipart_upload("m.bin", uid, [oss2.models.PartInfo(1, "0" * 32)])
    assert err.value.code == "InvalidPart"
    # with part CRCs and sizes oss2 checks the combined CRC64 of the result
    done = bucket.complete_multipart_upload("m.bin", uid, parts)
    assert done.crc == crc64(p1 + p2)
    md5s = bytes.fromhex(parts[0].etag) + bytes.fromhex(parts[1].etag)
    assert done.etag == _md5_hex(md5s) + "-2"
    head = bucket.head_object("m.bin")
    assert head.object_type == "Multipart" and head.content_length == len(p1) + len(p2)
    assert bucket.get_object("m.bin").read() == p1 + p2
    assert double.incomplete_uploads("bkt") == []
    with pytest.raises(oss2.exceptions.NoSuchUpload):
        bucket.upload_part("m.bin", uid, 3, b"late")


def test_parts_but_the_last_must_be_100_kib(bucket) -> None:
    uid = bucket.init_multipart_upload("small").upload_id
    parts = [oss2.models.PartInfo(n, bucket.upload_part("small", uid, n, b"x" * 10).etag)
             for n in (1, 2)]
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.complete_multipart_upload("small", uid, parts)
    assert err.value.status == 400 and err.value.code == "EntityTooSmall"
    with pytest.raises(oss2.exceptions.InvalidArgument):
        bucket.upload_part("small", uid, 10001, b"x")


def test_aborted_upload_is_listed_then_gone_and_never_an_object(double, bucket) -> None:
    uids = [bucket.init_multipart_upload(f"u/{k}").upload_id for k in "cabde"]
    bucket.upload_part("u/a", uids[1], 1, b"x")
    listed = [(u.key, u.upload_id) for u in oss2.MultipartUploadIterator(bucket, max_uploads=2)]
    assert listed == sorted(zip([f"u/{k}" for k in "cabde"], uids, strict=True))
    assert listed == double.incomplete_uploads("bkt")
    assert all(u.initiation_date > 0 for u in oss2.MultipartUploadIterator(bucket, prefix="u/a"))
    assert not bucket.object_exists("u/a") and double.objects("bkt") == {}
    bucket.abort_multipart_upload("u/a", uids[1])
    assert "u/a" not in [k for k, _u in double.incomplete_uploads("bkt")]
    with pytest.raises(oss2.exceptions.NoSuchUpload):
        bucket.abort_multipart_upload("u/a", uids[1])
    assert not bucket.object_exists("u/a")


def test_resumable_upload_goes_multipart(double, bucket, tmp_path) -> None:
    data = bytes(range(256)) * 1400  # 358,400 bytes: 4 parts of 100 KiB
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store = oss2.ResumableStore(root=str(tmp_path / "store"))
    oss2.resumable_upload(bucket, "ckpt/big.bin", str(src), store=store,
                          multipart_threshold=200 * KIB, part_size=100 * KIB)
    assert double.objects("bkt", "ckpt/") == {"ckpt/big.bin": data}
    counts = double.operation_counts
    assert counts["InitiateMultipartUpload"] == 1 and counts["UploadPart"] == 4
    assert counts["ListParts"] >= 1 and counts["CompleteMultipartUpload"] == 1
    assert double.incomplete_uploads("bkt") == []
    oss2.resumable_upload(bucket, "ckpt/small.bin", str(src), store=store,
                          multipart_threshold=1 << 20)
    assert double.operation_counts["PutObject"] == 1


def test_resumable_upload_resumes_after_a_dropped_part(double, bucket, tmp_path) -> None:
    data = b"".join(bytes([i]) * (100 * KIB) for i in range(4)) + b"tail"
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store = oss2.ResumableStore(root=str(tmp_path / "store"))
    double.drop_next(1, operations=("UploadPart",), skip=2, read_bytes=50 * KIB)
    with pytest.raises(oss2.exceptions.RequestError):
        oss2.resumable_upload(bucket, "r.bin", str(src), store=store,
                              multipart_threshold=200 * KIB, part_size=100 * KIB)
    assert double.objects("bkt") == {} and len(double.incomplete_uploads("bkt")) == 1
    assert double.faults_injected == 1
    before = double.operation_counts["UploadPart"]
    oss2.resumable_upload(bucket, "r.bin", str(src), store=store,
                          multipart_threshold=200 * KIB, part_size=100 * KIB)
    assert double.operation_counts["UploadPart"] - before == 3  # parts 3, 4 and 5 only
    assert double.objects("bkt") == {"r.bin": data}
    assert double.incomplete_uploads("bkt") == []


# ------------------------------------------------------------------ faults
def test_fail_next_then_a_retry_succeeds(double, bucket) -> None:
    double.fail_next(1, status=503, code="ServiceUnavailable")
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.put_object("k", b"x")
    assert err.value.status == 503 and err.value.code == "ServiceUnavailable"
    assert double.objects("bkt") == {}
    bucket.put_object("k", b"x")
    assert double.objects("bkt") == {"k": b"x"}
    double.fail_next(1, status=429, code="SlowDown", methods=("GET",))
    with pytest.raises(oss2.exceptions.ServerError) as err:
        bucket.get_object("k")
    assert err.value.status == 429 and err.value.code == "SlowDown"
    # oss2's iterators retry 5xx themselves
    double.fail_next(2, status=500, code="InternalError", operations=("ListObjectsV2",))
    assert [o.key for o in oss2.ObjectIteratorV2(bucket)] == ["k"]
    # a key prefix, and skip: the second matching request fails
    double.fail_next(1, key_prefix="ckpt/", skip=1, status=403, code="AccessDenied")
    bucket.put_object("other", b"1")
    bucket.put_object("ckpt/a", b"1")
    with pytest.raises(oss2.exceptions.AccessDenied):
        bucket.put_object("ckpt/b", b"1")
    assert double.faults_injected == 5
    assert double.method_counts["PUT"] == 5 and double.request_count == 9


def test_fail_rules_are_cleared_with_zero(double, bucket) -> None:
    double.fail_next(100, status=503)
    double.fail_next(0)
    bucket.put_object("k", b"x")
    double.delay_next(100, 5.0)
    double.clear_faults()
    assert bucket.get_object("k").read() == b"x"


def test_delay_past_the_client_timeout_raises_request_error(double) -> None:
    fast = _bucket(double, connect_timeout=0.2)
    fast.put_object("k", b"x")
    double.delay_next(1, 0.6, methods=("GET",))
    t0 = time.monotonic()
    with pytest.raises(oss2.exceptions.RequestError):
        fast.get_object("k")
    assert time.monotonic() - t0 < 0.5
    assert fast.get_object("k").read() == b"x"  # the next request is answered at once


def test_dropped_connections(double, bucket) -> None:
    double.drop_next(1, methods=("PUT",))
    with pytest.raises(oss2.exceptions.RequestError):
        bucket.put_object("k", b"x" * 1000)
    assert double.objects("bkt") == {}
    double.drop_next(1, methods=("PUT",), read_bytes=64 * KIB)  # cut mid-upload
    with pytest.raises(oss2.exceptions.RequestError):
        bucket.put_object("k", b"x" * (4 << 20))
    assert double.objects("bkt") == {}
    double.drop_next(1, methods=("PUT",), applied=True)  # the acknowledgement is lost
    with pytest.raises(oss2.exceptions.RequestError):
        bucket.put_object("k", b"y")
    assert double.objects("bkt") == {"k": b"y"}
    assert [s for m, _p, _q, s, _k in double.requests_log] == [-1, -1, -1]
    bucket.put_object("k", b"z")
    assert double.objects("bkt") == {"k": b"z"}


def test_a_client_gone_mid_body_stores_nothing(double) -> None:
    host, port = urlsplit(double.endpoint).netloc.split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"PUT /bkt/cut HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
        s.shutdown(socket.SHUT_WR)
        assert s.recv(100) == b""  # closed without an answer
    assert double.objects("bkt") == {}
    assert double.requests_log[-1][3] == -1


def test_outage(double, bucket) -> None:
    double.set_down(True)
    for _ in range(2):
        with pytest.raises(oss2.exceptions.ServerError) as err:
            bucket.put_object("k", b"x")
        assert err.value.status == 503
    with pytest.raises(oss2.exceptions.ServerError) as err:  # HEAD too, through x-oss-err
        bucket.object_exists("k")
    assert err.value.status == 503 and err.value.code == "ServiceUnavailable"
    double.set_down(False)
    bucket.put_object("k", b"x")
    assert double.faults_injected == 3 and double.request_count == 4


# ------------------------------------------------------------------ credentials
def test_access_key_ids_are_logged_and_checked_never_the_secret() -> None:
    with OssDouble(require_access_key_id="id") as d:
        good = _bucket(d)
        good.put_object("k", b"x")
        with pytest.raises(oss2.exceptions.ServerError) as err:
            _bucket(d, key_id="intruder").get_object("k")
        assert err.value.status == 403 and err.value.code == "InvalidAccessKeyId"
        with pytest.raises(oss2.exceptions.ServerError) as err:
            oss2.Bucket(oss2.AnonymousAuth(), d.endpoint, "bkt").get_object("k")
        assert err.value.code == "AccessDenied"
        v2 = oss2.Bucket(oss2.AuthV2("id", SECRET), d.endpoint, "bkt")
        assert v2.get_object("k").read() == b"x"
        v4 = oss2.Bucket(oss2.AuthV4("id", SECRET), d.endpoint, "bkt", region="cn-hangzhou")
        assert v4.get_object("k").read() == b"x"
        sts = oss2.Bucket(oss2.StsAuth("id", SECRET, "sts-token-value"), d.endpoint, "bkt")
        assert sts.get_object("k").read() == b"x"
        url = good.sign_url("GET", "k", 60)
        assert oss2.Bucket(oss2.AnonymousAuth(), d.endpoint, "bkt").get_object_with_url(
            url).read() == b"x"
        assert [entry[4] for entry in d.requests_log] == [
            "id", "intruder", "", "id", "id", "id", "id"]
        assert [entry[3] for entry in d.requests_log] == [200, 403, 403, 200, 200, 200, 200]
        text = repr(d.requests_log)
        assert SECRET not in text and "sts-token-value" not in text
        assert "Signature=REDACTED" in d.requests_log[-1][2]
        encoded = base64.b64encode(SECRET.encode()).decode()
        assert encoded not in text
