"""Validation of a pipeline config's features and of what every model class shares.

* features: every input is a configured input field and not the label; an IdFeature or
  ComboFeature has ``embedding_dim`` and exactly one of ``hash_bucket_size`` /
  ``num_buckets``; a RawFeature reads a numeric field and is either dense (no
  ``embedding_dim``) or bucketized (ascending ``boundaries`` and an ``embedding_dim``);
  ``combiner`` is ``sum`` or ``mean`` on every feature (a dense number has nothing to pool
  and its combiner is not read, but no other value is accepted there either); features
  sharing an ``embedding_name`` have the same table shape; sizes stay within
  :mod:`odl.config.limits`;
* the model's common part: loss terms, ``num_class``, unique non-empty feature groups naming
  existing features, combiners of the SequenceFeatures they list.

The checks model modules share are here too (:func:`validate_dnn`,
:func:`validate_sequence_groups`); a class's own settings are checked by its module
(``odl.models.model_registry``). Called by
:func:`odl.config.config_validation.validate_pipeline_config`.

:func:`validate_features` (with :mod:`odl.config.feature_settings` for vocabularies and
normalization and :mod:`odl.config.dynamic_table_config` for dynamic tables) holds every
static rule of a feature: the feature plan (``odl.features.feature_plan``) builds from a
config that passed it and checks only what needs a vocabulary's entries.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.dynamic_table_config import dynamic_table_spec
from odl.config.feature_configs import (
    EMBEDDED_FEATURE_TYPES,
    NUMERIC_FIELD_TYPES,
    FeatureConfig,
    dense_sequence,
    embedded_feature,
    feature_configs,
    feature_list_path,
)
from odl.config.feature_kinds import (
    validate_expr_feature,
    validate_lookup_feature,
    validate_multi_values,
    validate_number_sequence,
)
from odl.config.loss_settings import SOFTMAX_LOSS_TYPES
from odl.config.model_classes import domain_label, is_multi_task_model
from odl.protos import pipeline_pb2

__all__ = ["SUPPORTED_ACTIVATIONS", "sequence_combiner_width", "validate_dnn", "validate_features",
           "validate_losses", "validate_model_common", "validate_sequence_groups"]

logger = logging.getLogger(__name__)

_FT = pipeline_pb2.FeatureConfig.FeatureType
_FIELD_TYPE = pipeline_pb2.DatasetConfig.FieldType

# DNN.activation values the model builder accepts.
# (EasyRec's get_activation: its names, lower-cased, and TensorFlow's tf.nn functions)
SUPPORTED_ACTIVATIONS = frozenset({
    "relu", "linear", "gelu", "leaky_relu", "prelu", "dice", "elu", "selu", "tanh", "swish",
    "sigmoid", "tf.nn.relu", "tf.nn.gelu", "tf.nn.leaky_relu", "tf.nn.elu", "tf.nn.selu",
    "tf.nn.tanh", "tf.tanh", "tf.nn.swish", "tf.nn.sigmoid", "tf.sigmoid", "nn.ReLU",
})


def validate_features(
    config: pipeline_pb2.EasyRecConfig, fields: dict[str, int]
) -> dict[str, FeatureConfig]:
    """Checks every feature: its inputs, its type's fields, its table's size and sharing.

    Args:
        config: the config.
        fields: the input fields by name, with their ``DatasetConfig.FieldType``.

    Returns:
        The features by ``feature_name`` (names filled in, see ``feature_configs``).

    Raises:
        ConfigError: naming the first offending field.
    """
    features = feature_configs(config)
    prefix = feature_list_path(config)
    if not features:
        raise ConfigError(prefix, "no features configured")
    # a domain label (PEPNet's) is not trained on: features may read its column
    labels = set(config.data_config.label_fields) - {domain_label(config.model_config)}
    by_name: dict[str, FeatureConfig] = {}
    tables: dict[str, tuple] = {}
    mc = config.model_config
    model_ev = mc.ev_params if mc.HasField("ev_params") else None
    for i, fc in enumerate(features):
        where = f"{prefix}[{i}]"
        kind = _FT.Name(fc.feature_type)
        dyn = None
        if not fc.input_names:
            raise ConfigError(f"{where}.input_names", "required")
        if fc.feature_name in by_name:
            raise ConfigError(f"{where}.feature_name",
                              f"duplicate feature name {fc.feature_name!r}")
        by_name[fc.feature_name] = fc
        for j, name in enumerate(fc.input_names):
            if name not in fields:
                raise ConfigError(f"{where}.input_names[{j}]",
                                  f"{name!r} is not in data_config.input_fields")
            if name in labels:
                raise ConfigError(f"{where}.input_names[{j}]",
                                  f"the label {name!r} cannot be a feature input")
        if fc.feature_type == _FT.ExprFeature:
            validate_expr_feature(fc, where)
            continue
        if fc.expression:
            raise ConfigError(f"{where}.expression",
                              f"an expression belongs to an ExprFeature, not a {kind}")
        if fc.feature_type == _FT.LookupFeature:
            validate_lookup_feature(fc, where, fields)
        elif fc.HasField("lookup_max_sel_elem_num"):
            raise ConfigError(f"{where}.lookup_max_sel_elem_num",
                              f"belongs to a LookupFeature, not a {kind}")
        if fc.combo_input_seps and fc.feature_type != _FT.ComboFeature:
            raise ConfigError(f"{where}.combo_input_seps",
                              f"splits a ComboFeature's inputs, not a {kind}'s")
        if fc.feature_type == _FT.ComboFeature:
            if len(fc.input_names) < 2:
                raise ConfigError(f"{where}.input_names", "a ComboFeature crosses 2 or more inputs")
            if fc.combo_input_seps and len(fc.combo_input_seps) != len(fc.input_names):
                raise ConfigError(f"{where}.combo_input_seps",
                                  f"one separator per input ({len(fc.input_names)}, \"\" for "
                                  f"an input read whole), got {len(fc.combo_input_seps)}")
            for j, sep in enumerate(fc.combo_input_seps):
                if sep and fields[fc.input_names[j]] != _FIELD_TYPE.STRING:
                    raise ConfigError(f"{where}.combo_input_seps[{j}]",
                                      f"splits a STRING input, {fc.input_names[j]!r} is "
                                      f"{_FIELD_TYPE.Name(fields[fc.input_names[j]])}")
        elif len(fc.input_names) == 2 and fc.feature_type == _FT.IdFeature:
            # EasyRec's weighted TagFeature: tags, then their weights
            if fields[fc.input_names[1]] != _FIELD_TYPE.STRING:
                raise ConfigError(f"{where}.input_names[1]",
                                  f"the tags' weights are read from a STRING field (split on "
                                  f"separator {fc.separator!r}), {fc.input_names[1]!r} is "
                                  f"{_FIELD_TYPE.Name(fields[fc.input_names[1]])}")
            if fc.kv_separator:
                raise ConfigError(f"{where}.kv_separator",
                                  "give the weights in a second input or with kv_separator, "
                                  "not both")
        elif len(fc.input_names) != 1 and fc.feature_type != _FT.LookupFeature:
            raise ConfigError(f"{where}.input_names", f"a {kind} reads exactly one input "
                              "(a TagFeature: its tags, and optionally their weights)")
        if fc.kv_separator and fc.feature_type not in (_FT.IdFeature, _FT.LookupFeature):
            raise ConfigError(f"{where}.kv_separator",
                              f"weights (kv_separator) belong to a TagFeature, not a {kind}")
        if (len(fc.input_names) == 2 or fc.kv_separator) and fc.feature_type == _FT.IdFeature:
            if dynamic_table_spec(fc, model_ev, where) is not None:
                raise ConfigError(f"{where}.input_names",
                                  "weighted tags in a dynamic table (ev_params / zch / "
                                  "ctr_accessor_param) are not implemented")
        if fc.combiner not in ("sum", "mean"):
            raise ConfigError(f"{where}.combiner", f"expected sum or mean, got {fc.combiner!r}")
        listed = (fc.feature_type in (_FT.IdFeature, _FT.SequenceFeature, _FT.LookupFeature)
                  or (fc.feature_type == _FT.RawFeature and fc.raw_input_dim > 1))
        if listed and not fc.separator:
            raise ConfigError(f"{where}.separator", "must not be empty")
        if fc.feature_type == _FT.RawFeature or (
                fc.feature_type == _FT.SequenceFeature
                and fc.sub_feature_type == _FT.RawFeature):  # numbers: no dynamic table
            dynamic_table_spec(fc, model_ev, where)
        if (fc.feature_type == _FT.SequenceFeature
                and fc.sub_feature_type == _FT.RawFeature):
            validate_number_sequence(fc, where, fields)
            if not fc.boundaries:
                continue
        elif fc.feature_type in EMBEDDED_FEATURE_TYPES:
            if fc.embedding_dim <= 0:
                raise ConfigError(f"{where}.embedding_dim", f"a {kind} needs embedding_dim > 0")
            dyn = dynamic_table_spec(fc, model_ev, where)
            if dyn is not None:
                if fc.hash_bucket_size and fc.num_buckets:
                    raise ConfigError(f"{where}.hash_bucket_size",
                                      f"a {kind} takes at most one of hash_bucket_size / "
                                      "num_buckets")
                if dyn.capacity > limits.MAX_TABLE_ROWS:
                    raise ConfigError(f"{where}.{dyn.form}",
                                      f"{dyn.capacity:,} rows is above the limit of "
                                      f"{limits.MAX_TABLE_ROWS:,} (2**31 - 1) rows per table")
                for attr in ("show_field", "click_field"):
                    count = getattr(dyn, attr, "")
                    if count and fields.get(count, _FIELD_TYPE.STRING) == _FIELD_TYPE.STRING:
                        raise ConfigError(f"{where}.ctr_accessor_param.{attr}",
                                          f"{count!r} must be a numeric "
                                          "data_config.input_fields field")
            elif fc.feature_type == _FT.ComboFeature and (fc.num_buckets
                                                          or not fc.hash_bucket_size):
                raise ConfigError(f"{where}.hash_bucket_size",
                                  "a ComboFeature hashes its crossed values: it needs "
                                  "hash_bucket_size (not num_buckets)")
            elif bool(fc.hash_bucket_size) == bool(fc.num_buckets):
                raise ConfigError(f"{where}.hash_bucket_size",
                                  f"a {kind} needs exactly one of hash_bucket_size / num_buckets")
            for size_field in ("hash_bucket_size", "num_buckets"):
                size = getattr(fc, size_field)
                if size > limits.MAX_TABLE_ROWS:
                    raise ConfigError(f"{where}.{size_field}",
                                      f"{size:,} rows is above the limit of "
                                      f"{limits.MAX_TABLE_ROWS:,} (2**31 - 1) rows per table")
            if fc.boundaries:
                raise ConfigError(f"{where}.boundaries", "only RawFeature takes boundaries")
        else:  # RawFeature
            field_type = fields[fc.input_names[0]]
            if fc.raw_input_dim > limits.MAX_RAW_INPUT_DIM:
                raise ConfigError(f"{where}.raw_input_dim",
                                  f"{fc.raw_input_dim} is above the limit of "
                                  f"{limits.MAX_RAW_INPUT_DIM}")
            if fc.raw_input_dim == 0:
                raise ConfigError(f"{where}.raw_input_dim", "must be at least 1")
            if fc.raw_input_dim > 1 and field_type != _FIELD_TYPE.STRING:
                raise ConfigError(f"{where}.input_names[0]",
                                  f"a RawFeature with raw_input_dim {fc.raw_input_dim} reads "
                                  f"its numbers from a STRING field (split on separator "
                                  f"{fc.separator!r}), {fc.input_names[0]!r} is "
                                  f"{_FIELD_TYPE.Name(field_type)}")
            if fc.raw_input_dim == 1 and field_type not in NUMERIC_FIELD_TYPES:
                raise ConfigError(f"{where}.input_names[0]",
                                  f"a RawFeature needs a numeric input field, "
                                  f"{fc.input_names[0]!r} is "
                                  f"{_FIELD_TYPE.Name(field_type)} (raw_input_dim > 1 reads "
                                  "several numbers from a STRING field)")
            if fc.hash_bucket_size or fc.num_buckets:
                raise ConfigError(f"{where}.hash_bucket_size",
                                  "a RawFeature takes boundaries, not hash_bucket_size / "
                                  "num_buckets")
            if fc.raw_input_dim > 1 and fc.boundaries:
                raise ConfigError(f"{where}.boundaries",
                                  "boundaries bucket one number: a RawFeature with boundaries "
                                  "needs raw_input_dim 1")
            if fc.boundaries:
                if fc.embedding_dim <= 0:
                    raise ConfigError(f"{where}.embedding_dim",
                                      "a RawFeature with boundaries needs embedding_dim > 0")
                b = list(fc.boundaries)
                if any(not math.isfinite(x) for x in b) or any(
                        b[k] >= b[k + 1] for k in range(len(b) - 1)):
                    raise ConfigError(f"{where}.boundaries", "must be finite and strictly "
                                                             "ascending")
                if len(b) + 1 > limits.MAX_TABLE_ROWS:
                    raise ConfigError(f"{where}.boundaries", "too many boundaries")
            else:  # dense, or projected (embedding_dim: value times a learned vector)
                if fc.embedding_dim > limits.MAX_EMBEDDING_DIM:
                    raise ConfigError(f"{where}.embedding_dim",
                                      f"{fc.embedding_dim} is above the limit of "
                                      f"{limits.MAX_EMBEDDING_DIM}")
                continue
        if fc.seq_multi_sep:
            validate_multi_values(fc, where)
        if fc.feature_type == _FT.SequenceFeature:
            if fc.sub_feature_type not in (_FT.IdFeature, _FT.RawFeature):
                raise ConfigError(f"{where}.sub_feature_type",
                                  "a SequenceFeature holds ids (IdFeature) or numbers "
                                  "(RawFeature)")
            if fc.max_seq_len > limits.MAX_SEQUENCE_LENGTH:
                raise ConfigError(f"{where}.max_seq_len",
                                  f"{fc.max_seq_len} is above the limit of "
                                  f"{limits.MAX_SEQUENCE_LENGTH}")
        if fc.embedding_dim > limits.MAX_EMBEDDING_DIM:
            raise ConfigError(f"{where}.embedding_dim",
                              f"{fc.embedding_dim} is above the limit of "
                              f"{limits.MAX_EMBEDDING_DIM}")
        table = fc.embedding_name or fc.feature_name
        # a SequenceFeature's ids share a table with IdFeatures (looked up per position)
        shared_kind = ("IdFeature" if fc.feature_type == _FT.SequenceFeature
                       and fc.sub_feature_type == _FT.IdFeature else kind)
        shape = (fc.embedding_dim, fc.hash_bucket_size, fc.num_buckets, len(fc.boundaries),
                 shared_kind, dyn, fc.combiner)
        if table in tables and tables[table] != shape:
            raise ConfigError(f"{where}.embedding_name",
                              f"features sharing embedding {table!r} must have the same "
                              "embedding_dim, bucket sizes or boundaries, type, combiner and "
                              "dynamic-table settings")
        tables.setdefault(table, shape)
    return by_name


def validate_model_common(
    config: pipeline_pb2.EasyRecConfig, features: dict[str, FeatureConfig]
) -> None:
    """Checks what every model class shares: losses, classes, feature groups.

    A class's own settings, and which group contents it takes, are checked by
    ``odl.models.model_registry.validate_model``.

    Args:
        config: the config.
        features: the features by name, as :func:`validate_features` returns them.

    Raises:
        ConfigError: naming the first offending field.
    """
    if not config.HasField("model_config"):
        raise ConfigError("model_config", "required")
    mc = config.model_config
    if mc.embedding_regularization < 0:
        raise ConfigError("model_config.embedding_regularization", "must be >= 0")
    validate_losses(mc.losses, "model_config.losses", mc.loss_weight_strategy)
    if mc.num_class > 1:
        _validate_classes(config)
    if not mc.feature_groups:
        raise ConfigError("model_config.feature_groups", "required")
    groups: dict[str, int] = {}
    raw_read = raw_sequence_groups(mc.backbone)
    if mc.WhichOneof("model") in ("cmbf", "uniter") or (
            mc.WhichOneof("model") == "dbmtl" and (mc.dbmtl.HasField("bottom_uniter")
                                                   or mc.dbmtl.HasField("bottom_cmbf"))):
        raw_read = raw_read | {"text"}  # (its positions are tokens: odl.models.multimodal_inputs)
    for i, g in enumerate(mc.feature_groups):
        where = f"model_config.feature_groups[{i}]"
        if not g.group_name:
            raise ConfigError(f"{where}.group_name", "required")
        if g.group_name in groups:
            raise ConfigError(f"{where}.group_name", f"duplicate group {g.group_name!r}")
        groups[g.group_name] = i
        if not g.feature_names:
            raise ConfigError(f"{where}.feature_names", "a group needs at least one feature")
        seen = set()
        for j, name in enumerate(g.feature_names):
            if name not in features:
                raise ConfigError(f"{where}.feature_names[{j}]", f"no feature named {name!r}")
            if (features[name].feature_type == _FT.SequenceFeature
                    and g.group_name not in raw_read):
                _check_group_sequence(features[name], f"{where}.feature_names[{j}]")
            if name in seen:
                raise ConfigError(f"{where}.feature_names[{j}]", f"{name!r} listed twice")
            seen.add(name)


def _validate_classes(config: pipeline_pb2.EasyRecConfig) -> None:
    """``num_class`` C > 1: a single-task model trained by softmax cross entropy."""
    mc = config.model_config
    if is_multi_task_model(mc):
        raise ConfigError("model_config.num_class",
                          f"{mc.model_class}'s tasks are binary (num_class 1); a task tower's "
                          "num_class is not implemented")
    if mc.num_class > limits.MAX_CLASSES:
        raise ConfigError("model_config.num_class",
                          f"{mc.num_class} is above the limit of {limits.MAX_CLASSES}")
    terms = [(f"model_config.losses[{i}].loss_type", t.loss_type)
             for i, t in enumerate(mc.losses)] or [("model_config.loss_type", mc.loss_type)]
    for where, kind in terms:
        if kind == pipeline_pb2.LossType.ZILN_LOSS:  # three logits, not classes
            continue
        if kind not in SOFTMAX_LOSS_TYPES:
            raise ConfigError(where, f"num_class {mc.num_class} trains softmax cross entropy: "
                                     "the loss must be CLASSIFICATION, CROSS_ENTROPY_LOSS or "
                                     f"JRC_LOSS, not {pipeline_pb2.LossType.Name(kind)}")


def validate_losses(losses: Any, prefix: str, strategy: int = 0,
                    calibration: bool = False) -> None:
    """Checks the settings of each loss term (``model_config.losses`` or a task's).

    ``calibration``: the terms are a multi-task model's task tower's, which may hold an
    ``ORDER_CALIBRATE_LOSS`` beside a prediction loss.
    """
    order = pipeline_pb2.LossType.ORDER_CALIBRATE_LOSS
    if any(loss.loss_type == order for loss in losses):
        i = next(i for i, loss in enumerate(losses) if loss.loss_type == order)
        if not calibration:
            raise ConfigError(f"{prefix}[{i}].loss_type",
                              "ORDER_CALIBRATE_LOSS compares a multi-task model's tasks: it "
                              "belongs in a task tower of MMoE, DBMTL or MultiTaskModel")
        if all(loss.loss_type == order for loss in losses):
            raise ConfigError(f"{prefix}[{i}].loss_type",
                              "ORDER_CALIBRATE_LOSS trains beside a prediction loss of the "
                              "task: add one (e.g. CLASSIFICATION)")
    for i, loss in enumerate(losses):
        where = f"{prefix}[{i}]"
        if loss.learn_loss_weight and strategy != pipeline_pb2.EasyRecModel.Uncertainty:
            raise ConfigError(f"{where}.learn_loss_weight",
                              "a learned loss weight needs model_config.loss_weight_strategy: "
                              "Uncertainty (EasyRec refuses it otherwise too)")
        if loss.weight <= 0:
            raise ConfigError(f"{where}.weight", "must be > 0")
        if loss.binary_focal_loss.gamma < 0:
            raise ConfigError(f"{where}.binary_focal_loss.gamma", "must be >= 0")
        if loss.binary_focal_loss.HasField("alpha") and not 0 < loss.binary_focal_loss.alpha < 1:
            raise ConfigError(f"{where}.binary_focal_loss.alpha", "must be in (0, 1)")
        if loss.pairwise_logistic_loss.temperature <= 0:
            raise ConfigError(f"{where}.pairwise_logistic_loss.temperature", "must be > 0")
        for name in ("pairwise_loss", "pairwise_logistic_loss"):
            if getattr(loss, name).session_name:
                raise ConfigError(f"{where}.{name}.session_name",
                                  "pairs within a session are an EasyRec feature that odl does "
                                  "not implement yet (pairs are formed over the batch)")


def sequence_combiner_width(fc: FeatureConfig) -> int:
    """Width of the vector a SequenceFeature's ``sequence_combiner`` makes (0: none set)."""
    which = fc.sequence_combiner.WhichOneof("combiner")
    if which == "attention":
        return int(fc.embedding_dim)
    if which == "text_cnn":
        return sum(int(n) for n in fc.sequence_combiner.text_cnn.num_filters)
    return 0


def backbone_blocks(backbone: pipeline_pb2.BackboneTower
                    ) -> list[tuple[str, pipeline_pb2.BackboneBlock]]:
    """Every block of a backbone and of its packages, with its config path."""
    out = [(f"model_config.backbone.blocks[{i}]", b) for i, b in enumerate(backbone.blocks)]
    for k, pkg in enumerate(backbone.packages):
        out += [(f"model_config.backbone.packages[{k}].blocks[{i}]", b)
                for i, b in enumerate(pkg.blocks)]
    return out


def raw_sequence_groups(backbone: pipeline_pb2.BackboneTower) -> set[str]:
    """The groups a backbone reads only with ``output_seq_and_normal_feature``.

    Their SequenceFeatures are handed out position by position (the RankModel's raw
    sequence input), so they need no ``sequence_combiner``.
    """
    raw, combined = set(), set()
    for _where, b in backbone_blocks(backbone):
        for inp in b.inputs:
            if inp.WhichOneof("name") != "feature_group_name":
                continue
            seq = (b.WhichOneof("layer") == "input_layer"
                   and b.input_layer.output_seq_and_normal_feature)
            (raw if seq else combined).add(inp.feature_group_name)
    return raw - combined


def item_width(fc: FeatureConfig) -> int:
    """A SequenceFeature's width per position as target attention reads it.

    Its ``embedding_dim`` (embedded, or numbers projected), else its numbers per position.
    """
    if dense_sequence(fc) and not fc.embedding_dim:
        return int(fc.raw_input_dim)
    return int(fc.embedding_dim)


def _check_group_sequence(fc: FeatureConfig, where: str) -> None:
    """A SequenceFeature listed in a feature group: its combiner."""
    name = fc.feature_name
    which = fc.sequence_combiner.WhichOneof("combiner")
    if dense_sequence(fc):
        raise ConfigError(where, f"SequenceFeature {name!r} holds numbers without boundaries: "
                                 "read by target attention only (a DIN tower, a group's "
                                 "sequence_features; or add boundaries to embed its buckets "
                                 "and combine them in a group)")
    if which is None:
        raise ConfigError(where, f"SequenceFeature {name!r} in a feature group needs a "
                                 "sequence_combiner (attention {} or text_cnn {...}); a DIN "
                                 "tower reads sequences through model_config.seq_att_groups")
    if which == "text_cnn":
        t = fc.sequence_combiner.text_cnn
        cw = f"{where} ({name}.sequence_combiner.text_cnn)"
        if not t.filter_sizes or len(t.filter_sizes) != len(t.num_filters):
            raise ConfigError(cw, "needs one num_filters entry per filter_sizes entry")
        if any(k <= 0 for k in t.filter_sizes) or any(f <= 0 for f in t.num_filters):
            raise ConfigError(cw, "filter sizes and counts must be > 0")
        if t.activation not in ("relu", "tf.nn.relu"):
            raise ConfigError(cw, f"activation {t.activation!r}: only relu is implemented")
        if t.HasField("mlp"):
            raise ConfigError(cw, "a sequence_combiner's mlp is not implemented (the "
                                  "backbone's TextCNN layer reads it)")
        positions = t.pad_sequence_length or fc.max_seq_len or 50
        if max(t.filter_sizes) > positions:
            raise ConfigError(cw, f"a filter of {max(t.filter_sizes)} is longer than the "
                                  f"{positions} positions")


def validate_sequence_groups(config: pipeline_pb2.EasyRecConfig,
                              features: dict[str, FeatureConfig], groups: Any = None,
                              prefix: str = "model_config.seq_att_groups",
                              dense_parts: bool = True) -> None:
    """Sequence attention groups: keys are (non-sequence) features, sequences as wide.

    ``seq_att_groups`` (DIN towers), or a feature group's ``sequence_features`` (a pooling
    one reads no key). Keys and sequences may be dense numbers too, each number one column,
    with ``dense_parts`` (not in WideAndDeep's deep groups) and not for pooling. A group's
    ``sequence_features`` (not a DIN tower's group) may also have auxiliary sequences, leave
    the key out, make the key as wide as the items (``allow_key_transform``) and read
    sequences of several numbers per position or projected ones; a DIN tower ignores those
    settings, as EasyRec's does (warned).
    """
    seen: set[str] = set()
    din_tower_groups = groups is None
    for i, g in enumerate(config.model_config.seq_att_groups if groups is None else groups):
        where = f"{prefix}[{i}]"
        if not g.group_name or g.group_name in seen:
            raise ConfigError(f"{where}.group_name", "required and unique")
        seen.add(g.group_name)
        if not g.seq_att_map:
            raise ConfigError(f"{where}.seq_att_map", "at least one key / hist_seq pairing")
        if g.pooling and (g.pooling not in ("mean", "sum") or g.HasField("attn_mlp")
                          or g.HasField("seq_dnn")):
            raise ConfigError(f"{where}.pooling", "mean or sum, without an attention MLP")
        key_width = hist_width = 0
        lengths: set[int] = set()
        din_towers = dense_parts and not g.pooling  # dense keys and sequences allowed
        for j, m in enumerate(g.seq_att_map):
            mw = f"{where}.seq_att_map[{j}]"
            if (not m.key and not g.pooling) or not m.hist_seq:
                raise ConfigError(mw, "needs a key and a hist_seq")
            for k in m.key:
                fc = features.get(k)
                dense_key = (din_towers and fc is not None
                             and fc.feature_type == _FT.RawFeature and not fc.boundaries
                             and not fc.embedding_dim)
                if fc is None or fc.feature_type == _FT.SequenceFeature or not (
                        embedded_feature(fc) or dense_key):
                    raise ConfigError(f"{mw}.key", f"{k!r} is not an embedded (non-sequence) "
                                                   "feature" + (" or a dense RawFeature"
                                                                if dense_parts else ""))
                key_width += fc.raw_input_dim if dense_key else fc.embedding_dim
            for h in m.hist_seq:
                fc = features.get(h)
                if fc is None or fc.feature_type != _FT.SequenceFeature:
                    raise ConfigError(f"{mw}.hist_seq", f"{h!r} is not a SequenceFeature")
                if dense_sequence(fc) and not din_towers:
                    raise ConfigError(f"{mw}.hist_seq",
                                      f"{h!r} is a SequenceFeature of numbers without "
                                      "boundaries: read by target attention in the tower and "
                                      "multi-task models only (add boundaries to embed its "
                                      "buckets)")
                if din_tower_groups and dense_sequence(fc) and (
                        fc.embedding_dim or fc.raw_input_dim != 1):
                    raise ConfigError(f"{mw}.hist_seq",
                                      f"{h!r}: projected numbers (embedding_dim) or several "
                                      "per position are read by a feature group's "
                                      "sequence_features, not by a DIN tower")
                hist_width += item_width(fc)
                lengths.add(fc.max_seq_len)
            for a in m.aux_hist_seq:
                fc = features.get(a)
                if fc is None or fc.feature_type != _FT.SequenceFeature:
                    raise ConfigError(f"{mw}.aux_hist_seq", f"{a!r} is not a SequenceFeature")
                if g.pooling or (dense_sequence(fc) and not din_towers):
                    raise ConfigError(f"{mw}.aux_hist_seq",
                                      "auxiliary sequences are read by a feature group's "
                                      "sequence_features with attention")
                if din_tower_groups:
                    logger.warning("%s.aux_hist_seq has no effect in a DIN tower and is "
                                   "ignored (EasyRec's DIN tower does not read it either; a "
                                   "feature group's sequence_features do)", mw)
                else:
                    lengths.add(fc.max_seq_len)
        if g.pooling:
            key_width = hist_width
        for field in ("need_key_feature", "allow_key_transform", "transform_dnn"):
            default = pipeline_pb2.SeqAttGroupConfig.DESCRIPTOR.fields_by_name[field]
            if not g.HasField(field) or getattr(g, field) == default.default_value:
                continue
            if din_tower_groups:
                logger.warning("%s.%s has no effect in a DIN tower and is ignored (EasyRec's "
                               "DIN tower does not read it either; a feature group's "
                               "sequence_features do)", where, field)
            elif g.pooling or g.HasField("attn_mlp"):
                raise ConfigError(f"{where}.{field}",
                                  "read by a feature group's sequence_features with EasyRec's "
                                  "attention (not an encoder or pooling)")
        if key_width != hist_width and (din_tower_groups or not g.allow_key_transform):
            raise ConfigError(where, f"the keys' embeddings ({key_width} wide) and the "
                                     f"sequences' ({hist_width}) must be as wide"
                                     + ("" if din_tower_groups else
                                        ", or allow_key_transform: true"))
        if len(lengths) > 1:
            raise ConfigError(where, "the group's SequenceFeatures need one max_seq_len")
        if g.HasField("seq_dnn"):
            validate_dnn(g.seq_dnn, f"{where}.seq_dnn", required=True)
            if g.seq_dnn.hidden_units[-1] != 1:
                raise ConfigError(f"{where}.seq_dnn.hidden_units",
                                  "the attention DNN ends in a layer of 1 unit (the score)")


def validate_dnn(dnn: Any, where: str, required: bool) -> None:
    """Checks a ``DNN`` message: layers, units, dropout ratios, activation.

    Args:
        dnn: the ``DNN``.
        where: its dotted path.
        required: it needs at least one hidden layer.

    Raises:
        ConfigError: naming the offending field.
    """
    if required and not dnn.hidden_units:
        raise ConfigError(f"{where}.hidden_units", "required (e.g. [256, 128, 64])")
    if len(dnn.hidden_units) > limits.MAX_HIDDEN_LAYERS:
        raise ConfigError(f"{where}.hidden_units",
                          f"{len(dnn.hidden_units)} layers is above the limit of "
                          f"{limits.MAX_HIDDEN_LAYERS}")
    for i, units in enumerate(dnn.hidden_units):
        if units <= 0:
            raise ConfigError(f"{where}.hidden_units[{i}]", "must be > 0")
        if units > limits.MAX_HIDDEN_UNITS:
            raise ConfigError(f"{where}.hidden_units[{i}]",
                              f"{units:,} units is above the limit of "
                              f"{limits.MAX_HIDDEN_UNITS:,}")
    if dnn.dropout_ratio and len(dnn.dropout_ratio) != len(dnn.hidden_units):
        raise ConfigError(f"{where}.dropout_ratio",
                          "give one ratio per hidden layer (or none)")
    for i, r in enumerate(dnn.dropout_ratio):
        if not 0.0 <= r < 1.0:
            raise ConfigError(f"{where}.dropout_ratio[{i}]", "must be in [0, 1)")
    if dnn.activation not in SUPPORTED_ACTIVATIONS and (
            dnn.activation.lower() not in SUPPORTED_ACTIVATIONS):
        raise ConfigError(f"{where}.activation",
                          f"expected one of {sorted(SUPPORTED_ACTIVATIONS)}, got "
                          f"{dnn.activation!r}")


def check_dropout_group(mc: pipeline_pb2.EasyRecModel, group: pipeline_pb2.FeatureGroupConfig,
                        features: dict[str, Any], with_sequences: bool = False) -> None:
    """``model_config.variational_dropout`` over ``group``: pooled and dense features.

    Args:
        mc: the model config (nothing is checked without its ``variational_dropout``).
        group: a feature group whose input the model drops.
        features: feature name -> its config.
        with_sequences: the model drops a group with sequences too (the multi-task models).

    Raises:
        ConfigError: the group holds sequences and the model does not drop those.
    """
    if not mc.HasField("variational_dropout") or with_sequences:
        return
    if group.sequence_features or group.sequence_groups or any(
            features[n].feature_type == pipeline_pb2.FeatureConfig.SequenceFeature
            for n in group.feature_names if n in features):
        raise ConfigError("model_config.variational_dropout",
                          f"feature group {group.group_name!r} holds sequences: variational "
                          "dropout is implemented for groups of pooled and dense features only")
