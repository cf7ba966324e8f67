"""Backbone layers over one tensor: EasyRec's ``MLP`` and the Keras layers its configs name.

* ``MLP`` (:class:`~odl.protos.pipeline_pb2.MLP`): per hidden unit count a Dense, then
  [BatchNorm], the activation, [Dropout]; the last layer with ``use_final_bn``,
  ``final_activation`` and ``use_final_bias``; ``use_bn_after_activation`` moves the
  normalization after the activation. Unset settings are EasyRec's (``relu``,
  ``he_uniform``, no bias) except batch normalization: ``use_bn`` and ``use_final_bn``
  normalize only where written true, odl's default for every DNN (docs/config.md, "Batch
  normalization"; EasyRec's is true, and loading warns where they are unwritten).
* ``Dense`` (``st_params``: ``units``, ``activation`` (none), ``use_bias`` (true),
  ``kernel_initializer`` (``glorot_uniform``)), ``Dropout`` (``rate``),
  ``BatchNormalization``, ``LayerNormalization``: Keras's layers of those names over the last
  axis.
* ``Add``: the sum of a list of tensors of one shape.

Keras's conventions are kept where they change what is learned: kernels drawn by the named
initializer (:func:`keras_dense`), biases zero, batch normalization over the last axis with
momentum 0.99 and epsilon 1e-3.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import math

import torch
from google.protobuf.message import Message
from torch import nn

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.value_specs import TensorSpec, flat_tensors, tensor
from odl.models.building_blocks import activation_layer
from odl.protos import pipeline_pb2

KERAS_INITIALIZERS = ("he_uniform", "he_normal", "glorot_uniform", "glorot_normal",
                      "lecun_uniform", "lecun_normal", "zeros")


def keras_dense(in_dim: int, units: int, use_bias: bool = True,
                initializer: str = "glorot_uniform") -> nn.Linear:
    """A Linear layer initialized as Keras's Dense with ``kernel_initializer`` (bias zero).

    Raises:
        ValueError: an initializer not in :data:`KERAS_INITIALIZERS`.
    """
    name = initializer.lower()
    if name not in KERAS_INITIALIZERS:
        raise ValueError(f"kernel initializer {initializer!r} is not one of "
                         f"{', '.join(KERAS_INITIALIZERS)}")
    layer = nn.Linear(int(in_dim), int(units), bias=use_bias)
    fan_in, fan_out = int(in_dim), int(units)
    with torch.no_grad():
        if name == "zeros":
            layer.weight.zero_()
        else:
            family, dist = name.split("_")
            scale = {"he": 2.0 / fan_in, "lecun": 1.0 / fan_in,
                     "glorot": 2.0 / (fan_in + fan_out)}[family]
            if dist == "uniform":
                bound = math.sqrt(3.0 * scale)
                layer.weight.uniform_(-bound, bound)
            else:  # Keras's truncated normal, stddev corrected for the truncation at 2
                std = math.sqrt(scale) / 0.87962566103423978
                nn.init.trunc_normal_(layer.weight, 0.0, std, -2 * std, 2 * std)
        if layer.bias is not None:
            layer.bias.zero_()
    return layer


class LastAxisBatchNorm(nn.Module):
    """Keras's BatchNormalization: per column of the last axis, over every other axis."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(int(width), eps=1e-3, momentum=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normalized, same shape."""
        if x.dim() == 2:
            return self.bn(x)
        return self.bn(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def easyrec_dense_layers(in_dim: int, units: int, use_bn: bool, dropout: float,
                         activation: str, initializer: str, use_bias: bool,
                         bn_after: bool) -> list[nn.Module]:
    """One layer of EasyRec's MLP: Dense, [BatchNorm], activation, [Dropout].

    With ``bn_after`` the normalization follows the activation.

    Raises:
        ValueError: an unknown activation or initializer, a dropout >= 1.
    """
    act = activation_layer(activation, units)
    layers: list[nn.Module] = [keras_dense(in_dim, units, use_bias, initializer)]
    if use_bn and not bn_after:
        layers += [LastAxisBatchNorm(units), act]
    else:
        layers.append(act)
        if use_bn:
            layers.append(LastAxisBatchNorm(units))
    if 0.0 < dropout < 1.0:
        layers.append(nn.Dropout(dropout))
    elif dropout >= 1.0:
        raise ValueError(f"dropout_ratio {dropout} must be below 1")
    return layers


def build_easyrec_mlp(in_dim: int, mlp: pipeline_pb2.MLP) -> tuple[nn.Sequential, int]:
    """EasyRec's MLP layer over ``in_dim`` columns (module docstring).

    Args:
        in_dim: the input's last dimension.
        mlp: the settings.

    Returns:
        ``(module, output width)``; the module maps ``[..., in_dim]`` to ``[..., width]``.

    Raises:
        ValueError: no hidden units, an unknown activation or initializer, a dropout >= 1.
    """
    units = [int(u) for u in mlp.hidden_units]
    if not units:
        raise ValueError("MLP needs hidden_units")
    drops = [float(d) for d in mlp.dropout_ratio]
    use_bn = bool(mlp.use_bn)  # unwritten: false (module docstring)
    use_final_bn = bool(mlp.use_final_bn)
    layers: list[nn.Module] = []
    width = int(in_dim)
    for i, u in enumerate(units):
        last = i == len(units) - 1
        layers += easyrec_dense_layers(
            width, u, use_final_bn if last else use_bn,
            drops[i] if i < len(drops) else 0.0,
            mlp.final_activation if last else mlp.activation, mlp.initializer,
            bool(mlp.use_final_bias if last else mlp.use_bias),
            bool(mlp.use_bn_after_activation))
        width = u
    return nn.Sequential(*layers), width


def optional_mlp(args: BlockArgs, width: int, settings: Message, field: str
                 ) -> tuple[nn.Module, int]:
    """A layer's optional ``mlp`` (e.g. FiBiNet's, MaskNet's): the identity when unset.

    Args:
        args: the layer's builder arguments (for errors).
        width: the MLP's input width.
        settings: the layer's params message holding ``mlp``.
        field: the params field, for errors (``"masknet"``).

    Returns:
        ``(module, output width)``.

    Raises:
        ConfigError: a bad MLP setting, at the layer.
    """
    if not settings.HasField("mlp"):
        return nn.Identity(), int(width)
    try:
        return build_easyrec_mlp(width, settings.mlp)
    except ValueError as e:
        raise args.refuse(f"{field}.mlp: {e}") from e


class OnTensor(nn.Module):
    """A module over one tensor as a backbone layer (one leaf in, one leaf out)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[inner(xs[0])]``."""
        return [self.inner(xs[0])]


class SumOfList(nn.Module):
    """Keras's Add: the sum of the input's tensors."""

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[xs[0] + xs[1] + ...]``."""
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return [out]


def _one_tensor(args: BlockArgs) -> TensorSpec:
    if not isinstance(args.spec, TensorSpec):
        raise args.refuse("takes one tensor")
    if not args.spec.shape:
        raise args.refuse("takes a tensor of at least two dimensions")
    return args.spec


def _build_mlp(args: BlockArgs) -> BuiltLayer:
    spec = _one_tensor(args)
    mlp = args.params if isinstance(args.params, pipeline_pb2.MLP) else None
    if mlp is None:
        raise args.refuse("needs mlp { hidden_units }")
    try:
        module, width = build_easyrec_mlp(spec.shape[-1], mlp)
    except ValueError as e:
        raise args.refuse(str(e)) from e
    return BuiltLayer(OnTensor(module), tensor(*spec.shape[:-1], width))


def _build_dense(args: BlockArgs) -> BuiltLayer:
    spec = _one_tensor(args)
    p = args.st_params
    if "units" not in p:
        raise args.refuse("needs st_params units")
    units = int(p["units"])
    try:
        layers: list[nn.Module] = [keras_dense(spec.shape[-1], units,
                                               bool(p.get("use_bias", True)),
                                               str(p.get("kernel_initializer",
                                                         "glorot_uniform")))]
        if p.get("activation"):
            layers.append(activation_layer(str(p["activation"]), units))
    except ValueError as e:
        raise args.refuse(str(e)) from e
    return BuiltLayer(OnTensor(nn.Sequential(*layers)), tensor(*spec.shape[:-1], units))


def _build_dropout(args: BlockArgs) -> BuiltLayer:
    spec = _one_tensor(args)
    rate = float(args.st_params.get("rate", 0.0))
    if not 0.0 <= rate < 1.0:
        raise args.refuse(f"rate must be in [0, 1), got {rate}")
    return BuiltLayer(OnTensor(nn.Dropout(rate) if rate > 0 else nn.Identity()), spec)


def _build_batch_norm(args: BlockArgs) -> BuiltLayer:
    spec = _one_tensor(args)
    return BuiltLayer(OnTensor(LastAxisBatchNorm(spec.shape[-1])), spec)


def _build_layer_norm(args: BlockArgs) -> BuiltLayer:
    spec = _one_tensor(args)
    eps = float(args.st_params.get("epsilon", 1e-3))
    return BuiltLayer(OnTensor(nn.LayerNorm(spec.shape[-1], eps=eps)), spec)


def _build_add(args: BlockArgs) -> BuiltLayer:
    items = flat_tensors(args.spec)
    if not items or len(set(items)) != 1:
        raise args.refuse("takes a list of tensors of one shape")
    return BuiltLayer(SumOfList(), items[0])


register_block("MLP", _build_mlp)
register_block("Dense", _build_dense)
register_block("Dropout", _build_dropout)
register_block("BatchNormalization", _build_batch_norm)
register_block("LayerNormalization", _build_layer_norm)
register_block("Add", _build_add)
