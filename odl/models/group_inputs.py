"""What a model's feature groups feed it: embedded and dense features, sequence blocks.

The model modules share these readings of ``model_config.feature_groups`` against a
``FeatureBuilder``: :func:`model_groups` (the wide-and-deep split), :func:`embedded_and_dense`
(per group, its lookups and dense columns), :func:`sequence_blocks` (the parts of a group's
input made from sequences), :func:`all_group` and :func:`group_input` (one group read
whole) and
:func:`dense_columns`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.sequence_layers import (
    KEY_AS_IS,
    KEY_LINEAR,
    KEY_PADDED,
    AttentionLayout,
    GroupSequences,
    SequenceBlock,
    SequencePool,
    TargetAttention,
    sequence_combiner,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


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
    dense = plain_dense(feature_builder)
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


def plain_dense(feature_builder: FeatureBuilder) -> dict[str, list[str]]:
    """Dense features other than sequences -> their ``Batch.dense`` columns."""
    sequences = feature_builder.dense_sequence_features
    return {f: cols for f, cols in feature_builder.dense_feature_columns.items()
            if f not in sequences}


def dense_columns(feature_builder: FeatureBuilder, features: list[str]) -> list[str]:
    """The ``Batch.dense`` columns of dense features, feature after feature."""
    cols = feature_builder.dense_feature_columns
    return [c for f in features for c in cols[f]]


def embedded_and_dense(mc: pipeline_pb2.EasyRecModel, feature_builder: FeatureBuilder,
                        blocks: dict[str, list[SequenceBlock]] | None = None
                        ) -> dict[str, tuple[list[str], list[str]]]:
    """Feature group name -> (embedded features, dense features), in group order.

    A group's sequence blocks (:func:`sequence_blocks`) come last: their lookups after the
    embedded features, their dense columns then their length columns after the dense ones
    (``GroupSequences``' layout).
    """
    sparse = set(feature_builder.sparse_feature_names)
    dense = plain_dense(feature_builder)
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


def all_group(mc: pipeline_pb2.EasyRecModel) -> str:
    """The one feature group a model reads whole: ``"all"``, or the model's only group.

    EasyRec's rule for its multi-task models, AutoInt and RocketLaunching.

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


@dataclasses.dataclass
class GroupInput:
    """One feature group as a model reads it whole (AutoInt, RocketLaunching).

    Attributes:
        lookups: the group's lookups in input order (its embedded features, then its
            sequence blocks'; a feature a block reads again is there twice).
        raw: its ``Batch.dense`` columns of plain raw values (projected raw features' left
            out), then its sequence blocks' dense columns and lengths.
        blocks: its sequence blocks.
    """

    lookups: list[str]
    raw: list[str]
    blocks: list[SequenceBlock]

    def sequences(self, dim_of: dict[str, int]) -> GroupSequences | None:
        """The blocks' combiner over ``[lookups, raw]`` (None without blocks)."""
        if not self.blocks:
            return None
        width = sum(dim_of[f] for f in self.lookups)
        return GroupSequences.of_blocks(list(self.blocks), dim_of, width, len(self.raw))


def group_input(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                group: str, leave_out: Sequence[str] = ()) -> GroupInput:
    """The group ``group`` read whole.

    ``leave_out``'s dense columns are not in its ``raw`` (e.g. projected raw features, read
    apart).
    """
    blocks = sequence_blocks(config, feature_builder).get(group, [])
    emb, raw = embedded_and_dense(config.model_config, feature_builder, {group: blocks})[group]
    cols = feature_builder.dense_feature_columns
    out = {c for f in leave_out for c in cols[f]}
    return GroupInput(list(emb), [c for c in raw if c not in out], blocks)


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
            blocks.append(_attention_block(sa, fcs, feature_builder))
        if blocks:
            out[g.group_name] = blocks
    return out


def _attention_block(sa: pipeline_pb2.SeqAttGroupConfig, fcs: dict,
                     feature_builder: FeatureBuilder) -> SequenceBlock:
    """A group's ``sequence_features`` entry as the block of its target attention.

    (Or of TorchEasyRec's pooling encoder.) The lookups and dense columns come in
    ``AttentionLayout``'s order: embedded keys and items looked up, dense ones
    ``Batch.dense`` columns.
    """
    positions = feature_builder.sequence_features
    cols = feature_builder.dense_feature_columns
    numbers = feature_builder.dense_sequence_item_widths
    keys = [k for m in sa.seq_att_map for k in m.key]
    hists = [h for m in sa.seq_att_map for h in m.hist_seq]
    auxes = [a for m in sa.seq_att_map for a in m.aux_hist_seq]
    n = positions[hists[0]]
    length = sequence_length_column(hists[0])
    emb_hists = [h for h in hists if h not in cols]
    emb_auxes = [a for a in auxes if a not in cols]
    items = tuple(sequence_key(h, p) for p in range(n) for h in emb_hists + emb_auxes)
    if sa.pooling:  # TorchEasyRec's pooling encoder: the items only
        width = sum(int(fcs[h].embedding_dim) for h in hists)
        return SequenceBlock(items, SequencePool(width, n, sa.pooling), length)
    encoder = sa.HasField("attn_mlp")  # TorchEasyRec's DIN encoder
    dnn = (sa.attn_mlp if encoder else sa.seq_dnn if sa.HasField("seq_dnn")
           else pipeline_pb2.DNN(hidden_units=DEFAULT_SEQ_DNN_UNITS))
    emb_keys = [k for k in keys if k not in cols]
    dense_keys = [c for k in keys if k in cols for c in cols[k]]
    dense_hists = [h for h in hists if h in cols]
    dense_auxes = [a for a in auxes if a in cols]

    def dense_parts(features: list[str]) -> tuple[tuple[int, int], ...]:
        # (numbers per position, projected width: EasyRec's embedding_dim; 0: as they are)
        return tuple((numbers[f], int(fcs[f].embedding_dim)) for f in features)

    layout = AttentionLayout(
        key_embedded=sum(int(fcs[k].embedding_dim) for k in emb_keys),
        item_embedded=sum(int(fcs[h].embedding_dim) for h in emb_hists),
        aux_embedded=sum(int(fcs[a].embedding_dim) for a in emb_auxes),
        key_dense=len(dense_keys), item_dense=dense_parts(dense_hists),
        aux_dense=dense_parts(dense_auxes), with_key=sa.need_key_feature)
    layout = dataclasses.replace(layout, key_transform=key_transform(
        sa, layout.key_width, layout.item_width))
    dense_items = tuple(c for p in range(n) for f in dense_hists + dense_auxes
                        for c in cols[f][p * numbers[f] : (p + 1) * numbers[f]])
    return SequenceBlock(tuple(emb_keys) + items,
                         TargetAttention(layout, n, dnn, encoder=encoder), length,
                         tuple(dense_keys) + dense_items)


def key_transform(sa: pipeline_pb2.SeqAttGroupConfig, key: int, item: int) -> str:
    """How a key of ``key`` columns is made as wide as ``item`` (``allow_key_transform``).

    As it is when they agree (or without the setting), padded with zeros when narrower
    (unless ``transform_dnn``), else through Linear layers (EasyRec's rule).
    """
    if key == item or not sa.allow_key_transform:
        return KEY_AS_IS
    return KEY_PADDED if item > key and not sa.transform_dnn else KEY_LINEAR
