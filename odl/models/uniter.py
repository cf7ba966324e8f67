"""EasyRec's UNITER bottom of DBMTL (``dbmtl.bottom_uniter``): one transformer over the modalities.

As EasyRec's ``easy_rec/python/layers/uniter.py``, over the modalities of
``odl.models.multimodal_inputs``: a token per ``image`` feature, per ``general`` feature and
per ``text`` sequence position (those past a record's length masked), each projected to
``hidden_size``; the ``other`` group through ``other_feature_dnn`` when set, joined after the
transformer's output.

Each modality's tokens get EasyRec's ``embedding_postprocessor``: a token-type embedding
(image 0, general next, each sequence its own; one shared table, used when there are several
modalities or several image or text features), a position embedding (image and each sequence
their own table of ``max_position_embeddings`` rows; none for general), a layer norm of its
own and dropout. A learned ``[CLS]`` vector leads the tokens; ``num_hidden_layers`` BERT
layers (``BertLayer``, as BST's) run over them; the output is the ``[CLS]`` token's, then the
other features.

This module has no ``from __future__ import annotations``: TorchScript reads the class's
annotations as types.
"""

import math

import torch
from torch import nn

from odl.models.backbone.sequence_encoders import (
    BERT_MASK_ADDER,
    POSITION_INIT_STDDEV,
    BertLayer,
    length_mask,
    truncated_normal_,
)
from odl.models.building_blocks import activation_layer
from odl.models.multimodal_inputs import Modality, MultimodalLayout, OtherFeatures
from odl.protos import pipeline_pb2

__all__ = ["UniterBottom"]


class UniterBottom(nn.Module):
    """The UNITER bottom (module docstring); scriptable.

    Args:
        settings: the ``UniterTower``.
        layout: where the modalities are in the input.

    Raises:
        ValueError: no modality, or settings the transformer cannot take.
    """

    __constants__ = ["has_transformer", "fixed_tokens", "adder"]
    length_columns: list[int]
    sequence_positions: list[int]

    def __init__(self, settings: pipeline_pb2.UniterTower, layout: MultimodalLayout) -> None:
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
        gen_start, gen_embedded, gen_dim = layout.general
        gen_count = gen_embedded + len(layout.general_raw[1])  # (embedded, then projected)
        seqs = list(layout.sequences)
        towers = (img_count > 0) + (gen_count > 0) + (len(seqs) > 0)
        use_types = towers > 1 or len(seqs) > 1 or img_count > 1
        vocab = len(seqs) + (img_count > 0) + (gen_count > 0)
        first = 1 if img_count > 0 else 0
        modalities: list[Modality] = []
        if img_count:
            modalities.append(Modality(img_start, img_count, img_width, hidden, 0, use_types,
                                        positions, dropout))
        if gen_count:
            modalities.append(Modality(gen_start, gen_embedded, gen_dim, hidden, first,
                                        use_types, 0, dropout, raw=layout.general_raw))
        for i, (start, n, dim, _length) in enumerate(seqs):
            if settings.use_position_embeddings and n > positions:
                raise ValueError(f"a text sequence's {n} positions exceed "
                                 f"bottom_uniter.max_position_embeddings {positions}")
            modalities.append(Modality(start, n, dim, hidden,
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
        self.other = OtherFeatures(layout, settings.other_feature_dnn
                                   if settings.HasField("other_feature_dnn") else None)
        other_out = int(self.other.out_width)
        self.out_width = (hidden if self.has_transformer else 0) + other_out
        if self.out_width == 0:
            raise ValueError("bottom_uniter reads the feature groups image, general, text and "
                             "other; the model has none of them")

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
        if self.other.present:
            parts.append(self.other(x))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
