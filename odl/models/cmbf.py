"""EasyRec's CMBF bottom of DBMTL (``dbmtl.bottom_cmbf``): cross-modal fusion of image and text.

As EasyRec's ``easy_rec/python/layers/cmbf.py`` (CMBF, Sensors 21(16):5275), over the
modalities of ``odl.models.multimodal_inputs``:

* image tower: the ``image`` features as tokens, each projected where its width differs
  (one feature split into ``image_feature_patch_num`` patches; or, with one patch,
  projected to ``image_feature_dim`` numbers, each a token ``number * a learned vector``),
  then ``image_self_attention_layer_num`` BERT layers of width ``image_head_size *
  image_multi_head_num`` (with no such layer: the tokens projected to ``multi_head_num *
  image_cross_head_size``, no transformer);
* text tower: the ``general`` features' embeddings (projected, as they are) and each ``text``
  sequence's positions (projected, then EasyRec's ``embedding_postprocessor``: its token type
  where ``use_token_type``, its own position table, layer norm, ``text_seq_emb_dropout_prob``
  dropout), padding masked, through ``text_self_attention_layer_num`` BERT layers of width
  ``text_head_size * text_multi_head_num``;
* with both: ``cross_modal_layer_num`` cross-modal layers (:class:`CrossBlock`, EasyRec's
  ``cross_attention_block``: attention from one side to the other, then self-attention over
  that, each side updated from the other's previous output) of widths ``multi_head_num *
  image_cross_head_size`` and ``multi_head_num * text_cross_head_size``;
* output: the image tokens' mean; the text tokens as EasyRec merges them (the general ones
  as they are, each sequence's valid positions averaged: an empty sequence averages to 0
  here, where EasyRec divides by zero); then the ``other`` group through
  ``other_feature_dnn`` when set.

Every BERT layer (``BertLayer``, as BST's and UNITER's) has ``multi_head_num`` heads, a
feed-forward part 4 times its width with EasyRec's GELU, ``hidden_dropout_prob`` and
``attention_probs_dropout_prob``; weights are drawn from a truncated normal of stddev 0.02.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import math

import torch
from torch import nn

from odl.models.backbone.sequence_encoders import (
    BERT_LAYER_NORM_EPS,
    BERT_MASK_ADDER,
    POSITION_INIT_STDDEV,
    BertDense,
    BertLayer,
    length_mask,
    truncated_normal_,
)
from odl.models.multimodal_inputs import (
    Modality,
    MultimodalLayout,
    OtherFeatures,
    projection,
)
from odl.protos import pipeline_pb2

__all__ = ["CMBFBottom", "CrossBlock", "CrossLayer"]

INIT_STDDEV = 0.02  # EasyRec's initializer_range of the CMBF transformers


class Attention(nn.Module):
    """EasyRec's ``attention_layer``: heads of scaled dot-product attention, no output dense."""

    __constants__ = ["heads", "size"]

    def __init__(self, from_width: int, to_width: int, heads: int, size: int,
                 attention_dropout: float) -> None:
        super().__init__()
        self.heads, self.size = int(heads), int(size)
        self.query = BertDense(from_width, heads * size, INIT_STDDEV)
        self.key = BertDense(to_width, heads * size, INIT_STDDEV)
        self.value = BertDense(to_width, heads * size, INIT_STDDEV)
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, x: torch.Tensor, to: torch.Tensor, adder: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, N, F]`` attends to ``to`` ``[B, M, T]`` (``adder`` ``[B, 1, 1, M]``)."""
        b, n, m = x.shape[0], x.shape[1], to.shape[1]
        q = self.query(x).reshape(b, n, self.heads, self.size).transpose(1, 2)
        k = self.key(to).reshape(b, m, self.heads, self.size).transpose(1, 2)
        v = self.value(to).reshape(b, m, self.heads, self.size).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.size))
        probs = self.dropout(torch.softmax(scores + adder, dim=-1))
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, n, self.heads * self.size)


class CrossBlock(nn.Module):
    """EasyRec's ``cross_attention_block``: one side attends to the other, then to itself."""

    def __init__(self, from_width: int, to_width: int, heads: int, size: int,
                 intermediate: int, hidden_dropout: float, attention_dropout: float) -> None:
        super().__init__()
        width = heads * size
        self.cross = Attention(from_width, to_width, heads, size, attention_dropout)
        self.itself = Attention(width, width, heads, size, attention_dropout)
        self.attention_norm = nn.LayerNorm(width, eps=BERT_LAYER_NORM_EPS)
        self.intermediate = BertDense(width, intermediate, INIT_STDDEV)
        self.output = BertDense(intermediate, width, INIT_STDDEV)
        self.output_norm = nn.LayerNorm(width, eps=BERT_LAYER_NORM_EPS)
        self.dropout = nn.Dropout(hidden_dropout)

    def forward(self, x: torch.Tensor, other: torch.Tensor, cross_adder: torch.Tensor,
                self_adder: torch.Tensor) -> torch.Tensor:
        """``x``'s tokens updated from ``other``'s: ``[B, N, heads * size]``."""
        cross = self.cross(x, other, cross_adder)
        attended = self.attention_norm(self.dropout(self.itself(cross, cross, self_adder))
                                       + cross)
        out = self.output(torch.relu(self.intermediate(attended)))
        return self.output_norm(self.dropout(out) + attended)


class CrossLayer(nn.Module):
    """One cross-modal layer: each side updated from the other's previous tokens."""

    def __init__(self, image: CrossBlock, text: CrossBlock) -> None:
        super().__init__()
        self.image = image
        self.text = text

    def forward(self, img: torch.Tensor, txt: torch.Tensor, img_adder: torch.Tensor,
                txt_adder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The image side's and the text side's new tokens."""
        return (self.image(img, txt, txt_adder, img_adder),
                self.text(txt, img, img_adder, txt_adder))


class ImageMapping(nn.Module):
    """One image feature as ``dim`` tokens: (projected) number ``i`` times a learned vector."""

    __constants__ = ["start", "width"]

    def __init__(self, start: int, width: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.start, self.width = int(start), int(width)
        self.project = projection(width, dim) if dim != width else nn.Identity()
        bound = math.sqrt(6.0 / (dim + hidden))  # TF's glorot_uniform of [1, dim, hidden]
        self.matrix = nn.Parameter(torch.empty(1, dim, hidden).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """``[B, dim, hidden]``."""
        numbers = self.project(x[:, self.start:self.start + self.width])
        return numbers.unsqueeze(-1) * self.matrix


class _NoImage(nn.Module):
    """The image tower's input where the model has no image group."""

    def forward(self, x: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """``[B, 0, 0]``."""
        return x.new_zeros(x.shape[0], 0, 0)


class CMBFBottom(nn.Module):
    """The CMBF bottom (module docstring); scriptable.

    Args:
        settings: the ``CMBFTower``.
        layout: where the modalities are in the input.

    Raises:
        ValueError: settings the towers cannot take.
    """

    __constants__ = ["has_image", "has_text", "num_general", "adder"]
    length_columns: list[int]
    sequence_positions: list[int]

    def __init__(self, settings: pipeline_pb2.CMBFTower, layout: MultimodalLayout) -> None:
        super().__init__()
        heads = int(settings.multi_head_num)
        hidden_dropout = float(settings.hidden_dropout_prob)
        attention_dropout = float(settings.attention_probs_dropout_prob)

        def layers(count: int, width: int, what: str) -> nn.ModuleList:
            if count and width % heads:
                raise ValueError(f"bottom_cmbf: the {what} width {width} is not a multiple of "
                                 f"multi_head_num {heads}")
            return nn.ModuleList(
                BertLayer(width, heads, 4 * width, nn.GELU(approximate="tanh"), hidden_dropout,
                          attention_dropout, INIT_STDDEV) for _ in range(count))

        img_start, n_img, img_width = layout.image
        self.has_image = n_img > 0
        img_layers = int(settings.image_self_attention_layer_num)
        img_hidden = (heads * int(settings.image_cross_head_size) if img_layers <= 0 else
                      int(settings.image_head_size) * int(settings.image_multi_head_num))
        patches = int(settings.image_feature_patch_num)
        image: nn.Module = _NoImage()
        if not self.has_image:
            pass
        elif n_img > 1 or img_layers <= 0:
            image = Modality(img_start, n_img, img_width, img_hidden, 0, False, 0, 0.0,
                             post=False)
        elif patches > 1:
            if img_width % patches:
                raise ValueError(f"bottom_cmbf.image_feature_patch_num {patches} does not "
                                 f"divide the image feature's {img_width} values")
            image = Modality(img_start, patches, img_width // patches, img_hidden, 0, False,
                             0, 0.0, post=False)
        else:
            if settings.image_feature_dim < 1:
                raise ValueError("bottom_cmbf.image_feature_dim must be set (>= 1) for one "
                                 "image feature without patches")
            image = ImageMapping(img_start, img_width, int(settings.image_feature_dim),
                                 img_hidden)
        self.image = image
        self.image_layers = layers(img_layers if self.has_image else 0, img_hidden, "image")

        gen_start, gen_embedded, gen_dim = layout.general
        n_gen = gen_embedded + len(layout.general_raw[1])  # (embedded, then projected)
        seqs = list(layout.sequences)
        self.has_text = n_gen > 0 or len(seqs) > 0
        self.num_general = int(n_gen)
        txt_hidden = int(settings.text_head_size) * int(settings.text_multi_head_num)
        positions = (int(settings.max_position_embeddings)
                     if settings.use_position_embeddings else 0)
        text: list[Modality] = []
        if n_gen:
            text.append(Modality(gen_start, gen_embedded, gen_dim, txt_hidden, 0, False, 0,
                                 0.0, post=False, raw=layout.general_raw))
        for i, (start, n, dim, _length) in enumerate(seqs):
            if settings.use_position_embeddings and n > positions:
                raise ValueError(f"a text sequence's {n} positions exceed "
                                 f"bottom_cmbf.max_position_embeddings {positions}")
            text.append(Modality(start, n, dim, txt_hidden, i, bool(settings.use_token_type),
                                 positions, float(settings.text_seq_emb_dropout_prob)))
        self.text = nn.ModuleList(text)
        self.token_types = nn.Parameter(truncated_normal_(
            torch.empty(max(len(seqs), 1), txt_hidden), POSITION_INIT_STDDEV))
        self.length_columns = [int(s[3]) for s in seqs]
        self.sequence_positions = [int(s[1]) for s in seqs]
        self.text_layers = layers(int(settings.text_self_attention_layer_num)
                                  if self.has_text else 0, txt_hidden, "text")

        both = self.has_image and self.has_text
        img_cross, txt_cross = int(settings.image_cross_head_size), int(
            settings.text_cross_head_size)
        cross = []
        for k in range(int(settings.cross_modal_layer_num) if both else 0):
            left_in = img_hidden if k == 0 else heads * img_cross
            right_in = txt_hidden if k == 0 else heads * txt_cross
            cross.append(CrossLayer(
                CrossBlock(left_in, right_in, heads, img_cross, 4 * img_cross * heads,
                           hidden_dropout, attention_dropout),
                CrossBlock(right_in, left_in, heads, txt_cross, 4 * txt_cross * heads,
                           hidden_dropout, attention_dropout)))
        self.cross = nn.ModuleList(cross)
        img_out = heads * img_cross if cross else img_hidden
        txt_out = heads * txt_cross if cross else txt_hidden
        self.adder = BERT_MASK_ADDER
        self.other = OtherFeatures(layout, settings.other_feature_dnn
                                   if settings.HasField("other_feature_dnn") else None)
        other_out = int(self.other.out_width)
        self.out_width = ((img_out if self.has_image else 0)
                          + ((n_gen + len(seqs)) * txt_out if self.has_text else 0) + other_out)
        if self.out_width == 0:
            raise ValueError("bottom_cmbf reads the feature groups image, general, text and "
                             "other; the model has none of them")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, out_width]``: the image tokens' mean, the merged text, the other features."""
        b = x.shape[0]
        parts: list[torch.Tensor] = []
        img = x.new_zeros(b, 0, 0)
        if self.has_image:
            img = self.image(x, self.token_types)
            none = img.new_zeros(b, 1, 1, img.shape[1])
            for layer in self.image_layers:
                img = layer(img, none)
        txt = x.new_zeros(b, 0, 0)
        txt_adder = x.new_zeros(b, 1, 1, 0)
        masks: list[torch.Tensor] = []
        if self.has_text:
            tokens: list[torch.Tensor] = []
            for modality in self.text:
                tokens.append(modality(x, self.token_types))
            txt = torch.cat(tokens, dim=1)
            masks.append(torch.ones(b, self.num_general, dtype=x.dtype, device=x.device))
            for k in range(len(self.length_columns)):
                lengths = x[:, self.length_columns[k]]
                masks.append(length_mask(lengths, self.sequence_positions[k]).to(x.dtype))
            txt_adder = ((1.0 - torch.cat(masks, dim=1)) * self.adder).unsqueeze(1).unsqueeze(1)
            for layer in self.text_layers:
                txt = layer(txt, txt_adder)
        if self.has_image and self.has_text:
            img_adder = img.new_zeros(b, 1, 1, img.shape[1])
            for layer in self.cross:
                img, txt = layer(img, txt, img_adder, txt_adder)
        if self.has_image:
            parts.append(img.mean(dim=1))
        if self.has_text:
            parts.append(self._merge_text(txt, masks))
        if self.other.present:
            parts.append(self.other(x))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _merge_text(self, txt: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
        """The general tokens as they are, each sequence's valid positions averaged."""
        b = txt.shape[0]
        out = [txt[:, :self.num_general].reshape(b, -1)]
        begin = self.num_general
        for k in range(len(self.sequence_positions)):
            n = self.sequence_positions[k]
            mask = masks[k + 1].unsqueeze(-1)
            total = (txt[:, begin:begin + n] * mask).sum(dim=1)
            out.append(total / mask.sum(dim=1).clamp_min(1.0))
            begin += n
        return torch.cat(out, dim=1)
