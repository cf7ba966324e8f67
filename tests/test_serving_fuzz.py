"""``/predict`` on a real uvicorn server: malformed bodies get 4xx with a reason, never 5xx.

A few hundred seeded random bodies (empty, garbage bytes, invalid UTF-8, wrong JSON types,
unknown JSON keys, deep nesting, NaN / huge numbers, too many records, a body over the size
limit) are posted;
the server must answer each with a 4xx JSON error naming the problem (or 200 when the body
happens to be valid), and still answer a good request afterwards.
"""

from __future__ import annotations

import http.client
import json
import os
import random

import pytest

from odl.export.exporter import export_checkpoint
from serving_plugin.predict_body import MAX_RECORDS
from serving_plugin.predict_limits import MAX_BODY_BYTES
from serving_plugin.serving_service import ServingService
from tests.harness import train_checkpoint

N_BODIES = 300
SEED = 4242


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("serve-fuzz"))
    tc = train_checkpoint(root)
    export = export_checkpoint(tc.config, tc.path, os.path.join(root, "exports")).path
    svc = ServingService(os.path.dirname(export), replay=False)
    port = svc.start()
    try:
        yield port, tc
    finally:
        svc.stop()


def _post(port: int, body: bytes, ctype: str = "application/json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/predict", body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randrange(-10**6, 10**6)
    if kind == 1:
        return rng.choice([float("nan"), float("inf"), -1e308, 1e308, 0.5, -0.0])
    if kind == 2:
        return "".join(rng.choice("ab,|{}[]\"\\\n\t") for _ in range(rng.randrange(0, 20)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["", "0", "1,2,3"])
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    keys = ["label", "I1", "C1", "records", "instances", "sample_id", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _with_dense(record: bytes, value: bytes) -> bytes:
    """The record with every dense column (I1..I13) set to ``value``."""
    cols = record.split(b",")
    cols[3:16] = [value] * 13
    return b",".join(cols)


def _bodies(rng: random.Random, good: list[bytes]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = [
        ("empty", b""), ("blank", b" \n\t\r\n "), ("null", b"null"), ("number", b"42"),
        ("string", b'"x"'), ("true", b"true"), ("empty_list", b"[]"), ("empty_obj", b"{}"),
        ("records_not_list", b'{"records": 5}'), ("records_empty", b'{"instances": []}'),
        ("deep_list", b"[" * 100_000 + b"]" * 100_000),
        ("deep_obj", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        ("big_int", b'[{"I1": ' + b"9" * 5000 + b"}]"),
        ("nan_json", b'{"I1": NaN, "label": 0}'),
        ("nan_csv", good[0].replace(b",", b",nan,", 1)),
        ("too_many", b"\n".join([b"a"] * (MAX_RECORDS + 1))),
        ("invalid_utf8", b"\xff\xfe" + good[0]),
        ("invalid_utf8_json", b'{"C1": "\xff"}'),
        ("huge_float", _with_dense(good[0], b"1e308")),
        ("tiny_float", _with_dense(good[0], b"-1e308")),
        ("max_float32", _with_dense(good[0], b"3.4e38")),
        ("records_extra_key", b'{"records": [%s], "x": 1}' % json.dumps(good[0].decode())
         .encode()),
        ("unknown_record_key", b'{"I1": 1.5, "not_a_field": 2}'),
    ]
    for i in range(N_BODIES - len(out)):
        kind = rng.randrange(6)
        if kind == 0:
            out.append((f"bytes{i}", rng.randbytes(rng.randrange(1, 2000))))
        elif kind == 1:
            out.append((f"json{i}", json.dumps(_random_json(rng)).encode()))
        elif kind == 2:  # a good record with a corrupted span
            rec = bytearray(rng.choice(good))
            a = rng.randrange(len(rec))
            rec[a:a + rng.randrange(1, 8)] = rng.randbytes(rng.randrange(0, 8))
            out.append((f"mutated{i}", bytes(rec)))
        elif kind == 3:  # good records mixed with bad lines
            lines = [rng.choice(good) if rng.random() < 0.7 else rng.randbytes(20)
                     for _ in range(rng.randrange(1, 20))]
            out.append((f"mixed{i}", b"\n".join(lines)))
        elif kind == 4:
            out.append((f"json_list{i}", json.dumps(
                [_random_json(rng) for _ in range(rng.randrange(1, 5))]).encode()))
        else:  # truncated JSON record
            rec = json.dumps({"I1": rng.random(), "C1": "x", "label": 1}).encode()
            out.append((f"truncated{i}", rec[: rng.randrange(1, len(rec))]))
    return out


# Bodies whose answer is known exactly.
EXPECTED = {"empty": 400, "empty_obj": 400, "too_many": 413, "records_extra_key": 400,
            "unknown_record_key": 400, "records_not_list": 400}


def test_predict_fuzz_never_5xx(server):
    port, tc = server
    rng = random.Random(SEED)
    good = tc.records(50, 9)
    codes: dict[int, int] = {}
    for name, body in _bodies(rng, good):
        code, raw = _post(port, body)
        codes[code] = codes.get(code, 0) + 1
        assert code < 500, (name, code, raw[:300])
        assert code == EXPECTED.get(name, code), (name, code, raw[:300])
        doc = json.loads(raw)
        if code == 200:
            assert len(doc["probabilities"]) >= 1
            assert all(0.0 <= p <= 1.0 for p in doc["probabilities"]), (name, doc)
        else:
            assert 400 <= code < 500, (name, code)
            assert doc["detail"]["error"], (name, doc)
    assert codes.get(400, 0) > N_BODIES // 2, codes
    assert codes.get(413, 0) >= 1, codes
    # Still alive and correct after the fuzz.
    code, raw = _post(port, b"\n".join(good[:3]), "text/plain")
    assert code == 200 and len(json.loads(raw)["probabilities"]) == 3


def test_predict_body_over_the_limit_is_413(server):
    port, _ = server
    code, raw = _post(port, b"a" * (MAX_BODY_BYTES + 1), "text/plain")
    assert code == 413 and "exceeds" in json.loads(raw)["detail"]["error"]
