"""The rules of the feature kinds beyond ids and single numbers, by field.

Called by :func:`odl.config.model_validation.validate_features` for each feature:
:func:`validate_number_sequence` (a SequenceFeature of numbers), :func:`validate_multi_values`
(``seq_multi_sep``), :func:`validate_lookup_feature` (EasyRec's LookupFeature) and
:func:`validate_expr_feature` (EasyRec's ExprFeature). What each kind means is
``odl.features.feature_plan``'s docstring.
"""

from __future__ import annotations

import math

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.expr_feature import compile_expression
from odl.config.feature_configs import FeatureConfig
from odl.config.feature_settings import has_vocabulary
from odl.protos import pipeline_pb2

__all__ = ["validate_expr_feature", "validate_lookup_feature", "validate_multi_values",
           "validate_number_sequence"]

_FT = pipeline_pb2.FeatureConfig.FeatureType
_FIELD_TYPE = pipeline_pb2.DatasetConfig.FieldType


def validate_lookup_feature(fc: FeatureConfig, where: str, fields: dict) -> None:
    """A LookupFeature: a key and a map column, hashed values (EasyRec's rules)."""
    if len(fc.input_names) != 2:
        raise ConfigError(f"{where}.input_names", "a LookupFeature reads a key column and a "
                                                  "map column (\"k1:v1|k2:v2\")")
    if fields[fc.input_names[1]] != _FIELD_TYPE.STRING:
        raise ConfigError(f"{where}.input_names[1]",
                          f"the map is read from a STRING field, {fc.input_names[1]!r} is "
                          f"{_FIELD_TYPE.Name(fields[fc.input_names[1]])}")
    if not fc.kv_separator or fc.kv_separator == fc.separator:
        raise ConfigError(f"{where}.kv_separator", "a LookupFeature's map needs a "
                                                   "kv_separator other than its separator")
    if not fc.hash_bucket_size or fc.num_buckets or has_vocabulary(fc):
        raise ConfigError(f"{where}.hash_bucket_size",
                          "a LookupFeature hashes the values it selects: it needs "
                          "hash_bucket_size (EasyRec's, not num_buckets or a vocabulary)")
    if not 1 <= fc.lookup_max_sel_elem_num <= limits.MAX_SEQUENCE_LENGTH:
        raise ConfigError(f"{where}.lookup_max_sel_elem_num",
                          f"must be 1 to {limits.MAX_SEQUENCE_LENGTH}, got "
                          f"{fc.lookup_max_sel_elem_num}")


def validate_expr_feature(fc: FeatureConfig, where: str) -> None:
    """An ExprFeature: its expression over its inputs, and nothing of an embedded feature."""
    for field in ("embedding_dim", "hash_bucket_size", "num_buckets", "boundaries",
                  "vocab_list", "vocab_file", "ev_params", "seq_multi_sep", "kv_separator",
                  "normalizer"):
        written = getattr(fc, field)
        if (len(written) > 0 if field in ("boundaries", "vocab_list") else
                fc.HasField(field) and bool(written)):
            raise ConfigError(f"{where}.{field}",
                              "EasyRec reads an ExprFeature as one number (a numeric "
                              "column): it is not embedded, bucketized or normalized")
    compile_expression(fc.expression, list(fc.input_names), f"{where}.expression")


def validate_multi_values(fc: FeatureConfig, where: str) -> None:
    """``seq_multi_sep``: several values per position of a SequenceFeature."""
    if fc.feature_type != _FT.SequenceFeature:
        raise ConfigError(f"{where}.seq_multi_sep", "splits the positions of a SequenceFeature")
    if fc.seq_multi_sep == fc.separator:
        raise ConfigError(f"{where}.seq_multi_sep", "must differ from separator")
    if fc.kv_separator or len(fc.input_names) > 1:
        raise ConfigError(f"{where}.seq_multi_sep", "not with weighted values")


def validate_number_sequence(fc: FeatureConfig, where: str, fields: dict) -> None:
    """A SequenceFeature of numbers: a STRING field; bucketized and embedded, or dense."""
    if fields[fc.input_names[0]] != _FIELD_TYPE.STRING:
        raise ConfigError(f"{where}.input_names[0]",
                          f"a SequenceFeature reads its items from a STRING field, "
                          f"{fc.input_names[0]!r} is "
                          f"{_FIELD_TYPE.Name(fields[fc.input_names[0]])}")
    if fc.hash_bucket_size or fc.num_buckets or has_vocabulary(fc):
        raise ConfigError(f"{where}.hash_bucket_size",
                          "a SequenceFeature of numbers (sub_feature_type RawFeature) takes "
                          "boundaries, not hash_bucket_size / num_buckets / a vocabulary")
    if fc.raw_input_dim != 1 and (fc.boundaries or not fc.seq_multi_sep):
        raise ConfigError(f"{where}.raw_input_dim",
                          "numbers per position of a sequence (raw_input_dim) are read "
                          "without boundaries, split on seq_multi_sep")
    if fc.raw_input_dim > limits.MAX_RAW_INPUT_DIM:
        raise ConfigError(f"{where}.raw_input_dim",
                          f"{fc.raw_input_dim} is above the limit of {limits.MAX_RAW_INPUT_DIM}")
    if fc.max_seq_len > limits.MAX_SEQUENCE_LENGTH:
        raise ConfigError(f"{where}.max_seq_len",
                          f"{fc.max_seq_len} is above the limit of {limits.MAX_SEQUENCE_LENGTH}")
    b = list(fc.boundaries)
    if b:
        if fc.embedding_dim <= 0:
            raise ConfigError(f"{where}.embedding_dim",
                              "a SequenceFeature of bucketized numbers needs embedding_dim > 0")
        if any(not math.isfinite(x) for x in b) or any(
                b[k] >= b[k + 1] for k in range(len(b) - 1)):
            raise ConfigError(f"{where}.boundaries", "must be finite and strictly ascending")
        if len(b) + 1 > limits.MAX_TABLE_ROWS:
            raise ConfigError(f"{where}.boundaries", "too many boundaries")
    elif fc.embedding_dim > limits.MAX_EMBEDDING_DIM:
        raise ConfigError(f"{where}.embedding_dim",
                          f"{fc.embedding_dim} is above the limit of {limits.MAX_EMBEDDING_DIM}")
