"""Layers the models are built from: the MLP, the FM term, the cross layer, the expert gates.

Each block is scriptable (``torch.jit.script``), keeps no state between calls, and keeps the
parameter names the models' checkpoints use (``<module>.<layer index>.weight`` for an MLP,
``weights`` / ``biases`` for a cross network, ``layers.<l>.0`` (U) / ``layers.<l>.1``
(V) for a v2 cross network,
``experts.<i>.*`` / ``gates.<t>.*`` for expert
gates).

* :func:`build_mlp`: EasyRec's DNN, per hidden layer ``Linear``, [``BatchNorm1d``], the
  activation (:func:`activation_layer`: EasyRec's names, ``dice`` a :class:`Dice`),
  [``Dropout``]; no hidden units is the identity.
* :func:`fm_term`: ``0.5 * ((sum_i v_i)**2 - sum_i v_i**2)`` over ``[B, n, d]`` vectors.
* :class:`CrossNet`: DCN v1's cross network, ``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l``.
* :class:`CrossNetV2`: DCN v2's, ``x_{l+1} = x_0 * (V_l (U_l x_l) + b_l) + x_l`` (low rank).
* :class:`ExpertGates`: MMoE's experts and per-task softmax gates,
  ``task_t = sum_e softmax(G_t(x))_e * expert_e(x)``.
* :class:`RawProjection`: EasyRec's projected raw features.

The layers over sequences are in :mod:`odl.models.sequence_layers`.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import logging
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from odl.models.embedding_tables import DEEP_INIT_STD
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


def build_mlp(in_dim: int, dnn: pipeline_pb2.DNN,
              last_plain: bool = False) -> tuple[nn.Sequential, int]:
    """EasyRec's DNN: per hidden layer Linear, [BatchNorm], activation, [Dropout].

    The activation is the DNN's (:func:`activation_layer`; ReLU by default).

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
    activation_layer(dnn.activation, 1)  # an unknown name fails before any layer is built
    layers: list[nn.Module] = []
    width = in_dim
    for i, units in enumerate(dnn.hidden_units):
        layers.append(nn.Linear(width, int(units)))
        if last_plain and i == len(dnn.hidden_units) - 1:
            width = int(units)
            break
        if dnn.use_bn:
            layers.append(nn.BatchNorm1d(int(units)))
        layers.append(activation_layer(dnn.activation, int(units)))
        if i < len(dnn.dropout_ratio) and dnn.dropout_ratio[i] > 0:
            layers.append(nn.Dropout(float(dnn.dropout_ratio[i])))
        width = int(units)
    return nn.Sequential(*layers), width


class Dice(nn.Module):
    """DIN's Dice activation, EasyRec's ``dice``: ``alpha * (1 - p) * x + p * x``.

    ``p = sigmoid(BatchNorm(x))`` without scale or shift (TensorFlow's ``epsilon=1e-9``,
    momentum 0.99), ``alpha`` one learned value per unit (from 0). The normalization uses the
    batch's statistics in training and the running ones in predictions and serving (as a
    DNN's ``use_bn``). Scriptable.

    Args:
        units: the layer's width.
    """

    def __init__(self, units: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(int(units), eps=1e-9, momentum=0.01, affine=False)
        self.alpha = nn.Parameter(torch.zeros(int(units)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, units]`` activated."""
        p = torch.sigmoid(self.norm(x))
        return self.alpha * (1.0 - p) * x + p * x


def activation_layer(name: str, units: int) -> nn.Module:
    """The layer of a DNN's ``activation`` (EasyRec's ``get_activation`` names).

    ``relu``; ``linear`` (none); ``softmax`` (over the last axis); ``gelu`` (EasyRec's
    tanh approximation; ``tf.nn.gelu``
    the exact one); ``leaky_relu`` and ``prelu`` without parameters (TensorFlow's slope
    0.2); ``elu``; ``selu``; ``tanh``; ``swish``; ``sigmoid``; ``dice`` (:class:`Dice`, one
    per layer of ``units``). Names are lower-cased; ``tf.nn.<name>`` is the same function.

    Raises:
        ValueError: another name.
    """
    key = name.lower()
    if key == "tf.nn.gelu":
        return nn.GELU()
    key = key.removeprefix("tf.nn.").removeprefix("tf.").removeprefix("nn.")
    if key == "dice":
        return Dice(units)
    simple = {"relu": nn.ReLU, "linear": nn.Identity, "elu": nn.ELU, "selu": nn.SELU,
              "tanh": nn.Tanh, "swish": nn.SiLU, "sigmoid": nn.Sigmoid}
    if key in simple:
        return simple[key]()
    if key == "softmax":
        return nn.Softmax(dim=-1)
    if key == "gelu":
        return nn.GELU(approximate="tanh")
    if key in ("leaky_relu", "prelu"):
        return nn.LeakyReLU(0.2)
    raise ValueError(f"DNN activation {name!r} is not supported")


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


class ProjectedTail(nn.Module):
    """Projected raw features at the end of an input: their values become their vectors.

    The last ``columns`` columns of the input are replaced by their ``RawProjection``
    vectors, the columns before are kept; scriptable.

    Args:
        widths: values per projected feature, in column order (``RawProjection``'s).
        dim: the projected vectors' width.
    """

    __constants__ = ["columns"]

    def __init__(self, widths: Sequence[int], dim: int) -> None:
        super().__init__()
        self.projection = RawProjection(widths, dim)
        self.columns = sum(int(w) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, kept + columns]`` -> ``[B, kept + features * dim]``."""
        kept = x.shape[1] - self.columns
        return torch.cat([x[:, :kept], self.projection(x[:, kept:])], dim=1)
