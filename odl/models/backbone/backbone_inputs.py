"""The lookups of the feature groups a backbone reads, and each group's input layer.

The sparse part of a backbone model looks up each ``(feature, table)`` a block reads once:
the deep tables of the features in DEEP groups (a SequenceFeature's positions, a target
attention's keys and items included), the wide tables (``wide_output_dim`` columns) of the
features in WIDE groups; one pooled group, ``"backbone"``, holds them all (deep lookups
first). :class:`BackboneInputs` plans them and builds the input layers
(``odl.models.backbone.input_layers``) over that pooled group and ``Batch.dense``.
"""

from __future__ import annotations

from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs, projected_raw
from odl.config.model_validation import backbone_blocks, raw_sequence_groups
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.backbone.input_layers import (
    POOLED,
    RAW,
    READER,
    DenseReader,
    FeatureSource,
    GroupInput,
    RawSequenceInput,
    SequenceReader,
)
from odl.models.building_blocks import RawProjection
from odl.models.ctr_model import PooledGroup
from odl.models.embedding_tables import EmbeddingLayout, build_embedding_layout
from odl.models.group_inputs import plain_dense, sequence_blocks
from odl.protos import pipeline_pb2

POOLED_GROUP = "backbone"


def read_groups(backbone: pipeline_pb2.BackboneTower) -> set[str]:
    """The feature groups the backbone's blocks (its packages' included) name."""
    return {inp.feature_group_name for _where, b in backbone_blocks(backbone)
            for inp in b.inputs if inp.WhichOneof("name") == "feature_group_name"}


def wide_output_dim(backbone: pipeline_pb2.BackboneTower) -> int:
    """The wide tables' width: the input layers' ``wide_output_dim`` (one value; 1 unset).

    Raises:
        ConfigError: two input layers give different values.
    """
    dims = [(where, int(b.input_layer.wide_output_dim))
            for where, b in backbone_blocks(backbone)
            if b.WhichOneof("layer") == "input_layer" and b.input_layer.wide_output_dim]
    values = {d for _w, d in dims}
    if len(values) > 1:
        raise ConfigError(f"{dims[-1][0]}.input_layer.wide_output_dim",
                          f"the input layers give different widths: {sorted(values)}")
    return values.pop() if values else 1


class BackboneInputs:
    """The lookups of the groups a backbone reads, and each group's input layer.

    Args:
        config: the pipeline config.
        feature_builder: its feature builder.

    Raises:
        ConfigError: a group names an unknown feature, a wide group holds sequences.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig,
                 feature_builder: FeatureBuilder) -> None:
        mc = config.model_config
        self.config = config
        self.fb = feature_builder
        self.groups = {g.group_name: (i, g) for i, g in enumerate(mc.feature_groups)}
        self.fcs = {fc.feature_name: fc for fc in feature_configs(config)}
        self.sparse = set(feature_builder.sparse_feature_names)
        self.dense = plain_dense(feature_builder)
        self.positions = feature_builder.sequence_features
        self.col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        self.wide_dim = wide_output_dim(mc.backbone)
        deep: list[str] = []
        wide: list[str] = []
        self.raw_only = raw_sequence_groups(mc.backbone)
        blocks = self._sequence_blocks()
        for name in sorted(read_groups(mc.backbone), key=lambda n: self.groups.get(n, (0,))[0]):
            if name not in self.groups:
                continue  # the graph refuses it by field
            gi, g = self.groups[name]
            is_wide = g.wide_deep == pipeline_pb2.WIDE
            for j, f in enumerate(g.feature_names):
                if f in self.sparse:
                    target = wide if is_wide else deep
                    if f not in target:
                        target.append(f)
                elif f not in self.dense and f not in self.positions:
                    raise ConfigError(f"model_config.feature_groups[{gi}].feature_names[{j}]",
                                      f"group {name!r} names unknown feature {f!r}")
            if is_wide and name in blocks:
                raise ConfigError(f"model_config.feature_groups[{gi}]",
                                  f"the wide group {name!r} holds sequences: a wide group "
                                  "reads ids and raw values only")
            for b in blocks.get(name, []):
                deep += [k for k in b.lookups if k not in deep]
            if name in self.raw_only:
                deep += [k for k in self._raw_sequence_keys(gi, g) if k not in deep]
        try:
            self.layout: EmbeddingLayout = build_embedding_layout(
                feature_builder.table_specs, deep, wide, self.wide_dim, mixed_dims=True)
        except ValueError as e:
            raise ConfigError("model_config.feature_groups", str(e)) from e
        self.deep_start: dict[str, tuple[int, int]] = {}
        self.wide_start: dict[str, tuple[int, int]] = {}
        col = 0
        for (f, _t), d in zip(self.layout.deep_keys, self.layout.deep_dims, strict=True):
            self.deep_start[f] = (col, int(d))
            col += int(d)
        for f, _t in self.layout.wide_keys:
            self.wide_start[f] = (col, self.wide_dim)
            col += self.wide_dim
        # the wide lookups end the pooled group: their first column, or -1 without any
        self.first_wide_column = (sum(int(d) for d in self.layout.deep_dims)
                           if self.layout.wide_keys else -1)
        self.pooled = PooledGroup.of(
            POOLED_GROUP, tuple(self.layout.deep_keys) + tuple(self.layout.wide_keys),
            list(self.layout.deep_dims) + [self.wide_dim] * len(self.layout.wide_keys))

    def _sequence_blocks(self) -> dict:
        """``sequence_blocks`` of the groups read combined (not the raw-only ones)."""
        config = self.config
        if self.raw_only:
            config = pipeline_pb2.EasyRecConfig()
            config.CopyFrom(self.config)
            for g in config.model_config.feature_groups:
                if g.group_name in self.raw_only:
                    del g.feature_names[:]
                    del g.sequence_features[:]
        return sequence_blocks(config, self.fb)

    def _raw_sequence_keys(self, gi: int, g: pipeline_pb2.FeatureGroupConfig) -> list[str]:
        """A raw-read group's position lookups, position after position.

        Its SequenceFeatures of ids side by side at each position.

        Raises:
            ConfigError: no SequenceFeature, sequences of numbers, or of several lengths.
        """
        where = f"model_config.feature_groups[{gi}]"
        seqs = [f for f in g.feature_names if f in self.positions]
        if not seqs:
            raise ConfigError(where, f"group {g.group_name!r} is read with "
                                     "output_seq_and_normal_feature but holds no "
                                     "SequenceFeature")
        numbers = [f for f in seqs if f in self.fb.dense_sequence_features]
        if numbers:
            raise ConfigError(where, f"sequences of numbers ({numbers[0]!r}) read with "
                                     "output_seq_and_normal_feature are not implemented")
        lengths = {self.positions[f] for f in seqs}
        if len(lengths) != 1 or g.sequence_features:
            raise ConfigError(where, "output_seq_and_normal_feature needs the group's "
                                     "SequenceFeatures to share one max_seq_len and no "
                                     "sequence_features")
        n = lengths.pop()
        return [sequence_key(f, p) for p in range(n) for f in seqs]

    def group_input(self, name: str, settings: pipeline_pb2.BackboneInputLayer,
                    where: str) -> nn.Module:
        """The input layer of group ``name`` with ``settings`` (``input_layers``)."""
        gi, g = self.groups[name]
        if settings.output_seq_and_normal_feature:
            return self._raw_sequence_input(name, settings, where)
        is_wide = g.wide_deep == pipeline_pb2.WIDE
        sources: list[FeatureSource] = []
        for f in g.feature_names:
            if f in self.sparse:
                start, width = (self.wide_start if is_wide else self.deep_start)[f]
                sources.append(FeatureSource(f, POOLED, width, start=start))
            elif f in self.dense:
                cols = [self.col[c] for c in self.dense[f]]
                fc = self.fcs[f]
                if is_wide:
                    matrix = nn.Linear(len(cols), self.wide_dim, bias=False)
                    nn.init.zeros_(matrix.weight)
                    sources.append(FeatureSource(f, READER, self.wide_dim,
                                                 reader=DenseReader(cols, matrix)))
                elif projected_raw(fc):
                    dim = int(fc.embedding_dim)
                    sources.append(FeatureSource(f, READER, dim, reader=DenseReader(
                        cols, RawProjection([len(cols)], dim))))
                else:
                    sources.append(FeatureSource(f, RAW, len(cols), columns=tuple(cols)))
        if name in self.raw_only:
            return (GroupInput(sources, settings, where, self.pooled.width, len(self.col))
                    if sources else None)
        # each input layer combines the group's sequences with its own combiners
        for b in self._sequence_blocks().get(name, []):
            idx = [c for k in b.lookups
                   for c in range(self.deep_start[k][0], sum(self.deep_start[k]))]
            dense = [self.col[c] for c in b.dense] + [self.col[b.length_column]]
            sources.append(FeatureSource(b.lookups[0], READER, int(b.module.out_width),
                                         reader=SequenceReader(idx, dense, b.module)))
        return GroupInput(sources, settings, where, self.pooled.width, len(self.col))


    def _raw_sequence_input(self, name: str, settings: pipeline_pb2.BackboneInputLayer,
                            where: str) -> RawSequenceInput:
        gi, g = self.groups[name]
        if not settings.concat_seq_feature:
            raise ConfigError(f"{where}.concat_seq_feature",
                              "the sequences as a list (false) are not implemented")
        if name not in self.raw_only:
            raise ConfigError(f"{where}.output_seq_and_normal_feature",
                              f"group {name!r} is also read combined by another block")
        keys = self._raw_sequence_keys(gi, g)
        seqs = [f for f in g.feature_names if f in self.positions]
        idx = [c for k in keys for c in range(self.deep_start[k][0], sum(self.deep_start[k]))]
        dim = sum(self.deep_start[sequence_key(f, 0)][1] for f in seqs)
        targets = self.group_input(name, pipeline_pb2.BackboneInputLayer(), where)
        return RawSequenceInput(idx, self.positions[seqs[0]], dim,
                                self.col[sequence_length_column(seqs[0])], targets)
