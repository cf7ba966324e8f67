"""Layers the models are built from: the MLP, the FM term, the cross layer, the expert gates.

Each block is scriptable (``torch.jit.script``), keeps no state between calls, and keeps the
parameter names the models' checkpoints use (``<module>.<layer index>.weight`` for an MLP,
``weights`` / ``biases`` for a cross network, ``layers.<l>.0`` (U) / ``layers.<l>.1``
(V) for a v2 cross network,
``experts.<i>.*`` / ``gates.<t>.*`` for expert
gates).

* :func:`build_mlp`: EasyRec's DNN, per hidden layer ``Linear``, [``BatchNorm1d``], ``ReLU``,
  [``Dropout``]; no hidden units is the identity.
* :func:`fm_term`: ``0.5 * ((sum_i v_i)**2 - sum_i v_i**2)`` over ``[B, n, d]`` vectors.
* :class:`CrossNet`: DCN v1's cross network, ``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l``.
* :class:`CrossNetV2`: DCN v2's, ``x_{l+1} = x_0 * (V_l (U_l x_l) + b_l) + x_l`` (low rank).
* :class:`TargetAttention`: DIN's attention of a key over a behaviour sequence;
* :class:`AttentionPool`, :class:`TextCNN`: EasyRec's sequence combiners (a sequence in a
  feature group becomes one vector);
* :class:`ExpertGates`: MMoE's experts and per-task softmax gates,
  ``task_t = sum_e softmax(G_t(x))_e * expert_e(x)``.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from odl.models.embedding_tables import DEEP_INIT_STD
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


def build_mlp(in_dim: int, dnn: pipeline_pb2.DNN,
              last_plain: bool = False) -> tuple[nn.Sequential, int]:
    """EasyRec's DNN: per hidden layer Linear, [BatchNorm], ReLU, [Dropout].

    Args:
        in_dim: input width.
        dnn: the layer settings.
        last_plain: the last layer is a Linear alone (no BatchNorm, activation or dropout:
            EasyRec's ``last_layer_no_activation``, a score).

    Returns:
        ``(module, output width)``.

    Raises:
        ValueError: unsupported activation.
    """
    if dnn.activation not in ("relu", "tf.nn.relu", "nn.ReLU"):
        raise ValueError(f"DNN activation {dnn.activation!r} is not supported (use relu)")
    layers: list[nn.Module] = []
    width = in_dim
    for i, units in enumerate(dnn.hidden_units):
        layers.append(nn.Linear(width, int(units)))
        if last_plain and i == len(dnn.hidden_units) - 1:
            width = int(units)
            break
        if dnn.use_bn:
            layers.append(nn.BatchNorm1d(int(units)))
        layers.append(nn.ReLU())
        if i < len(dnn.dropout_ratio) and dnn.dropout_ratio[i] > 0:
            layers.append(nn.Dropout(float(dnn.dropout_ratio[i])))
        width = int(units)
    return nn.Sequential(*layers), width


def build_optional_mlp(in_dim: int,
                       dnn: Optional[pipeline_pb2.DNN]) -> tuple[nn.Sequential, int]:
    """:func:`build_mlp` of an optional DNN: the identity (``(Sequential(), in_dim)``) for None."""
    return build_mlp(in_dim, dnn if dnn is not None else pipeline_pb2.DNN())


def fm_term(v: torch.Tensor) -> torch.Tensor:
    """FM's pairwise interactions of ``[B, n, d]`` vectors: ``[B, d]``."""
    return 0.5 * (v.sum(dim=1).square() - v.square().sum(dim=1))


class CrossNet(nn.Module):
    """DCN v1's cross network over ``[B, width]`` inputs; scriptable.

    Args:
        width: input (and output) width.
        layers: number of cross layers (``cross_num``).
    """

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.empty(int(layers), int(width)))
        self.biases = nn.Parameter(torch.zeros(int(layers), int(width)))
        nn.init.normal_(self.weights, std=(1.0 / max(1, int(width))) ** 0.5)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l`` for every layer."""
        x = x0
        for i in range(self.weights.shape[0]):
            x = x0 * (x * self.weights[i]).sum(dim=1, keepdim=True) + self.biases[i] + x
        return x


class CrossNetV2(nn.Module):
    """DCN v2's cross network with low-rank weights over ``[B, width]`` inputs; scriptable.

    ``x_{l+1} = x_0 * (V_l(U_l x_l)) + x_l`` with ``U_l``: width -> rank (no bias) and
    ``V_l``: rank -> width (with bias), TorchEasyRec's ``CrossV2``.

    Args:
        width: input (and output) width.
        layers: number of cross layers (``cross_num``).
        rank: ``low_rank``.
    """

    def __init__(self, width: int, layers: int, rank: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(int(width), int(rank), bias=False),
                          nn.Linear(int(rank), int(width)))
            for _ in range(int(layers)))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """Every layer in turn."""
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class TargetAttention(nn.Module):
    """DIN's target attention over a behaviour sequence; scriptable.

    Its input is one ``[B, key + seq_len * item + 1]`` tensor: the key's embedding
    (``key`` columns), the sequence's item embeddings position after position (``item``
    columns each, as wide as the key), then the sequence's length. Per position ``p``
    ``score_p = MLP([k, h_p, k - h_p, k * h_p])`` (the MLP's last layer one unit, no
    activation); positions at or past the length get ``-2**32 + 1``; the output is
    ``[sum_p softmax(score)_p * h_p, k]``, ``[B, 2 * key]`` (EasyRec's ``din``).

    With ``encoder`` (TorchEasyRec's ``DINEncoder``): the MLP's layers are all activated and
    a Linear to one unit scores, and the output is the attended sequence alone, ``[B, key]``.

    With dense parts (a DIN tower's dense query features and SequenceFeatures of numbers):
    the input is ``[key embeddings, item embeddings by position, dense key, dense items by
    position, length]``; the key is its embeddings then its dense part, each item likewise.

    Args:
        key: width of the key (and of each item), dense parts included.
        seq_len: positions of the sequence.
        dnn: the attention MLP (its last layer of 1 unit, unless ``encoder``).
        encoder: TorchEasyRec's form.
        dense_key: columns of the key that are dense numbers.
        dense_item: columns of each item that are dense numbers.

    Raises:
        ValueError: the MLP does not end in one unit (EasyRec's form), or dense parts wider
            than the key.
    """

    __constants__ = ["key", "seq_len", "with_key", "dense_key", "dense_item"]

    def __init__(self, key: int, seq_len: int, dnn: pipeline_pb2.DNN,
                 encoder: bool = False, dense_key: int = 0, dense_item: int = 0) -> None:
        super().__init__()
        if not encoder and (not dnn.hidden_units or int(dnn.hidden_units[-1]) != 1):
            raise ValueError("a DIN tower's dnn must end in a layer of 1 unit (the score)")
        self.key = int(key)
        self.seq_len = int(seq_len)
        self.with_key = not encoder
        self.dense_key = int(dense_key)
        self.dense_item = int(dense_item)
        if max(self.dense_key, self.dense_item) > self.key:
            raise ValueError("the dense parts are wider than the key")
        if encoder:
            mlp, width = build_mlp(4 * self.key, dnn)
            self.mlp = nn.Sequential(mlp, nn.Linear(width, 1))
        else:
            self.mlp, _ = build_mlp(4 * self.key, dnn, last_plain=True)
        self.out_width = 2 * self.key if self.with_key else self.key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 2 * key]``: the attended sequence, then the key."""
        b = x.shape[0]
        if self.dense_key == 0 and self.dense_item == 0:
            k = x[:, : self.key]
            h = x[:, self.key : self.key + self.seq_len * self.key].reshape(b, self.seq_len,
                                                                              self.key)
        else:
            ke = self.key - self.dense_key
            ie = self.key - self.dense_item
            start = ke + self.seq_len * ie
            k = torch.cat([x[:, :ke], x[:, start : start + self.dense_key]], dim=1)
            start += self.dense_key
            h = torch.cat([
                x[:, ke : ke + self.seq_len * ie].reshape(b, self.seq_len, ie),
                x[:, start : start + self.seq_len * self.dense_item].reshape(
                    b, self.seq_len, self.dense_item)], dim=2)
        length = x[:, -1:]
        q = k.unsqueeze(1).expand(b, self.seq_len, self.key)
        att_in = torch.cat([q, h, q - h, q * h], dim=2).reshape(b * self.seq_len, 4 * self.key)
        scores = self.mlp(att_in).reshape(b, self.seq_len)
        positions = torch.arange(self.seq_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        scores = torch.where(positions < length, scores,
                             torch.full_like(scores, -2.0**32 + 1))
        weights = torch.softmax(scores, dim=1)
        attended = (weights.unsqueeze(2) * h).sum(dim=1)
        if self.with_key:
            return torch.cat([attended, k], dim=1)
        return attended


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The combined group input."""
        n = x.shape[1]
        lengths = x[:, n - self.num_sequences :]
        parts = [x[:, : self.regular]]
        end = self.regular + sum(self.widths)
        d = end + self.raw  # the sequences' dense columns
        for i, combiner in enumerate(self.combiners):
            s = self.starts[i]
            w = self.widths[i]
            dw = self.dense_widths[i]
            parts.append(combiner(torch.cat([x[:, s : s + w], x[:, d : d + dw],
                                             lengths[:, i : i + 1]], dim=1)))
            d += dw
        parts.append(x[:, end : end + self.raw])
        return torch.cat(parts, dim=1)


class _Gate(nn.Module):
    """One task's gate: [an MLP,] a Linear to ``num_expert`` logits, a softmax."""

    def __init__(self, in_width: int, num_expert: int,
                 gate_dnn: Optional[pipeline_pb2.DNN]) -> None:
        super().__init__()
        self.mlp, width = build_optional_mlp(in_width, gate_dnn)
        self.out = nn.Linear(width, num_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.out(self.mlp(x)), dim=1)


class ExpertGates(nn.Module):
    """MMoE: one MLP per expert and one softmax gate per task; scriptable.

    Args:
        in_width: input width.
        expert_dnns: each expert's layers (``num_expert`` times ``expert_dnn``, or EasyRec's
            ``experts``, each its own; their last layers of one width).
        num_tasks: number of gates.
        gate_dnn: layers before each gate's Linear (TorchEasyRec's ``gate_mlp``), or None.

    Raises:
        ValueError: no expert, an expert without layers, or experts of different widths.
    """

    def __init__(self, in_width: int, expert_dnns: Sequence[pipeline_pb2.DNN],
                 num_tasks: int, gate_dnn: Optional[pipeline_pb2.DNN] = None) -> None:
        super().__init__()
        if not expert_dnns:
            raise ValueError("at least one expert is needed")
        experts = []
        widths = []
        for dnn in expert_dnns:
            if not dnn.hidden_units:
                raise ValueError("an expert needs at least one layer")
            mlp, width = build_mlp(in_width, dnn)
            experts.append(mlp)
            widths.append(width)
        if len(set(widths)) > 1:
            raise ValueError(f"the experts' last layers differ in width: {widths}")
        self.experts = nn.ModuleList(experts)
        self.gates = nn.ModuleList(_Gate(in_width, len(experts), gate_dnn)
                                   for _ in range(int(num_tasks)))
        self.out_width = widths[0]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One ``[B, expert width]`` input per task."""
        outs: list[torch.Tensor] = []
        for expert in self.experts:
            outs.append(expert(x))
        stacked = torch.stack(outs, dim=1)  # [B, E, H]
        tasks: list[torch.Tensor] = []
        for gate in self.gates:
            g = gate(x)  # [B, E]
            tasks.append((stacked * g.unsqueeze(2)).sum(dim=1))
        return tasks


class RawProjection(nn.Module):
    """Projected raw features: ``[B, columns]`` values to ``[B, n * dim]``.

    EasyRec's RawFeature with ``embedding_dim`` and no ``boundaries`` (a table of one row
    per value, weighted by the value): feature ``j`` of ``d_j`` values ``v`` becomes
    ``sum_k v_k * p_jk`` (``value * p_j`` for one value). ``weight`` ``[columns, dim]``
    holds the rows, feature after feature, initialized as deep tables are
    (``N(0, DEEP_INIT_STD**2)``); scriptable.

    Args:
        widths: values per projected feature (``raw_input_dim``), in column order.
        dim: the rows' width.
    """

    __constants__ = ["single"]
    widths: list[int]

    def __init__(self, widths: Sequence[int], dim: int) -> None:
        super().__init__()
        self.widths = [int(w) for w in widths]
        self.weight = nn.Parameter(torch.randn(sum(self.widths), int(dim)) * DEEP_INIT_STD)
        self.single = all(w == 1 for w in self.widths)

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, n * dim]``: per feature, its values times its rows, summed."""
        if self.single:
            return (values.unsqueeze(2) * self.weight.unsqueeze(0)).reshape(values.shape[0], -1)
        parts: list[torch.Tensor] = []
        start = 0
        for w in self.widths:
            parts.append(torch.matmul(values[:, start : start + w],
                                      self.weight[start : start + w]))
            start += w
        return torch.cat(parts, dim=1)
