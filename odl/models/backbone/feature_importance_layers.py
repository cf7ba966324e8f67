"""Backbone layers of FiBiNet: EasyRec's ``SENet``, ``BiLinear`` and ``FiBiNet``.

Each takes a list of features' vectors ``v_1 .. v_f`` (``[B, d_i]`` each; an input layer's
``only_output_feature_list``), as EasyRec's layers do; ``d = d_1 + ... + d_f``.

* ``SENet`` (``senet { reduction_ratio (4), num_squeeze_group g (2), use_skip_connection
  (true), use_output_layer_norm (true) }``; EasyRec reads only the message): each ``v_i``
  is cut into ``g`` groups of ``d_i / g`` columns and squeezed to the groups' max and mean;
  ``z = [max(v_1), mean(v_1), max(v_2), ...]`` (``[B, 2 f g]``);
  ``w = W2 relu(W1 z + b1) + b2`` (``W1``: ``2 f g -> max(1, 2 f g // reduction_ratio)``,
  He-normal; ``W2``: to ``d``, Glorot-normal); ``y = concat(v) * w``, plus ``concat(v)``
  with the skip connection, then layer normalization (epsilon 1e-3) if asked. Output
  ``[B, d]``. Every ``d_i`` must be a multiple of ``g``.
* ``BiLinear`` (``bilinear { type, use_plus, num_output_units }`` or the same keys in
  ``st_params``; ``type`` ``interaction`` and ``use_plus`` true by default): per pair
  ``i < j`` (in ``itertools.combinations`` order) ``p_ij = g(W_x v_i + b_x, v_j)`` with
  ``W_x`` one ``d_1 x d_1`` matrix for every ``i`` (``all``), one per ``i`` (``each``;
  these two need one width) or one ``d_i -> d_j`` per pair (``interaction``); ``g`` the
  dot product (``[B, 1]``, ``use_plus``) or the element-wise product (``[B, d_j]``).
  Output ``Dense(num_output_units)(concat(p))``, ``[B, num_output_units]``.
* ``FiBiNet`` (``fibinet { senet, bilinear, mlp }``): ``concat(SENet(v), BiLinear(v))``
  (SENet alone without ``bilinear``), then EasyRec's ``MLP`` if ``mlp`` is set. Output
  ``[B, d + num_output_units]`` or the MLP's ``[B, last hidden unit]``.

Dense layers are Keras's: bias on and zero, Glorot-uniform kernels unless said above.

EasyRec's ``BiLinear`` is registered by its Python name ``BiLinear`` (EasyRec's
``load_keras_layer`` resolves no ``Bilinear``). Deviations: EasyRec's ``interaction`` type
cannot run (it builds the pairs' layers in combination order but looks them up at
``i * f + j``, past the list's end for the last pair), so odl gives the evident meaning, one
matrix per pair; EasyRec's proto requires ``senet`` in ``FiBiNet``, odl takes an unset one
as ``senet {}``. Refused: fewer than two features for ``BiLinear``, differing widths for
``all`` / ``each``, ``num_output_units`` unset or 0, a zero ``reduction_ratio`` or
``num_squeeze_group``, and a params message of another layer.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import itertools
from typing import Optional

import torch
from torch import nn

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.dense_layers import keras_dense, optional_mlp
from odl.models.backbone.layer_settings import (
    bool_setting,
    int_setting,
    params_message,
    setting,
)
from odl.models.backbone.value_specs import flat_tensors, tensor
from odl.protos import pipeline_pb2

BILINEAR_TYPES = ("all", "each", "interaction")


def feature_widths(args: BlockArgs, minimum: int = 1) -> list[int]:
    """The widths ``d_i`` of a list of ``[B, d_i]`` tensors.

    Raises:
        ConfigError: another input, or fewer than ``minimum`` features.
    """
    items = flat_tensors(args.spec)
    if not items or any(len(s.shape) != 1 for s in items):
        raise args.refuse("takes a list of [B, d] tensors (the features' vectors)")
    if len(items) < minimum:
        raise args.refuse(f"needs at least {minimum} features")
    return [s.shape[0] for s in items]


# ---- SENet ------------------------------------------------------------------------------


class SENetLayer(nn.Module):
    """FiBiNet's squeeze-and-excitation re-weighting (module docstring)."""

    def __init__(self, widths: list[int], groups: int, reduction_ratio: int,
                 use_skip_connection: bool, use_output_layer_norm: bool) -> None:
        super().__init__()
        self.groups = int(groups)
        squeezed = 2 * len(widths) * self.groups
        total = sum(widths)
        reduced = max(1, squeezed // int(reduction_ratio))
        self.reduce = keras_dense(squeezed, reduced, True, "he_normal")
        self.excite = keras_dense(reduced, total, True, "glorot_normal")
        self.use_skip_connection = use_skip_connection
        self.norm = nn.LayerNorm(total, eps=1e-3) if use_output_layer_norm else nn.Identity()

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, d]``: the concatenated features re-weighted."""
        squeezed: list[torch.Tensor] = []
        for x in xs:
            grouped = x.reshape(x.shape[0], self.groups, -1)
            squeezed.append(grouped.amax(dim=-1))
            squeezed.append(grouped.mean(dim=-1))
        weights = self.excite(torch.relu(self.reduce(torch.cat(squeezed, dim=1))))
        features = torch.cat(xs, dim=-1)
        out = features * weights
        if self.use_skip_connection:
            out = out + features
        return [self.norm(out)]


def senet_layer(args: BlockArgs, config: pipeline_pb2.SENet, widths: list[int],
                prefix: str) -> SENetLayer:
    """The SENet of ``config`` over features of ``widths``.

    Raises:
        ConfigError: a zero ratio or group count, a width not a multiple of the groups.
    """
    groups, ratio = int(config.num_squeeze_group), int(config.reduction_ratio)
    if groups < 1 or ratio < 1:
        raise args.refuse(f"{prefix}num_squeeze_group and {prefix}reduction_ratio must be "
                          f">= 1, got {groups} and {ratio}")
    bad = [d for d in widths if d % groups]
    if bad:
        raise args.refuse(f"every feature's width must be a multiple of "
                          f"{prefix}num_squeeze_group {groups}; got {bad[0]}")
    return SENetLayer(widths, groups, ratio, bool(config.use_skip_connection),
                      bool(config.use_output_layer_norm))


def _build_senet(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.SENet, "senet", required=True)
    widths = feature_widths(args)
    return BuiltLayer(senet_layer(args, config, widths, "senet."), tensor(sum(widths)))


# ---- BiLinear ---------------------------------------------------------------------------


class BiLinearLayer(nn.Module):
    """FiBiNet's bilinear interaction of the features' pairs (module docstring)."""

    def __init__(self, widths: list[int], kind: str, use_plus: bool, units: int) -> None:
        super().__init__()
        pairs = list(itertools.combinations(range(len(widths)), 2))
        self.shared = kind == "all"
        if kind == "interaction":
            layers = [keras_dense(widths[i], widths[j]) for i, j in pairs]
            self.sources = [i for i, _ in pairs]
            self.pair_projection = list(range(len(pairs)))
        else:
            d = widths[0]
            layers = [keras_dense(d, d) for _ in range(1 if self.shared else len(widths) - 1)]
            self.sources = list(range(len(widths) - 1))
            self.pair_projection = [i for i, _ in pairs]
        self.projections = nn.ModuleList(layers)
        self.pair_other = [j for _, j in pairs]
        self.use_plus = use_plus
        width = len(pairs) if use_plus else sum(widths[j] for _, j in pairs)
        self.output = keras_dense(width, int(units))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, num_output_units]``."""
        projected: list[torch.Tensor] = []
        if self.shared:
            for i in self.sources:
                projected.append(self.projections[0](xs[i]))
        else:
            for k, layer in enumerate(self.projections):
                projected.append(layer(xs[self.sources[k]]))
        products: list[torch.Tensor] = []
        for p in range(len(self.pair_other)):
            product = projected[self.pair_projection[p]] * xs[self.pair_other[p]]
            products.append(product.sum(dim=-1, keepdim=True) if self.use_plus else product)
        return [self.output(torch.cat(products, dim=-1))]


def bilinear_layer(args: BlockArgs, config: Optional[pipeline_pb2.Bilinear],
                   widths: list[int], prefix: str) -> BiLinearLayer:
    """The BiLinear of ``config`` (``None``: ``args.st_params``) over features of ``widths``.

    Raises:
        ConfigError: no output units, an unknown type, fewer than two features, differing
            widths for ``all`` / ``each``.
    """
    if config is not None:
        units = int(config.num_output_units)
    elif "num_output_units" in args.st_params:
        units = int_setting(args, "st_params.num_output_units",
                            args.st_params["num_output_units"], 1)
    else:
        raise args.refuse("needs st_params num_output_units")
    if units < 1:
        raise args.refuse(f"needs {prefix}num_output_units >= 1")
    kind = setting(args, config, "type", "interaction")
    if not isinstance(kind, str) or kind.lower() not in BILINEAR_TYPES:
        raise args.refuse(f"{prefix}type must be one of {', '.join(BILINEAR_TYPES)}; "
                          f"got {kind!r}")
    kind = kind.lower()
    use_plus = bool_setting(args, config, "use_plus", True)
    if len(widths) < 2:
        raise args.refuse("BiLinear needs at least 2 features")
    if kind != "interaction" and len(set(widths)) != 1:
        raise args.refuse(f"{prefix}type {kind!r} needs features of one width (type "
                          f"'interaction' takes different widths)")
    return BiLinearLayer(widths, kind, use_plus, units)


def _build_bilinear(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.Bilinear, "bilinear")
    widths = feature_widths(args)
    layer = bilinear_layer(args, config, widths, "bilinear." if config else "st_params.")
    return BuiltLayer(layer, tensor(layer.output.out_features))


# ---- FiBiNet ----------------------------------------------------------------------------


class FiBiNetLayer(nn.Module):
    """FiBiNet: SENet and BiLinear side by side, then an MLP (module docstring)."""

    def __init__(self, senet: SENetLayer, bilinear: Optional[BiLinearLayer],
                 mlp: Optional[nn.Module]) -> None:
        super().__init__()
        self.senet = senet
        self.bilinear = bilinear
        self.mlp = mlp if mlp is not None else nn.Identity()

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, width]``: the MLP's output, or the parts concatenated."""
        feature = self.senet(xs)[0]
        if self.bilinear is not None:
            feature = torch.cat([feature, self.bilinear(xs)[0]], dim=-1)
        return [self.mlp(feature)]


def _build_fibinet(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.FiBiNet, "fibinet", required=True)
    widths = feature_widths(args)
    senet = senet_layer(args, config.senet, widths, "fibinet.senet.")
    width = sum(widths)
    bilinear = None
    if config.HasField("bilinear"):
        bilinear = bilinear_layer(args, config.bilinear, widths, "fibinet.bilinear.")
        width += bilinear.output.out_features
    mlp, width = optional_mlp(args, width, config, "fibinet")
    return BuiltLayer(FiBiNetLayer(senet, bilinear, mlp), tensor(width))


register_block("SENet", _build_senet)
register_block("BiLinear", _build_bilinear)
register_block("FiBiNet", _build_fibinet)
