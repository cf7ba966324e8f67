"""A ``/predict`` body to raw records: the accepted shapes, and what is refused.

Accepted bodies (``odl-serve``'s ``POST /predict``):

* text: one CSV (or JSON) record per line;
* JSON: one object (a record: its keys are input field names), an array of objects (or of
  CSV strings), exactly ``{"records": [...]}`` / ``{"instances": [...]}``, or
  newline-delimited JSON objects.

Refused with ``RequestError`` (400, or 413 for size): an empty or undecodable body, a wrapper
with other keys, JSON records that are empty or hold keys that are not input fields (each
named in the message), more than ``MAX_RECORDS`` records.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any, Optional

from starlette.requests import Request

from serving_plugin.predict_limits import MAX_BODY_BYTES

MAX_RECORDS = 100_000
_LIST_KEYS = ("records", "instances")
_MAX_NAMED_KEYS = 10


class RequestError(ValueError):
    """A /predict body that cannot be turned into records (answered with 400 / 413)."""

    def __init__(self, message: str, status: int = 400,
                 rejected: Optional[list[dict]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.rejected = rejected or []


def _quoted(keys: Collection[str]) -> str:
    """Up to ``_MAX_NAMED_KEYS`` keys, quoted and shortened, for an error message."""
    names = list(keys)
    shown = ", ".join(json.dumps(k[:64]) for k in names[:_MAX_NAMED_KEYS])
    more = len(names) - _MAX_NAMED_KEYS
    return shown + (f" and {more} more" if more > 0 else "")


def _unknown_keys(obj: dict, fields: Optional[frozenset[str]]) -> list[str]:
    """The keys of a JSON record that are not input fields (none when fields is None)."""
    if fields is None:
        return []
    return [k for k in obj if k not in fields]


def _wrapper_items(doc: dict, fields: Optional[frozenset[str]]) -> Optional[list]:
    """The record list of a ``{"records": [...]}`` / ``{"instances": [...]}`` body.

    Returns:
        The list, or None when ``doc`` is a record rather than a wrapper.

    Raises:
        RequestError: a wrapper with other keys, or whose value is not an array.
    """
    keys = [k for k in doc if k in _LIST_KEYS and (fields is None or k not in fields)]
    if not keys:
        return None
    key = keys[0]
    extra = [k for k in doc if k != key]
    if extra:
        raise RequestError(f'a {{"{key}": [...]}} body takes no other keys; unexpected: '
                           f"{_quoted(extra)}")
    items = doc[key]
    if not isinstance(items, list):
        raise RequestError(f'"{key}" must be a JSON array of records, not '
                           f"{type(items).__name__}")
    return items


def _check_record_keys(records: list[bytes], objects: dict[int, dict],
                       fields: Optional[Collection[str]]) -> None:
    """Rejects JSON records that are empty or have keys that are not input fields.

    Args:
        records: the raw records (for the count in the message).
        objects: record index -> the decoded JSON object of that record.
        fields: the input field names (None = no check).

    Raises:
        RequestError: 400 listing the offending records and naming the unknown keys.
    """
    if fields is None:
        return
    known = frozenset(fields)
    rejected: list[dict] = []
    unknown: set[str] = set()
    for i, obj in objects.items():
        if not obj:
            rejected.append({"index": i, "reason": "empty"})
            continue
        bad = _unknown_keys(obj, known)
        if bad:
            unknown.update(bad)
            rejected.append({"index": i, "reason": "unknown_fields"})
    if not rejected:
        return
    n_empty = len(rejected) - sum(r["reason"] == "unknown_fields" for r in rejected)
    parts = []
    if unknown:
        parts.append(f"keys that are not input fields: {_quoted(sorted(unknown))} (the input "
                     f"fields are {_quoted(fields)})")
    if n_empty:
        parts.append(f"{n_empty} empty JSON object{'s' if n_empty > 1 else ''} (no fields)")
    raise RequestError(f"{len(rejected)} of {len(records)} records rejected: "
                       + "; ".join(parts),
                       rejected=sorted(rejected, key=lambda r: r["index"])[:100])


def split_body(body: bytes, max_bytes: int = MAX_BODY_BYTES,
               fields: Optional[Collection[str]] = None) -> list[bytes]:
    """Turns a /predict body into raw records (see the module docstring).

    Args:
        body: the request body.
        max_bytes: the largest body accepted.
        fields: the model's input field names: JSON records with other keys (or none) are
            rejected; None skips the check.

    Returns:
        The records, each as the training stream would carry it.

    Raises:
        RequestError: empty, undecodable, oversized or oddly shaped body, unknown keys.
    """
    if len(body) > max_bytes:
        raise RequestError(f"body of {len(body)} bytes exceeds {max_bytes}", 413)
    known = frozenset(fields) if fields is not None else None
    text = body.strip()
    if not text:
        raise RequestError("empty body: send CSV lines or JSON records")
    records: list[bytes]
    objects: dict[int, dict] = {}
    if text[:1] in (b"[", b"{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        if doc is None:
            if text[:1] != b"{":
                raise RequestError("body is not valid JSON")
            # Newline-delimited JSON records: lines that decode to objects are checked here,
            # the others are left to the record parser (bad_json).
            records = [ln for ln in text.splitlines() if ln.strip()]
            for i, ln in enumerate(records):
                try:
                    obj = json.loads(ln)
                except (ValueError, RecursionError):
                    continue
                if isinstance(obj, dict):
                    objects[i] = obj
        else:
            items: Any = doc
            if isinstance(doc, dict):
                items = _wrapper_items(doc, known)
                if items is None:
                    items = [doc]
            elif not isinstance(doc, list):
                items = [doc]
            records = []
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    objects[i] = item
                    records.append(json.dumps(item).encode("utf-8"))
                elif isinstance(item, str):
                    records.append(item.encode("utf-8"))
                else:
                    raise RequestError(f"record {i} is a {type(item).__name__}; expected a JSON "
                                       "object or a CSV string")
    else:
        records = [ln for ln in text.splitlines() if ln.strip()]
    if not records:
        raise RequestError("no records in the body")
    if len(records) > MAX_RECORDS:
        raise RequestError(f"{len(records)} records exceed the limit of {MAX_RECORDS}", 413)
    _check_record_keys(records, objects, fields)
    return records


def content_length(request: Request) -> Optional[int]:
    """The declared ``Content-Length`` (None when absent, e.g. a chunked body).

    Raises:
        RequestError: not a non-negative integer (uvicorn's parser normally refuses first).
    """
    value = request.headers.get("content-length")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise RequestError("Content-Length is not an integer") from None
    if n < 0:
        raise RequestError("Content-Length is negative")
    return n
