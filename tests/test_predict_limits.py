"""``/predict`` under hostile uploads, on a real uvicorn server on loopback.

Oversized bodies are refused by ``Content-Length`` before any of the body is read, chunked
ones as soon as they pass ``max_body_bytes``; in-flight requests and body bytes are bounded
(503 with ``Retry-After``); a client that disconnects mid-upload costs one quiet log line and
a 499 in the metrics; JSON bodies with keys that are neither a wrapper nor input fields are
400. Raw sockets play the clients, so each test controls exactly what is sent when.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from odl.export.exporter import export_checkpoint
from serving_plugin.predict_body import RequestError, split_body
from serving_plugin.predict_limits import TRIM_AFTER_BYTES, PredictLimits
from serving_plugin.serving_service import ServingService
from tests.harness import train_checkpoint

MIB = 1 << 20


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("predict-limits"))
    tc = train_checkpoint(root, steps=2)
    export = export_checkpoint(tc.config, tc.path, os.path.join(root, "exports")).path
    return export, tc


@pytest.fixture
def serve(exported) -> Iterator[Callable[..., tuple[ServingService, int]]]:
    """Starts ``ServingService`` instances with the given limits: ``serve(**limits)``."""
    started: list[ServingService] = []

    def start(**limits) -> tuple[ServingService, int]:
        svc = ServingService(exported[0], replay=False, limits=PredictLimits(**limits))
        started.append(svc)
        return svc, svc.start()

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture
def good(exported) -> bytes:
    return exported[1].records(1, 9)[0]


def _value(svc: ServingService, name: str, **labels: str) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _open(port: int, headers: dict[str, str], timeout: float = 10.0) -> socket.socket:
    """A connection that has sent a /predict request head (no body yet)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    head = "POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    return sock


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    body = resp.read()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(body)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _post(port: int, body: bytes) -> tuple[int, dict[str, str], dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/predict", body=body)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _capture_logs() -> Iterator[list[logging.LogRecord]]:
    """Every record of odl's serving and of uvicorn (whose loggers do not reach the root)."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error")]
    levels = [(lg, lg.level) for lg in
              loggers + [logging.getLogger("serving_plugin"), logging.getLogger("asyncio")]]
    for lg in loggers:
        lg.addHandler(handler)
    for lg, _ in levels[1:]:
        lg.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        for lg, level in levels:
            lg.setLevel(level)


def test_oversized_content_length_is_refused_before_the_body(serve, good):
    svc, port = serve()  # default limits: 16 MiB
    sock = _open(port, {"Content-Length": str(200_000_000)})
    try:
        sock.sendall(b"abc")  # and nothing more: the answer must not wait for the body
        t0 = time.monotonic()
        code, headers, doc = _response(sock)
        assert code == 413 and time.monotonic() - t0 < 5
        assert "200000000" in doc["detail"]["error"]
        assert headers.get("connection") == "close" and _closed_by_server(sock)
    finally:
        sock.close()
    assert _value(svc, "odl_serving_predict_refused_total", reason="body_too_large") == 1
    assert _value(svc, "odl_serving_predict_inflight_bytes") == 0
    assert _post(port, good)[0] == 200


def test_small_oversize_keeps_the_connection_unless_100_continue(serve, good):
    _, port = serve(max_body_bytes=1000)
    # The whole body sent before reading: the server discards the rest and the answer is read.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n"
                     + b"z" * 1001)
        code, headers, _ = _response(sock)
        assert code == 413 and "connection" not in headers
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(good), good))  # the same connection serves the next request
        assert _response(sock)[0] == 200
    # A client waiting for 100 Continue may never send the body: the connection closes.
    sock = _open(port, {"Content-Length": "1001", "Expect": "100-continue"})
    try:
        code, headers, _ = _response(sock)
        assert code == 413 and headers.get("connection") == "close"
    finally:
        sock.close()


def test_chunked_oversized_upload_gets_413_at_the_limit(serve, good):
    svc, port = serve(max_body_bytes=MIB, max_inflight_bytes=2 * MIB)
    sock = _open(port, {"Transfer-Encoding": "chunked"})
    try:
        piece = b"x" * (64 << 10)
        for _ in range(MIB // len(piece) + 1):  # one piece past the limit, no final chunk
            sock.sendall(_chunk(piece))
        code, headers, doc = _response(sock)
        assert code == 413 and "--max_body_bytes" in doc["detail"]["error"]
        assert headers.get("connection") == "close" and _closed_by_server(sock)
    finally:
        sock.close()
    _wait(lambda: _value(svc, "odl_serving_predict_inflight_bytes") == 0, "bytes released")
    assert _value(svc, "odl_serving_predict_inflight_requests") == 0
    # A chunked body within the limit is read whole and answered.
    sock = _open(port, {"Transfer-Encoding": "chunked"})
    try:
        sock.sendall(_chunk(good[:10]) + _chunk(good[10:]) + b"0\r\n\r\n")
        code, _, doc = _response(sock)
        assert code == 200 and len(doc["probabilities"]) == 1
    finally:
        sock.close()


def test_inflight_request_bound_gives_503(serve, good):
    svc, port = serve(max_inflight_requests=2)
    holders = [_open(port, {"Content-Length": "1000"}) for _ in range(2)]
    try:
        for s in holders:
            s.sendall(b"0" * 10)  # mid-upload: admitted, reading the body
        _wait(lambda: _value(svc, "odl_serving_predict_inflight_requests") == 2, "2 in flight")
        code, headers, doc = _post(port, good)
        assert code == 503 and headers.get("retry-after") == "1"
        assert "--max_inflight_requests" in doc["detail"]["error"]
    finally:
        for s in holders:
            s.close()
    _wait(lambda: _value(svc, "odl_serving_predict_inflight_requests") == 0, "holders gone")
    assert _post(port, good)[0] == 200
    assert _value(svc, "odl_serving_predict_refused_total", reason="inflight_requests") == 1


def test_inflight_byte_bound_gives_503(serve, good):
    svc, port = serve(max_body_bytes=MIB, max_inflight_bytes=MIB + MIB // 2)
    holder = _open(port, {"Content-Length": str(MIB)})
    try:
        holder.sendall(b"0" * 10)
        _wait(lambda: _value(svc, "odl_serving_predict_inflight_bytes") == MIB, "1 MiB held")
        # A declared body that does not fit: refused before any of it is read.
        s = _open(port, {"Content-Length": str(MIB // 2 + 1)})
        try:
            code, headers, doc = _response(s)
            assert code == 503 and headers.get("retry-after") == "1"
            assert "--max_inflight_bytes" in doc["detail"]["error"]
        finally:
            s.close()
        # A chunked body: refused once what it sent no longer fits.
        s = _open(port, {"Transfer-Encoding": "chunked"})
        try:
            for _ in range(9):
                s.sendall(_chunk(b"y" * (64 << 10)))
            code, headers, _ = _response(s)
            assert code == 503 and headers.get("retry-after") == "1"
            assert headers.get("connection") == "close"
        finally:
            s.close()
        assert _post(port, good)[0] == 200  # a small body still fits
    finally:
        holder.close()
    _wait(lambda: _value(svc, "odl_serving_predict_inflight_bytes") == 0, "bytes released")
    assert _value(svc, "odl_serving_predict_refused_total", reason="inflight_bytes") == 2


def test_client_disconnect_mid_upload_is_one_quiet_line(serve, good):
    svc, port = serve()
    with _capture_logs() as records:
        s = _open(port, {"Content-Length": "100000"})
        s.sendall(b"1" * 1000)
        _wait(lambda: _value(svc, "odl_serving_predict_inflight_requests") == 1, "upload")
        s.close()
        _wait(lambda: _value(svc, "odl_serving_predict_client_disconnects_total") == 1,
              "the disconnect counted")
        assert _post(port, good)[0] == 200  # still answering
    assert _value(svc, "odl_serving_predict_requests_total", code="499") == 1
    assert _value(svc, "odl_serving_predict_inflight_requests") == 0
    assert _value(svc, "odl_serving_predict_inflight_bytes") == 0
    assert not [r for r in records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in records]
    lines = [r for r in records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno <= logging.INFO
    assert "499" in lines[0].getMessage()


def test_slow_body_gets_408(serve, good):
    svc, port = serve(body_timeout_s=0.3)
    s = _open(port, {"Content-Length": "1000"})
    try:
        s.sendall(b"2" * 10)
        code, headers, doc = _response(s)
        assert code == 408 and "--body_timeout_s" in doc["detail"]["error"]
        assert headers.get("connection") == "close"
    finally:
        s.close()
    _wait(lambda: _value(svc, "odl_serving_predict_inflight_requests") == 0, "released")
    assert _post(port, good)[0] == 200


def test_large_body_is_released_and_the_heap_trimmed(serve):
    svc, port = serve()
    code, _, _ = _post(port, b"a" * (2 * TRIM_AFTER_BYTES))  # one malformed 2 MiB record
    assert code == 400
    assert _value(svc, "odl_serving_predict_inflight_bytes") == 0
    if svc.gate.trimmer.available:  # glibc
        _wait(lambda: svc.gate.trimmer.trims >= 1, "malloc_trim")


@pytest.mark.parametrize("body, named", [
    (b'{"records": [%s], "x": 1}', ['"x"']),
    (b'{"instances": [%s], "records": []}', ['"records"', "instances"]),
    (b'{"x": 1, "I1": 0.5}', ['"x"']),
    (b'{"I1": 0.5, "C1": "ab", "bogus": 2, "other": 3}', ['"bogus"', '"other"']),
    (b'[{"I1": 0.5}, {"zz": 1}]', ['"zz"']),
    (b'{"I1": 0.5}\n{"I2": 1, "nope": 2}', ['"nope"']),
    (b"{}", ["empty"]),
    (b'{"records": {"I1": 1}}', ['"records" must be a JSON array']),
])
def test_unknown_json_keys_are_400(serve, good, exported, body, named):
    _, port = serve()
    if b"%s" in body:
        body = body % json.dumps(good.decode()).encode()
    code, _, doc = _post(port, body)
    assert code == 400, doc
    for name in named:
        assert name in doc["detail"]["error"], doc


def test_known_json_shapes_still_predict(serve, exported):
    _, port = serve()
    rec = exported[1].records(2, 9, fmt="json")
    for body in (rec[0], b"\n".join(rec), b'{"records": [%s, %s]}' % (rec[0], rec[1]),
                 b'{"instances": [%s]}' % rec[0], b"[%s, %s]" % (rec[0], rec[1])):
        code, _, doc = _post(port, body)
        assert code == 200, (body[:80], doc)


def test_split_body_names_unknown_keys():
    fields = ["label", "a", "b"]
    assert split_body(b'{"a": 1}', fields=fields) == [b'{"a": 1}']
    assert len(split_body(b'{"records": [{"a": 1}, "1,2,3"]}', fields=fields)) == 2
    with pytest.raises(RequestError, match='"x"') as e:
        split_body(b'[{"a": 1}, {"a": 2, "x": 3}]', fields=fields)
    assert e.value.rejected == [{"index": 1, "reason": "unknown_fields"}]
    # A field named like a wrapper key is a field.
    assert split_body(b'{"records": 1}', fields=["records"]) == [b'{"records": 1}']
    with pytest.raises(RequestError, match="exceeds 10") as e:
        split_body(b"x" * 11, max_bytes=10)
    assert e.value.status == 413


@pytest.mark.parametrize("limits", [
    {"max_body_bytes": 0}, {"max_inflight_requests": 0},
    {"max_body_bytes": 2 * MIB, "max_inflight_bytes": MIB}, {"body_timeout_s": -1.0},
])
def test_limits_are_validated(limits):
    with pytest.raises(ValueError, match="--"):
        PredictLimits(**limits)


def test_serve_cli_refuses_bad_limits(capsys):
    from odl.cli import serve_cli

    rc = serve_cli.main(["--export_dir", "x", "--log_level", "ERROR",
                         "--max_body_bytes", "2048", "--max_inflight_bytes", "1024"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("odl-serve: --max_inflight_bytes") and err.count("\n") == 1
