"""EasyRec's UNITER bottom of DBMTL (``dbmtl.bottom_uniter``): one transformer over the modalities.

As EasyRec's ``easy_rec/python/layers/uniter.py``, from the feature groups by name:

* ``image``: each feature's raw values (RawFeatures of one ``raw_input_dim``), projected to
  ``hidden_size`` by a TF dense where the widths differ: a token per feature;
* ``general``: each feature's embedding (one ``embedding_dim``), projected: a token each;
* ``text``: each SequenceFeature (one ``embedding_dim``), every position projected (one
  projection per sequence): a token per position, those past a record's length masked;
* ``other``: its embeddings and raw values, through ``other_feature_dnn`` when set, joined
  after the transformer's output.

Each modality's tokens get EasyRec's ``embedding_postprocessor``: a token-type embedding
(image 0, general next, each sequence its own; one shared table, used when there are several
modalities or several image or text features), a position embedding (image and each sequence
their own table of ``max_position_embeddings`` rows; none for general), a layer norm of its
own and dropout. A learned ``[CLS]`` vector leads the tokens; ``num_hidden_layers`` BERT
layers (``BertLayer``, as BST's) run over them; the output is the ``[CLS]`` token's, then the
other features. The module reads the model's group input ``x``: the lookups (general, then
each sequence's positions, then other's), then the dense columns (image values, other's
values, then each sequence's length) (:class:`UniterLayout`).

This module has no ``from __future__ import annotations``: TorchScript reads the class's
annotations as types.
"""

import math
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
    BERT_MASK_ADDER,
    POSITION_INIT_STDDEV,
    BertDense,
    BertLayer,
    length_mask,
    truncated_normal_,
)
from odl.models.building_blocks import activation_layer, build_mlp
from odl.models.group_inputs import plain_dense
from odl.protos import pipeline_pb2

__all__ = ["UNITER_GROUPS", "UniterBottom", "UniterLayout", "uniter_inputs"]

# the feature groups the bottom reads, by name (EasyRec's)
UNITER_GROUPS = ("image", "general", "text", "other")


@dataclass
class UniterLayout:
    """Where each modality is in the bottom's input ``x`` (module docstring).

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


def _projection(width: int, hidden: int) -> nn.Module:
    """A TF dense without a regularizer: Glorot-uniform kernel, zero bias, not in the L2 term."""
    dense = BertDense(width, hidden, 0.0)
    with torch.no_grad():
        nn.init.xavier_uniform_(dense.weight)
    return dense


class _Modality(nn.Module):
    """Projection to the hidden width, then EasyRec's embedding post-processing."""

    __constants__ = ["start", "tokens", "width", "token_type", "use_token_type"]

    def __init__(self, start: int, tokens: int, width: int, hidden: int, token_type: int,
                 use_token_type: bool, positions: int, dropout: float) -> None:
        super().__init__()
        self.start, self.tokens, self.width = int(start), int(tokens), int(width)
        self.token_type = int(token_type)
        self.use_token_type = bool(use_token_type)
        self.project = _projection(width, hidden) if width != hidden else nn.Identity()
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
        if self.use_token_type:
            tokens = tokens + types[self.token_type]
        position = self.position
        if position is not None:
            tokens = tokens + position[: self.tokens]
        return self.dropout(self.norm(tokens))


class UniterBottom(nn.Module):
    """The UNITER bottom (module docstring); scriptable.

    Args:
        settings: the ``UniterTower``.
        layout: where the modalities are in the input.
        in_width: columns of the input.

    Raises:
        ValueError: no modality, or settings the transformer cannot take.
    """

    __constants__ = ["has_transformer", "fixed_tokens", "other_start", "other_width",
                     "other_dense_start", "other_dense_width", "adder"]
    length_columns: list[int]
    sequence_positions: list[int]

    def __init__(self, settings: pipeline_pb2.UniterTower, layout: UniterLayout,
                 in_width: int) -> None:
        super().__init__()
        hidden, heads = int(settings.hidden_size), int(settings.num_attention_heads)
        if hidden < 1 or heads < 1 or hidden % heads:
            raise ValueError(f"bottom_uniter.hidden_size ({hidden}) must be a positive "
                             f"multiple of num_attention_heads ({heads})")
        if settings.intermediate_size < 1:
            raise ValueError("bottom_uniter.intermediate_size must be >= 1")
        dropout = float(settings.hidden_dropout_prob)
        positions = (int(settings.max_position_embeddings)
                     if settings.use_position_embeddings else 0)
        img_start, img_count, img_width = layout.image
        gen_start, gen_count, gen_dim = layout.general
        seqs = list(layout.sequences)
        towers = (img_count > 0) + (gen_count > 0) + (len(seqs) > 0)
        use_types = towers > 1 or len(seqs) > 1 or img_count > 1
        vocab = len(seqs) + (img_count > 0) + (gen_count > 0)
        first = 1 if img_count > 0 else 0
        modalities: list[_Modality] = []
        if img_count:
            modalities.append(_Modality(img_start, img_count, img_width, hidden, 0, use_types,
                                        positions, dropout))
        if gen_count:
            modalities.append(_Modality(gen_start, gen_count, gen_dim, hidden, first,
                                        use_types, 0, dropout))
        for i, (start, n, dim, _length) in enumerate(seqs):
            if settings.use_position_embeddings and n > positions:
                raise ValueError(f"a text sequence's {n} positions exceed "
                                 f"bottom_uniter.max_position_embeddings {positions}")
            modalities.append(_Modality(start, n, dim, hidden,
                                        first + (gen_count > 0) + i, use_types, positions,
                                        dropout))
        self.modalities = nn.ModuleList(modalities)
        self.length_columns = [int(s[3]) for s in seqs]
        self.sequence_positions = [int(s[1]) for s in seqs]
        self.fixed_tokens = 1 + img_count + gen_count  # [CLS], image and general tokens
        self.adder = BERT_MASK_ADDER
        self.has_transformer = bool(modalities)
        self.token_types = nn.Parameter(truncated_normal_(
            torch.empty(max(vocab, 1), hidden), POSITION_INIT_STDDEV))
        bound = math.sqrt(6.0 / (1 + hidden))  # TF's glorot_uniform of a [1, 1, H] variable
        self.cls = nn.Parameter(torch.empty(1, 1, hidden).uniform_(-bound, bound))
        try:
            act = activation_layer(settings.hidden_act, int(settings.intermediate_size))
        except ValueError as e:
            raise ValueError(f"bottom_uniter.hidden_act: {e}") from None
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, int(settings.intermediate_size), act, dropout,
                      float(settings.attention_probs_dropout_prob),
                      float(settings.initializer_range))
            for _ in range(int(settings.num_hidden_layers)))
        self.other_start, self.other_width = (int(v) for v in layout.other_lookups)
        self.other_dense_start, self.other_dense_width = (int(v) for v in layout.other_dense)
        other = self.other_width + self.other_dense_width
        self.other_dnn, other_out = (build_mlp(other, settings.other_feature_dnn)
                                     if other and settings.HasField("other_feature_dnn")
                                     else (nn.Sequential(), other))
        self.out_width = (hidden if self.has_transformer else 0) + other_out
        if self.out_width == 0:
            raise ValueError("bottom_uniter reads the feature groups image, general, text and "
                             "other; the model has none of them")
        del in_width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, out_width]``: the ``[CLS]`` token's output, then the other features."""
        parts: list[torch.Tensor] = []
        b = x.shape[0]
        if self.has_transformer:
            tokens = [self.cls.expand(b, 1, self.cls.shape[2])]
            for modality in self.modalities:
                tokens.append(modality(x, self.token_types))
            seq = torch.cat(tokens, dim=1)
            masks = [torch.ones(b, self.fixed_tokens, dtype=x.dtype, device=x.device)]
            for k in range(len(self.length_columns)):  # (TorchScript: no zip(strict=))
                lengths = x[:, self.length_columns[k]]
                masks.append(length_mask(lengths, self.sequence_positions[k]).to(x.dtype))
            mask = torch.cat(masks, dim=1)
            adder = ((1.0 - mask) * self.adder).unsqueeze(1).unsqueeze(1)
            for layer in self.layers:
                seq = layer(seq, adder)
            parts.append(seq[:, 0])
        other: list[torch.Tensor] = []
        if self.other_width:
            other.append(x[:, self.other_start:self.other_start + self.other_width])
        if self.other_dense_width:
            other.append(x[:, self.other_dense_start:
                           self.other_dense_start + self.other_dense_width])
        if other:
            parts.append(self.other_dnn(torch.cat(other, dim=1)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def uniter_inputs(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder
                  ) -> tuple[list[str], list[str], UniterLayout]:
    """What the bottom reads: ``(lookups, Batch.dense columns, layout)``, in its input order.

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
                              f"bottom_uniter reads the {group!r} group's features as {kind}; "
                              f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not")
        return names

    def one_width(group: str, widths: dict[str, int]) -> int:
        if len(set(widths.values())) > 1:
            gi = groups[group][0]
            raise ConfigError(f"model_config.feature_groups[{gi}].feature_names",
                              f"bottom_uniter needs one width in the {group!r} group; got "
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
    layout = UniterLayout(
        general=(0, len(general), gen_dim), image=(col, len(image), img_width),
        sequences=[(s[0], s[1], s[2], col + len(image_cols) + len(other_dense) + k)
                   for k, s in enumerate(sequences)],
        other_lookups=other_lookups,
        other_dense=(col + len(image_cols), len(other_dense)))
    return lookups, columns, layout
