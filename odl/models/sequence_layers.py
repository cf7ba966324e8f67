"""Layers over sequences: DIN's target attention, the sequence combiners, a group's sequences.

* :class:`TargetAttention` (with its :class:`AttentionLayout`): DIN's attention of a key over
  a behaviour sequence, EasyRec's ``sequence_features`` / DIN towers and TorchEasyRec's DIN
  encoder; auxiliary sequences, keys made as wide as the items, and sequences of numbers
  (as they are, or projected per position) included.
* :class:`AttentionPool`, :class:`TextCNN`: EasyRec's sequence combiners (a sequence in a
  feature group becomes one vector); :class:`SequencePool`: TorchEasyRec's pooling encoder.
* :class:`SequenceBlock`, :class:`GroupSequences`: a feature group's input with each of its
  sequences combined into one vector.

Each layer is scriptable (``torch.jit.script``) and keeps no state between calls. This
module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from odl.models.building_blocks import build_mlp
from odl.models.embedding_tables import DEEP_INIT_STD
from odl.models.feature_dropout import FeatureDropout
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

# AttentionLayout.key_transform
KEY_AS_IS = ""
KEY_PADDED = "pad"
KEY_LINEAR = "linear"


@dataclass(frozen=True)
class AttentionLayout:
    """Where a target attention's parts are in its input, and what it outputs.

    The input is ``[key lookups, per position (item lookups, aux lookups), dense key,
    per position (dense items' numbers, dense aux numbers), length]``.

    Attributes:
        key_embedded: the key's looked-up columns.
        item_embedded: per position, the scored sequences' (``hist_seq``) looked-up columns.
        aux_embedded: per position, the auxiliary sequences' (``aux_hist_seq``) looked-up
            columns.
        key_dense: the key's dense columns (RawFeatures as they are).
        item_dense: per ``hist_seq`` sequence of numbers, ``(numbers per position, projected
            width)``: a width of 0 keeps the numbers as they are (TorchEasyRec), else they
            are projected per position by a learned ``[numbers, width]`` matrix (EasyRec's
            ``embedding_dim`` on a sequence of numbers without boundaries).
        aux_dense: the same for ``aux_hist_seq``'s sequences of numbers.
        key_transform: :data:`KEY_AS_IS` (the key is as wide as an item), :data:`KEY_PADDED`
            (zeros appended) or :data:`KEY_LINEAR` (the key and the items each pass a
            Linear layer to the item width), EasyRec's ``allow_key_transform``.
        with_key: the output ends with the key (EasyRec's ``need_key_feature``).
    """

    key_embedded: int
    item_embedded: int
    aux_embedded: int = 0
    key_dense: int = 0
    item_dense: tuple[tuple[int, int], ...] = ()
    aux_dense: tuple[tuple[int, int], ...] = ()
    key_transform: str = KEY_AS_IS
    with_key: bool = True

    @classmethod
    def plain(cls, key: int, dense_key: int = 0, dense_item: int = 0) -> "AttentionLayout":
        """A key and items ``key`` wide.

        ``dense_key`` / ``dense_item`` of their columns are numbers as they are (one per
        sequence of numbers).
        """
        return cls(key - dense_key, key - dense_item, key_dense=dense_key,
                   item_dense=((1, 0),) * dense_item)

    @property
    def key_width(self) -> int:
        """The key's width as read."""
        return self.key_embedded + self.key_dense

    @property
    def item_width(self) -> int:
        """An item's width (scored sequences), numbers projected."""
        return self.item_embedded + sum(w or d for d, w in self.item_dense)

    @property
    def aux_width(self) -> int:
        """An item's auxiliary width, numbers projected."""
        return self.aux_embedded + sum(w or d for d, w in self.aux_dense)


class TargetAttention(nn.Module):
    """DIN's target attention over a behaviour sequence; scriptable.

    Its input is one tensor laid out as :class:`AttentionLayout` says. With key ``k`` and
    items ``h_p`` (the scored sequences' parts of position ``p``, sequences of numbers
    projected), per position ``score_p = MLP([k, h_p, k - h_p, k * h_p])`` (the MLP's last
    layer one unit, no activation); positions at or past the length get ``-2**32 + 1``;
    the output is ``[sum_p softmax(score)_p * [h_p, a_p], k]`` with ``a_p`` the auxiliary
    sequences' parts (EasyRec's ``din``; without ``with_key`` the key is left out). A key of
    another width than the items is padded with zeros or passed, with the items, through a
    Linear layer first (``key_transform``, EasyRec's ``allow_key_transform``).

    With ``encoder`` (TorchEasyRec's ``DINEncoder``): the MLP's layers are all activated and
    a Linear to one unit scores, and the output is the attended sequence alone.

    The MLP scores only the positions within the lengths (the padding's scores are replaced
    anyway), so its cost follows the sequences' lengths, not ``seq_len``; an MLP with batch
    normalization (``use_bn``, ``dice``) scores every position, as EasyRec's does, since its
    batch statistics include the padding.

    Args:
        layout: the input's layout and the output's form.
        seq_len: positions of the sequence.
        dnn: the attention MLP (its last layer of 1 unit, unless ``encoder``).
        encoder: TorchEasyRec's form.

    Raises:
        ValueError: the MLP does not end in one unit (EasyRec's form), or a key of another
            width than the items without a transform that makes them one width.
    """

    __constants__ = ["key_embedded", "item_embedded", "aux_embedded", "key_dense",
                     "dense_numbers", "num_item_dense", "seq_len", "width", "key_pad",
                     "with_key", "score_valid_only"]
    dense_sizes: list[int]

    def __init__(self, layout: AttentionLayout, seq_len: int, dnn: pipeline_pb2.DNN,
                 encoder: bool = False) -> None:
        super().__init__()
        if not encoder and (not dnn.hidden_units or int(dnn.hidden_units[-1]) != 1):
            raise ValueError("a DIN tower's dnn must end in a layer of 1 unit (the score)")
        self.key_embedded = int(layout.key_embedded)
        self.item_embedded = int(layout.item_embedded)
        self.aux_embedded = int(layout.aux_embedded)
        self.key_dense = int(layout.key_dense)
        self.seq_len = int(seq_len)
        self.with_key = bool(layout.with_key) and not encoder
        dense = list(layout.item_dense) + list(layout.aux_dense)
        self.num_item_dense = len(layout.item_dense)
        self.dense_sizes = [int(d) for d, _w in dense]
        self.dense_numbers = sum(self.dense_sizes)
        self.projections = nn.ModuleList(
            _projection(int(d), int(w)) if w else nn.Identity() for d, w in dense)
        key, width = layout.key_width, layout.item_width
        self.width = int(width)
        self.key_pad = 0
        self.key_map: nn.Module = nn.Identity()
        self.item_map: nn.Module = nn.Identity()
        if layout.key_transform == KEY_PADDED:
            if key > width:
                raise ValueError(f"a key ({key} wide) cannot be padded to the items' {width}")
            self.key_pad = width - key
        elif layout.key_transform == KEY_LINEAR:
            self.key_map = nn.Linear(key, width)
            self.item_map = nn.Linear(width, width)
        elif key != width:
            raise ValueError(f"the key ({key} wide) and the items ({width}) differ in width")
        if encoder:
            mlp, hidden = build_mlp(4 * self.width, dnn)
            self.mlp = nn.Sequential(mlp, nn.Linear(hidden, 1))
        else:
            self.mlp, _ = build_mlp(4 * self.width, dnn, last_plain=True)
        self.out_width = self.width + layout.aux_width + (self.width if self.with_key else 0)
        # the padding's scores are replaced, so only the positions within the lengths need
        # the MLP, unless it normalizes by the batch (whose statistics include the padding)
        self.score_valid_only = not any(isinstance(m, nn.BatchNorm1d)
                                        for m in self.mlp.modules())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, out_width]``: the attended items (and auxiliary parts), then the key."""
        b = x.shape[0]
        n = self.seq_len
        per = self.item_embedded + self.aux_embedded
        k = x[:, : self.key_embedded]
        looked_up = x[:, self.key_embedded : self.key_embedded + n * per].reshape(b, n, per)
        start = self.key_embedded + n * per
        items = [looked_up[:, :, : self.item_embedded]]
        aux = [looked_up[:, :, self.item_embedded :]]
        if self.key_dense > 0:
            k = torch.cat([k, x[:, start : start + self.key_dense]], dim=1)
        start += self.key_dense
        if self.dense_numbers > 0:
            numbers = x[:, start : start + n * self.dense_numbers].reshape(
                b, n, self.dense_numbers)
            col = 0
            for i, projection in enumerate(self.projections):
                size = self.dense_sizes[i]
                part = projection(numbers[:, :, col : col + size])
                col += size
                if i < self.num_item_dense:
                    items.append(part)
                else:
                    aux.append(part)
        h = torch.cat(items, dim=2)
        if self.key_pad > 0:
            k = nn.functional.pad(k, (0, self.key_pad))
        k = self.key_map(k)
        h = self.item_map(h)
        length = x[:, -1:]
        positions = torch.arange(n, device=x.device, dtype=x.dtype).unsqueeze(0)
        valid = positions < length
        if self.score_valid_only:  # the MLP scores the positions within the lengths only
            index = torch.nonzero(valid.reshape(-1)).squeeze(1)
            hv = h.reshape(b * n, self.width).index_select(0, index)
            kv = k.index_select(0, torch.div(index, n, rounding_mode="floor"))
            att_in = torch.cat([kv, hv, kv - hv, kv * hv], dim=1)
            scores = torch.full((b * n,), -2.0**32 + 1, dtype=x.dtype, device=x.device)
            scores = scores.index_put((index,), self.mlp(att_in).reshape(-1)).reshape(b, n)
        else:
            q = k.unsqueeze(1).expand(b, n, self.width)
            att_in = torch.cat([q, h, q - h, q * h], dim=2).reshape(b * n, 4 * self.width)
            scores = self.mlp(att_in).reshape(b, n)
            scores = torch.where(valid, scores, torch.full_like(scores, -2.0**32 + 1))
        weights = torch.softmax(scores, dim=1).unsqueeze(2)
        attended = (weights * torch.cat([h] + aux, dim=2)).sum(dim=1)
        if self.with_key:
            return torch.cat([attended, k], dim=1)
        return attended


def _projection(numbers: int, width: int) -> nn.Linear:
    """A sequence's numbers per position to ``width`` (no bias).

    EasyRec's table of ``raw_input_dim`` rows weighted by the numbers, initialized as deep
    tables are (``N(0, DEEP_INIT_STD**2)``).
    """
    layer = nn.Linear(numbers, width, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0.0, DEEP_INIT_STD)
    return layer


class AttentionPool(nn.Module):
    """EasyRec's attention combiner of a sequence; scriptable.

    Input ``[B, seq_len * dim + 1]``: the positions' embeddings, then the length. Output
    ``[B, dim]``: ``sum_p softmax(s)_p * h_p`` with ``s_p = w . h_p`` (positions at or past the
    length scored ``-2**32 + 1``).

    Args:
        dim: embedding width.
        seq_len: positions.
    """

    __constants__ = ["dim", "seq_len"]

    def __init__(self, dim: int, seq_len: int) -> None:
        super().__init__()
        self.dim = int(dim)
        self.seq_len = int(seq_len)
        self.score = nn.Linear(self.dim, 1, bias=False)
        self.out_width = self.dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, dim]``."""
        b = x.shape[0]
        h = x[:, : self.seq_len * self.dim].reshape(b, self.seq_len, self.dim)
        scores = self.score(h).squeeze(2)
        positions = torch.arange(self.seq_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        scores = torch.where(positions < x[:, -1:], scores, torch.full_like(scores, -2.0**32 + 1))
        return (torch.softmax(scores, dim=1).unsqueeze(2) * h).sum(dim=1)


class SequencePool(nn.Module):
    """TorchEasyRec's pooling encoder: a sequence's items pooled over its length; scriptable.

    Input as :class:`AttentionPool`'s. Output ``[B, dim]``: the sum of the items at positions
    below the length, divided by the length (at least 1) for ``"mean"``.

    Args:
        dim: embedding width.
        seq_len: positions.
        mode: ``"mean"`` or ``"sum"``.
    """

    __constants__ = ["dim", "seq_len", "mean"]

    def __init__(self, dim: int, seq_len: int, mode: str = "mean") -> None:
        super().__init__()
        if mode not in ("mean", "sum"):
            raise ValueError(f"pooling {mode!r}: mean or sum")
        self.dim = int(dim)
        self.seq_len = int(seq_len)
        self.mean = mode == "mean"
        self.out_width = self.dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, dim]``."""
        b = x.shape[0]
        h = x[:, : self.seq_len * self.dim].reshape(b, self.seq_len, self.dim)
        length = x[:, -1:]
        positions = torch.arange(self.seq_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        kept = (positions < length).to(x.dtype).unsqueeze(2)
        total = (h * kept).sum(dim=1)
        if self.mean:
            return total / torch.clamp(length, min=1.0)
        return total


class TextCNN(nn.Module):
    """EasyRec's TextCNN combiner of a sequence; scriptable.

    Input as :class:`AttentionPool`'s (the length is not read: padding positions are zero
    vectors, convolved like EasyRec's padding). The ``seq_len`` positions are padded with
    zeros or cut to ``pad_len``; per (kernel size, filters) a ``Conv1d`` over positions, the
    activation (ReLU), a max over positions; the results concatenated,
    ``[B, sum(num_filters)]``.

    Args:
        dim: embedding width.
        seq_len: positions given.
        settings: the ``TextCNN`` message.

    Raises:
        ValueError: sizes and filters of different lengths, a kernel longer than the padded
            sequence, or another activation.
    """

    __constants__ = ["dim", "seq_len", "pad_len"]

    def __init__(self, dim: int, seq_len: int, settings: pipeline_pb2.TextCNN) -> None:
        super().__init__()
        sizes = [int(k) for k in settings.filter_sizes]
        filters = [int(f) for f in settings.num_filters]
        if not sizes or len(sizes) != len(filters):
            raise ValueError("text_cnn needs one num_filters per filter_sizes entry")
        if settings.activation not in ("relu", "tf.nn.relu"):
            raise ValueError(f"text_cnn activation {settings.activation!r}: only relu")
        self.dim = int(dim)
        self.seq_len = int(seq_len)
        self.pad_len = int(settings.pad_sequence_length) or self.seq_len
        if max(sizes) > self.pad_len:
            raise ValueError(f"a text_cnn kernel of {max(sizes)} is longer than the "
                             f"{self.pad_len} positions")
        self.convs = nn.ModuleList(nn.Conv1d(self.dim, f, k)
                                   for k, f in zip(sizes, filters, strict=True))
        self.out_width = sum(filters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, sum(num_filters)]``."""
        b = x.shape[0]
        h = x[:, : self.seq_len * self.dim].reshape(b, self.seq_len, self.dim)
        if self.pad_len < self.seq_len:
            h = h[:, : self.pad_len]
        elif self.pad_len > self.seq_len:
            h = torch.cat([h, h.new_zeros(b, self.pad_len - self.seq_len, self.dim)], dim=1)
        t = h.transpose(1, 2)  # [B, dim, positions]
        outs: list[torch.Tensor] = []
        for conv in self.convs:
            outs.append(torch.relu(conv(t)).max(dim=2).values)
        return torch.cat(outs, dim=1)


def sequence_combiner(dim: int, seq_len: int,
                      settings: pipeline_pb2.SequenceCombiner) -> nn.Module:
    """The combiner module a ``SequenceCombiner`` asks for.

    Args:
        dim: the sequence's embedding width.
        seq_len: its positions.
        settings: the ``SequenceCombiner``.

    Returns:
        An :class:`AttentionPool` or :class:`TextCNN` (its ``out_width``: the vector's width).

    Raises:
        ValueError: no combiner set, or a bad TextCNN setting.
    """
    which = settings.WhichOneof("combiner")
    if which == "attention":
        return AttentionPool(dim, seq_len)
    if which == "text_cnn":
        if settings.text_cnn.HasField("mlp"):
            raise ValueError("a text_cnn sequence_combiner's mlp is not implemented (the "
                             "backbone's TextCNN layer reads it)")
        return TextCNN(dim, seq_len, settings.text_cnn)
    raise ValueError("a SequenceFeature in a feature group needs a sequence_combiner")


@dataclass(frozen=True)
class SequenceBlock:
    """A part of a feature group's input made from sequences (``GroupSequences``).

    Attributes:
        lookups: its KJT keys, in order (a sequence's positions; a target attention's keys,
            then its sequences' positions, position after position).
        module: combines ``[its lookups' columns, its dense columns, the length]`` into one
            vector (``out_width`` wide).
        length_column: the ``Batch.dense`` column of the sequence length it reads.
        dense: its ``Batch.dense`` columns besides the length (a target attention's dense
            keys, then its dense sequences' positions, position after position).
    """

    lookups: tuple[str, ...]
    module: nn.Module
    length_column: str
    dense: tuple[str, ...] = ()


class GroupSequences(nn.Module):
    """A feature group's input with each of its sequences combined into one vector.

    Input ``[B, regular + sum(seq widths) + raw + sum(dense widths) + k]``: the group's other
    embeddings, each sequence's looked-up columns (``seq_len * dim`` positions, after a target
    attention's keys), the group's raw dense features, each sequence's dense columns
    (:attr:`SequenceBlock.dense`), then the ``k`` sequences' lengths. Output ``[B, regular +
    sum(combiner widths) + raw]``: the other embeddings, each sequence's combined vector, the
    raw dense features. Scriptable.

    Args:
        regular: columns of the other embeddings.
        combiners: per sequence ``(its looked-up columns, its combiner module)``.
        raw: columns of the raw dense features.
        dense_widths: per sequence, its dense columns (default: none).
    """

    __constants__ = ["regular", "raw", "num_sequences"]
    starts: list[int]
    widths: list[int]
    dense_widths: list[int]
    dropped: list[int]

    def __init__(self, regular: int, combiners: list[tuple[int, nn.Module]], raw: int,
                 dense_widths: Optional[list[int]] = None) -> None:
        super().__init__()
        self.regular = int(regular)
        self.raw = int(raw)
        self.num_sequences = len(combiners)
        self.starts = []
        self.widths = []
        self.dense_widths = ([int(w) for w in dense_widths] if dense_widths is not None
                             else [0] * len(combiners))
        col = self.regular
        for width, _module in combiners:
            self.starts.append(col)
            self.widths.append(int(width))
            col += int(width)
        self.combiners = nn.ModuleList(m for _w, m in combiners)
        self.out_width = self.regular + sum(int(m.out_width) for _w, m in combiners) + self.raw
        self.dropout: Optional[FeatureDropout] = None
        self.dropped = []

    @classmethod
    def of_blocks(cls, blocks: "list[SequenceBlock]", dim_of: dict[str, int],
                  lookup_width: int, dense_columns: int) -> "GroupSequences":
        """The combiner of a group whose input ends with ``blocks``' parts.

        Args:
            blocks: the group's sequence blocks, in order.
            dim_of: lookup (KJT key) -> its width.
            lookup_width: the group's looked-up columns, the blocks' lookups included.
            dense_columns: the group's dense columns, the blocks' dense columns and lengths
                included.
        """
        widths = [sum(dim_of[k] for k in b.lookups) for b in blocks]
        dense_widths = [len(b.dense) for b in blocks]
        return cls(lookup_width - sum(widths),
                   [(w, b.module) for w, b in zip(widths, blocks, strict=True)],
                   dense_columns - len(blocks) - sum(dense_widths), dense_widths)

    def set_dropout(self, dropout: FeatureDropout, dropped: Sequence[int]) -> None:
        """Drops the group's features with ``dropout`` (EasyRec's variational dropout).

        Its input is ``[the other embeddings, the vectors of the sequences ``dropped``
        names (their indices: the combiners of SequenceFeatures in the group), the raw dense
        features]``; the other sequences' vectors (target attention, which EasyRec appends
        after its input layer's dropout) pass as they are.
        """
        self.dropout = dropout
        self.dropped = [int(i) for i in dropped]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The combined group input."""
        n = x.shape[1]
        lengths = x[:, n - self.num_sequences :]
        regular = x[:, : self.regular]
        vectors: list[torch.Tensor] = []
        end = self.regular + sum(self.widths)
        d = end + self.raw  # the sequences' dense columns
        for i, combiner in enumerate(self.combiners):
            s = self.starts[i]
            w = self.widths[i]
            dw = self.dense_widths[i]
            vectors.append(combiner(torch.cat([x[:, s : s + w], x[:, d : d + dw],
                                               lengths[:, i : i + 1]], dim=1)))
            d += dw
        raw = x[:, end : end + self.raw]
        dropout = self.dropout
        if dropout is not None:
            masked = dropout(torch.cat([regular] + [vectors[i] for i in self.dropped] + [raw],
                                       dim=1))
            regular = masked[:, : self.regular]
            col = self.regular
            for i in self.dropped:
                w = vectors[i].shape[1]
                vectors[i] = masked[:, col : col + w]
                col += w
            raw = masked[:, col:]
        return torch.cat([regular] + vectors + [raw], dim=1)
