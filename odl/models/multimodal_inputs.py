"""The modalities of EasyRec's multimodal DBMTL bottoms (``bottom_uniter``, ``bottom_cmbf``).

Both read the feature groups by name (EasyRec's): ``image`` (RawFeatures of one
``raw_input_dim``), ``general`` (embedded features of one ``embedding_dim``), ``text``
(SequenceFeatures of one ``embedding_dim``, read position by position, without a
``sequence_combiner``) and ``other`` (any features, joined after the bottom's output).
:func:`multimodal_inputs` lays them out in the bottom's input ``x``: the lookups (general,
then each sequence's positions, then other's), then the dense columns (image values, other's
values, then each sequence's length) (:class:`MultimodalLayout`). :class:`Modality` turns one
modality's columns into tokens: a projection to the bottom's width (a TF dense, where the
widths differ), then, where EasyRec post-processes them (``embedding_postprocessor``), a
token-type embedding, a position embedding, a layer norm of its own and dropout.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs, projected_raw
from odl.config.model_validation import validate_dnn
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.backbone.sequence_encoders import (
    BERT_LAYER_NORM_EPS,
    POSITION_INIT_STDDEV,
    BertDense,
    truncated_normal_,
)
from odl.models.building_blocks import RawProjection, build_mlp
from odl.models.group_inputs import plain_dense
from odl.protos import pipeline_pb2

__all__ = ["MULTIMODAL_GROUPS", "Modality", "MultimodalLayout", "OtherFeatures",
           "check_multimodal_groups", "multimodal_inputs", "projection",
           "validate_multimodal_layer"]

# the feature groups the bottoms read, by name (EasyRec's)
MULTIMODAL_GROUPS = ("image", "general", "text", "other")


@dataclass
class MultimodalLayout:
    """Where each modality is in a bottom's input ``x`` (module docstring).

    Attributes:
        general: ``(first column, features, embedding_dim)``; 0 features: no group.
        image: ``(first column, features, raw_input_dim)``.
        sequences: per text SequenceFeature ``(first column, positions, embedding_dim,
            column of its length)``.
        other_lookups: ``(first column, width)`` of the other group's lookups.
        other_dense: ``(first column, width)`` of its raw values (features without
            ``embedding_dim``).
        general_raw: ``(first column, values per feature)`` of the general group's projected
            raw features (RawFeatures with ``embedding_dim``: a token each, after its
            embedded features).
        other_raw: ``(first column, values per feature, embedding_dim)`` of the other group's
            projected raw features.
    """

    general: tuple[int, int, int] = (0, 0, 0)
    image: tuple[int, int, int] = (0, 0, 0)
    sequences: list[tuple[int, int, int, int]] = field(default_factory=list)
    other_lookups: tuple[int, int] = (0, 0)
    other_dense: tuple[int, int] = (0, 0)
    general_raw: tuple[int, list[int]] = (0, [])
    other_raw: tuple[int, list[int], int] = (0, [], 0)


def check_multimodal_groups(groups: dict[str, int], layer: str) -> None:
    """At least one of the groups a multimodal layer reads (:data:`MULTIMODAL_GROUPS`).

    Args:
        groups: the model's feature group names (to their index).
        layer: the layer's config field, for the message.

    Raises:
        ConfigError: none of them.
    """
    if not set(groups) & set(MULTIMODAL_GROUPS):
        raise ConfigError("model_config.feature_groups",
                          f"{layer} reads the groups {', '.join(MULTIMODAL_GROUPS)}; the "
                          f"model has {sorted(groups)}")


def validate_multimodal_layer(settings: "pipeline_pb2.UniterTower | pipeline_pb2.CMBFTower",
                              where: str) -> None:
    """Checks a ``UniterTower`` or ``CMBFTower`` (DBMTL's bottoms, the CMBF, Uniter models).

    Args:
        settings: the layer's message.
        where: its config path.

    Raises:
        ConfigError: a required width unset, a head count not dividing the width, a dropout
            outside [0, 1), a bad ``other_feature_dnn``.
    """
    uniter = isinstance(settings, pipeline_pb2.UniterTower)
    required = (("hidden_size", "num_attention_heads", "intermediate_size") if uniter else
                ("multi_head_num", "text_head_size", "text_multi_head_num", "image_head_size",
                 "image_multi_head_num", "image_cross_head_size", "text_cross_head_size"))
    for key in required:
        if getattr(settings, key) < 1:
            raise ConfigError(f"{where}.{key}", "must be set (>= 1)")
    if uniter and settings.hidden_size % settings.num_attention_heads:
        raise ConfigError(f"{where}.num_attention_heads",
                          f"must divide hidden_size {settings.hidden_size}")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob",
                "text_seq_emb_dropout_prob"):
        if hasattr(settings, key) and not 0 <= getattr(settings, key) < 1:
            raise ConfigError(f"{where}.{key}", "must be in [0, 1)")
    if settings.HasField("other_feature_dnn"):
        validate_dnn(settings.other_feature_dnn, f"{where}.other_feature_dnn", required=False)


def projection(width: int, hidden: int) -> nn.Module:
    """A TF dense without a regularizer: Glorot-uniform kernel, zero bias, not in the L2 term."""
    dense = BertDense(width, hidden, 0.0)
    with torch.no_grad():
        nn.init.xavier_uniform_(dense.weight)
    return dense


class Modality(nn.Module):
    """A modality's tokens (module docstring).

    Args:
        start: its first column in the bottom's input.
        tokens: its tokens (features, or positions).
        width: columns per token.
        hidden: the width of the tokens made.
        token_type: its row of the token-type table.
        use_token_type: add that row.
        positions: rows of its position table (0: no position embedding).
        dropout: dropout of the post-processed tokens.
        post: post-process the tokens (type, position, layer norm, dropout); False: the
            projection alone.
        raw: ``(first column, values per feature)`` of projected raw features whose
            vectors (``RawProjection``, ``width`` wide) join as tokens after the others.
    """

    __constants__ = ["start", "tokens", "width", "token_type", "use_token_type", "post",
                     "raw_start", "raw_width", "raw_count"]

    def __init__(self, start: int, tokens: int, width: int, hidden: int, token_type: int,
                 use_token_type: bool, positions: int, dropout: float,
                 post: bool = True, raw: tuple[int, list[int]] = (0, [])) -> None:
        super().__init__()
        self.start, self.tokens, self.width = int(start), int(tokens), int(width)
        self.raw_start, self.raw_width, self.raw_count = (int(raw[0]), sum(raw[1]),
                                                          len(raw[1]))
        self.raw: Optional[RawProjection] = (RawProjection(raw[1], width) if raw[1]
                                             else None)
        self.count = self.tokens + self.raw_count  # tokens made
        self.token_type = int(token_type)
        self.use_token_type = bool(use_token_type)
        self.post = bool(post)
        self.project = projection(width, hidden) if width != hidden else nn.Identity()
        self.position: Optional[nn.Parameter] = (
            nn.Parameter(truncated_normal_(torch.empty(positions, hidden),
                                           POSITION_INIT_STDDEV)) if positions > 0 else None)
        self.norm = nn.LayerNorm(hidden, eps=BERT_LAYER_NORM_EPS)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """``[B, tokens, hidden]`` of the columns ``start ..`` of ``x``."""
        b = x.shape[0]
        tokens = x[:, self.start:self.start + self.tokens * self.width].reshape(
            b, self.tokens, self.width)
        raw = self.raw
        if raw is not None:
            values = x[:, self.raw_start:self.raw_start + self.raw_width]
            tokens = torch.cat([tokens, raw(values).reshape(b, self.raw_count, self.width)],
                               dim=1)
        tokens = self.project(tokens)
        if not self.post:
            return tokens
        if self.use_token_type:
            tokens = tokens + types[self.token_type]
        position = self.position
        if position is not None:
            tokens = tokens + position[: self.tokens]
        return self.dropout(self.norm(tokens))


class OtherFeatures(nn.Module):
    """The ``other`` group's features, through ``other_feature_dnn`` when set.

    Its lookups, projected raw features and raw values, concatenated; ``present``: the group
    has a feature.
    """

    __constants__ = ["lookup_start", "lookup_width", "raw_start", "raw_width", "dense_start",
                     "dense_width", "present"]

    def __init__(self, layout: MultimodalLayout, dnn: Optional[pipeline_pb2.DNN]) -> None:
        super().__init__()
        self.lookup_start, self.lookup_width = (int(v) for v in layout.other_lookups)
        raw_start, raw_widths, raw_dim = layout.other_raw
        self.raw_start, self.raw_width = int(raw_start), sum(raw_widths)
        self.dense_start, self.dense_width = (int(v) for v in layout.other_dense)
        self.raw: Optional[RawProjection] = (RawProjection(raw_widths, raw_dim) if raw_widths
                                             else None)
        width = self.lookup_width + len(raw_widths) * int(raw_dim) + self.dense_width
        self.present = width > 0
        self.dnn, self.out_width = (build_mlp(width, dnn) if width and dnn is not None
                                    else (nn.Sequential(), width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, out_width]`` (call where ``present``)."""
        parts: list[torch.Tensor] = []
        if self.lookup_width:
            parts.append(x[:, self.lookup_start:self.lookup_start + self.lookup_width])
        raw = self.raw
        if raw is not None:
            parts.append(raw(x[:, self.raw_start:self.raw_start + self.raw_width]))
        if self.dense_width:
            parts.append(x[:, self.dense_start:self.dense_start + self.dense_width])
        return self.dnn(torch.cat(parts, dim=1))


def multimodal_inputs(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder
                      ) -> tuple[list[str], list[str], "MultimodalLayout"]:
    """What a bottom reads: ``(lookups, Batch.dense columns, layout)``, in its input order.

    Raises:
        ConfigError: a group's features of a kind or width the bottom does not take.
    """
    groups = {g.group_name: (i, list(g.feature_names))
              for i, g in enumerate(config.model_config.feature_groups)}
    dims = {fc.feature_name: int(fc.embedding_dim) for fc in feature_configs(config)}
    sparse = set(feature_builder.sparse_feature_names)
    dense = plain_dense(feature_builder)
    positions = feature_builder.sequence_features

    def members(group: str, kind: str, allowed: set | dict) -> list[str]:
        gi, names = groups.get(group, (0, []))
        wrong = [f for f in names if f not in allowed]
        if wrong:
            raise ConfigError(f"model_config.feature_groups[{gi}].feature_names",
                              f"the multimodal bottom reads the {group!r} group's features "
                              f"as {kind}; "
                              f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not")
        return names

    def one_width(group: str, widths: dict[str, int]) -> int:
        if len(set(widths.values())) > 1:
            gi = groups[group][0]
            raise ConfigError(f"model_config.feature_groups[{gi}].feature_names",
                              f"the multimodal bottom needs one width in the {group!r} group; got "
                              + ", ".join(f"{f}={w}" for f, w in widths.items()))
        return next(iter(widths.values()), 0)

    projected = {fc.feature_name: int(fc.embedding_dim) for fc in feature_configs(config)
                 if projected_raw(fc)}
    general = members("general", "embedded or projected raw features", sparse | set(projected))
    general_raw = [f for f in general if f in projected]
    general = [f for f in general if f not in general_raw]
    text = members("text", "SequenceFeatures", positions)
    image = members("image", "raw features", dense)
    other = members("other", "embedded or raw features", sparse | set(dense))
    other_sparse = [f for f in other if f in sparse]
    other_raw = [f for f in other if f in projected]
    other_dense = [c for f in other if f in dense and f not in projected for c in dense[f]]
    gen_dim = one_width("general", {f: dims[f] for f in general + general_raw})
    txt_dim = one_width("text", {f: dims[f] for f in text})
    img_width = one_width("image", {f: len(dense[f]) for f in image})
    other_raw_dim = one_width("other", {f: projected[f] for f in other_raw})
    lookups = list(general)
    sequences = []
    col = len(general) * gen_dim
    for f in text:
        sequences.append([col, int(positions[f]), txt_dim, sequence_length_column(f)])
        lookups += [sequence_key(f, p) for p in range(int(positions[f]))]
        col += int(positions[f]) * txt_dim
    other_lookups = (col, sum(dims[f] for f in other_sparse))
    lookups += other_sparse
    col += other_lookups[1]
    # the dense columns: image values, projected raw values (general, other), other's raw
    # values, then the sequences' lengths
    image_cols = [c for f in image for c in dense[f]]
    general_raw_cols = [c for f in general_raw for c in dense[f]]
    other_raw_cols = [c for f in other_raw for c in dense[f]]
    columns = (image_cols + general_raw_cols + other_raw_cols + other_dense
               + [s[3] for s in sequences])
    at = col + len(image_cols)
    layout = MultimodalLayout(
        general=(0, len(general), gen_dim), image=(col, len(image), img_width),
        general_raw=(at, [len(dense[f]) for f in general_raw]),
        other_raw=(at + len(general_raw_cols), [len(dense[f]) for f in other_raw],
                   other_raw_dim),
        other_dense=(at + len(general_raw_cols) + len(other_raw_cols), len(other_dense)),
        sequences=[(s[0], s[1], s[2], len(columns) - len(sequences) + col + k)
                   for k, s in enumerate(sequences)],
        other_lookups=other_lookups)
    return lookups, columns, layout
