r"""Hostile variants of synthetic records: what an attacker or a broken producer sends.

Used to prove the record path's rule (``docs/reliability.md``): a record is either trained
once or dead-lettered once with a reason, and nothing a record holds stops a thread or a
process. ``hostile_record`` turns one good record (``odl.datagen.synthetic_ctr`` layout, CSV
or JSON) into one of the ``HOSTILE_KINDS`` below, driven by a ``random.Random`` so that a
seeded run is reproducible and a property-based test (hypothesis ``st.randoms()``) can
shrink a failure. ``hostile_stream`` mixes good and hostile records.

Kinds (the value is bytes as a Kafka message would carry it):

* ``invalid_utf8``: bytes that are not UTF-8 in a string field;
* ``surrogate``: a JSON record with a lone UTF-16 surrogate escape (``"\ud800"``);
* ``extreme_number``: a numeric field set to an extreme, non-finite or odd spelling
  (``1e308``, ``3.4e38``, ``nan``, ``-inf``, ``2**63``, ``0x1p3``, ``1_000``, ...);
* ``huge_field``: a string field of 64 KiB to 1.5 MiB (some records exceed the 1 MiB limit;
  the sizes are a parameter);
* ``wrong_count``: fields dropped or added;
* ``empty_label`` / ``bad_label``: a label that is empty, or not 0 / 1;
* ``event_time``: an event time in milliseconds or nanoseconds, zero, negative, far ahead or
  not a number;
* ``garbage``: random bytes, random text, or nothing;
* ``json_types``: a JSON record with wrong types (objects, lists, booleans), ``null``s, a
  missing label, deep nesting or a huge integer;
* ``separators``: id fields made of separators, empty pieces or thousands of ids;
* ``control_chars``: NUL, tabs, CR/LF and other control characters inside string fields.

Every kind except ``garbage`` keeps the record's ``sample_id`` (the first field), so a test
can tell which record a trained sample was.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from odl.datagen.synthetic_ctr import (
    ALL_COLUMNS,
    DENSE_FIELDS,
    SPARSE_FIELDS,
    SyntheticCtrStream,
    encode,
)

HOSTILE_KINDS: tuple[str, ...] = (
    "invalid_utf8", "surrogate", "extreme_number", "huge_field", "wrong_count", "empty_label",
    "bad_label", "event_time", "garbage", "json_types", "separators", "control_chars",
)

_EXTREME_NUMBERS: tuple[str, ...] = (
    "1e308", "-1e308", "3.4e38", "-3.4028235e38", "3.5e38", "1e-320", "-0", "1e999", "nan",
    "NaN", "inf", "-inf", "Infinity", str(2**63), str(-(2**63) - 1), str(10**30), "0x1p3",
    "1_000", " 1", "1 ", "+5", "1e", ".", "--1", "1e-7", "123456789012345678901234567890",
)
_BAD_LABELS: tuple[str, ...] = ("2", "-1", "0.5", "yes", "1e0", "true", " ", "01", "nan")
_INVALID_UTF8: tuple[bytes, ...] = (
    b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
    b"\xc0\xaf", b"ab\x80cd",
)
_CONTROL: tuple[str, ...] = ("\x00", "\t", "\r", "\n", "\x1b[2J", "\x7f", "\u2028", "\ufeff")
_COL = {name: i for i, name in enumerate(ALL_COLUMNS)}
# A huge_field record's field: 64 KiB, 900 KiB, or 1.5 MiB (over the 1 MiB record limit).
HUGE_FIELD_BYTES: tuple[int, ...] = (64 << 10, 900 << 10, 1536 << 10)


def _csv_fields(record: dict[str, Any]) -> list[bytes]:
    return encode(record, "csv").split(b",")


def _event_time_text(rng: random.Random, now: float) -> str:
    return rng.choice([
        str(int(now * 1e9)), str(int(now * 1e3)), "0", "-1", str(now + 30 * 86400),
        str(now + 2 * 86400), "946684799", "nan", "1e300", "",
    ])


def hostile_record(record: dict[str, Any], kind: str, rng: random.Random, now: float,
                   huge_field_bytes: tuple[int, ...] = HUGE_FIELD_BYTES) -> bytes:
    """One hostile variant of ``record``.

    Args:
        record: a good record (``SyntheticCtrStream.next_records``).
        kind: one of ``HOSTILE_KINDS``.
        rng: drives every choice.
        now: the current unix time (for event times relative to it).
        huge_field_bytes: sizes a ``huge_field`` record's field is drawn from.

    Returns:
        The record's bytes.

    Raises:
        ValueError: unknown ``kind``.
    """
    as_json = rng.random() < 0.3
    if kind == "surrogate":
        doc = dict(record)
        doc[rng.choice(SPARSE_FIELDS)] = rng.choice(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
        return json.dumps(doc).encode()  # ensure_ascii writes the escapes
    if kind == "json_types":
        return _json_types(record, rng)
    if kind == "garbage":
        which = rng.randrange(3)
        if which == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        if which == 1:
            return "".join(chr(rng.randrange(32, 0x2FFF))
                           for _ in range(rng.randrange(1, 200))).encode()
        return b""
    if as_json and kind in ("extreme_number", "empty_label", "bad_label", "event_time",
                            "control_chars", "separators"):
        return _json_variant(record, kind, rng, now)
    fields = _csv_fields(record)
    if kind == "invalid_utf8":
        col = _COL[rng.choice(SPARSE_FIELDS)]
        fields[col] = fields[col][: rng.randrange(len(fields[col]) + 1)] + rng.choice(
            _INVALID_UTF8)
    elif kind == "extreme_number":
        col = _COL[rng.choice(DENSE_FIELDS + ("label", "event_time"))]
        fields[col] = rng.choice(_EXTREME_NUMBERS).encode()
    elif kind == "huge_field":
        col = _COL[rng.choice(SPARSE_FIELDS)]
        fields[col] = b"x" * rng.choice(huge_field_bytes)
    elif kind == "wrong_count":
        if rng.random() < 0.5:
            start = rng.randrange(1, len(fields))
            del fields[start: rng.randrange(start + 1, len(fields) + 1)]
        else:
            fields += [b"extra"] * rng.randrange(1, 5)
    elif kind == "empty_label":
        fields[_COL["label"]] = b""
    elif kind == "bad_label":
        fields[_COL["label"]] = rng.choice(_BAD_LABELS).encode()
    elif kind == "event_time":
        fields[_COL["event_time"]] = _event_time_text(rng, now).encode()
    elif kind == "separators":
        col = _COL[rng.choice(SPARSE_FIELDS)]
        fields[col] = rng.choice([b"|", b"||||", b"|a||b|", b"|".join([b"id"] * 5000),
                                  b"|".join(b"%d" % i for i in range(2000))])
    elif kind == "control_chars":
        col = _COL[rng.choice(SPARSE_FIELDS)]
        fields[col] = fields[col] + rng.choice(_CONTROL).encode()
    else:
        raise ValueError(f"unknown hostile kind {kind!r}")
    return b",".join(fields)


def _json_variant(record: dict[str, Any], kind: str, rng: random.Random, now: float) -> bytes:
    doc: dict[str, Any] = dict(record)
    if kind == "extreme_number":
        field = rng.choice(DENSE_FIELDS + ("label", "event_time"))
        doc[field] = rng.choice([1e308, -1e308, 3.4e38, 3.5e38, 2**63, -(2**64), 10**40,
                                 float("nan"), float("inf"), -0.0, 5e-324])
    elif kind == "empty_label":
        doc["label"] = rng.choice(["", None])
    elif kind == "bad_label":
        doc["label"] = rng.choice([2, -1, 0.5, "yes", True, "1.0"])
    elif kind == "event_time":
        text = _event_time_text(rng, now)
        doc["event_time"] = float(text) if text not in ("", "nan") else text
    elif kind == "control_chars":
        doc[rng.choice(SPARSE_FIELDS)] = "a" + rng.choice(_CONTROL) + "b"
    else:  # separators
        doc[rng.choice(SPARSE_FIELDS)] = rng.choice(["|", "||||", ["a", "", "b"], ["x"] * 3000])
    return json.dumps(doc, allow_nan=True).encode()


def _json_types(record: dict[str, Any], rng: random.Random) -> bytes:
    doc: dict[str, Any] = dict(record)
    which = rng.randrange(7)
    if which == 0:
        doc[rng.choice(DENSE_FIELDS)] = {"nested": [1, 2]}
    elif which == 1:
        doc[rng.choice(DENSE_FIELDS)] = [1.0, 2.0]
    elif which == 2:
        doc[rng.choice(DENSE_FIELDS + SPARSE_FIELDS)] = rng.choice([True, False, None])
    elif which == 3:
        doc.pop("label")
    elif which == 4:
        doc[rng.choice(SPARSE_FIELDS)] = 10**rng.randrange(20, 4000)
    elif which == 5:
        nest: Any = 1
        for _ in range(rng.choice([50, 500, 5000])):
            nest = [nest]
        doc[rng.choice(SPARSE_FIELDS)] = nest
    else:
        text = json.dumps(doc)
        return (text[:-1] + ', "label": 1, "label": "x"}').encode()  # duplicate keys
    try:
        return json.dumps(doc).encode()
    except (RecursionError, ValueError):  # too deep or too long for json itself
        return b'{"sample_id": "%s", "label": [[[[' % str(record["sample_id"]).encode()


def hostile_stream(n: int, seed: int, hostile_fraction: float = 0.3, fmt: str = "csv",
                   huge_field_bytes: tuple[int, ...] = HUGE_FIELD_BYTES,
                   ) -> Iterator[tuple[str, str, bytes]]:
    """Good and hostile records, mixed.

    Args:
        n: records.
        seed: seeds the good records and every choice.
        hostile_fraction: share of hostile records.
        fmt: encoding of the good records (``csv`` or ``json``).
        huge_field_bytes: sizes a ``huge_field`` record's field is drawn from (keep a
            broker's backlog small with small sizes).

    Yields:
        ``(sample_id, kind, value)``; kind is ``"good"`` or one of ``HOSTILE_KINDS``.
    """
    rng = random.Random(seed)
    stream = SyntheticCtrStream(seed=seed)
    done = 0
    while done < n:
        chunk = stream.next_records(min(1000, n - done))
        now = float(chunk[-1]["event_time"])
        for record in chunk:
            if rng.random() < hostile_fraction:
                kind = rng.choice(HOSTILE_KINDS)
                yield record["sample_id"], kind, hostile_record(record, kind, rng, now,
                                                                huge_field_bytes)
            else:
                yield record["sample_id"], "good", encode(record, fmt)
        done += len(chunk)
