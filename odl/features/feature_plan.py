"""The feature plan: what each configured feature becomes, read once when it is made.

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
* ``seq_multi_sep`` (a SequenceFeature's values per position, EasyRec's): each position
  (piece on ``separator``) is split again on it. Ids and bucketized numbers: the position's
  key holds them all, a bag pooled by the table's combiner (an empty piece: an empty bag).
  Numbers without boundaries: ``raw_input_dim`` numbers per position, the columns
  ``"<feature>#<position * raw_input_dim + k>"``; another count rejects the record as
  ``bad_number``.
* Weighted tags (EasyRec's TagFeature with a second input of weights, or with
  ``kv_separator``: pieces ``tag<kv_separator>weight``): the ids as above, each with its
  weight (a number; a missing or non-numeric weight, or a weights column with another count
  of pieces than the tags column, rejects the record as ``bad_number``). A batch of a config
  with weighted tags carries per-value weights for every feature (``Batch.sparse.weights()``)
  and every table is sum-pooled over them: a weighted feature's values weigh their weight
  (``combiner: mean``: weight / the bag's sum of weights, EasyRec's weighted mean), the other
  features' values 1 (``mean``: 1 / the bag's length), so sum and mean features keep their
  pooling. (:attr:`FeaturePlan.weighted`.)
* ``LookupFeature`` (inputs: key, map): the map's pieces (on ``separator``) are
  ``key<kv_separator>value``; the values of the pieces whose key is the record's key text,
  the first ``lookup_max_sel_elem_num``, are hashed as an IdFeature's (a piece without
  ``kv_separator`` selects nothing).
* ``ExprFeature``: one dense column, EasyRec's expression over the input columns read as
  numbers (:mod:`odl.config.expr_feature`); a result that is not finite rejects the record
  as ``non_finite``.
* ``ComboFeature``: row = ``fnv1a64(v1 + combo_join_sep + v2 + ...) % hash_bucket_size`` over
  the input values' texts (not split); no id when any input is empty. With
  ``combo_input_seps`` an input with a separator is split on it first, and the ids are
  those of every combination of the inputs' values (the first input's values varying
  slowest), EasyRec's sparse cross.
* Features of a *dynamic* table (``ev_params`` / ``zch`` / ``ctr_accessor_param``, see
  ``odl.config.dynamic_table_config``) are not reduced to a bucket: their ids are *raw ids*
  in ``[0, 2**63)``, the 63 low bits of the FNV-1a hash for hashed and combo features, the
  integer itself for ``num_buckets`` features (a negative integer keeps its 63 low bits, so
  -1 becomes 2**63 - 1) and the vocabulary index for vocabulary features. The trainer and
  serving map raw ids to rows (``odl.models.dynamic``, ``odl.features.raw_id_index``).

Tables: features with the same ``embedding_name`` share one table (validation requires
them to agree on its shape); otherwise a feature's table is named after the feature.

:class:`FeaturePlan` reads the config once: the inputs each feature reads, its table (rows,
dimension, dynamic or not), vocabularies and normalization, sequences and weights, the
labels and the special columns. It takes a validated config: every static rule of the
features and the data config is :mod:`odl.config.config_validation`'s (through
:func:`odl.config.model_validation.validate_features`), and the plan checks only what needs
the vocabularies' data: a ``vocab_file`` it cannot read (the file changed or went away since
validation) and two entries with one FNV-1a 64 hash, each a ``ConfigError`` naming the field
as validation does (``feature_config.features[j].vocab_file``).
``odl.features.feature_builder.FeatureBuilder`` builds batches by that plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from odl.config.config_error import ConfigError
from odl.config.dynamic_table_config import DynamicTableSpec, dynamic_table_spec
from odl.config.expr_feature import ExprFunction, compile_expression
from odl.config.feature_configs import FeatureConfig, feature_configs, feature_list_path
from odl.config.feature_settings import has_vocabulary, normalizes, read_vocabulary
from odl.config.label_functions import label_functions
from odl.config.loss_settings import (
    jrc_session_field,
    label_class_counts,
    num_classes,
    real_valued_labels,
    sample_weight_field,
)
from odl.config.metric_settings import grouped_auc_field
from odl.config.raw_normalizer import RawNormalizer, parse_normalizer
from odl.features.id_hashing import hash_segments, pack_strings
from odl.features.record_parser import RecordParser
from odl.protos import pipeline_pb2

_FT = pipeline_pb2.FeatureConfig.FeatureType
_DT = pipeline_pb2.DatasetConfig.FieldType


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
class PlannedDense:
    """A dense input of the plan: a RawFeature without boundaries, or numbers in a sequence."""

    name: str
    input: str
    width: int = 1  # values per record: raw_input_dim, or a dense sequence's positions
    separator: bytes = b""  # splits a value of several numbers (width > 1 or a sequence)
    sequence: bool = False  # a SequenceFeature of numbers (kept length: its own column)
    multi_sep: bytes = b""  # a sequence's seq_multi_sep: item_width numbers per position
    item_width: int = 1  # a sequence's numbers per position (its columns: width / item_width)
    norm: tuple[float, float] | None = None  # (min_val, max_val - min_val)
    normalizer: RawNormalizer | None = None  # TorchEasyRec's normalizer, applied first
    expression: ExprFunction | None = None  # an ExprFeature's, over its inputs
    inputs: tuple[str, ...] = ()  # an ExprFeature's input columns (numbers)

    @property
    def columns(self) -> list[str]:
        """Its ``Batch.dense`` columns."""
        return dense_columns(self.name, self.width)


@dataclass(frozen=True)
class PlannedSparse:
    """An embedded input of the plan: how its values become ids (``kind``) and its table rows."""

    name: str
    kind: str  # "hash" | "int" | "vocab" | "bucket" | "combo" | "lookup"
    inputs: tuple[str, ...]
    num_rows: int
    separator: bytes = b""
    combo_sep: bytes = b""
    combo_input_seps: tuple[bytes, ...] = ()  # a ComboFeature's per-input separators
    lookup_kv: bytes = b""  # a LookupFeature's kv_separator in its map
    max_sel: int = 0  # a LookupFeature's values kept per record
    boundaries: np.ndarray | None = None
    raw_ids: bool = False
    vocab: Vocabulary | None = None
    norm: tuple[float, float] | None = None  # (min_val, max_val - min_val)
    normalizer: RawNormalizer | None = None  # TorchEasyRec's normalizer, applied first
    seq_len: int = 0  # SequenceFeature: positions kept (one KJT key each); 0: not one
    multi_sep: bytes = b""  # a sequence's seq_multi_sep: a bag of values per position
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
class Vocabulary:
    """A vocabulary as sorted FNV-1a 64 hashes with the byte length and row of each entry."""

    hashes: np.ndarray  # uint64, ascending
    lengths: np.ndarray  # int64
    rows: np.ndarray  # int64

    @classmethod
    def of(cls, entries: list[str], where: str) -> Vocabulary:
        """The vocabulary of ``entries`` (row = position); ``where`` names the config field."""
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


class FeaturePlan:
    """The features of a pipeline config, as they are built (module docstring).

    Args:
        pipeline_config: a config that passed validation
            (``odl.models.model_registry.check_pipeline_config``, or
            :func:`odl.config.config_validation.validate_data_and_features` where only the
            data and the features matter, as in serving); the plan relies on its rules.
        max_record_bytes: records longer than this are rejected as ``oversized``.
        check_event_time: reject records whose event time is outside the window
            (``odl.features.feature_builder``); serving, which never reads event times,
            passes False.

    Raises:
        ConfigError: a vocabulary cannot be read or has two entries with one FNV-1a 64 hash
            (the field named as validation names it).
    """

    def __init__(
        self,
        pipeline_config: pipeline_pb2.EasyRecConfig,
        max_record_bytes: int = 1 << 20,
        check_event_time: bool = True,
    ) -> None:
        dc = pipeline_config.data_config
        field_types = {f.input_name: f.input_type for f in dc.input_fields}
        self._labels = list(dc.label_fields)
        self._label = self._labels[0]
        self._sample_id_field = dc.sample_id_field
        self._group_field = grouped_auc_field(pipeline_config)
        self._session_field = jrc_session_field(pipeline_config)
        self._weight_field = sample_weight_field(pipeline_config)
        self._event_time_field = dc.event_time_field
        self._check_event_time = bool(check_event_time and dc.event_time_field)
        self._sparse: list[PlannedSparse] = []
        self._dense: list[PlannedDense] = []
        self._seq_lengths: list[str] = []  # SequenceFeatures: a length column each
        tables: dict[str, dict] = {}
        numeric_fields: list[str] = []
        list_seps: dict[str, str] = {}
        mc = pipeline_config.model_config
        model_ev = mc.ev_params if mc.HasField("ev_params") else None
        tc = pipeline_config.train_config
        disk_tier = tc.disk_tier if tc.HasField("disk_tier") else None
        prefix = feature_list_path(pipeline_config)
        for i, fc in enumerate(feature_configs(pipeline_config)):
            path = f"{prefix}[{i}]"
            name = fc.feature_name
            dyn = dynamic_table_spec(fc, model_ev, path, disk_tier)
            numeric_fields.extend(inp for inp in fc.input_names
                                  if field_types[inp] != _DT.STRING)
            inp0 = fc.input_names[0]
            raw_sequence = (fc.feature_type == _FT.SequenceFeature
                            and fc.sub_feature_type == _FT.RawFeature)
            if fc.feature_type == _FT.ExprFeature:  # one number of its numeric inputs
                numeric_fields.extend(fc.input_names)
                self._dense.append(PlannedDense(
                    name, inp0, expression=compile_expression(
                        fc.expression, list(fc.input_names), f"{path}.expression"),
                    inputs=tuple(fc.input_names)))
                continue
            if fc.feature_type == _FT.RawFeature or raw_sequence:
                width = 1 if raw_sequence else int(fc.raw_input_dim)
                listed = width > 1 or raw_sequence  # numbers split on the separator
                if listed:
                    list_seps[inp0] = fc.separator
                else:
                    numeric_fields.append(inp0)
                norm = ((float(fc.min_val), float(fc.max_val) - float(fc.min_val))
                        if normalizes(fc) else None)
                normalizer = (parse_normalizer(fc.normalizer, f"{path}.normalizer")
                              if fc.normalizer else None)
                seq_len = (int(fc.max_seq_len or DEFAULT_MAX_SEQ_LEN) if raw_sequence else 0)
                multi_sep = fc.seq_multi_sep.encode() if raw_sequence else b""
                if not fc.boundaries:
                    item = int(fc.raw_input_dim) if raw_sequence else 1
                    self._dense.append(PlannedDense(
                        name, inp0, seq_len * item or width,
                        separator=fc.separator.encode() if listed else b"",
                        sequence=raw_sequence, multi_sep=multi_sep, item_width=item,
                        norm=norm, normalizer=normalizer))
                    if raw_sequence:
                        self._seq_lengths.append(name)
                    continue
                b = np.asarray(list(fc.boundaries), dtype=np.float64)
                if raw_sequence:
                    self._seq_lengths.append(name)
                sp = PlannedSparse(name, "bucket", (inp0,), len(b) + 1, boundaries=b, norm=norm,
                                   normalizer=normalizer,
                                   separator=fc.separator.encode() if raw_sequence else b"",
                                   seq_len=seq_len, multi_sep=multi_sep)
            elif fc.feature_type == _FT.LookupFeature:
                rows = dyn.capacity if dyn is not None else int(fc.hash_bucket_size)
                sp = PlannedSparse(name, "lookup", tuple(fc.input_names), rows,
                                   separator=fc.separator.encode(), raw_ids=dyn is not None,
                                   lookup_kv=fc.kv_separator.encode(),
                                   max_sel=int(fc.lookup_max_sel_elem_num))
                list_seps[fc.input_names[1]] = fc.separator
            elif fc.feature_type == _FT.ComboFeature:
                rows = dyn.capacity if dyn is not None else int(fc.hash_bucket_size)
                sp = PlannedSparse(name, "combo", tuple(fc.input_names), rows,
                                   combo_sep=fc.combo_join_sep.encode(), raw_ids=dyn is not None,
                                   combo_input_seps=tuple(s.encode()
                                                          for s in fc.combo_input_seps))
            else:  # an IdFeature, or a SequenceFeature of ids
                sp = self._plan_ids(fc, path, dyn)
                if sp.seq_len:
                    self._seq_lengths.append(name)
                list_seps[inp0] = fc.separator
                if sp.weights_input:
                    list_seps[sp.weights_input] = fc.separator
            if fc.combiner == "mean":  # every kind of feature: a weighted batch's mean
                sp = dataclasses.replace(sp, mean=True)
            self._sparse.append(sp)
            t = tables.setdefault(  # a shared table's features agree (validated)
                fc.embedding_name or name,
                {"rows": sp.num_rows, "dim": int(fc.embedding_dim), "features": [],
                 "pooling": fc.combiner, "dynamic": dyn})
            t["features"].extend(sp.keys)
        self._count_fields: list[str] = []  # ctr_accessor_param's show / click fields
        for t in tables.values():
            for attr in ("show_field", "click_field"):
                f = getattr(t["dynamic"], attr, "")
                if f and f not in self._count_fields:
                    self._count_fields.append(f)
        numeric_fields.extend(self._count_fields)
        if self._weight_field:  # a finite number, else the record is rejected
            numeric_fields.append(self._weight_field)
        self._weighted = any(sp.weights_input or sp.kv_separator for sp in self._sparse)
        self._tables = [
            TableSpec(n, t["rows"], t["dim"], tuple(t["features"]),
                      "sum" if self._weighted else t["pooling"], t["dynamic"], self._weighted)
            for n, t in tables.items()
        ]
        self._feature_to_table = {f: t.name for t in self._tables for f in t.feature_names}
        if self._check_event_time:
            numeric_fields.append(self._event_time_field)
        # a vector label (a distillation's soft label): a JSON list joins on its separator
        self._vector_labels = {v.input_name: int(v.dim) for v in dc.vector_labels}
        list_seps.update({v.input_name: v.separator for v in dc.vector_labels if v.separator})
        self._parser = RecordParser(
            dc,
            max_record_bytes=max_record_bytes,
            list_separators=list_seps,
            numeric_fields=list(dict.fromkeys(numeric_fields)),
            real_labels=sorted(real_valued_labels(pipeline_config)),
            class_labels=label_class_counts(pipeline_config),
            label_functions=label_functions(dc),
        )
        self._classes = num_classes(pipeline_config)
        self._seps = sorted({sp.separator for sp in self._sparse if sp.separator
                             and sp.kind in ("hash", "int", "vocab", "bucket", "lookup")}
                            | {sp.lookup_kv for sp in self._sparse if sp.lookup_kv}
                            | {d.separator for d in self._dense if d.separator}
                            | {x.multi_sep for x in [*self._sparse, *self._dense]
                               if x.multi_sep}
                            | {s for sp in self._sparse for s in sp.combo_input_seps if s}
                            | {sp.kv_separator for sp in self._sparse if sp.kv_separator})

    @staticmethod
    def _plan_ids(fc: FeatureConfig, path: str, dyn: DynamicTableSpec | None) -> PlannedSparse:
        """An IdFeature's (or a SequenceFeature of ids') ids: hashed, integers or a vocabulary.

        Args:
            fc: the feature (validated: one of hash_bucket_size, num_buckets or a
                vocabulary; a dynamic table may give neither size).
            path: the feature's config path, for a vocabulary's errors.
            dyn: its dynamic-table spec, or None.

        Raises:
            ConfigError: its vocabulary cannot be read or has two entries with one hash.
        """
        vocab = None
        if has_vocabulary(fc):
            field = f"{path}.vocab_list" if fc.vocab_list else f"{path}.vocab_file"
            vocab = Vocabulary.of(read_vocabulary(fc, path), field)
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
        return PlannedSparse(fc.feature_name, kind, (fc.input_names[0],), rows,
                             separator=fc.separator.encode(), raw_ids=dyn is not None,
                             vocab=vocab, seq_len=seq_len,
                             multi_sep=fc.seq_multi_sep.encode() if seq_len else b"",
                             weights_input=fc.input_names[1] if len(fc.input_names) > 1 else "",
                             kv_separator=fc.kv_separator.encode())

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
        return {d.name: d.width // d.item_width for d in self._dense if d.sequence}

    @property
    def dense_sequence_item_widths(self) -> dict[str, int]:
        """SequenceFeatures of numbers without boundaries -> numbers per position.

        Their columns are position after position, ``raw_input_dim`` each.
        """
        return {d.name: d.item_width for d in self._dense if d.sequence}

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
