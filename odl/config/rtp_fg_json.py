r"""EasyRec's ``fg_json_path``: the input fields and features of an RTP FG ``fg.json``.

With ``fg_json_path`` the records are the output of RTP's feature generator (FG): one
column per feature of the fg.json, named by its ``feature_name`` and holding what the
generator made of it (an id, ids, a bucket, numbers), in the RTP layout
(``odl.features.rtp_layout``). EasyRec builds the config's ``data_config.input_fields`` and
features from the fg.json when it loads the config (``fg_util.load_fg_json_to_config``);
:func:`load_fg_json` does the same, by EasyRec's rules (``convert_rtp_fg.process_features``):

* the label fields first, INT32 with default ``"0"``; then one STRING field per feature
  (DOUBLE for a raw feature of one number, INT32 for a bucketized one);
* ``id_feature``: an IdFeature, multi-valued (``is_multi``: EasyRec's TagFeature, with its
  ``kv_separator``); ``lookup_feature`` / ``match_feature`` with ``needDiscrete`` (the
  default) and ``combo_feature``: multi-valued ids; ``overlap_feature``: ids (multi-valued
  for ``common_word_divided`` / ``diff_word_divided``); ``raw_feature`` (and the others
  without ``needDiscrete``): a RawFeature (``value_dimension`` numbers, ``boundaries``
  embedded), or, with ``bucketize_boundaries`` (bucketized by the generator), ids of
  ``len(bucketize_boundaries) + 1`` buckets;
* a feature's table: ``hash_bucket_size``, ``vocab_file``, ``vocab_list`` or
  ``num_buckets``; ``filter_freq`` / ``steps_to_live`` make it a dynamic table
  (``ev_params``; EasyRec's EmbeddingVariable: odl's table then grows with the ids instead
  of taking EasyRec's 2**63 - 1 bucket placeholder); ``shared_name`` is the
  ``embedding_name``; ``embedding_dimension`` / ``embedding_dim`` the dim (the fg.json's
  ``embedding_dim``, else 16); ``combiner`` (``sum``); ``extra_combo_info`` adds a
  ComboFeature of the feature and ``feature_names``;
* values of several ids or numbers are split on ``\x03`` (EasyRec's in-column separator);
* ``sequence_name`` entries: a SequenceFeature ``<sequence_name>_<feature_name>`` per
  sub-feature.

The input fields the config writes are replaced, its ``feature_configs`` too, and the
fg.json's features join ``feature_config.features`` (after those the config writes, as
EasyRec); ``fg_json_path`` is then cleared, so checkpoints and exports keep the expanded
config. A path starting with ``!`` is EasyRec's mark of a config already expanded (its loader
writes the ``!`` after the expansion): its input fields and features are the config's own,
and the file is not read (``fg_test_extensions_final.config``). What EasyRec's converter
does not read is not read here either (``value_type``, ``group``, ``expression``, ``map``,
``key``: the generator's side); ``normalizer_fn``, ``needWeighting`` and ``is_cache`` are
refused by name.
"""

from __future__ import annotations

import json
import os
from typing import Any

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

__all__ = ["load_fg_json"]

_FT = pipeline_pb2.FeatureConfig.FeatureType
_DT = pipeline_pb2.DatasetConfig
# EasyRec's defaults of the converter
DEFAULT_EMBEDDING_DIM = 16
IN_COLUMN_SEPARATOR = "\x03"
_REFUSED_KEYS = ("normalizer_fn", "needWeighting", "is_cache")


def load_fg_json(config: pipeline_pb2.EasyRecConfig, config_path: str) -> None:
    """Replaces a config's input fields and features by its ``fg_json_path``'s, in place.

    A relative ``fg_json_path`` is tried against the config file's directory, then the
    working directory (EasyRec's). Without ``fg_json_path`` nothing happens; with one marked
    expanded already (``!path``) the field is cleared and nothing else changes.

    Args:
        config: the config loaded from ``config_path``.
        config_path: the config file (local or ``oss://``), or "" (a config from text).

    Raises:
        ConfigError: the file missing or not JSON, or a feature the converter refuses.
    """
    path = config.fg_json_path
    if not path:
        return
    if path.startswith("!"):  # EasyRec's: expanded already, the fields are the config's
        config.ClearField("fg_json_path")
        return
    where = "fg_json_path"
    doc = _read(_resolve(path, config_path), where)
    if not isinstance(doc, dict) or not isinstance(doc.get("features"), list):
        raise ConfigError(where, f"{path}: an fg.json is an object with a 'features' list")
    dim = int(doc.get("embedding_dim", DEFAULT_EMBEDDING_DIM))
    dc = config.data_config
    fields = [_DT.Field(input_name=label, input_type=_DT.INT32, default_val="0")
              for label in dc.label_fields]
    features: list[pipeline_pb2.FeatureConfig] = []
    for i, feature in enumerate(doc["features"]):
        fw = f"{where} ({path}) features[{i}]"
        if not isinstance(feature, dict):
            raise ConfigError(fw, "each feature is a JSON object")
        if "feature_name" in feature:
            _convert(feature, str(feature["feature_name"]), dim, False, fw, fields, features)
        elif "sequence_name" in feature:
            for j, sub in enumerate(feature.get("features", [])):
                name = f"{feature['sequence_name']}_{sub.get('feature_name', '')}"
                _convert(sub, name, dim, True, f"{fw}.features[{j}]", fields, features)
        else:
            raise ConfigError(fw, "needs feature_name (or sequence_name)")
    del dc.input_fields[:]
    dc.input_fields.extend(fields)
    config.ClearField("feature_configs")
    config.feature_config.features.extend(features)
    config.ClearField("fg_json_path")


def _resolve(path: str, config_path: str) -> str:
    if "://" in path or os.path.isabs(path) or not config_path:
        return path
    if "://" in config_path:
        return f"{config_path.rsplit('/', 1)[0]}/{path}"
    beside = os.path.join(os.path.dirname(os.path.abspath(config_path)), path)
    return beside if os.path.exists(beside) else path


def _read(path: str, where: str) -> Any:
    from odl.storage import file_store  # the storage layer (oss2) only where a file is read

    try:
        return json.loads(file_store.read_text(path))
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"cannot read {path}: {e}") from None


def _convert(feature: dict, name: str, dim: int, sequence: bool, where: str,
             fields: list, features: list) -> None:
    """One fg.json feature into its input field and feature config (EasyRec's rules)."""
    for key in _REFUSED_KEYS:
        if feature.get(key):
            raise ConfigError(where, f"{key} is an fg.json setting odl does not implement")
    kind = feature.get("feature_type", "")
    fc = pipeline_pb2.FeatureConfig(separator=IN_COLUMN_SEPARATOR)
    fc.input_names.append(name)
    field = _DT.Field(input_name=name)
    emb = int(feature.get("embedding_dimension", feature.get("embedding_dim", dim)))
    combiner = str(feature.get("combiner", "sum"))
    multi = bool(feature.get("is_multi", False))
    discrete = bool(feature.get("needDiscrete", True))
    if sequence:
        fc.feature_type = _FT.SequenceFeature
        fc.embedding_dim = emb
        if kind == "raw_feature":
            fc.sub_feature_type = _FT.RawFeature
            field.default_val = str(feature.get("default_value", "0.0"))
            fc.boundaries.extend(float(b) for b in feature.get("boundaries", []))
            if int(feature.get("value_dimension", 1)) > 1:
                fc.raw_input_dim = int(feature["value_dimension"])
        else:
            _table(feature, fc, field, where)
            fc.combiner = combiner
    elif kind == "id_feature" or (kind in ("lookup_feature", "match_feature") and discrete) \
            or kind in ("combo_feature", "overlap_feature"):
        fc.feature_type = _FT.IdFeature
        if kind == "id_feature" and multi and feature.get("kv_separator"):
            fc.kv_separator = str(feature["kv_separator"])
        fc.embedding_dim = emb
        _table(feature, fc, field, where)
        fc.combiner = combiner
    elif kind in ("raw_feature", "lookup_feature", "match_feature"):
        if kind == "match_feature" and "bucketize_boundaries" in feature:
            raise ConfigError(where, "a match_feature without needDiscrete takes no "
                                     "bucketize_boundaries (EasyRec's converter refuses it)")
        _raw(feature, fc, field, multi or feature.get("matchType") == "multihit", emb)
    else:
        raise ConfigError(where, f"feature_type {kind!r} is not one the converter reads "
                                 "(id_feature, raw_feature, lookup_feature, match_feature, "
                                 "combo_feature, overlap_feature)")
    if "shared_name" in feature:
        fc.embedding_name = str(feature["shared_name"])
    features.append(fc)
    fields.append(field)
    combo = feature.get("extra_combo_info")
    if combo:
        _combo(combo, name, dim, where, features)


def _table(feature: dict, fc: pipeline_pb2.FeatureConfig, field: Any, where: str) -> None:
    """EasyRec's ``_set_hash_bucket``: the feature's table kind and size."""
    if "hash_bucket_size" in feature:
        fc.hash_bucket_size = int(feature["hash_bucket_size"])
        for key in ("filter_freq", "steps_to_live"):
            if int(feature.get(key, -1)) >= 0:  # EasyRec's EmbeddingVariable
                setattr(fc.ev_params, key, int(feature[key]))
                fc.ClearField("hash_bucket_size")
    elif "vocab_file" in feature:
        fc.vocab_file = str(feature["vocab_file"])
    elif "vocab_list" in feature:
        fc.vocab_list.extend(str(v) for v in feature["vocab_list"])
    elif "num_buckets" in feature:
        fc.num_buckets = int(feature["num_buckets"])
        if field is not None:
            field.default_val = str(feature.get("default_value", "0"))
    else:
        raise ConfigError(where, "one of hash_bucket_size, vocab_file, vocab_list, "
                                 "num_buckets must be set")


def _raw(feature: dict, fc: pipeline_pb2.FeatureConfig, field: Any, multi: bool,
         emb: int) -> None:
    """EasyRec's ``_gen_raw_config``: numbers, or the generator's buckets as ids."""
    if "bucketize_boundaries" in feature:
        field.input_type = _DT.STRING if multi else _DT.INT32
        fc.feature_type = _FT.IdFeature
        fc.num_buckets = len(str(feature["bucketize_boundaries"]).split(",")) + 1
        fc.embedding_dim = emb
        return
    fc.feature_type = _FT.RawFeature
    field.default_val = str(feature.get("default_value", "0.0"))
    width = int(feature.get("value_dimension", 1))
    if width > 1:
        fc.raw_input_dim = width
        field.input_type = _DT.STRING
    else:
        field.input_type = _DT.DOUBLE
    if "boundaries" in feature:
        fc.boundaries.extend(float(b) for b in feature["boundaries"])
        fc.embedding_dim = emb


def _combo(combo: dict, name: str, dim: int, where: str, features: list) -> None:
    """``extra_combo_info``: a ComboFeature of the feature and ``feature_names``."""
    others = [str(n) for n in combo.get("feature_names", [])]
    if not others:
        raise ConfigError(where, "extra_combo_info needs feature_names")
    if "hash_bucket_size" not in combo:
        raise ConfigError(where, "extra_combo_info needs hash_bucket_size")
    inputs = [name, *others]
    fc = pipeline_pb2.FeatureConfig(
        feature_type=_FT.ComboFeature,
        feature_name=str(combo.get("final_feature_name", "combo__" + "_".join(inputs))),
        embedding_dim=int(combo.get("embedding_dimension", combo.get("embedding_dim", dim))),
        combiner=str(combo.get("combiner", "mean")))
    fc.input_names.extend(inputs)
    _table(combo, fc, None, where)
    features.append(fc)
