"""Turns raw records into model batches: parse, hash / bucketize, pack as a KeyedJaggedTensor.

What each feature becomes is the plan's (``odl.features.feature_plan``, its module docstring
lists the feature kinds); :class:`FeatureBuilder` is a plan that builds batches by it, with
the column operations of ``odl.features.column_ops`` and the crossed ids of
``odl.features.crossed_ids``. Like the plan it takes a validated
config and checks no config rule of its own.

Only fields that some feature, the label, or the event time reads are validated as numbers;
other columns are carried as text and never reject a record.

Event times (``data_config.event_time_field``, unix seconds) must lie in
``[EVENT_TIME_MIN_SECS, now + EVENT_TIME_MAX_AHEAD_SECS]`` (2000-01-01 up to one day ahead of
the building host's clock); a record outside that window (milliseconds or nanoseconds sent
as seconds, a zero, a clock far in the future) is rejected as ``bad_event_time``, so no
absurd time ever reaches a delta version's header or the freshness figures.

No record can stop the input: ``build_arrays`` never raises for the content of its records.
When building a batch raises anyway (a bug meeting an input nobody foresaw), the batch is
built again record by record; each record whose own build raises is rejected as
``unprocessable`` (logged with its traceback at a bounded rate) and the rest is built as one
batch.

Building is split in two so that the costly part can run in a worker process
(``odl.inputs.feature_build_worker``): ``build_arrays`` parses, hashes and bucketizes into
numpy arrays (:class:`BatchArrays`) and needs no torch; ``to_batch`` wraps those arrays as
tensors and a KeyedJaggedTensor without copying. This module imports torch only inside
``to_batch``, so a worker that only calls ``build_arrays`` never loads it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from odl.features.column_ops import (
    bag_weights,
    raw_ids,
    sequence_positions,
    split_column,
    split_ranges,
)
from odl.features.crossed_ids import combo_ids, lookup_ids
from odl.features.feature_plan import FeaturePlan, PlannedDense, PlannedSparse
from odl.features.id_hashing import bucketize_hashes, hash_segments
from odl.features.record_parser import ParsedColumns, parse_numbers

if TYPE_CHECKING:
    from odl.features.batch import Batch

logger = logging.getLogger(__name__)

# Dense inputs reach the model as float32: a finite float64 beyond this would become inf.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# The event time window (unix seconds): 2000-01-01T00:00:00Z up to one day ahead of now.
EVENT_TIME_MIN_SECS = 946_684_800.0
EVENT_TIME_MAX_AHEAD_SECS = 86_400.0
# At most one "unprocessable record" traceback per this many seconds (per process).
_GUARD_LOG_INTERVAL_SECS = 30.0


@dataclass
class BatchArrays:
    """A built batch as numpy arrays: what ``to_batch`` turns into a :class:`Batch`.

    Attributes:
        values: ``int64`` table rows of every sparse feature, feature after feature
            (KeyedJaggedTensor values in ``sparse_feature_names`` order).
        lengths: ``int32`` ids per (feature, sample), feature-major (KJT lengths).
        dense: ``float32 [B, num_dense]`` raw numeric features.
        labels: ``float32 [B]`` labels (``[B, n]`` with ``n`` label fields, in
            ``label_fields`` order; ``[B, C]`` one-hot for a ``num_class`` C model).
        sample_ids: per-sample ids when ``data_config.sample_id_field`` is set.
        event_times: ``float64`` unix seconds when ``data_config.event_time_field`` is set.
        group_keys: ``int64`` per-sample FNV-1a hash of the GAUC grouping column's text
            (``odl.config.metric_settings.grouped_auc_field``) when one is configured.
        counts: ``float32`` per-sample values of the dynamic tables' ``show_field`` /
            ``click_field``, by field name, when a table names one.
        weights: ``float32`` per-value weights aligned with ``values`` (a config with
            weighted tags), or None.
        session_keys: ``int64`` per-sample FNV-1a hash of the JRC_LOSS session column's
            text (``odl.config.loss_settings.jrc_session_field``) when one is configured.
        sample_weights: ``float32`` per-sample loss weights of ``data_config.sample_weight``
            (``odl.config.loss_settings.sample_weight_field``) when one is configured.
        label_vectors: ``float32 [B, dim]`` numbers of each vector label
            (``data_config.vector_labels``: a distillation's soft labels), or None.
    """

    values: np.ndarray
    lengths: np.ndarray
    dense: np.ndarray
    labels: np.ndarray
    sample_ids: list[str] | None = None
    event_times: np.ndarray | None = None
    counts: dict[str, np.ndarray] | None = None
    group_keys: np.ndarray | None = None
    weights: np.ndarray | None = None
    session_keys: np.ndarray | None = None
    sample_weights: np.ndarray | None = None
    label_vectors: dict[str, np.ndarray] | None = None


@dataclass
class ArraysResult:
    """Result of ``FeatureBuilder.build_arrays`` (picklable, torch-free).

    Attributes:
        arrays: the accepted records' arrays, or ``None`` when every record was rejected.
        accepted: ``int64`` indices (into the input values) of the batch rows, in order.
        rejected: ``(index, reason)`` of every rejected record, by index.
    """

    arrays: BatchArrays | None
    accepted: np.ndarray
    rejected: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class BuildResult:
    """Result of ``FeatureBuilder.build``.

    Attributes:
        batch: the batch of accepted records, or ``None`` when every record was rejected.
        accepted: ``int64`` indices (into the input values) of the batch rows, in order.
        rejected: ``(index, reason)`` of every rejected record, by index.
    """

    batch: Batch | None
    accepted: np.ndarray
    rejected: list[tuple[int, str]] = field(default_factory=list)


class FeatureBuilder(FeaturePlan):
    """Builds ``Batch``es from raw record bytes by its feature plan (module docstring).

    Made as a :class:`FeaturePlan` is (the same arguments: a validated config); the
    event-time window it checks is this module's.
    """

    # the last "unprocessable record" traceback logged (monotonic seconds), per builder
    _last_guard_log = -_GUARD_LOG_INTERVAL_SECS

    # -- building ---------------------------------------------------------------------------

    def build(self, values: Sequence[bytes]) -> BuildResult:
        """Parses and featurizes raw records (``build_arrays`` then ``to_batch``).

        Args:
            values: raw record bytes (e.g. Kafka message values).

        Returns:
            The batch of accepted records, their indices, and the rejected ones with reasons.
        """
        result = self.build_arrays(values)
        batch = self.to_batch(result.arrays) if result.arrays is not None else None
        return BuildResult(batch, result.accepted, result.rejected)

    def to_batch(self, arrays: BatchArrays) -> Batch:
        """Wraps built arrays as a :class:`Batch` (tensors share the arrays' memory).

        Args:
            arrays: from ``build_arrays`` (in this process or a worker).

        Returns:
            The model batch.
        """
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from odl.features.batch import Batch

        kjt = KeyedJaggedTensor(
            keys=self.sparse_feature_names,
            values=torch.from_numpy(arrays.values),
            lengths=torch.from_numpy(arrays.lengths),
            weights=(torch.from_numpy(arrays.weights) if arrays.weights is not None
                     else None),
        )
        return Batch(
            sparse=kjt,
            dense=torch.from_numpy(arrays.dense),
            labels=torch.from_numpy(arrays.labels),
            sample_ids=arrays.sample_ids,
            event_times=arrays.event_times,
            counts=arrays.counts,
            group_keys=arrays.group_keys,
            session_keys=arrays.session_keys,
            sample_weights=arrays.sample_weights,
            label_vectors=arrays.label_vectors,
        )

    def empty_arrays(self) -> BatchArrays:
        """The arrays of a batch of no records, shaped as ``build_arrays`` shapes them.

        A rank of a job of several that has nothing to train at a step still takes part in
        the step with such a batch (``odl.train.distributed``).
        """
        labels = (np.zeros((0, self._classes), np.float32) if self._classes > 1
                  else np.zeros(0, np.float32) if len(self._labels) == 1
                  else np.zeros((0, len(self._labels)), np.float32))
        return BatchArrays(
            values=np.zeros(0, np.int64), lengths=np.zeros(0, np.int32),
            dense=np.zeros((0, len(self.dense_feature_names)), np.float32), labels=labels,
            sample_ids=[] if self._sample_id_field else None,
            event_times=np.zeros(0, np.float64) if self._check_event_time else None,
            counts=({f: np.zeros(0, np.float32) for f in self._count_fields}
                    if self._count_fields else None),
            group_keys=np.zeros(0, np.int64) if self._group_field else None,
            weights=np.zeros(0, np.float32) if self._weighted else None,
            session_keys=np.zeros(0, np.int64) if self._session_field else None,
            sample_weights=np.zeros(0, np.float32) if self._weight_field else None,
            label_vectors=({n: np.zeros((0, d), np.float32)
                            for n, d in self._vector_labels.items()}
                           if self._vector_labels else None),
        )

    def build_arrays(self, values: Sequence[bytes]) -> ArraysResult:
        """Parses and featurizes raw records into numpy arrays (no torch involved).

        Never raises for the content of ``values``: a record whose building raises is
        rejected as ``unprocessable`` (see the module docstring).

        Args:
            values: raw record bytes (e.g. Kafka message values).

        Returns:
            The accepted records' arrays, their indices, and the rejected ones with reasons.
        """
        try:
            return self._build_arrays(values)
        except Exception as exc:  # noqa: BLE001 - isolate the record(s) that raise
            return self._build_record_by_record(values, exc)

    def _build_record_by_record(self, values: Sequence[bytes], exc: Exception) -> ArraysResult:
        """Builds ``values`` without the records whose own build raises (``unprocessable``)."""
        bad: list[int] = []
        for i, value in enumerate(values):
            try:
                self._build_arrays([value])
            except Exception as one:  # noqa: BLE001
                bad.append(i)
                self._log_unprocessable(one)
        if not bad:  # only the batch as a whole fails: reject all of it, never stop
            bad = list(range(len(values)))
            self._log_unprocessable(exc)
        good = np.setdiff1d(np.arange(len(values), dtype=np.int64),
                            np.asarray(bad, dtype=np.int64))
        rejected = [(i, "unprocessable") for i in bad]
        if not good.shape[0]:
            return ArraysResult(None, good, rejected)
        try:
            result = self._build_arrays([values[i] for i in good.tolist()])
        except Exception as rest:  # noqa: BLE001
            self._log_unprocessable(rest)
            return ArraysResult(None, np.empty(0, dtype=np.int64),
                                [(i, "unprocessable") for i in range(len(values))])
        return ArraysResult(
            result.arrays,
            good[result.accepted],
            sorted(rejected + [(int(good[i]), r) for i, r in result.rejected]),
        )

    def _log_unprocessable(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_guard_log >= _GUARD_LOG_INTERVAL_SECS:
            self._last_guard_log = now
            logger.error("a record could not be built and is rejected as unprocessable: %r",
                         exc, exc_info=exc)

    def _build_arrays(self, values: Sequence[bytes]) -> ArraysResult:
        parsed = self._parser.parse(values)
        rejected = parsed.rejected
        if parsed.num_rows == 0:
            return ArraysResult(None, parsed.accepted, rejected)
        raw = parsed.buffer.tobytes()
        sep_pos = self._separatorsequence_positions(raw)
        pieces = {}
        bags: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        bad = np.zeros(parsed.num_rows, dtype=bool)
        tag_weights: dict[str, np.ndarray] = {}
        for sp in self._sparse:
            if sp.kind in ("hash", "int", "vocab"):
                pieces[sp.name] = self._split_values(parsed, sp, sep_pos, bags)
                if sp.weights_input or sp.kv_separator:
                    s, e, lengths, w, wrong = self._tag_weights(parsed, sp, pieces[sp.name],
                                                                sep_pos)
                    pieces[sp.name] = (s, e, lengths)
                    tag_weights[sp.name] = w
                    bad |= wrong
            if sp.kind == "int":
                s, e, lengths = pieces[sp.name]
                ints, ok = parse_numbers(parsed.buffer, s, e, "int")
                if not ok.all():
                    row = np.repeat(np.arange(parsed.num_rows), lengths)
                    bad[row[~ok]] = True
                pieces[sp.name] = (s, e, lengths, ints)
        overflow = np.zeros(parsed.num_rows, dtype=bool)
        dense_values = {}
        for d in self._dense:
            values, wrong, kept = self._dense_values(parsed, d, sep_pos)
            dense_values[d.name] = (values, kept)
            bad |= wrong
            overflow |= ~(np.abs(values) <= _FLOAT32_MAX).all(axis=1)
        for sp in self._sparse:
            if sp.kind == "bucket" and sp.seq_len:
                s, e, lengths = self._split_values(parsed, sp, sep_pos, bags)
                numbers, ok = parse_numbers(parsed.buffer, s, e, "float")
                row = np.repeat(np.arange(parsed.num_rows), lengths)
                bad[row[~ok]] = True
                overflow[row[~np.isfinite(numbers)]] = True
                pieces[sp.name] = (lengths, numbers)
        overflow &= ~bad
        bad_time = np.zeros(parsed.num_rows, dtype=bool)
        if self._check_event_time:
            t = parsed.numeric[self._event_time_field]
            bad_time = ~((t >= EVENT_TIME_MIN_SECS)
                         & (t <= time.time() + EVENT_TIME_MAX_AHEAD_SECS))
            bad_time &= ~(bad | overflow)
        if bad.any() or overflow.any() or bad_time.any():
            rejected = sorted(rejected + [(int(i), "bad_number") for i in parsed.accepted[bad]]
                              + [(int(i), "non_finite") for i in parsed.accepted[overflow]]
                              + [(int(i), "bad_event_time")
                                 for i in parsed.accepted[bad_time]])
            parsed = parsed.select(~(bad | overflow | bad_time))
            if parsed.num_rows == 0:
                return ArraysResult(None, parsed.accepted, rejected)
            return self._build_parsed(parsed, rejected, raw)
        return self._build_parsed(parsed, rejected, raw, pieces, sep_pos, dense_values,
                                  tag_weights, bags)

    @staticmethod
    def _split_values(parsed: ParsedColumns, sp: PlannedSparse, sep_pos: dict,
                      bags: dict[str, tuple[np.ndarray, np.ndarray]]
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A sparse feature's values: ``(starts, ends, values per row)``.

        Split on its separator, and each piece again on ``seq_multi_sep`` when it has one;
        then ``bags[sp.name]`` gets ``(positions per row, values per position)``.
        """
        s, e, lengths = split_column(parsed, sp.inputs[0], sp.separator, sep_pos[sp.separator])
        if not sp.multi_sep:
            return s, e, lengths
        s, e, per_position = split_ranges(s, e, sp.multi_sep, sep_pos[sp.multi_sep])
        n = parsed.num_rows
        per_row = np.bincount(np.repeat(np.arange(n), lengths), weights=per_position,
                              minlength=n).astype(np.int64)
        bags[sp.name] = (lengths, per_position)
        return s, e, per_row

    def _tag_weights(self, parsed: ParsedColumns, sp: PlannedSparse,
                     pieces: tuple[np.ndarray, np.ndarray, np.ndarray], sep_pos: dict
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Weighted tags: ``(id starts, id ends, lengths, weights, bad rows)``.

        The ids are the tags' pieces (cut at ``kv_separator``); a row whose weight is
        missing, not a number, or not finite, or whose weights column has another count of
        pieces, is bad.
        """
        s, e, lengths = pieces
        n = parsed.num_rows
        row = np.repeat(np.arange(n), lengths)
        bad = np.zeros(n, dtype=bool)
        if sp.kv_separator:
            positions = sep_pos[sp.kv_separator]
            if positions is None or positions.shape[0] == 0:
                k = e.copy()
            else:  # the first kv separator inside each piece
                j = np.searchsorted(positions, s)
                k = np.where(j < positions.shape[0],
                             positions[np.minimum(j, positions.shape[0] - 1)], e)
                k = np.where(k + len(sp.kv_separator) <= e, k, e)
            missing = k >= e
            w, ok = parse_numbers(parsed.buffer, np.minimum(k + len(sp.kv_separator), e), e,
                                  "float")
            bad[row[missing | ~ok | ~np.isfinite(w)]] = True
            e = k
        else:
            ws, we, wlen = split_column(parsed, sp.weights_input, sp.separator,
                                  sep_pos[sp.separator])
            bad |= wlen != lengths
            w = np.ones(s.shape[0], dtype=np.float64)
            same = ~bad[row] if row.shape[0] else np.zeros(0, dtype=bool)
            wrow = np.repeat(np.arange(n), wlen)
            wsame = ~bad[wrow] if wrow.shape[0] else np.zeros(0, dtype=bool)
            parsed_w, ok = parse_numbers(parsed.buffer, ws[wsame], we[wsame], "float")
            w[same] = parsed_w
            bad[row[same][~ok | ~np.isfinite(parsed_w)]] = True
        return s, e, lengths, w, bad

    def _dense_values(self, parsed: ParsedColumns, d: PlannedDense, sep_pos: dict
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A dense feature's ``[n, width]`` values (normalized by ``min_val`` / ``max_val``).

        Returns:
            ``(values, bad, kept)``: the values (0 where absent), the rows whose value is not
            ``width`` numbers (nor empty) or holds a piece that is not a number, and a
            sequence's kept lengths (None for a RawFeature).
        """
        n = parsed.num_rows
        kept = None
        bad = np.zeros(n, dtype=bool)
        if d.expression is not None:  # an ExprFeature: non-finite results are rejected
            with np.errstate(all="ignore"):
                v = d.expression({c: parsed.numeric[c].astype(np.float64, copy=False)
                                  for c in d.inputs})
            return np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)).reshape(n, 1), \
                bad, None
        if not d.separator:
            v = parsed.numeric[d.input].astype(np.float64, copy=False).reshape(n, 1)
        else:
            s, e, lengths = split_column(parsed, d.input, d.separator, sep_pos[d.separator])
            starts = np.cumsum(lengths) - lengths
            pos = np.arange(s.shape[0]) - np.repeat(starts, lengths)
            row = np.repeat(np.arange(n), lengths)
            if d.multi_sep:  # item_width numbers per position
                s, e, per_position = split_ranges(s, e, d.multi_sep, sep_pos[d.multi_sep])
                bad[row[per_position != d.item_width]] = True
                k = np.arange(s.shape[0]) - np.repeat(np.cumsum(per_position) - per_position,
                                                      per_position)
                row = np.repeat(row, per_position)
                pos = np.repeat(pos, per_position) * d.item_width + np.minimum(
                    k, d.item_width - 1)
            numbers, ok = parse_numbers(parsed.buffer, s, e, "float")
            bad[row[~ok]] = True
            if d.sequence:
                kept = np.minimum(lengths, d.width // d.item_width)
            else:
                bad |= (lengths != d.width) & (lengths != 0)
            keep = (pos < d.width) & ~bad[row]
            v = np.zeros((n, d.width), dtype=np.float64)
            v[row[keep], pos[keep]] = numbers[keep]
        if d.normalizer is not None:  # a value it cannot take: NaN, rejected as non_finite
            v = d.normalizer.apply(v)
            if kept is not None:  # padding positions stay 0
                v = np.where(self._kept_columns(d, kept), v, 0.0)
        if d.norm is not None:
            with np.errstate(over="ignore"):
                v = (v - d.norm[0]) / d.norm[1]
            if kept is not None:  # padding positions stay 0
                v = np.where(self._kept_columns(d, kept), v, 0.0)
        return v, bad, kept

    @staticmethod
    def _kept_columns(d: PlannedDense, kept: np.ndarray) -> np.ndarray:
        """``[n, width]``: whether a dense sequence's column is of a kept position."""
        position = np.arange(d.width) // d.item_width
        return position[None, :] < kept[:, None]

    def _separatorsequence_positions(self, raw: bytes) -> dict[bytes, np.ndarray | None]:
        out: dict[bytes, np.ndarray | None] = {}
        for sep in self._seps:
            if raw.find(sep) < 0:
                out[sep] = None
            elif len(sep) == 1:
                out[sep] = np.flatnonzero(np.frombuffer(raw, dtype=np.uint8) == sep[0])
            else:
                out[sep] = np.fromiter(
                    (m.start() for m in re.finditer(re.escape(sep), raw)), dtype=np.int64)
        return out

    def _build_parsed(
        self,
        parsed: ParsedColumns,
        rejected: list[tuple[int, str]],
        raw: bytes,
        pieces: dict | None = None,
        sep_pos: dict | None = None,
        dense_values: dict | None = None,
        tag_weights: dict | None = None,
        bags: dict | None = None,
    ) -> ArraysResult:
        n = parsed.num_rows
        buf = parsed.buffer
        if sep_pos is None:
            sep_pos = self._separatorsequence_positions(raw)
        pieces = dict(pieces or {})
        tag_weights = dict(tag_weights or {})
        bags = dict(bags or {})
        for sp in self._sparse:
            if sp.kind in ("hash", "int", "vocab") and sp.name not in pieces:
                pieces[sp.name] = self._split_values(parsed, sp, sep_pos, bags)
                if sp.weights_input or sp.kv_separator:
                    s, e, lengths, w, _bad = self._tag_weights(parsed, sp, pieces[sp.name],
                                                               sep_pos)
                    pieces[sp.name] = (s, e, lengths)
                    tag_weights[sp.name] = w
            if sp.kind == "bucket" and sp.seq_len and sp.name not in pieces:
                s, e, lengths = self._split_values(parsed, sp, sep_pos, bags)
                pieces[sp.name] = (lengths, parse_numbers(buf, s, e, "float")[0])
            if sp.kind == "int" and len(pieces[sp.name]) == 3:
                s, e, lengths = pieces[sp.name]
                ints, _ = parse_numbers(buf, s, e, "int")
                pieces[sp.name] = (s, e, lengths, ints)
        # Hash every hashed id feature's pieces in one vectorized call.
        hash_feats = [sp for sp in self._sparse if sp.kind in ("hash", "vocab")]
        hashed: dict[str, np.ndarray] = {}
        if hash_feats:
            all_s = np.concatenate([pieces[sp.name][0] for sp in hash_feats])
            all_e = np.concatenate([pieces[sp.name][1] for sp in hash_feats])
            h = hash_segments(buf, all_s, all_e)
            pos = 0
            for sp in hash_feats:
                k = pieces[sp.name][0].shape[0]
                hashed[sp.name] = h[pos : pos + k]
                pos += k
        values_list = []
        lengths_list = []
        weights_list = []
        seq_lengths: dict[str, np.ndarray] = {}
        for sp in self._sparse:
            if sp.kind == "hash":
                _, _, lengths = pieces[sp.name]
                ids = (raw_ids(hashed[sp.name]) if sp.raw_ids
                       else bucketize_hashes(hashed[sp.name], sp.num_rows))
            elif sp.kind == "int":
                _, _, lengths, ints = pieces[sp.name]
                ids = raw_ids(ints) if sp.raw_ids else np.mod(ints, sp.num_rows)
            elif sp.kind == "vocab":
                s, e, lengths = pieces[sp.name]
                ids = sp.vocab.lookup(hashed[sp.name], e - s)
            elif sp.kind == "bucket":
                if sp.seq_len:
                    lengths, v = pieces[sp.name]
                else:
                    v = parsed.numeric[sp.inputs[0]]
                    lengths = np.ones(n, dtype=np.int64)
                if sp.normalizer is not None:  # NaN sorts past every boundary: last bucket
                    v = sp.normalizer.apply(v)
                if sp.norm is not None:
                    v = (v - sp.norm[0]) / sp.norm[1]
                ids = np.searchsorted(sp.boundaries, v, side="right").astype(np.int64)
            elif sp.kind == "lookup":
                ids, lengths = lookup_ids(parsed, sp, sep_pos)
            else:
                ids, lengths = combo_ids(parsed, sp, sep_pos)
            if sp.seq_len and sp.name in bags:
                positions, per_position = bags[sp.name]
                ids, lengths, kept = sequence_positions(ids, positions, sp.seq_len,
                                                        per_position)
                seq_lengths[sp.name] = kept
            elif sp.seq_len:
                ids, lengths, kept = sequence_positions(ids, lengths, sp.seq_len)
                seq_lengths[sp.name] = kept
            values_list.append(ids)
            lengths_list.append(lengths)
            if self._weighted:
                weights_list.append(bag_weights(tag_weights.get(sp.name), lengths, sp.mean))
        values = np.concatenate(values_list) if values_list else np.zeros(0, dtype=np.int64)
        lengths = (np.concatenate(lengths_list) if lengths_list
                   else np.zeros(0, dtype=np.int64)).astype(np.int32)
        if self._dense or self._seq_lengths:
            widths = [d.width for d in self._dense]
            dense_np = np.empty((n, sum(widths) + len(self._seq_lengths)), dtype=np.float32)
            col = 0
            for d in self._dense:
                if dense_values is not None and d.name in dense_values:
                    numbers, kept = dense_values[d.name]
                else:
                    numbers, _bad, kept = self._dense_values(parsed, d, sep_pos)
                dense_np[:, col : col + d.width] = numbers
                col += d.width
                if kept is not None:
                    seq_lengths[d.name] = kept
            for j, name in enumerate(self._seq_lengths, start=col):
                dense_np[:, j] = seq_lengths[name]
        else:
            dense_np = np.zeros((n, 0), dtype=np.float32)
        arrays = BatchArrays(
            values=np.ascontiguousarray(values, dtype=np.int64),
            lengths=lengths,
            dense=dense_np,
            labels=self._label_array(parsed),
            sample_ids=parsed.texts(self._sample_id_field) if self._sample_id_field else None,
            event_times=(parsed.numeric[self._event_time_field].astype(np.float64)
                         if self._check_event_time else None),
            counts=({f: parsed.numeric[f].astype(np.float32) for f in self._count_fields}
                    if self._count_fields else None),
            group_keys=(hash_segments(buf, parsed.starts[self._group_field],
                                      parsed.ends[self._group_field]).astype(np.int64)
                        if self._group_field else None),
            weights=(np.concatenate(weights_list).astype(np.float32) if self._weighted
                     else None),
            session_keys=(hash_segments(buf, parsed.starts[self._session_field],
                                        parsed.ends[self._session_field]).astype(np.int64)
                          if self._session_field else None),
            sample_weights=(parsed.numeric[self._weight_field].astype(np.float32)
                            if self._weight_field else None),
            label_vectors=({n: parsed.numeric[n] for n in self._vector_labels}
                           if self._vector_labels else None),
        )
        return ArraysResult(arrays, parsed.accepted, rejected)

    def _label_array(self, parsed: ParsedColumns) -> np.ndarray:
        """``[B]`` (one label), ``[B, n]`` (n label fields) or ``[B, C]`` one-hot (C classes)."""
        if self._classes > 1:
            index = parsed.numeric[self._label].astype(np.int64)
            out = np.zeros((index.shape[0], self._classes), dtype=np.float32)
            out[np.arange(index.shape[0]), index] = 1.0
            return out
        if len(self._labels) == 1:
            return parsed.numeric[self._label].astype(np.float32)
        return np.stack([parsed.numeric[lf] for lf in self._labels], axis=1).astype(np.float32)
