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
from odl.config.feature_configs import feature_configs
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.backbone.sequence_encoders import (
    BERT_LAYER_NORM_EPS,
    POSITION_INIT_STDDEV,
    BertDense,
    truncated_normal_,
)
from odl.models.group_inputs import plain_dense
from odl.protos import pipeline_pb2

__all__ = ["MULTIMODAL_GROUPS", "Modality", "MultimodalLayout", "multimodal_inputs",
           "projection"]

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
        other: ``(first column, width)`` of its lookups, and of its dense values.
    """

    general: tuple[int, int, int] = (0, 0, 0)
    image: tuple[int, int, int] = (0, 0, 0)
    sequences: list[tuple[int, int, int, int]] = field(default_factory=list)
    other_lookups: tuple[int, int] = (0, 0)
    other_dense: tuple[int, int] = (0, 0)


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
    """

    __constants__ = ["start", "tokens", "width", "token_type", "use_token_type", "post"]

    def __init__(self, start: int, tokens: int, width: int, hidden: int, token_type: int,
                 use_token_type: bool, positions: int, dropout: float,
                 post: bool = True) -> None:
        super().__init__()
        self.start, self.tokens, self.width = int(start), int(tokens), int(width)
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
        tokens = self.project(x[:, self.start:self.start + self.tokens * self.width]
                              .reshape(b, self.tokens, self.width))
        if not self.post:
            return tokens
        if self.use_token_type:
            tokens = tokens + types[self.token_type]
        position = self.position
        if position is not None:
            tokens = tokens + position[: self.tokens]
        return self.dropout(self.norm(tokens))


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

    general = members("general", "embedded features", sparse)
    text = members("text", "SequenceFeatures", positions)
    image = members("image", "raw features", dense)
    other_sparse = [f for f in groups.get("other", (0, []))[1] if f in sparse]
    other_dense = [c for f in members("other", "embedded or raw features", sparse | set(dense))
                   if f in dense for c in dense[f]]
    gen_dim = one_width("general", {f: dims[f] for f in general})
    txt_dim = one_width("text", {f: dims[f] for f in text})
    img_width = one_width("image", {f: len(dense[f]) for f in image})
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
    image_cols = [c for f in image for c in dense[f]]
    columns = image_cols + other_dense + [s[3] for s in sequences]
    layout = MultimodalLayout(
        general=(0, len(general), gen_dim), image=(col, len(image), img_width),
        sequences=[(s[0], s[1], s[2], col + len(image_cols) + len(other_dense) + k)
                   for k, s in enumerate(sequences)],
        other_lookups=other_lookups,
        other_dense=(col + len(image_cols), len(other_dense)))
    return lookups, columns, layout
