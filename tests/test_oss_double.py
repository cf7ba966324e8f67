"""The OSS test double answers the real ``oss2`` SDK as OSS does, faults included."""

from __future__ import annotations

import oss2
import pytest

from odl.harness.oss_double import OssDouble


@pytest.fixture
def bucket():
    with OssDouble(require_access_key_id="id") as double:
        yield double, oss2.Bucket(oss2.Auth("id", "secret"), double.endpoint, "bkt",
                                  connect_timeout=1)


def test_objects_ranges_copies_and_listings(bucket) -> None:
    double, b = bucket
    for i in range(7):
        b.put_object(f"d/{i}.txt", f"v{i}".encode())
    b.put_object("d/sub/x", b"0123456789")
    assert b.get_object("d/sub/x", byte_range=(2, 4)).read() == b"234"
    b.copy_object("bkt", "d/sub/x", "e/copy")
    assert b.get_object("e/copy").read() == b"0123456789"
    assert b.object_exists("e/copy") and not b.object_exists("e/none")
    with pytest.raises(oss2.exceptions.NoSuchKey):
        b.get_object("e/none")
    v1 = [o.key for o in oss2.ObjectIterator(b, prefix="d/", delimiter="/", max_keys=3)]
    v2 = [o.key for o in oss2.ObjectIteratorV2(b, prefix="d/", delimiter="/", max_keys=2)]
    assert v1 == v2 == [f"d/{i}.txt" for i in range(7)] + ["d/sub/"]
    b.batch_delete_objects([f"d/{i}.txt" for i in range(7)])
    assert list(double.objects("bkt", "d/")) == ["d/sub/x"]


def test_multipart_complete_and_abort(bucket) -> None:
    double, b = bucket
    uid = b.init_multipart_upload("m").upload_id
    parts = [oss2.models.PartInfo(n, b.upload_part("m", uid, n, bytes([n]) * 1000).etag)
             for n in (1, 2)]
    b.complete_multipart_upload("m", uid, parts)
    assert b.get_object("m").read() == b"\x01" * 1000 + b"\x02" * 1000
    uid = b.init_multipart_upload("n").upload_id
    b.upload_part("n", uid, 1, b"x")
    assert double.incomplete_uploads("bkt") == [("n", uid)]
    assert [u.key for u in oss2.MultipartUploadIterator(b)] == ["n"]
    b.abort_multipart_upload("n", uid)
    assert double.incomplete_uploads("bkt") == [] and not b.object_exists("n")


def test_faults(bucket) -> None:
    double, b = bucket
    double.fail_next(1, status=503, code="SlowDown")
    with pytest.raises(oss2.exceptions.ServerError) as err:
        b.put_object("k", b"x")
    assert err.value.status == 503 and err.value.code == "SlowDown"
    double.drop_next(1, methods=("PUT",))
    with pytest.raises(oss2.exceptions.RequestError):
        b.put_object("k", b"x")
    assert double.objects("bkt") == {}
    double.delay_next(1, 1.5)
    with pytest.raises(oss2.exceptions.RequestError):  # past the 1 s client timeout
        b.get_object("k")
    other = oss2.Bucket(oss2.Auth("intruder", "s"), double.endpoint, "bkt")
    with pytest.raises(oss2.exceptions.ServerError) as err:
        other.put_object("k", b"x")
    assert err.value.code == "InvalidAccessKeyId"
    b.put_object("k", b"x")
    assert {entry[4] for entry in double.requests_log} == {"id", "intruder"}
