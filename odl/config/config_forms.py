"""TorchEasyRec's and EasyRec's other spellings of what odl implements, rewritten to one form.

:func:`normalize_config_forms` rewrites a parsed config in place so that the rest of odl
reads one form of each setting: EasyRec's ``TagFeature`` as the multi-valued ``IdFeature``
it is; TorchEasyRec's nested feature messages (``id_feature {}``, ``raw_feature {}``,
``sequence_feature {}``) as EasyRec's flat features; TorchEasyRec's sequence groups and
encoders as EasyRec's sequence attention groups; TorchEasyRec's names of model settings
(``mlp``, ``final``, ``group_type``, ``losses { binary_cross_entropy {} }``, ...) as
EasyRec's. The loader (:mod:`odl.config.pipeline_config`) and the validator
(:mod:`odl.config.config_validation`) both call it; it is idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from odl.config.config_error import ConfigError
from odl.config.feature_settings import (
    expand_config_names,
    expand_shared_names,
    raw_num_buckets_to_boundaries,
)
from odl.config.model_classes import classes_of_message, task_towers
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = ["normalize_config_forms"]


def normalize_config_forms(config: pipeline_pb2.EasyRecConfig) -> None:
    """Rewrites EasyRec's and TorchEasyRec's other spellings of what odl implements, in place.

    * ``feature_type: TagFeature`` (tags split on ``separator``) becomes the multi-valued
      ``IdFeature`` it is, its weights (a second input, or ``kv_separator``) kept;
    * names ``c[1-3]`` of input fields (with ``data_config.auto_expand_input_fields``) and of
      feature groups become ``c1, c2, c3``, and a RawFeature's ``num_buckets`` over
      ``min_val`` / ``max_val`` becomes its boundaries
      (:mod:`odl.config.feature_settings`); EasyRec's ``sequence_length`` of a
      SequenceFeature becomes ``max_seq_len``;
    * TorchEasyRec's ``deepfm { deep {} final {} }`` become ``dnn`` / ``final_dnn``; its
      ``*_mlp`` / ``mlp`` of MMoE, DBMTL, RocketLaunching and task towers become EasyRec's
      ``*_dnn`` / ``dnn``;
    * TorchEasyRec's ``losses { binary_cross_entropy {} }`` (of the model or of a task tower)
      becomes ``loss_type: CLASSIFICATION``, as does ``softmax_cross_entropy {}`` of a
      ``num_class`` >= 2 model (CLASSIFICATION's softmax form there);
    * TorchEasyRec's ``train_config.num_epochs`` moves to ``data_config.num_epochs`` when that
      is unset, its ``data_config.delimiter`` becomes ``separator``;
    * TorchEasyRec's ``feature_configs { id_feature {} }`` / ``raw_feature {}`` become EasyRec's
      flat ``IdFeature`` / ``RawFeature`` (input column: the expression after ``:``, or the
      feature name), and ``feature_groups[].group_type`` becomes ``wide_deep``; such a config
      without ``data_config.input_fields`` gets them derived (:func:`_derive_input_fields`);
      their ``trainable`` (a sequence's features' too) is the flat feature's.

    Idempotent; the loader and the validator both call it.

    Args:
        config: a parsed config.

    Raises:
        ConfigError: a form that cannot be rewritten (both names given, tag weights).
    """
    ft = pipeline_pb2.FeatureConfig.FeatureType
    expand_config_names(config)
    expand_shared_names(config)
    torcheasyrec_features = _flatten_torcheasyrec_sequences(config)
    for path, fc in _feature_entries(config):
        torcheasyrec_features |= fc.HasField("id_feature") or fc.HasField("raw_feature")
        _flatten_torcheasyrec_feature(path, fc)
        _sequence_length_to_max_seq_len(path, fc)
        raw_num_buckets_to_boundaries(fc)
        if fc.feature_type == ft.RawFeature and fc.hash_bucket_size:
            logger.warning("%s.hash_bucket_size has no effect on a RawFeature and is ignored "
                           "(as EasyRec does): a raw value is dense, bucketized by boundaries, "
                           "or projected by embedding_dim, never hashed", path)
            fc.ClearField("hash_bucket_size")
        if fc.feature_type != ft.TagFeature:
            continue
        fc.feature_type = ft.IdFeature
    if torcheasyrec_features and not config.data_config.input_fields:
        _derive_input_fields(config)
    mc = config.model_config
    for i, g in enumerate(mc.feature_groups):
        if g.HasField("group_type"):
            if g.HasField("wide_deep") and g.wide_deep != g.group_type:
                raise ConfigError(f"model_config.feature_groups[{i}].group_type",
                                  "give one of group_type (TorchEasyRec) and wide_deep (EasyRec)")
            g.wide_deep = g.group_type
            g.ClearField("group_type")
    _sequence_groups_to_attention(config)
    if mc.HasField("multi_tower_din"):  # TorchEasyRec's DIN, read through multi_tower
        src = pipeline_pb2.TzMultiTowerDIN()
        src.CopyFrom(mc.multi_tower_din)  # setting multi_tower clears it (oneof model)
        mc.multi_tower.towers.extend(src.towers)
        mc.multi_tower.din_towers.extend(src.din_towers)
        if src.HasField("final"):
            mc.multi_tower.final.CopyFrom(src.final)
        mc.multi_tower.l2_regularization = 0.0  # TorchEasyRec's models have none
        if not mc.model_class:
            mc.model_class = classes_of_message("multi_tower_din")[0]
    if mc.HasField("deepfm"):
        _rename(mc.deepfm, "model_config.deepfm", (("deep", "dnn"), ("final", "final_dnn")))
    if mc.HasField("multi_tower"):
        _rename(mc.multi_tower, "model_config.multi_tower", (("final", "final_dnn"),))
        for i, tower in enumerate(mc.multi_tower.towers):
            _rename(tower, f"model_config.multi_tower.towers[{i}]", (("mlp", "dnn"),))
    if mc.HasField("dcn_v2"):
        _rename(mc.dcn_v2, "model_config.dcn_v2", (("final", "final_dnn"),))
    if mc.HasField("mmoe"):
        _rename(mc.mmoe, "model_config.mmoe", (("expert_mlp", "expert_dnn"),))
    if mc.HasField("dbmtl"):
        _rename(mc.dbmtl, "model_config.dbmtl",
                (("bottom_mlp", "bottom_dnn"), ("expert_mlp", "expert_dnn")))
    if mc.HasField("rocket_launching"):
        _rename(mc.rocket_launching, "model_config.rocket_launching",
                (("share_mlp", "share_dnn"), ("booster_mlp", "booster_dnn"),
                 ("light_mlp", "light_dnn")))
    losses = list(mc.losses)
    for where, task in task_towers(mc):
        _rename(task, where, (("mlp", "dnn"), ("relation_mlp", "relation_dnn")))
        losses += list(task.losses)
    for i, tower in enumerate(mc.esmm.groups if mc.HasField("esmm") else ()):
        _rename(tower, f"model_config.esmm.groups[{i}]", (("mlp", "dnn"),))
    for loss in losses:
        if loss.HasField("binary_cross_entropy"):
            loss.loss_type = pipeline_pb2.CLASSIFICATION
            loss.ClearField("binary_cross_entropy")
        if loss.HasField("softmax_cross_entropy"):
            if loss.softmax_cross_entropy.label_smoothing:
                raise ConfigError("model_config.losses.softmax_cross_entropy.label_smoothing",
                                  "label smoothing is not implemented (0 only)")
            if mc.num_class < 2:
                raise ConfigError("model_config.losses.softmax_cross_entropy",
                                  "a softmax over classes needs model_config.num_class >= 2")
            loss.loss_type = pipeline_pb2.CLASSIFICATION
            loss.ClearField("softmax_cross_entropy")
    dc = config.data_config
    if dc.HasField("delimiter"):  # TorchEasyRec's name of the record separator
        if dc.HasField("separator") and dc.separator != dc.delimiter:
            raise ConfigError("data_config.delimiter",
                              "give one of delimiter (TorchEasyRec) and separator (EasyRec)")
        dc.separator = dc.delimiter
        dc.ClearField("delimiter")
    tc = config.train_config
    if tc.HasField("num_epochs"):
        if not config.data_config.HasField("num_epochs"):
            config.data_config.num_epochs = tc.num_epochs
        tc.ClearField("num_epochs")


def _sequence_length_to_max_seq_len(path: str, fc: pipeline_pb2.FeatureConfig) -> None:
    """EasyRec's ``sequence_length`` as ``max_seq_len`` (the positions kept).

    EasyRec pads a SequenceFeature of numbers read as dense positions to
    ``sequence_length`` and reads the other sequences whole; odl keeps the first
    ``max_seq_len`` positions of every sequence, so the written length is the one kept. On
    a feature that is not a sequence it has no effect (warned).

    Raises:
        ConfigError: ``max_seq_len`` written too, with another value.
    """
    if not fc.HasField("sequence_length"):
        return
    n = int(fc.sequence_length)
    fc.ClearField("sequence_length")
    if fc.feature_type != pipeline_pb2.FeatureConfig.SequenceFeature:
        logger.warning("%s.sequence_length has no effect on a feature that is not a "
                       "SequenceFeature and is ignored (as EasyRec does)", path)
        return
    if fc.HasField("max_seq_len") and fc.max_seq_len != n:
        raise ConfigError(f"{path}.sequence_length",
                          f"{n} differs from max_seq_len {fc.max_seq_len}: give one of them "
                          "(sequence_length is EasyRec's name of max_seq_len)")
    fc.max_seq_len = n


def _flatten_torcheasyrec_sequences(config: pipeline_pb2.EasyRecConfig) -> bool:
    """TorchEasyRec's ``sequence_feature {}`` entries into flat SequenceFeatures.

    Each ``id_feature`` inside becomes the SequenceFeature ``<sequence_name>__<feature_name>``
    reading the column of that name (items split on ``sequence_delim``, the first
    ``sequence_length`` kept), with the id feature's buckets, dim and embedding name.

    Returns:
        Whether there was one (the config is TorchEasyRec's form).
    """
    ft = pipeline_pb2.FeatureConfig.FeatureType
    found = False
    for container in (config.feature_configs, config.feature_config.features):
        if not any(fc.HasField("sequence_feature") for fc in container):
            continue
        found = True
        flat = []
        for fc in container:
            if not fc.HasField("sequence_feature"):
                flat.append(fc)
                continue
            seq = fc.sequence_feature
            for sub in seq.features:
                raw = sub.HasField("raw_feature")
                tz = sub.raw_feature if raw else sub.id_feature
                name = f"{seq.sequence_name}__{tz.feature_name}"
                out = pipeline_pb2.FeatureConfig(
                    feature_name=name, feature_type=ft.SequenceFeature,
                    separator=seq.sequence_delim, max_seq_len=seq.sequence_length,
                    sub_feature_type=ft.RawFeature if raw else ft.IdFeature)
                out.input_names.append(name)
                for field in ("hash_bucket_size", "num_buckets", "embedding_dim",
                              "embedding_name"):
                    if field in tz.DESCRIPTOR.fields_by_name and tz.HasField(field):
                        setattr(out, field, getattr(tz, field))
                if raw:
                    out.boundaries.extend(tz.boundaries)
                    if not tz.boundaries:  # dense positions: nothing is embedded
                        out.ClearField("embedding_dim")
                if tz.HasField("trainable"):
                    out.trainable = tz.trainable
                flat.append(out)
        del container[:]
        container.extend(flat)
    return found


def _sequence_groups_to_attention(config: pipeline_pb2.EasyRecConfig) -> None:
    """TorchEasyRec's sequence groups into EasyRec's sequence attention forms.

    A SEQUENCE feature group becomes a ``seq_att_groups`` entry (a DIN tower's input); a
    DEEP group's ``sequence_groups`` read by its ``sequence_encoders`` become the group's
    ``sequence_features``, one per encoder in encoder order (:func:`_encoders_to_attention`).
    In both, the group's SequenceFeatures are the sequence, its other features the query
    (key).

    Raises:
        ConfigError: TorchEasyRec's rules for sequence groups and encoders broken.
    """
    mc = config.model_config
    sequences = {fc.feature_name for _p, fc in _feature_entries(config)
                 if fc.feature_type == pipeline_pb2.FeatureConfig.SequenceFeature}
    keep = []
    for i, g in enumerate(mc.feature_groups):
        if g.sequence_groups or g.sequence_encoders:
            _encoders_to_attention(g, f"model_config.feature_groups[{i}]", sequences)
        if g.wide_deep != pipeline_pb2.SEQUENCE:
            keep.append(g)
            continue
        att = mc.seq_att_groups.add(group_name=g.group_name)
        att.seq_att_map.add(key=[f for f in g.feature_names if f not in sequences],
                            hist_seq=[f for f in g.feature_names if f in sequences])
    if len(keep) != len(mc.feature_groups):
        kept = [pipeline_pb2.FeatureGroupConfig.FromString(g.SerializeToString()) for g in keep]
        del mc.feature_groups[:]
        mc.feature_groups.extend(kept)


def _encoders_to_attention(group: pipeline_pb2.FeatureGroupConfig, where: str,
                           sequences: set[str]) -> None:
    """A DEEP group's ``sequence_groups`` / ``sequence_encoders`` into ``sequence_features``.

    TorchEasyRec's rules: both or neither are given; an encoder without ``input`` reads the
    only sequence group (which may be unnamed); every sequence group is read by an encoder.
    A DIN encoder becomes a target attention with ``attn_mlp``, a pooling encoder one with
    ``pooling``.
    """
    if group.wide_deep != pipeline_pb2.DEEP:
        raise ConfigError(f"{where}.sequence_groups",
                          "sequence_groups and sequence_encoders belong to a DEEP group")
    if not group.sequence_groups or not group.sequence_encoders:
        raise ConfigError(f"{where}.sequence_encoders",
                          "give both sequence_groups and sequence_encoders (an encoder reads "
                          "a sequence group)")
    named = {}
    for j, sg in enumerate(group.sequence_groups):
        name = sg.group_name or (group.group_name if len(group.sequence_groups) == 1 else "")
        if not name or name in named:
            raise ConfigError(f"{where}.sequence_groups[{j}].group_name",
                              "several sequence_groups need distinct names")
        hists = [f for f in sg.feature_names if f in sequences]
        if not hists:
            raise ConfigError(f"{where}.sequence_groups[{j}].feature_names",
                              f"sequence group {name!r} names no sequence feature")
        named[name] = ([f for f in sg.feature_names if f not in sequences], hists)
    read = set()
    for j, enc in enumerate(group.sequence_encoders):
        kind = enc.WhichOneof("seq_module")
        if kind is None:
            raise ConfigError(f"{where}.sequence_encoders[{j}]", "names no encoder")
        settings = getattr(enc, kind)
        name = settings.input or (next(iter(named)) if len(named) == 1 else "")
        if name not in named:
            raise ConfigError(f"{where}.sequence_encoders[{j}].{kind}.input",
                              f"must name one of the sequence_groups {sorted(named)}")
        keys, hists = named[name]
        # a group read by several encoders: one attention group each, named apart
        att = group.sequence_features.add(group_name=name if name not in read else
                                          f"{name}#{j}")
        read.add(name)
        att.seq_att_map.add(key=keys, hist_seq=hists)
        if kind == "din_encoder":
            if not settings.HasField("attn_mlp"):
                raise ConfigError(f"{where}.sequence_encoders[{j}].din_encoder.attn_mlp",
                                  "a DIN encoder needs its attn_mlp")
            att.attn_mlp.CopyFrom(settings.attn_mlp)
        else:
            if settings.pooling_type not in ("mean", "sum"):
                raise ConfigError(f"{where}.sequence_encoders[{j}].pooling_encoder.pooling_type",
                                  f"expected mean or sum, got {settings.pooling_type!r}")
            att.pooling = settings.pooling_type
    unread = [n for n in named if n not in read]
    if unread:
        raise ConfigError(f"{where}.sequence_encoders",
                          f"sequence groups {unread} are read by no encoder")
    group.ClearField("sequence_groups")
    group.ClearField("sequence_encoders")


def _derive_input_fields(config: pipeline_pb2.EasyRecConfig) -> None:
    """``data_config.input_fields`` of a TorchEasyRec config that names none.

    TorchEasyRec reads the columns from its table's schema; a stream's records need them
    named: the label fields (DOUBLE), then every feature's input columns in feature order
    (STRING for id features, DOUBLE for raw ones), each once. JSON records are read by these
    names; CSV records must have the columns in this order.
    """
    dc = config.data_config
    ft = pipeline_pb2.FeatureConfig.FeatureType
    types = pipeline_pb2.DatasetConfig
    columns: dict[str, int] = {name: types.DOUBLE for name in dc.label_fields}
    for _path, fc in _feature_entries(config):
        kind = (types.DOUBLE if fc.feature_type == ft.RawFeature and fc.raw_input_dim == 1
                else types.STRING)
        for name in fc.input_names:
            columns.setdefault(name, kind)
    for name, kind in columns.items():
        dc.input_fields.add(input_name=name, input_type=kind)
    logger.warning("data_config.input_fields is not given (TorchEasyRec takes the columns from "
                   "its table's schema): odl reads the columns %s (JSON records: by name; CSV: "
                   "in this order)", ", ".join(f"{n}:{types.FieldType.Name(k)}"
                                                for n, k in columns.items()))


def _rename(msg: Any, where: str, pairs: tuple[tuple[str, str], ...]) -> None:
    """Moves TorchEasyRec's ``alias`` fields of ``msg`` to EasyRec's ``name`` (one of the two)."""
    for alias, name in pairs:
        if msg.HasField(alias):
            if msg.HasField(name):
                raise ConfigError(f"{where}.{alias}",
                                  f"give one of {alias} (TorchEasyRec) and {name} (EasyRec)")
            getattr(msg, name).CopyFrom(getattr(msg, alias))
            msg.ClearField(alias)


_TZ_FIELDS = {"id_feature": ("feature_name", "hash_bucket_size", "num_buckets", "embedding_dim",
                              "embedding_name", "separator"),
              "raw_feature": ("feature_name", "embedding_dim", "embedding_name")}


def _flatten_torcheasyrec_feature(path: str, fc: pipeline_pb2.FeatureConfig) -> None:
    """``feature_configs { id_feature { ... } }`` / ``raw_feature`` into EasyRec's flat form.

    The input column is the expression's part after ``:`` (``"user:user_id"`` reads column
    ``user_id``), or the feature name.
    """
    kind = ("id_feature" if fc.HasField("id_feature") else
            "raw_feature" if fc.HasField("raw_feature") else None)
    if kind is None:
        return
    tz = getattr(fc, kind)
    flat = [f.name for f, _v in fc.ListFields() if f.name not in (kind,)]
    if flat:
        raise ConfigError(f"{path}.{kind}",
                          f"give the feature either as {kind} {{ }} (TorchEasyRec) or with "
                          f"EasyRec's fields, not both ({', '.join(flat)} set)")
    ft = pipeline_pb2.FeatureConfig.FeatureType
    fc.feature_type = ft.IdFeature if kind == "id_feature" else ft.RawFeature
    for name in _TZ_FIELDS[kind]:
        if tz.HasField(name):
            setattr(fc, name, getattr(tz, name))
    column = tz.expression.split(":", 1)[-1].strip() if tz.expression else tz.feature_name
    fc.input_names.append(column)
    if tz.expression:
        fc.fg_expression = tz.expression
    if kind == "id_feature" and tz.HasField("pooling"):
        fc.combiner = tz.pooling
    if kind == "id_feature" and tz.weighted:  # TorchEasyRec's "id:weight" values
        fc.kv_separator = ":"
    if kind == "raw_feature":
        fc.boundaries.extend(tz.boundaries)
        fc.raw_input_dim = max(int(tz.value_dim), 1)
        fc.separator = tz.separator
        fc.normalizer = tz.normalizer
    if tz.HasField("trainable"):
        fc.trainable = tz.trainable
    fc.ClearField(kind)


def _feature_entries(
    config: pipeline_pb2.EasyRecConfig,
) -> Iterator[tuple[str, pipeline_pb2.FeatureConfig]]:
    """``(path, FeatureConfig)`` of both feature list forms, as written."""
    for i, fc in enumerate(config.feature_configs):
        yield f"feature_configs[{i}]", fc
    for i, fc in enumerate(config.feature_config.features):
        yield f"feature_config.features[{i}]", fc
