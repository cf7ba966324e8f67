r"""Parses raw Kafka message values (CSV or JSON records) into columns, never raising.

Output layout (``ParsedColumns``): every accepted record's field texts live in one ``uint8``
buffer; field ``name`` of row ``i`` is ``buffer[starts[name][i]:ends[name][i]]`` (UTF-8).
Numeric fields also get a typed column (``numeric[name]``: ``float64`` for FLOAT / DOUBLE /
BOOL, ``int64`` for INT32 / INT64). Keeping texts as ranges of one buffer lets the feature
builder hash and split whole columns with numpy instead of touching one Python object per
value.

Rules:

* CSV: a record is split on ``data_config.separator``; it must have exactly
  ``len(input_fields)`` fields. A trailing ``\n`` / ``\r\n`` is dropped.
* RTP (EasyRec's ``RTPInput`` layout, ``odl.features.rtp_layout``): the label columns and
  the features column that ``selected_cols`` names become a CSV record as above; a record
  without those columns is ``field_count``. A record starting with ``{`` is JSON, as
  below (``record_format: AUTO``; a DataHub TUPLE topic's records).
* JSON: a record is one object; keys are ``input_name``s. Numbers and strings are accepted
  for every field (their text is used: ``str(value)``), ``true``/``false`` for BOOL and
  STRING fields, ``null`` or a missing key means empty. A list is joined with the field's
  list separator when one is given (``list_separators``, e.g. a multi-valued id feature's
  ``separator``; a vector label's list may hold numbers). Label fields are required.
* Empty field: replaced by the field's ``default_val`` text when that is not empty;
  otherwise a numeric field reads 0 and a STRING field stays empty. Label fields are never
  filled in: an empty label is ``bad_label`` whatever its ``default_val``.
* Numbers: INT32 / INT64 fields must hold integers (``"3.0"`` is ``bad_number``); FLOAT /
  DOUBLE anything numpy parses as a float; NaN / inf are ``non_finite``. BOOL accepts
  ``0/1/true/false`` (any case).
* A label field with EasyRec's ``user_define_fn`` (``odl.config.label_functions``) is
  checked as below after the function made its values (a record it fails on is
  ``bad_label``).
* A vector label (``data_config.vector_labels``, ``odl.config.vector_labels``) holds ``dim``
  finite numbers split on its separator (one number when ``dim`` is 1), else ``bad_label``;
  ``numeric`` holds it as ``[n, dim]``.
* Labels must be 0 or 1 (an empty label is ``bad_label``), except the ``real_labels`` (a
  regression output's), which may hold any finite number, and the ``class_labels`` (a
  ``num_class`` C model's), which hold a class index, an integer in ``[0, C)``.
* JSON strings must be encodable as UTF-8: a lone surrogate (``"\ud800"``) is
  ``invalid_utf8``, like invalid bytes in a CSV record.

A rejected record gets exactly one reason from ``REJECT_REASONS`` (the first check failed,
in the order listed there). The parser's own reasons come first; ``bad_event_time`` is
assigned by the feature builder (``odl.features.feature_builder``), ``unprocessable`` by the
build guard (a record whose building raised), and ``non_finite_output`` by the trainer (a
record whose prediction was not finite, so it cannot be trained on).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from odl.config.label_functions import LabelFunction
from odl.features.rtp_layout import RtpLayout
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

REJECT_REASONS = (
    "oversized",
    "empty",
    "invalid_utf8",
    "bad_json",
    "json_type",
    "field_count",
    "bad_number",
    "non_finite",
    "bad_label",
    "bad_event_time",
    "unprocessable",
    "non_finite_output",
)

DEFAULT_MAX_RECORD_BYTES = 1 << 20

_FT = pipeline_pb2.DatasetConfig.FieldType
_INT_TYPES = (_FT.INT32, _FT.INT64)
_FLOAT_TYPES = (_FT.FLOAT, _FT.DOUBLE)
_BOOL_TEXT = {b"0": 0.0, b"1": 1.0, b"true": 1.0, b"false": 0.0}


@dataclass
class ParsedColumns:
    """Accepted records as columns (see the module docstring for the layout).

    Attributes:
        buffer: ``uint8`` buffer holding every field text.
        starts: field name -> ``int64 [n]`` start offsets into ``buffer``.
        ends: field name -> ``int64 [n]`` end offsets (exclusive).
        numeric: field name -> typed values ``[n]`` for numeric fields.
        accepted: ``int64 [n]`` indices of the accepted records in the parser's input.
        rejected: ``(index, reason)`` for every rejected record, by index.
    """

    buffer: np.ndarray
    starts: dict[str, np.ndarray]
    ends: dict[str, np.ndarray]
    numeric: dict[str, np.ndarray]
    accepted: np.ndarray
    rejected: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Number of accepted records."""
        return int(self.accepted.shape[0])

    def texts(self, name: str) -> list[str]:
        """Field ``name`` of every row as ``str``."""
        raw = self.buffer.tobytes()
        return [
            raw[s:e].decode("utf-8")
            for s, e in zip(self.starts[name].tolist(), self.ends[name].tolist(), strict=False)
        ]

    def select(self, keep: np.ndarray) -> ParsedColumns:
        """Returns the rows where the boolean mask ``keep`` is true (``rejected`` unchanged)."""
        return ParsedColumns(
            buffer=self.buffer,
            starts={k: v[keep] for k, v in self.starts.items()},
            ends={k: v[keep] for k, v in self.ends.items()},
            numeric={k: v[keep] for k, v in self.numeric.items()},
            accepted=self.accepted[keep],
            rejected=list(self.rejected),
        )


def gather_segments(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Copies byte ranges into one contiguous buffer.

    Args:
        buf: ``uint8`` buffer.
        starts: range starts.
        ends: range ends (exclusive).

    Returns:
        ``(data uint8, offsets int32 [n + 1])``: range ``i`` is ``data[offsets[i]:offsets[i+1]]``
        (Arrow's binary layout).
    """
    lengths = ends - starts
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    idx = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
    return buf[idx], offsets


def parse_numbers(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, kind: str = "float"
) -> tuple[np.ndarray, np.ndarray]:
    """Parses byte ranges as numbers.

    The fast path is Arrow's string cast (C++, vectorized); when it refuses a value the
    column is parsed again value by value with Python's ``float`` / ``int`` (the reference
    semantics), marking the values neither accepts.

    Args:
        buf: ``uint8`` buffer.
        starts: range starts.
        ends: range ends (exclusive).
        kind: ``"float"`` (float64) or ``"int"`` (int64, decimal integers only).

    Returns:
        ``(values, ok)``: parsed values (0 where not ok) and a boolean mask of parsed ranges.
    """
    n = int(starts.shape[0])
    dtype = np.float64 if kind == "float" else np.int64
    if n == 0:
        return np.zeros(0, dtype=dtype), np.ones(0, dtype=bool)
    data, offsets = gather_segments(buf, starts, ends)
    try:
        arr = pa.Array.from_buffers(
            pa.utf8(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
        )
        target = pa.float64() if kind == "float" else pa.int64()
        out = pc.cast(arr, target).to_numpy(zero_copy_only=False)
        return out.astype(dtype, copy=False), np.ones(n, dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    raw = data.tobytes()
    conv = float if kind == "float" else int
    vals = np.zeros(n, dtype=dtype)
    ok = np.ones(n, dtype=bool)
    off = offsets.tolist()
    for i in range(n):
        try:
            v = conv(raw[off[i] : off[i + 1]])
            if kind == "int" and not -(1 << 63) <= v < (1 << 63):
                raise ValueError("out of int64 range")
            vals[i] = v
        except ValueError:
            ok[i] = False
    return vals, ok


class RecordParser:
    """Parses a batch of raw record bytes into ``ParsedColumns``.

    Args:
        data_config: the pipeline's ``DatasetConfig`` (fields, separator, labels, format),
            validated (``odl.config.config_validation``: unique fields, labels among them, a
            separator, default texts that parse as their field's type).
        max_record_bytes: records longer than this are rejected as ``oversized``.
        list_separators: field name -> separator used to join a JSON list in that field.
        numeric_fields: numeric fields to parse and validate (default: every field whose
            ``input_type`` is numeric, plus the labels).
        real_labels: label fields that may hold any finite number (not only 0 / 1).
        class_labels: label field -> its number of classes C (the label: an integer in
            ``[0, C)``).
        label_functions: label field -> EasyRec's ``user_define_fn``
            (``odl.config.label_functions``), applied before the label is checked.
    """

    def __init__(
        self,
        data_config: pipeline_pb2.DatasetConfig,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        list_separators: Mapping[str, str] | None = None,
        numeric_fields: Sequence[str] | None = None,
        real_labels: Sequence[str] = (),
        class_labels: Mapping[str, int] | None = None,
        label_functions: Mapping[str, LabelFunction] | None = None,
    ) -> None:
        self._label_functions = dict(label_functions or {})
        self._real_labels = set(real_labels)
        self._class_labels = dict(class_labels or {})
        self._fields = [f.input_name for f in data_config.input_fields]
        self._types = {f.input_name: f.input_type for f in data_config.input_fields}
        self._labels = list(data_config.label_fields)
        self._vector_labels = {v.input_name: (int(v.dim), v.separator)
                               for v in data_config.vector_labels}
        self._sep = data_config.separator.encode("utf-8")
        self._rtp = RtpLayout.of(data_config)
        self._format = data_config.record_format
        self._max_bytes = int(max_record_bytes)
        self._list_seps = dict(list_separators or {})
        if numeric_fields is None:
            numeric = [
                n for n in self._fields if self._types[n] != _FT.STRING or n in self._labels
            ]
        else:
            numeric = list(dict.fromkeys(list(numeric_fields) + self._labels))
        self._numeric = numeric
        # Default texts (empty field replacement), appended after the records in the buffer.
        self._defaults = {f.input_name: f.default_val.encode("utf-8") for f in
                          data_config.input_fields}

    @property
    def field_names(self) -> list[str]:
        """Input field names in record order."""
        return list(self._fields)

    def parse(self, values: Sequence[bytes]) -> ParsedColumns:
        """Parses ``values``; a malformed record is rejected, never raised.

        Args:
            values: raw record bytes (Kafka message values); ``None`` counts as empty.

        Returns:
            The accepted records as columns, with the rejected indices and reasons.
        """
        vals = [b"" if v is None else v for v in values]
        n = len(vals)
        reasons: list[str | None] = [None] * n
        lengths = np.fromiter(map(len, vals), dtype=np.int64, count=n)
        for i in np.flatnonzero(lengths == 0):
            reasons[i] = "empty"
        big = lengths > self._max_bytes
        if big.any():
            for i in np.flatnonzero(big):
                reasons[i] = "oversized"
                vals[i] = b""
        if self._rtp is not None:
            auto = self._format == pipeline_pb2.DatasetConfig.AUTO
            for i in range(n):
                if reasons[i] is None and not (auto and vals[i][:1] == b"{"):
                    plain = self._rtp.plain_record(vals[i])
                    if plain is None:
                        reasons[i], vals[i] = "field_count", b""
                    else:
                        vals[i] = plain
        parts = []
        if self._format == pipeline_pb2.DatasetConfig.JSON:
            json_idx = [i for i in range(n) if reasons[i] is None]
        else:
            part, json_idx = self._split_csv(vals, reasons)
            parts.append(part)
        if json_idx:
            parts.append(self._split_json(vals, json_idx, reasons))
        return self._finish(parts, reasons)

    # -- CSV --------------------------------------------------------------------------------

    def _split_csv(self, vals: list, reasons: list) -> tuple[tuple, list[int]]:
        """Splits the CSV records of ``vals`` (those without a reason yet).

        Returns:
            ``((row indices, buffer, starts [m, F], ends [m, F]), json_indices)``: the
            well-formed CSV records, and (AUTO format) the records starting with ``{``.
        """
        n = len(vals)
        nf = len(self._fields)
        ok = np.fromiter((r is None for r in reasons), dtype=bool, count=n)
        joined = self._sep.join(vals)
        buf = np.frombuffer(joined, dtype=np.uint8)
        lengths = np.fromiter(map(len, vals), dtype=np.int64, count=n)
        seplen = len(self._sep)
        rec_end = np.cumsum(lengths + seplen) - seplen
        rec_start = rec_end - lengths
        has = lengths > 0
        if has.any():
            last = np.zeros(n, dtype=np.uint8)
            last[has] = buf[rec_end[has] - 1]
            if (last == 10).any():  # drop trailing newlines, then split again
                stripped = [v.rstrip(b"\r\n") if v[-1:] == b"\n" else v for v in vals]
                for i in np.flatnonzero(ok):
                    if not stripped[i]:
                        reasons[i] = "empty"
                        ok[i] = False
                return self._split_csv(stripped, reasons)
        json_idx: list[int] = []
        if self._format == pipeline_pb2.DatasetConfig.AUTO and ok.any():
            first = np.zeros(n, dtype=np.uint8)
            first[has] = buf[rec_start[has]]
            is_json = ok & (first == ord("{"))
            if is_json.any():
                json_idx = np.flatnonzero(is_json).tolist()
                ok &= ~is_json
        try:
            joined.decode("utf-8")
        except UnicodeDecodeError:
            for i in np.flatnonzero(ok):
                try:
                    vals[i].decode("utf-8")
                except UnicodeDecodeError:
                    ok[i] = False
                    reasons[i] = "invalid_utf8"
        if seplen == 1:
            seps = np.flatnonzero(buf == self._sep[0])
            lo = np.searchsorted(seps, rec_start)
            hi = np.searchsorted(seps, rec_end)
            bad_count = ok & ((hi - lo + 1) != nf)
            for i in np.flatnonzero(bad_count):
                reasons[i] = "field_count"
            ok &= ~bad_count
            lo, rec_start, rec_end = lo[ok], rec_start[ok], rec_end[ok]
            if nf > 1:
                inner = seps[lo[:, None] + np.arange(nf - 1)]
            else:
                inner = np.empty((lo.shape[0], 0), dtype=np.int64)
            starts = np.concatenate([rec_start[:, None], inner + 1], axis=1)
            ends = np.concatenate([inner, rec_end[:, None]], axis=1)
            return (np.flatnonzero(ok), buf, starts, ends), json_idx
        # Multi-byte separator: split in Python (slower, rare).
        rows: list[list[bytes]] = []
        keep = []
        for i in np.flatnonzero(ok):
            f = vals[i].split(self._sep)
            if len(f) != nf:
                reasons[i] = "field_count"
                continue
            rows.append(f)
            keep.append(i)
        return self._pack_rows(np.asarray(keep, dtype=np.int64), rows), json_idx

    def _pack_rows(
        self, idx: np.ndarray, rows: list[list[bytes]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        nf = len(self._fields)
        flat = [t for row in rows for t in row]
        buf = np.frombuffer(b"".join(flat), dtype=np.uint8)
        lengths = np.fromiter(map(len, flat), dtype=np.int64, count=len(flat))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        return idx, buf, starts.reshape(-1, nf), ends.reshape(-1, nf)

    # -- JSON -------------------------------------------------------------------------------

    def _split_json(
        self, vals: list, idx: list[int], reasons: list
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rows: list[list[bytes]] = []
        keep: list[int] = []
        for i in idx:
            try:
                text = vals[i].decode("utf-8")
            except UnicodeDecodeError:
                reasons[i] = "invalid_utf8"
                continue
            if not text.strip():
                reasons[i] = "empty"
                continue
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError):
                reasons[i] = "bad_json"
                continue
            row = self._json_row(obj)
            if isinstance(row, str):
                reasons[i] = row
                continue
            rows.append(row)
            keep.append(i)
        return self._pack_rows(np.asarray(keep, dtype=np.int64), rows)

    def _json_row(self, obj: object) -> list[bytes] | str:
        """The field texts of a decoded JSON record, or the reason it is rejected."""
        if not isinstance(obj, dict):
            return "json_type"
        try:
            return self._json_fields(obj)
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8 form
            return "invalid_utf8"

    def _json_fields(self, obj: dict) -> list[bytes] | str:
        row = []
        for name in self._fields:
            v = obj.get(name)
            t = self._types[name]
            if v is None:
                if name in self._labels:
                    return "json_type"
                row.append(b"")
            elif isinstance(v, bool):
                if t not in (_FT.BOOL, _FT.STRING):
                    return "json_type"
                row.append(b"true" if v else b"false")
            elif isinstance(v, (int, float)):
                row.append(repr(v).encode() if isinstance(v, float) else str(v).encode())
            elif isinstance(v, str):
                row.append(v.encode("utf-8"))
            elif isinstance(v, list) and name in self._list_seps and t == _FT.STRING:
                kinds = (str, int, float) if name in self._vector_labels else (str, int)
                if not all(isinstance(x, kinds) and not isinstance(x, bool) for x in v):
                    return "json_type"
                row.append(self._list_seps[name].join(
                    repr(x) if isinstance(x, float) else str(x) for x in v).encode("utf-8"))
            else:
                return "json_type"
        return row

    # -- columns ----------------------------------------------------------------------------

    def _finish(self, parts: list, reasons: list) -> ParsedColumns:
        nf = len(self._fields)
        if not parts:
            idx = np.empty(0, dtype=np.int64)
            buf = np.empty(0, dtype=np.uint8)
            starts = ends = np.empty((0, nf), dtype=np.int64)
        elif len(parts) == 1:
            idx, buf, starts, ends = parts[0]
        else:
            bufs, ss, es, ids = [], [], [], []
            offset = 0
            for p_idx, p_buf, p_s, p_e in parts:
                ids.append(p_idx)
                bufs.append(p_buf)
                ss.append(p_s + offset)
                es.append(p_e + offset)
                offset += p_buf.shape[0]
            idx = np.concatenate(ids)
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
            buf = np.concatenate(bufs)
            starts = np.concatenate(ss)[order]
            ends = np.concatenate(es)[order]
        # Append the default texts and a "0" (the value of an empty numeric field without a
        # default), and point empty fields at them.
        base = buf.shape[0]
        dflt = [self._defaults[name] for name in self._fields]
        buf = np.concatenate([buf, np.frombuffer(b"".join(dflt) + b"0", dtype=np.uint8)])
        zero_at = buf.shape[0] - 1
        starts = starts.copy()
        ends = ends.copy()
        off = base
        numeric_set = set(self._numeric)
        labels = set(self._labels)
        for j, name in enumerate(self._fields):
            d = dflt[j]
            empty = starts[:, j] == ends[:, j]
            if name in labels:  # an empty label stays empty (bad_label), default or not
                pass
            elif d:
                starts[empty, j] = off
                ends[empty, j] = off + len(d)
            elif name in numeric_set:
                starts[empty, j] = zero_at
                ends[empty, j] = zero_at + 1
            off += len(d)
        m = idx.shape[0]
        row_reason = np.zeros(m, dtype=np.int8)  # 0 ok, else index+1 in _NUM_REASONS
        numeric: dict[str, np.ndarray] = {}
        col = {name: j for j, name in enumerate(self._fields)}
        # Parse numeric columns in two groups (one vectorized call each).
        groups: dict[str, list[str]] = {"float": [], "int": [], "bool": []}
        for name in self._numeric:
            t = self._types[name]
            if t == _FT.BOOL:
                groups["bool"].append(name)
            elif t in _INT_TYPES and name not in self._labels:
                groups["int"].append(name)
            else:
                groups["float"].append(name)
        for kind, names in groups.items():
            if not names:
                continue
            js = [col[nm] for nm in names]
            s = starts[:, js].T.ravel()
            e = ends[:, js].T.ravel()
            if kind == "bool":
                v, good = _parse_bool(buf, s, e)
            else:
                v, good = parse_numbers(buf, s, e, kind)
            v = v.reshape(len(names), m)
            if self._label_functions:  # (their values are replaced below)
                v = v.copy()
            good = good.reshape(len(names), m)
            for k, name in enumerate(names):
                is_label = name in self._labels
                if is_label:  # labels have no "0" substitute: empty is still empty
                    _mark(row_reason, starts[:, col[name]] == ends[:, col[name]], 3)
                _mark(row_reason, ~good[k], 1)
                if kind != "int":
                    _mark(row_reason, ~np.isfinite(v[k]), 2)
                if is_label and name in self._label_functions:  # user_define_fn first
                    v[k], failed = self._label_functions[name].apply(v[k], row_reason == 0)
                    _mark(row_reason, failed, 3)
                if is_label and name in self._class_labels:
                    classes = self._class_labels[name]
                    _mark(row_reason, (v[k] != np.floor(v[k])) | (v[k] < 0)
                          | (v[k] >= classes), 3)
                elif is_label and name not in self._real_labels:
                    _mark(row_reason, (v[k] != 0) & (v[k] != 1), 3)
                numeric[name] = v[k]
        for name, (dim, sep) in self._vector_labels.items():  # [m, dim] numbers each
            j = col[name]
            numeric[name], bad = _vector_label(buf, starts[:, j], ends[:, j], dim, sep,
                                               row_reason == 0)
            _mark(row_reason, bad, 3)
        ok = row_reason == 0

        for j in np.flatnonzero(~ok):
            reasons[int(idx[j])] = _NUM_REASONS[row_reason[j] - 1]
        rejected = [(i, r) for i, r in enumerate(reasons) if r is not None]
        if not ok.all():
            idx, starts, ends = idx[ok], starts[ok], ends[ok]
            numeric = {k: v[ok] for k, v in numeric.items()}
        return ParsedColumns(
            buffer=buf,
            starts=dict(zip(self._fields, np.ascontiguousarray(starts.T), strict=False)),
            ends=dict(zip(self._fields, np.ascontiguousarray(ends.T), strict=False)),
            numeric=numeric,
            accepted=idx,
            rejected=rejected,
        )


_NUM_REASONS = ("bad_number", "non_finite", "bad_label")


def _vector_label(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, dim: int, sep: str,
                  ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A vector label's ``float32 [m, dim]`` numbers, and the rows without ``dim`` finite ones.

    One number per record when ``dim`` is 1; ``sep`` "" splits the text into single characters.
    """
    out = np.zeros((starts.shape[0], dim), dtype=np.float32)
    bad = np.zeros(starts.shape[0], dtype=bool)
    for i in np.flatnonzero(ok):
        text = buf[starts[i]:ends[i]].tobytes().decode("utf-8", "replace").strip()
        parts = [text] if dim == 1 else list(text) if sep == "" else text.split(sep)
        try:
            values = np.array([float(p) for p in parts], dtype=np.float64)
        except ValueError:
            bad[i] = True
            continue
        if values.shape[0] != dim or not np.isfinite(values).all():
            bad[i] = True
            continue
        out[i] = values
    return out, bad


def _mark(row_reason: np.ndarray, mask: np.ndarray, code: int) -> None:
    """Sets ``code`` on rows in ``mask`` that have no reason yet (first failure wins)."""
    row_reason[mask & (row_reason == 0)] = code


def _parse_bool(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    raw = buf.tobytes()
    n = int(starts.shape[0])
    vals = np.zeros(n, dtype=np.float64)
    ok = np.ones(n, dtype=bool)
    for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=False)):
        x = _BOOL_TEXT.get(raw[a:b].strip().lower())
        if x is None:
            ok[i] = False
        else:
            vals[i] = x
    return vals, ok
