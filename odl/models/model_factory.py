"""Builds the model named by ``model_config.model_class`` (a ``CtrModel``).

Every model follows the contract of ``odl.models.ctr_model``; a new model class is added to
``odl.config.model_classes`` and to ``build_model``. DeepFM and WideAndDeep are one class
(``odl.models.deepfm.DeepFM``; WideAndDeep has no FM term); MultiTower and DCN are
``odl.models.tower_models.TowerModel``; MMoE and DBMTL are
``odl.models.multi_task_models.MultiTaskModel``.
"""

from __future__ import annotations

import logging

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.config.model_classes import (
    IMPLEMENTED_MODEL_CLASSES,
    is_multi_task_model,
    is_tower_model,
    multi_task_settings,
    sequence_attention_features,
    task_label_names,
    tower_settings,
    uses_fm,
    wide_deep_settings,
)
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.building_blocks import (
    SequenceBlock,
    SequencePool,
    TargetAttention,
    sequence_combiner,
)
from odl.models.ctr_model import CtrModel
from odl.models.deepfm import DeepFM
from odl.models.embedding_tables import build_embedding_layout
from odl.models.multi_task_models import MultiTaskModel
from odl.models.tower_models import TowerModel
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

SUPPORTED_MODELS = IMPLEMENTED_MODEL_CLASSES


def model_groups(
    model_config: pipeline_pb2.EasyRecModel, feature_builder: FeatureBuilder
) -> dict[str, list[str]]:
    """Splits the feature groups into deep / wide, embedded / dense feature lists.

    Args:
        model_config: the model config.
        feature_builder: the feature builder (which features exist, which are embedded).

    Returns:
        ``{"deep_sparse", "deep_dense", "wide_sparse", "wide_dense"}`` -> feature names, in
        group order without repeats (a deep group's SequenceFeatures: its
        :func:`sequence_blocks`).

    Raises:
        ConfigError: a group names an unknown feature.
    """
    sparse = set(feature_builder.sparse_feature_names)
    dense = _plain_dense(feature_builder)
    sequences = feature_builder.sequence_features
    out: dict[str, list[str]] = {k: [] for k in ("deep_sparse", "deep_dense", "wide_sparse",
                                                 "wide_dense")}
    for gi, g in enumerate(model_config.feature_groups):
        parts = []
        if g.wide_deep in (pipeline_pb2.DEEP, pipeline_pb2.WIDE_AND_DEEP):
            parts.append("deep")
        if g.wide_deep in (pipeline_pb2.WIDE, pipeline_pb2.WIDE_AND_DEEP):
            parts.append("wide")
        for f in g.feature_names:
            if f in sparse:
                kind = "sparse"
            elif f in dense:
                kind = "dense"
            elif f in sequences and parts == ["deep"]:
                continue  # combined with the group's other sequences (sequence_blocks)
            else:
                raise ConfigError(
                    f"model_config.feature_groups[{gi}].feature_names",
                    f"group {g.group_name!r} names unknown feature {f!r}")
            for p in parts:
                lst = out[f"{p}_{kind}"]
                if f not in lst:
                    lst.append(f)
    return out


def _plain_dense(feature_builder: FeatureBuilder) -> dict[str, list[str]]:
    """Dense features other than sequences -> their ``Batch.dense`` columns."""
    sequences = feature_builder.dense_sequence_features
    return {f: cols for f, cols in feature_builder.dense_feature_columns.items()
            if f not in sequences}


def _columns(feature_builder: FeatureBuilder, features: list[str]) -> list[str]:
    """The ``Batch.dense`` columns of dense features, feature after feature."""
    cols = feature_builder.dense_feature_columns
    return [c for f in features for c in cols[f]]


def build_model(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> CtrModel:
    """Builds the configured model (tables on the ``meta`` device, dense parts on CPU).

    Args:
        config: the pipeline config.
        feature_builder: the feature builder of the same config.

    Returns:
        The model.

    Raises:
        ConfigError: unknown model class or inconsistent groups/features.
    """
    mc = config.model_config
    if mc.model_class not in SUPPORTED_MODELS:
        raise ConfigError(
            "model_config.model_class",
            f"unknown model class {mc.model_class!r}; supported: {', '.join(SUPPORTED_MODELS)}")
    labels = list(config.data_config.label_fields) or ["label"]
    if is_multi_task_model(mc):
        return _build_multi_task_model(mc, feature_builder, labels,
                                       sequence_blocks(config, feature_builder))
    if is_tower_model(mc):
        return _build_tower_model(mc, feature_builder, labels[0],
                                  sequence_blocks(config, feature_builder))
    groups = model_groups(mc, feature_builder)
    field, settings = wide_deep_settings(mc)
    wide_dim = int(settings.wide_output_dim) or 1
    try:
        blocks = [b for g in mc.feature_groups if g.wide_deep == pipeline_pb2.DEEP
                  for b in sequence_blocks(config, feature_builder).get(g.group_name, [])]
        positions = [k for b in blocks for k in b.lookups if k not in groups["deep_sparse"]]
        layout = build_embedding_layout(
            feature_builder.table_specs, groups["deep_sparse"] + positions, groups["wide_sparse"],
            wide_dim, mixed_dims=not uses_fm(mc))
    except ValueError as e:
        raise ConfigError("model_config.feature_groups", str(e)) from e
    if not settings.dnn.hidden_units:
        raise ConfigError(f"model_config.{field}.dnn.hidden_units",
                          "at least one layer is needed")
    # EasyRec's projected raw features (embedding_dim, no boundaries) in the deep group
    fcs = {fc.feature_name: fc for fc in feature_configs(config)}
    dims = {n: int(fc.embedding_dim) for n, fc in fcs.items()}
    projected = [f for f in groups["deep_dense"] if dims.get(f, 0) > 0]
    deep_dense = [f for f in groups["deep_dense"] if f not in projected]
    widths = {f: len(c) for f, c in feature_builder.dense_feature_columns.items()}
    try:
        return DeepFM(layout, feature_builder.dense_feature_names,
                      _columns(feature_builder, deep_dense),
                      _columns(feature_builder, groups["wide_dense"]), mc,
                      output_name=labels[0], projected=_columns(feature_builder, projected),
                      projected_dim=dims[projected[0]] if projected else 0,
                      projected_widths=[widths[f] for f in projected],
                      sequences=blocks, deep_features=groups["deep_sparse"])
    except ValueError as e:
        raise ConfigError(f"model_config.{field}", str(e)) from e


def _embedded_and_dense(mc: pipeline_pb2.EasyRecModel, feature_builder: FeatureBuilder,
                        blocks: dict[str, list[SequenceBlock]] | None = None
                        ) -> dict[str, tuple[list[str], list[str]]]:
    """Feature group name -> (embedded features, dense features), in group order.

    A group's sequence blocks (:func:`sequence_blocks`) come last: their lookups after the
    embedded features, their dense columns then their length columns after the dense ones
    (``GroupSequences``' layout).
    """
    sparse = set(feature_builder.sparse_feature_names)
    dense = _plain_dense(feature_builder)
    positions = feature_builder.sequence_features
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for gi, g in enumerate(mc.feature_groups):
        emb, raw = [], []
        for f in g.feature_names:
            if f in sparse:
                emb.append(f)
            elif f in dense:
                raw += dense[f]
            elif f not in positions:
                raise ConfigError(f"model_config.feature_groups[{gi}].feature_names",
                                  f"group {g.group_name!r} names unknown feature {f!r}")
        group_blocks = (blocks or {}).get(g.group_name, [])
        for b in group_blocks:
            emb += list(b.lookups)
        raw += [c for b in group_blocks for c in b.dense]
        raw += [b.length_column for b in group_blocks]
        groups[g.group_name] = (emb, raw)
    return groups


# EasyRec's attention DNN of a feature group's sequence_features when seq_dnn is unset
DEFAULT_SEQ_DNN_UNITS = (128, 64, 32, 1)


def sequence_blocks(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder
                    ) -> dict[str, list[SequenceBlock]]:
    """Feature group name -> the parts of its input made from sequences, in order.

    Each SequenceFeature listed in the group (its positions, combined by its
    ``sequence_combiner``), then each of its ``sequence_features`` (a target attention:
    the keys, then the sequences' positions, into ``[attended sequence, key]``).
    """
    fcs = {fc.feature_name: fc for fc in feature_configs(config)}
    positions = feature_builder.sequence_features
    cols = feature_builder.dense_feature_columns
    out: dict[str, list[SequenceBlock]] = {}
    for g in config.model_config.feature_groups:
        blocks = []
        for f in g.feature_names:
            if f in positions:
                n, d = positions[f], int(fcs[f].embedding_dim)
                blocks.append(SequenceBlock(
                    tuple(sequence_key(f, p) for p in range(n)),
                    sequence_combiner(d, n, fcs[f].sequence_combiner),
                    sequence_length_column(f)))
        for sa in g.sequence_features:
            keys = [k for m in sa.seq_att_map for k in m.key]
            hists = [h for m in sa.seq_att_map for h in m.hist_seq]
            n = positions[hists[0]]
            # embedded keys and items are looked up; dense ones are Batch.dense columns
            emb_keys = [k for k in keys if k not in cols]
            emb_hists = [h for h in hists if h not in cols]
            dense_hists = [h for h in hists if h in cols]
            items = tuple(sequence_key(h, p) for p in range(n) for h in emb_hists)
            length = sequence_length_column(hists[0])
            if sa.pooling:  # TorchEasyRec's pooling encoder: the items only
                width = sum(int(fcs[h].embedding_dim) for h in hists)
                blocks.append(SequenceBlock(items, SequencePool(width, n, sa.pooling), length))
                continue
            encoder = sa.HasField("attn_mlp")  # TorchEasyRec's DIN encoder
            dnn = (sa.attn_mlp if encoder else sa.seq_dnn if sa.HasField("seq_dnn")
                   else pipeline_pb2.DNN(hidden_units=DEFAULT_SEQ_DNN_UNITS))
            dense_keys = [c for k in keys if k in cols for c in cols[k]]
            width = sum(int(fcs[k].embedding_dim) for k in emb_keys) + len(dense_keys)
            blocks.append(SequenceBlock(
                tuple(emb_keys) + items,
                TargetAttention(width, n, dnn, encoder=encoder, dense_key=len(dense_keys),
                                dense_item=len(dense_hists)),
                length,
                tuple(dense_keys) + tuple(cols[h][p] for p in range(n) for h in dense_hists)))
        if blocks:
            out[g.group_name] = blocks
    return out


def multi_task_group(mc: pipeline_pb2.EasyRecModel) -> str:
    """The feature group a multi-task model reads: ``"all"``, or the model's only group.

    Raises:
        ConfigError: neither exists.
    """
    names = [g.group_name for g in mc.feature_groups]
    if "all" in names:
        return "all"
    if len(names) == 1:
        return names[0]
    raise ConfigError("model_config.feature_groups",
                      f"{mc.model_class} reads the feature group named \"all\" (or the only "
                      f"group); groups are {names}")


def _build_multi_task_model(mc: pipeline_pb2.EasyRecModel, feature_builder: FeatureBuilder,
                            label_fields: list[str],
                            sequences: dict[str, list[SequenceBlock]]) -> CtrModel:
    """MMoE / DBMTL over the "all" group (and its sequence blocks); each task's label."""
    field, settings = multi_task_settings(mc)
    group = multi_task_group(mc)
    blocks = sequences.get(group, [])
    emb, raw = _embedded_and_dense(mc, feature_builder, {group: blocks})[group]
    regular = emb[: len(emb) - sum(len(b.lookups) for b in blocks)]
    columns = []
    spaces: list[int | None] = []
    for i, name in enumerate(task_label_names(mc, label_fields)):
        if name not in label_fields:
            raise ConfigError(f"model_config.{field}.task_towers[{i}].label_name",
                              f"label {name!r} is not one of data_config.label_fields "
                              f"{label_fields}")
        columns.append(label_fields.index(name))
        space = settings.task_towers[i].task_space_indicator_label
        if space and space not in label_fields:
            raise ConfigError(f"model_config.{field}.task_towers[{i}]"
                              ".task_space_indicator_label",
                              f"{space!r} is not one of data_config.label_fields")
        spaces.append(label_fields.index(space) if space else None)
    try:
        layout = build_embedding_layout(feature_builder.table_specs, list(dict.fromkeys(emb)),
                                        [], 1, mixed_dims=True)
        return MultiTaskModel(layout, feature_builder.dense_feature_names, raw, mc, columns,
                              spaces, regular=regular, sequences=blocks)
    except ValueError as e:
        raise ConfigError(f"model_config.{field}", str(e)) from e


def _build_tower_model(mc: pipeline_pb2.EasyRecModel, feature_builder: FeatureBuilder,
                       output_name: str, sequences: dict[str, list[SequenceBlock]]) -> CtrModel:
    """MultiTower(DIN) / DCN(V2): the towers' groups, split into embedded and dense features.

    A DIN tower's group (a sequence attention group) holds its keys, then its sequences'
    positional keys position after position, and, as its dense feature, the first
    sequence's length column.
    """
    field, _settings, towers = tower_settings(mc)
    groups = _embedded_and_dense(mc, feature_builder, sequences)
    seq_lens = feature_builder.sequence_features
    dense_seqs = feature_builder.dense_sequence_features
    cols = feature_builder.dense_feature_columns
    din_dense: dict[str, tuple[int, int]] = {}
    for kind, group, _tower in towers:
        if kind != "din" or group in groups:
            continue
        keys, hists = sequence_attention_features(mc, group)
        if not hists or any(h not in seq_lens for h in hists):
            raise ConfigError("model_config.seq_att_groups",
                              f"group {group!r} needs SequenceFeatures in hist_seq")
        positions = seq_lens[hists[0]]
        # embedded keys and items first, then the dense ones (each position's after another)
        dense_keys = [c for k in keys if k in cols for c in cols[k]]
        items = [h for h in hists if h not in dense_seqs]
        dense_items = [h for h in hists if h in dense_seqs]
        groups[group] = ([k for k in keys if k not in cols]
                         + [sequence_key(h, p) for p in range(positions) for h in items],
                         dense_keys + [cols[h][p] for p in range(positions) for h in dense_items]
                         + [sequence_length_column(hists[0])])
        din_dense[group] = (len(dense_keys), len(dense_items))
    embedded: list[str] = []
    for _kind, group, _tower in towers:
        for f in groups.get(group, ([], []))[0]:
            if f not in embedded:
                embedded.append(f)
    try:
        layout = build_embedding_layout(feature_builder.table_specs, embedded, [], 1,
                                        mixed_dims=True)
        return TowerModel(layout, feature_builder.dense_feature_names, groups, mc,
                          output_name=output_name, sequences=sequences, din_dense=din_dense)
    except ValueError as e:
        raise ConfigError(f"model_config.{field}", str(e)) from e

