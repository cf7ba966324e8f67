"""Turns raw records into model batches: parse, hash / bucketize, pack as a KeyedJaggedTensor.

Feature kinds (``FeatureConfig.feature_type``):

* ``IdFeature`` with ``hash_bucket_size``: row = ``fnv1a64(utf8(value)) % hash_bucket_size``
  (``odl.features.id_hashing``; the value's text as it appears in the record).
* ``IdFeature`` with ``num_buckets``: row = ``int(value) % num_buckets`` (Python modulo, so
  negative ids wrap to ``[0, num_buckets)``); a value that is not a decimal integer rejects
  the record as ``bad_number``.
* ``IdFeature`` with ``vocab_list`` / ``vocab_file``: row = the value's index in the
  vocabulary, 0 for a value not in it (EasyRec's ``default_value=0``); a table of one row
  per entry (``odl.config.feature_settings``). Values are matched by their FNV-1a 64 hash
  and byte length.
* All IdFeature forms are multi-valued: the value is split on the feature's ``separator``
  (default ``|``), empty pieces are dropped; an empty value gives no id (a zero-length bag,
  pooled to zeros).
* ``RawFeature`` with ``max_val > min_val``: the value is first normalized to
  ``(x - min_val) / (max_val - min_val)`` (not clipped).
* ``RawFeature`` without ``boundaries``: one float32 column of ``Batch.dense``; a value
  beyond float32's range (it would reach the model as inf) rejects the record as
  ``non_finite``.
* ``RawFeature`` with ``raw_input_dim`` d > 1 (TorchEasyRec's ``value_dim``): a STRING
  column of d numbers split on the feature's ``separator`` (a JSON list is joined with it),
  d float32 columns of ``Batch.dense`` (:func:`dense_columns`: ``"<feature>#<k>"``); an
  empty value reads d zeros, any other count of numbers rejects the record as
  ``bad_number``.
* ``RawFeature`` with ``boundaries``: row = ``searchsorted(boundaries, value, side="right")``
  in a table of ``len(boundaries) + 1`` rows (bucket i is ``[b[i-1], b[i])``).
* ``SequenceFeature`` (of ids: ``sub_feature_type`` IdFeature): its ids as an IdFeature's,
  the first ``max_seq_len`` (default :data:`DEFAULT_MAX_SEQ_LEN`) kept in order, each
  position its own KJT key (:func:`sequence_key`: ``"<feature>#<position>"``, an id or an
  empty bag) looked up in the feature's table, and the kept length a ``Batch.dense`` column
  (:func:`sequence_length_column`: ``"<feature>#len"``, after the dense raw features). DIN
  towers read them (``odl.models.tower_models``).
* ``SequenceFeature`` of numbers (``sub_feature_type`` RawFeature): with ``boundaries``, each
  number bucketized as a RawFeature's and the buckets embedded as a sequence of ids (above);
  without, the first ``max_seq_len`` numbers are ``max_seq_len`` dense columns
  (``"<feature>#<position>"``, 0 past the sequence's end) and the kept length its
  ``"<feature>#len"`` column. A piece that is not a number rejects the record as
  ``bad_number``.
* Weighted tags (EasyRec's TagFeature with a second input of weights, or with
  ``kv_separator``: pieces ``tag<kv_separator>weight``): the ids as above, each with its
  weight (a number; a missing or non-numeric weight, or a weights column with another count
  of pieces than the tags column, rejects the record as ``bad_number``). A batch of a config
  with weighted tags carries per-value weights for every feature (``Batch.sparse.weights()``)
  and every table is sum-pooled over them: a weighted feature's values weigh their weight
  (``combiner: mean``: weight / the bag's sum of weights, EasyRec's weighted mean), the other
  features' values 1 (``mean``: 1 / the bag's length), so sum and mean features keep their
  pooling. (:attr:`FeatureBuilder.weighted`.)
* ``ComboFeature``: row = ``fnv1a64(v1 + combo_join_sep + v2 + ...) % hash_bucket_size`` over
  the input values' texts (not split); no id when any input is empty.
* Features of a *dynamic* table (``ev_params`` / ``zch`` / ``ctr_accessor_param``, see
  ``odl.config.dynamic_table_config``) are not reduced to a bucket: their ids are *raw ids*
  in ``[0, 2**63)``, the 63 low bits of the FNV-1a hash for hashed and combo features, the
  integer itself for ``num_buckets`` features (a negative integer keeps its 63 low bits, so
  -1 becomes 2**63 - 1) and the vocabulary index for vocabulary features. The trainer and
  serving map raw ids to rows (``odl.models.dynamic``, ``odl.features.raw_id_index``).

Tables: features with the same ``embedding_name`` share one table (their row count and
dimension must agree); otherwise a feature's table is named after the feature.

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

import dataclasses
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from odl.config.config_error import ConfigError
from odl.config.dynamic_table_config import DynamicTableSpec, dynamic_table_spec
from odl.config.feature_configs import feature_configs
from odl.config.feature_settings import has_vocabulary, normalizes, read_vocabulary
from odl.config.loss_settings import jrc_session_field, num_classes, real_valued_labels
from odl.config.metric_settings import grouped_auc_field
from odl.features.id_hashing import FNV64_PRIME, bucketize_hashes, hash_segments, pack_strings
from odl.features.raw_id_index import RAW_ID_MASK
from odl.features.record_parser import ParsedColumns, RecordParser, parse_numbers
from odl.protos import pipeline_pb2

if TYPE_CHECKING:
    from odl.features.batch import Batch

logger = logging.getLogger(__name__)

_FT = pipeline_pb2.FeatureConfig.FeatureType
_DT = pipeline_pb2.DatasetConfig.FieldType
# Dense inputs reach the model as float32: a finite float64 beyond this would become inf.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# The event time window (unix seconds): 2000-01-01T00:00:00Z up to one day ahead of now.
EVENT_TIME_MIN_SECS = 946_684_800.0
EVENT_TIME_MAX_AHEAD_SECS = 86_400.0
# At most one "unprocessable record" traceback per this many seconds (per process).
_GUARD_LOG_INTERVAL_SECS = 30.0


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the features define it.

    Attributes:
        name: table name (``embedding_name``, or the feature name when unset).
        num_rows: number of rows (hash_bucket_size, num_buckets or len(boundaries) + 1).
        dim: embedding dimension (0 when no feature gave one, e.g. wide-only features).
        feature_names: features looked up in this table, in config order.
        pooling: ``"sum"`` or ``"mean"`` (the features' ``combiner``; always ``"sum"`` in
            a weighted batch, whose weights carry the means).
        dynamic: the admission / eviction settings of a dynamic table (its features give
            raw ids and ``num_rows`` is its capacity); None for a fixed table.
        weighted: looked up with the batch's per-value weights (every table of a config with
            weighted tags).
    """

    name: str
    num_rows: int
    dim: int
    feature_names: tuple[str, ...]
    pooling: str = "sum"
    dynamic: DynamicTableSpec | None = None
    weighted: bool = False


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


# SequenceFeature: positions kept when max_seq_len is 0
DEFAULT_MAX_SEQ_LEN = 50


def sequence_key(feature: str, position: int) -> str:
    """The KJT key of position ``position`` of SequenceFeature ``feature``."""
    return f"{feature}#{position}"


def sequence_length_column(feature: str) -> str:
    """The ``Batch.dense`` column holding SequenceFeature ``feature``'s length."""
    return f"{feature}#len"


def dense_columns(feature: str, width: int) -> list[str]:
    """The ``Batch.dense`` columns of a dense feature ``width`` values wide.

    A one-value RawFeature's column is the feature's name; a wider one's (``raw_input_dim``,
    or a dense sequence's positions) are ``"<feature>#<k>"``.
    """
    return [feature] if width == 1 else [f"{feature}#{k}" for k in range(width)]


@dataclass(frozen=True)
class _Dense:
    name: str
    input: str
    width: int = 1  # values per record: raw_input_dim, or a dense sequence's positions
    separator: bytes = b""  # splits a value of several numbers (width > 1 or a sequence)
    sequence: bool = False  # a SequenceFeature of numbers (kept length: its own column)
    norm: tuple[float, float] | None = None  # (min_val, max_val - min_val)

    @property
    def columns(self) -> list[str]:
        """Its ``Batch.dense`` columns."""
        return dense_columns(self.name, self.width)


@dataclass(frozen=True)
class _Sparse:
    name: str
    kind: str  # "hash" | "int" | "vocab" | "bucket" | "combo"
    inputs: tuple[str, ...]
    num_rows: int
    separator: bytes = b""
    combo_sep: bytes = b""
    boundaries: np.ndarray | None = None
    raw_ids: bool = False
    vocab: _Vocabulary | None = None
    norm: tuple[float, float] | None = None  # (min_val, max_val - min_val)
    seq_len: int = 0  # SequenceFeature: positions kept (one KJT key each); 0: not one
    mean: bool = False  # combiner mean (a weighted batch's weights carry it)
    weights_input: str = ""  # weighted tags: the column of the weights
    kv_separator: bytes = b""  # weighted tags: tag<kv>weight pieces

    @property
    def keys(self) -> list[str]:
        """Its KJT keys: the feature, or one per position of a sequence."""
        if self.seq_len:
            return [sequence_key(self.name, p) for p in range(self.seq_len)]
        return [self.name]


@dataclass(frozen=True)
class _Vocabulary:
    """A vocabulary as sorted FNV-1a 64 hashes with the byte length and row of each entry."""

    hashes: np.ndarray  # uint64, ascending
    lengths: np.ndarray  # int64
    rows: np.ndarray  # int64

    @classmethod
    def of(cls, entries: list[str], where: str) -> _Vocabulary:
        buf, starts, ends = pack_strings(entries)
        h = hash_segments(buf, starts, ends)
        order = np.argsort(h, kind="stable")
        h = h[order]
        if h.shape[0] > 1 and np.any(h[1:] == h[:-1]):
            raise ConfigError(where, "two vocabulary entries have the same FNV-1a 64 hash")
        return cls(h, (ends - starts)[order], order.astype(np.int64))

    def lookup(self, h: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rows of the values with hashes ``h`` and byte lengths ``lengths`` (0 when absent)."""
        pos = np.minimum(np.searchsorted(self.hashes, h), self.hashes.shape[0] - 1)
        found = (self.hashes[pos] == h) & (self.lengths[pos] == lengths)
        return np.where(found, self.rows[pos], 0).astype(np.int64)


class FeatureBuilder:
    """Builds ``Batch``es from raw record bytes according to a pipeline config.

    Args:
        pipeline_config: the pipeline config (``data_config`` and the features).
        max_record_bytes: records longer than this are rejected as ``oversized``.
        check_event_time: reject records whose event time is outside the window (see the
            module docstring); serving, which never reads event times, passes False.

    Raises:
        ConfigError: a feature or the data config is inconsistent.
    """

    def __init__(
        self,
        pipeline_config: pipeline_pb2.EasyRecConfig,
        max_record_bytes: int = 1 << 20,
        check_event_time: bool = True,
    ) -> None:
        dc = pipeline_config.data_config
        field_types = {f.input_name: f.input_type for f in dc.input_fields}
        if not dc.label_fields:
            raise ConfigError("data_config.label_fields", "at least one label field is needed")
        if len(set(dc.label_fields)) != len(dc.label_fields):
            raise ConfigError("data_config.label_fields",
                              f"label fields repeat: {list(dc.label_fields)}")
        self._labels = list(dc.label_fields)
        self._label = self._labels[0]
        self._sample_id_field = dc.sample_id_field
        self._group_field = grouped_auc_field(pipeline_config)
        self._session_field = jrc_session_field(pipeline_config)
        self._event_time_field = dc.event_time_field
        self._check_event_time = bool(check_event_time and dc.event_time_field)
        for fname, path in (*((lf, "data_config.label_fields") for lf in self._labels),
                            (dc.sample_id_field, "data_config.sample_id_field"),
                            (dc.event_time_field, "data_config.event_time_field")):
            if fname and fname not in field_types:
                raise ConfigError(path, f"{fname!r} is not one of data_config.input_fields")

        self._sparse: list[_Sparse] = []
        self._dense: list[_Dense] = []
        self._seq_lengths: list[str] = []  # SequenceFeatures: a length column each
        tables: dict[str, dict] = {}
        numeric_fields: list[str] = []
        list_seps: dict[str, str] = {}
        seen: set[str] = set()
        mc = pipeline_config.model_config
        model_ev = mc.ev_params if mc.HasField("ev_params") else None
        for i, fc in enumerate(feature_configs(pipeline_config)):
            path = f"feature_configs[{i}]"
            name = fc.feature_name
            dyn = dynamic_table_spec(fc, model_ev, path)
            if not fc.input_names:
                raise ConfigError(f"{path}.input_names", "a feature needs at least one input")
            if name in seen:
                raise ConfigError(f"{path}.feature_name", f"duplicate feature name {name!r}")
            seen.add(name)
            for inp in fc.input_names:
                if inp not in field_types:
                    raise ConfigError(
                        f"{path}.input_names", f"{inp!r} is not one of data_config.input_fields")
            for inp in fc.input_names:
                if field_types[inp] != _DT.STRING:
                    numeric_fields.append(inp)
            inp0 = fc.input_names[0]
            raw_sequence = (fc.feature_type == _FT.SequenceFeature
                            and fc.sub_feature_type == _FT.RawFeature)
            if fc.feature_type == _FT.RawFeature or raw_sequence:
                width = 1 if raw_sequence else int(fc.raw_input_dim)
                if width < 1 or (raw_sequence and fc.raw_input_dim != 1):
                    raise ConfigError(f"{path}.raw_input_dim",
                                      "must be at least 1 (1 for a SequenceFeature)")
                listed = width > 1 or raw_sequence
                if listed:
                    if field_types[inp0] != _DT.STRING:
                        raise ConfigError(
                            f"{path}.input_names",
                            f"{inp0!r} holds several numbers split on the separator "
                            f"{fc.separator!r}: its input field must be STRING")
                    if not fc.separator:
                        raise ConfigError(f"{path}.separator", "must not be empty")
                    list_seps[inp0] = fc.separator
                else:
                    numeric_fields.append(inp0)
                norm = ((float(fc.min_val), float(fc.max_val) - float(fc.min_val))
                        if normalizes(fc) else None)
                seq_len = (int(fc.max_seq_len or DEFAULT_MAX_SEQ_LEN) if raw_sequence else 0)
                if not fc.boundaries:
                    self._dense.append(_Dense(
                        name, inp0, seq_len or width,
                        separator=fc.separator.encode() if listed else b"",
                        sequence=raw_sequence, norm=norm))
                    if raw_sequence:
                        self._seq_lengths.append(name)
                    continue
                if width > 1:
                    raise ConfigError(f"{path}.raw_input_dim",
                                      "a RawFeature with boundaries buckets one number")
                b = np.asarray(list(fc.boundaries), dtype=np.float64)
                if np.any(np.diff(b) <= 0):
                    raise ConfigError(f"{path}.boundaries", "must be strictly ascending")
                if raw_sequence:
                    self._seq_lengths.append(name)
                sp = _Sparse(name, "bucket", (inp0,), len(b) + 1, boundaries=b, norm=norm,
                             separator=fc.separator.encode() if raw_sequence else b"",
                             seq_len=seq_len)
            elif fc.feature_type in (_FT.IdFeature, _FT.SequenceFeature):
                if (fc.feature_type == _FT.SequenceFeature
                        and fc.sub_feature_type != _FT.IdFeature):
                    raise ConfigError(f"{path}.sub_feature_type",
                                      "a SequenceFeature holds ids (IdFeature) or numbers "
                                      "(RawFeature)")
                vocab = None
                if has_vocabulary(fc):
                    if fc.hash_bucket_size or fc.num_buckets:
                        raise ConfigError(
                            f"{path}.hash_bucket_size",
                            "give one of hash_bucket_size, num_buckets, vocab_list, vocab_file")
                    vocab = _Vocabulary.of(read_vocabulary(fc, path), f"{path}.vocab_list")
                elif bool(fc.hash_bucket_size) == bool(fc.num_buckets) and not (
                        dyn is not None and not fc.num_buckets):
                    raise ConfigError(
                        f"{path}.hash_bucket_size",
                        "an IdFeature needs exactly one of hash_bucket_size or num_buckets")
                if not fc.separator:
                    raise ConfigError(f"{path}.separator", "must not be empty")
                kind = "hash" if fc.hash_bucket_size else "int"
                rows = int(fc.hash_bucket_size or fc.num_buckets)
                if vocab is not None:
                    kind, rows = "vocab", int(vocab.rows.shape[0])
                if dyn is not None:
                    if vocab is None:
                        kind = "int" if fc.num_buckets and not fc.hash_bucket_size else "hash"
                    rows = dyn.capacity
                seq_len = 0
                if fc.feature_type == _FT.SequenceFeature:
                    pad = (fc.sequence_combiner.text_cnn.pad_sequence_length
                           if fc.sequence_combiner.HasField("text_cnn") else 0)
                    seq_len = int(fc.max_seq_len or pad or DEFAULT_MAX_SEQ_LEN)
                    self._seq_lengths.append(name)
                weights_input = fc.input_names[1] if len(fc.input_names) > 1 else ""
                if (weights_input or fc.kv_separator) and (seq_len or dyn is not None):
                    raise ConfigError(f"{path}.input_names",
                                      "weighted tags are not implemented for a SequenceFeature "
                                      "or a dynamic table")
                if weights_input and fc.kv_separator:
                    raise ConfigError(f"{path}.kv_separator",
                                      "give the weights in a second input or with "
                                      "kv_separator, not both")
                sp = _Sparse(name, kind, (inp0,), rows, separator=fc.separator.encode(),
                             raw_ids=dyn is not None, vocab=vocab, seq_len=seq_len,
                             weights_input=weights_input,
                             kv_separator=fc.kv_separator.encode())
                list_seps[inp0] = fc.separator
                if weights_input:
                    list_seps[weights_input] = fc.separator
            elif fc.feature_type == _FT.ComboFeature:
                if not fc.hash_bucket_size and dyn is None:
                    raise ConfigError(f"{path}.hash_bucket_size", "a ComboFeature needs it")
                rows = dyn.capacity if dyn is not None else int(fc.hash_bucket_size)
                sp = _Sparse(name, "combo", tuple(fc.input_names), rows,
                             combo_sep=fc.combo_join_sep.encode(), raw_ids=dyn is not None)
            else:
                raise ConfigError(f"{path}.feature_type", "unsupported feature type")
            if fc.combiner not in ("sum", "mean"):
                raise ConfigError(f"{path}.combiner", f"expected sum or mean, got {fc.combiner!r}")
            if fc.combiner == "mean":  # every kind of feature: a weighted batch's mean
                sp = dataclasses.replace(sp, mean=True)
            self._sparse.append(sp)
            tname = fc.embedding_name or name
            t = tables.setdefault(
                tname, {"rows": sp.num_rows, "dim": 0, "features": [], "pooling": fc.combiner,
                        "dynamic": dyn})
            if t["dynamic"] != dyn:
                raise ConfigError(
                    f"{path}.embedding_name",
                    f"table {tname!r} is shared by features with different dynamic-table "
                    "settings (ev_params / zch / ctr_accessor_param must agree)")
            if t["rows"] != sp.num_rows:
                raise ConfigError(
                    f"{path}.embedding_name",
                    f"table {tname!r} is shared by features with different row counts "
                    f"({t['rows']} vs {sp.num_rows})")
            if fc.embedding_dim:
                if t["dim"] and t["dim"] != fc.embedding_dim:
                    raise ConfigError(
                        f"{path}.embedding_dim",
                        f"table {tname!r} is shared by features with different dims "
                        f"({t['dim']} vs {fc.embedding_dim})")
                t["dim"] = int(fc.embedding_dim)
            if t["pooling"] != fc.combiner:
                raise ConfigError(f"{path}.combiner",
                                  f"table {tname!r} is shared by features with different combiners")
            t["features"].extend(sp.keys)
        self._count_fields: list[str] = []
        for tname, t in tables.items():
            dyn = t["dynamic"]
            for attr in ("show_field", "click_field"):
                f = getattr(dyn, attr, "") if dyn is not None else ""
                if not f:
                    continue
                if f not in field_types or field_types[f] == _DT.STRING:
                    raise ConfigError(
                        f"ctr_accessor_param.{attr}",
                        f"table {tname!r}: {f!r} must be a numeric data_config.input_fields "
                        "field")
                numeric_fields.append(f)
                if f not in self._count_fields:
                    self._count_fields.append(f)
        self._weighted = any(sp.weights_input or sp.kv_separator for sp in self._sparse)
        self._tables = [
            TableSpec(n, t["rows"], t["dim"], tuple(t["features"]),
                      "sum" if self._weighted else t["pooling"], t["dynamic"], self._weighted)
            for n, t in tables.items()
        ]
        self._feature_to_table = {f: t.name for t in self._tables for f in t.feature_names}
        if self._check_event_time:
            numeric_fields.append(self._event_time_field)
        self._parser = RecordParser(
            dc,
            max_record_bytes=max_record_bytes,
            list_separators=list_seps,
            numeric_fields=list(dict.fromkeys(numeric_fields)),
            real_labels=sorted(real_valued_labels(pipeline_config)),
            class_labels=({self._label: num_classes(pipeline_config)}
                          if num_classes(pipeline_config) > 1 else None),
        )
        self._classes = num_classes(pipeline_config)
        self._seps = sorted({sp.separator for sp in self._sparse if sp.separator
                             and sp.kind in ("hash", "int", "vocab", "bucket")}
                            | {d.separator for d in self._dense if d.separator}
                            | {sp.kv_separator for sp in self._sparse if sp.kv_separator})
        self._last_guard_log = -_GUARD_LOG_INTERVAL_SECS

    # -- introspection ----------------------------------------------------------------------

    @property
    def sparse_feature_names(self) -> list[str]:
        """KJT keys: embedded features in config order, a SequenceFeature one per position."""
        return [k for sp in self._sparse for k in sp.keys]

    @property
    def dense_feature_names(self) -> list[str]:
        """``Batch.dense`` columns: the dense features', then each SequenceFeature's length."""
        return [c for d in self._dense for c in d.columns] + [sequence_length_column(n)
                                                              for n in self._seq_lengths]

    @property
    def weighted(self) -> bool:
        """Whether batches carry per-value weights (the config has weighted tags)."""
        return self._weighted

    @property
    def dense_feature_columns(self) -> dict[str, list[str]]:
        """Dense feature name -> its columns (one, ``raw_input_dim``, or positions)."""
        return {d.name: d.columns for d in self._dense}

    @property
    def sequence_features(self) -> dict[str, int]:
        """SequenceFeature name -> positions kept (``max_seq_len``), embedded and dense."""
        out = {sp.name: sp.seq_len for sp in self._sparse if sp.seq_len}
        out.update(self.dense_sequence_features)
        return out

    @property
    def dense_sequence_features(self) -> dict[str, int]:
        """SequenceFeatures of numbers without boundaries -> positions (dense columns)."""
        return {d.name: d.width for d in self._dense if d.sequence}

    @property
    def table_specs(self) -> list[TableSpec]:
        """Embedding tables, in order of first use."""
        return list(self._tables)

    @property
    def feature_to_table(self) -> dict[str, str]:
        """Embedded feature name -> table name."""
        return dict(self._feature_to_table)

    @property
    def label_field(self) -> str:
        """The first label column."""
        return self._label

    @property
    def label_fields(self) -> list[str]:
        """The label columns (``Batch.labels`` is ``[B]`` for one, ``[B, n]`` for several)."""
        return list(self._labels)

    @property
    def parser(self) -> RecordParser:
        """The record parser used by ``build``."""
        return self._parser

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
        sep_pos = self._separator_positions(raw)
        pieces = {}
        bad = np.zeros(parsed.num_rows, dtype=bool)
        tag_weights: dict[str, np.ndarray] = {}
        for sp in self._sparse:
            if sp.kind in ("hash", "int", "vocab"):
                pieces[sp.name] = _split(parsed, sp.inputs[0], sp.separator, sep_pos[sp.separator])
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
                s, e, lengths = _split(parsed, sp.inputs[0], sp.separator, sep_pos[sp.separator])
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
                                  tag_weights)

    def _tag_weights(self, parsed: ParsedColumns, sp: _Sparse,
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
            ws, we, wlen = _split(parsed, sp.weights_input, sp.separator,
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

    def _dense_values(self, parsed: ParsedColumns, d: _Dense, sep_pos: dict
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
        if not d.separator:
            v = parsed.numeric[d.input].astype(np.float64, copy=False).reshape(n, 1)
        else:
            s, e, lengths = _split(parsed, d.input, d.separator, sep_pos[d.separator])
            numbers, ok = parse_numbers(parsed.buffer, s, e, "float")
            row = np.repeat(np.arange(n), lengths)
            bad[row[~ok]] = True
            starts = np.cumsum(lengths) - lengths
            pos = np.arange(numbers.shape[0]) - np.repeat(starts, lengths)
            if d.sequence:
                kept = np.minimum(lengths, d.width)
            else:
                bad |= (lengths != d.width) & (lengths != 0)
            keep = (pos < d.width) & ~bad[row]
            v = np.zeros((n, d.width), dtype=np.float64)
            v[row[keep], pos[keep]] = numbers[keep]
        if d.norm is not None:
            with np.errstate(over="ignore"):
                v = (v - d.norm[0]) / d.norm[1]
            if kept is not None:  # padding positions stay 0
                v = np.where(np.arange(d.width)[None, :] < kept[:, None], v, 0.0)
        return v, bad, kept

    def _separator_positions(self, raw: bytes) -> dict[bytes, np.ndarray | None]:
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
    ) -> ArraysResult:
        n = parsed.num_rows
        buf = parsed.buffer
        if sep_pos is None:
            sep_pos = self._separator_positions(raw)
        pieces = dict(pieces or {})
        tag_weights = dict(tag_weights or {})
        for sp in self._sparse:
            if sp.kind in ("hash", "int", "vocab") and sp.name not in pieces:
                pieces[sp.name] = _split(parsed, sp.inputs[0], sp.separator, sep_pos[sp.separator])
                if sp.weights_input or sp.kv_separator:
                    s, e, lengths, w, _bad = self._tag_weights(parsed, sp, pieces[sp.name],
                                                               sep_pos)
                    pieces[sp.name] = (s, e, lengths)
                    tag_weights[sp.name] = w
            if sp.kind == "bucket" and sp.seq_len and sp.name not in pieces:
                s, e, lengths = _split(parsed, sp.inputs[0], sp.separator, sep_pos[sp.separator])
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
                ids = (_raw_ids(hashed[sp.name]) if sp.raw_ids
                       else bucketize_hashes(hashed[sp.name], sp.num_rows))
            elif sp.kind == "int":
                _, _, lengths, ints = pieces[sp.name]
                ids = _raw_ids(ints) if sp.raw_ids else np.mod(ints, sp.num_rows)
            elif sp.kind == "vocab":
                s, e, lengths = pieces[sp.name]
                ids = sp.vocab.lookup(hashed[sp.name], e - s)
            elif sp.kind == "bucket":
                if sp.seq_len:
                    lengths, v = pieces[sp.name]
                else:
                    v = parsed.numeric[sp.inputs[0]]
                    lengths = np.ones(n, dtype=np.int64)
                if sp.norm is not None:
                    v = (v - sp.norm[0]) / sp.norm[1]
                ids = np.searchsorted(sp.boundaries, v, side="right").astype(np.int64)
            else:
                ids, lengths = self._combo(parsed, sp)
            if sp.seq_len:
                ids, lengths, kept = _positions(ids, lengths, sp.seq_len)
                seq_lengths[sp.name] = kept
            values_list.append(ids)
            lengths_list.append(lengths)
            if self._weighted:
                weights_list.append(_bag_weights(tag_weights.get(sp.name), lengths, sp.mean))
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

    def _combo(self, parsed: ParsedColumns, sp: _Sparse) -> tuple[np.ndarray, np.ndarray]:
        buf = parsed.buffer
        n = parsed.num_rows
        nonempty = np.ones(n, dtype=bool)
        h = None
        prime = np.uint64(FNV64_PRIME)
        for k, inp in enumerate(sp.inputs):
            s, e = parsed.starts[inp], parsed.ends[inp]
            nonempty &= e > s
            if k > 0:
                for byte in sp.combo_sep:
                    h = (h ^ np.uint64(byte)) * prime
            h = hash_segments(buf, s, e, init=h)
        ids = _raw_ids(h[nonempty]) if sp.raw_ids else bucketize_hashes(h[nonempty], sp.num_rows)
        return ids, nonempty.astype(np.int64)


def _positions(ids: np.ndarray, lengths: np.ndarray,
               seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sequence's ids by position: the KJT values and lengths of its ``seq_len`` keys.

    Args:
        ids: the sequence's ids, sample after sample.
        lengths: ids per sample.
        seq_len: positions kept (the first ones).

    Returns:
        ``(values, lengths, kept)``: position-major values (position 0's id of every sample
        that has one, then position 1's, ...), ``[seq_len * B]`` lengths (0 or 1) in the same
        order, and the kept length per sample.
    """
    lengths = lengths.astype(np.int64)
    n = lengths.shape[0]
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(ids.shape[0]) - np.repeat(starts, lengths)
    sample = np.repeat(np.arange(n), lengths)
    keep = pos < seq_len
    order = np.lexsort((sample[keep], pos[keep]))  # position-major, samples in order
    kept = np.minimum(lengths, seq_len)
    per_key = (kept[None, :] > np.arange(seq_len)[:, None]).astype(np.int64).reshape(-1)
    return ids[keep][order], per_key, kept


def _bag_weights(weights: np.ndarray | None, lengths: np.ndarray, mean: bool) -> np.ndarray:
    """Per-value weights of one feature in a weighted batch (module docstring).

    Args:
        weights: the values' own weights (weighted tags), or None (1 each).
        lengths: values per bag.
        mean: the feature's combiner is ``mean``: each weight divided by its bag's sum.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    w = (np.ones(int(lengths.sum()), dtype=np.float64) if weights is None
         else np.asarray(weights, dtype=np.float64))
    if not mean or w.shape[0] == 0:
        return w
    bag = np.repeat(np.arange(lengths.shape[0]), lengths)
    total = np.bincount(bag, weights=w, minlength=lengths.shape[0])
    denom = total[bag]
    return np.divide(w, denom, out=np.zeros_like(w), where=denom != 0)


def _raw_ids(values: np.ndarray) -> np.ndarray:
    """The 63 low bits of hashes or integers as ``int64`` raw ids (module docstring)."""
    return (np.asarray(values).astype(np.uint64) & np.uint64(RAW_ID_MASK)).astype(np.int64)


def _split(
    parsed: ParsedColumns, inp: str, sep: bytes, positions: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits column ``inp`` on ``sep``; returns (piece starts, piece ends, pieces per row).

    Empty pieces are dropped, so an empty value has no pieces.
    """
    s, e = parsed.starts[inp], parsed.ends[inp]
    if positions is not None and positions.shape[0]:
        lo = np.searchsorted(positions, s)
        hi = np.searchsorted(positions, e - len(sep) + 1)
        cnt = np.maximum(hi - lo, 0)
    else:
        cnt = None
    if cnt is None or not cnt.any():
        nonempty = e > s
        return s[nonempty], e[nonempty], nonempty.astype(np.int64)
    npieces = cnt + 1
    total = int(npieces.sum())
    first = np.cumsum(npieces) - npieces
    k = np.arange(total) - np.repeat(first, npieces)
    pidx = np.repeat(lo, npieces) + k
    last = positions.shape[0] - 1
    ps = np.where(k == 0, np.repeat(s, npieces),
                  positions[np.clip(pidx - 1, 0, last)] + len(sep))
    pe = np.where(k == np.repeat(cnt, npieces), np.repeat(e, npieces),
                  positions[np.clip(pidx, 0, last)])
    keep = pe > ps
    row = np.repeat(np.arange(s.shape[0]), npieces)
    lengths = np.bincount(row[keep], minlength=s.shape[0]).astype(np.int64)
    return ps[keep], pe[keep], lengths
