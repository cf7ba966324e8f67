"""``assets/fg.json``: the export's features in TorchEasyRec's / EasyRec's fg.json form.

A feature-generation service (PAI's FG, TorchEasyRec's ``pyfg``) or a caller building
``/predict`` requests reads it to know which input each feature takes and how it is
bucketized. Layout::

    {"features": [
        {"feature_name": str,
         "feature_type": "id_feature" | "raw_feature" | "combo_feature" | "sequence_feature"
                         | "expr_feature" | "lookup_feature",
         "expression": "<side>:<column>",          (combo: "expression": [..., ...];
                                                    expr: EasyRec's expression, with
                                                    "variables": ["<side>:<column>", ...];
                                                    lookup: "key" and "map" instead, with
                                                    "kv_separator" and "max_sel")
         "embedding_dim": int,                     (embedded features)
         "hash_bucket_size" | "num_buckets" | "vocab_list": ...,   (id / combo features)
         "normalizer": str,                        (raw features: the generator's transform)
         "boundaries": [float, ...],               (bucketized raw features)
         "value_dim": int,                         (raw features of several numbers)
         "separator": str, "pooling": "sum" | "mean",
         "sequence_length": int, "sequence_delim": str,  (sequence features; of several
                                                   values per position: separator, pooling
                                                   and, of numbers, value_dim too)
         "embedding_name": str},                   (a shared table)
        ...],
     "reserves": [label fields, sample id field, event time field]}

Names are the config's: ``feature_name``, and ``expression`` from the feature's
``fg_expression`` (TorchEasyRec's ``expression`` is kept there), else ``"user:<input
column>"`` (odl reads the column of that name from each record; the side is not known to
odl, set ``fg_expression`` to name it). The file describes; odl itself never reads it.
"""

from __future__ import annotations

from typing import Any

from odl.config.feature_configs import feature_configs, feature_list_path
from odl.config.feature_settings import has_vocabulary, read_vocabulary
from odl.protos import pipeline_pb2

__all__ = ["FG_JSON_NAME", "fg_json_of"]

FG_JSON_NAME = "fg.json"

_FT = pipeline_pb2.FeatureConfig.FeatureType


def _expression(fc: pipeline_pb2.FeatureConfig, column: str) -> str:
    return fc.fg_expression or f"user:{column}"


def fg_json_of(config: pipeline_pb2.EasyRecConfig) -> dict[str, Any]:
    """The fg.json document of a config's features (layout: module docstring).

    Args:
        config: a validated pipeline config.

    Returns:
        The JSON-ready document.
    """
    features: list[dict[str, Any]] = []
    for i, fc in enumerate(feature_configs(config)):
        kind = fc.feature_type
        entry: dict[str, Any] = {"feature_name": fc.feature_name}
        if kind == _FT.ComboFeature:
            entry["feature_type"] = "combo_feature"
            entry["expression"] = [f"user:{c}" for c in fc.input_names]
        elif kind == _FT.LookupFeature:
            entry["feature_type"] = "lookup_feature"
            entry["key"] = f"user:{fc.input_names[0]}"
            entry["map"] = f"user:{fc.input_names[1]}"
            entry["separator"] = fc.separator
            entry["kv_separator"] = fc.kv_separator
            entry["max_sel"] = int(fc.lookup_max_sel_elem_num)
        elif kind == _FT.ExprFeature:
            entry["feature_type"] = "expr_feature"
            entry["expression"] = fc.expression
            entry["variables"] = [f"user:{c}" for c in fc.input_names]
        elif kind == _FT.RawFeature:
            entry["feature_type"] = "raw_feature"
            entry["expression"] = _expression(fc, fc.input_names[0])
        elif kind == _FT.SequenceFeature:
            entry["feature_type"] = "sequence_feature"
            entry["sub_feature_type"] = ("raw_feature" if fc.sub_feature_type == _FT.RawFeature
                                         else "id_feature")
            entry["expression"] = _expression(fc, fc.input_names[0])
            entry["sequence_length"] = int(fc.max_seq_len) or 50
            entry["sequence_delim"] = fc.separator
            if fc.seq_multi_sep:  # several values per position
                entry["separator"] = fc.seq_multi_sep
                entry["pooling"] = fc.combiner
                if fc.sub_feature_type == _FT.RawFeature and not fc.boundaries:
                    entry["value_dim"] = int(fc.raw_input_dim)
        else:
            entry["feature_type"] = "id_feature"
            entry["expression"] = _expression(fc, fc.input_names[0])
        if fc.embedding_dim:
            entry["embedding_dim"] = int(fc.embedding_dim)
        if fc.hash_bucket_size:
            entry["hash_bucket_size"] = int(fc.hash_bucket_size)
        if fc.num_buckets:
            entry["num_buckets"] = int(fc.num_buckets)
        if has_vocabulary(fc):
            entry["vocab_list"] = read_vocabulary(fc, f"{feature_list_path(config)}[{i}]")
        if fc.normalizer:
            entry["normalizer"] = fc.normalizer
        if fc.boundaries:
            entry["boundaries"] = [float(b) for b in fc.boundaries]
        if kind == _FT.RawFeature and fc.raw_input_dim > 1:
            entry["value_dim"] = int(fc.raw_input_dim)
            entry["separator"] = fc.separator
        if kind in (_FT.IdFeature, _FT.TagFeature):
            entry["separator"] = fc.separator
            entry["pooling"] = fc.combiner
        if kind == _FT.ComboFeature:
            entry["combo_join_sep"] = fc.combo_join_sep
        if fc.embedding_name:
            entry["embedding_name"] = fc.embedding_name
        features.append(entry)
    dc = config.data_config
    reserves = list(dc.label_fields) + [f for f in (dc.sample_id_field, dc.event_time_field)
                                        if f]
    return {"features": features, "reserves": reserves}
