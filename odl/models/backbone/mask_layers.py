"""Backbone layers that mask or gate a tensor: MaskBlock, MaskNet, Highway, Gate (EasyRec).

* ``MaskBlock`` (``mask_block { }``; EasyRec reads only the message): MaskNet's
  instance-guided mask. Input ``[net, mask_input]`` (a list; items after the second are
  ignored, as EasyRec's ``inputs[:2]``) or one tensor (both roles). With ``a`` the
  aggregation width (``int(mask_width * reduction_factor)`` when ``reduction_factor`` is set,
  else ``aggregation_size``)::

      u      = mask_input                       (or  U mask_input, no bias, with projection_dim)
      weight = W2 relu(W1 u + b1) + b2          (W1: a units, he_uniform; W2: net's width)
      masked = LN_in(net) * weight              (LN_in only with input_layer_norm)
      out    = masked                           (no output_size)
             = relu(LN_out(W3 masked))          (output_size: W3 without bias)

  Output: ``net``'s shape, its last axis ``output_size`` when set. ``net`` and
  ``mask_input`` must agree on every axis but the last.
* ``MaskNet`` (``masknet { }``): ``x = LN(input)`` (``input_layer_norm``, default true);
  ``use_parallel`` (default true): ``concat_i block_i(x, x)`` on axis 1; serial:
  ``net = block_i(net, x)`` from ``net = x``; then ``mlp`` when set
  (:func:`~odl.models.backbone.dense_layers.build_easyrec_mlp`, with odl's batch
  normalization default). Input: one ``[B, D]`` tensor. Output ``[B, width]``.
* ``Highway`` (``highway { }``, ``st_params`` or nothing): ``v = P x`` when ``emb_size`` is
  set and differs from the input width (else ``v = x``); then ``num_layers`` (1) times
  ``g = sigmoid(G v + b_g)``, ``t = dropout(act(T v + b_t))``, ``v = g * t + (1 - g) * v``;
  ``activation`` (``relu``; one instance shared by the layers, as EasyRec), ``dropout_rate``
  (0), ``b_g`` starting at ``init_gate_bias`` (-3). Input: one tensor; output: its shape
  with the last axis the projected width (the activation sees ``[-1, width]`` rows, which
  matters for ``dice``). ``highway.input`` is not read (EasyRec's neither).
* ``Gate`` (``st_params { weight_index }``, default 0): CDN's weighted sum. Input: a list of
  at least two ``[B, d]`` tensors; ``w = inputs[weight_index]`` (``[B, k]``) and the other
  items ``x_0, x_1, ...`` in order: ``sum_j w[:, j:j+1] * x_j``, ``[B, d]``.

Initialization is Keras's (biases zero): Dense kernels ``glorot_uniform`` unless named
above; LayerNormalization with ``epsilon`` 1e-3, scale one, offset zero.

Regularization as EasyRec's: only the kernels EasyRec regularizes are ``nn.Linear`` (which
the model's ``l2_regularization`` penalizes): MaskBlock's aggregation and projection and
MaskNet's MLP. MaskBlock's mask and output kernels and all of Highway's are plain
parameters (:class:`PlainDense`), unpenalized as in EasyRec.

EasyRec's oddities kept: MaskBlock's ``aggregation_size`` is read whenever
``reduction_factor`` is unset (EasyRec's ``HasField(...) is not None`` is always true);
MaskNet's blocks in parallel all see the normalized input while its serial blocks take it
as the mask input; Highway's activation layer (a ``dice`` one has parameters) is shared by
its layers; Gate uses the first ``len(inputs) - 1`` columns of the weights, ignoring more.

Refused (``ConfigError``): MaskBlock without a positive aggregation width, an explicit
``output_size: 0``; MaskBlock / MaskNet from ``st_params`` (EasyRec's ``get_pb_config``
refuses them too); MaskNet with ``use_parallel`` and no ``mask_blocks`` (EasyRec fails on
the empty concat); ``emb_size: 0``; dropout outside ``[0, 1)``; Gate's ``mlp`` (odl's
``KerasLayer`` has no ``gate`` message, and EasyRec's ``st_params`` form cannot build it:
follow the Gate with an MLP block), a ``weight_index`` outside the list, weights narrower
than the number of other inputs (EasyRec's slice fails at run time), inputs of different
shapes or not ``[B, d]`` (EasyRec's ``[B, 1]`` weight would broadcast them wrongly).
``projection_dim: 0`` means no projection (odl's proto documents 0 as none).

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.dense_layers import keras_dense, optional_mlp
from odl.models.backbone.layer_settings import (
    float_setting,
    int_setting,
    only_st_params,
    params_message,
    setting,
)
from odl.models.backbone.value_specs import TensorSpec, flat_tensors, item_offsets, tensor
from odl.models.building_blocks import activation_layer
from odl.protos import pipeline_pb2

KERAS_LN_EPSILON = 1e-3


# ---- shared helpers ---------------------------------------------------------------------


def keras_layer_norm(width: int) -> nn.LayerNorm:
    """Keras's LayerNormalization over the last axis (epsilon 1e-3)."""
    return nn.LayerNorm(int(width), eps=KERAS_LN_EPSILON)


class PlainDense(nn.Module):
    """A Keras Dense whose kernel is a plain parameter (not ``nn.Linear``).

    The model's ``l2_regularization`` penalizes ``nn.Linear`` kernels only, so this holds
    the kernels EasyRec leaves unregularized. Initialized as :func:`keras_dense`.

    Args:
        in_dim: input width.
        units: output width.
        use_bias: add a bias (zeros at first).
        initializer: a :data:`~odl.models.backbone.dense_layers.KERAS_INITIALIZERS` name.
    """

    def __init__(self, in_dim: int, units: int, use_bias: bool = True,
                 initializer: str = "glorot_uniform") -> None:
        super().__init__()
        linear = keras_dense(in_dim, units, use_bias, initializer)
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.bias: Optional[torch.Tensor] = (
            nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` over the last axis."""
        return F.linear(x, self.weight, self.bias)


class OnRows(nn.Module):
    """An activation over a tensor as ``[-1, width]`` rows (Dice normalizes per column)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``act`` over the last axis, same shape."""
        if x.dim() == 2:
            return self.act(x)
        return self.act(x.reshape(-1, x.shape[-1])).reshape(x.shape)


# ---- MaskBlock --------------------------------------------------------------------------


class MaskBlockCore(nn.Module):
    """One MaskBlock over ``(net, mask_input)`` (module docstring)."""

    def __init__(self, net_dim: int, mask_dim: int, aggregation: int, projection: int,
                 output_size: int, input_layer_norm: bool) -> None:
        super().__init__()
        self.input_layer_norm = bool(input_layer_norm)
        self.input_ln = keras_layer_norm(net_dim) if input_layer_norm else nn.Identity()
        self.has_projection = projection > 0
        self.project = (keras_dense(mask_dim, projection, use_bias=False)
                        if projection > 0 else nn.Identity())
        self.aggregation = keras_dense(projection if projection > 0 else mask_dim,
                                       aggregation, True, "he_uniform")
        self.mask_weights = PlainDense(aggregation, net_dim)
        self.has_output = output_size > 0
        self.output_layer = (PlainDense(net_dim, output_size, use_bias=False)
                             if output_size > 0 else nn.Identity())
        self.output_ln = keras_layer_norm(output_size) if output_size > 0 else nn.Identity()

    def forward(self, net: torch.Tensor, mask_input: torch.Tensor) -> torch.Tensor:
        """The masked ``net`` (``[..., output_size]`` with an output layer)."""
        net = self.input_ln(net)
        hidden = torch.relu(self.aggregation(self.project(mask_input)))
        masked = net * self.mask_weights(hidden)
        if not self.has_output:
            return masked
        return torch.relu(self.output_ln(self.output_layer(masked)))


class MaskBlockLayer(nn.Module):
    """MaskBlock as a backbone layer: ``net`` and ``mask_input`` are two of the leaves."""

    def __init__(self, core: MaskBlockCore, net_index: int, mask_index: int) -> None:
        super().__init__()
        self.core = core
        self.net_index = int(net_index)
        self.mask_index = int(mask_index)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[block(net, mask_input)]``."""
        return [self.core(xs[self.net_index], xs[self.mask_index])]


def mask_block_core(args: BlockArgs, config: pipeline_pb2.MaskBlock, net_dim: int,
                    mask_dim: int, where: str = "mask_block") -> tuple[MaskBlockCore, int]:
    """A MaskBlock of ``config`` over widths ``net_dim`` / ``mask_dim``.

    Returns:
        ``(block, output width)``.

    Raises:
        ConfigError: no positive aggregation width, ``output_size: 0``.
    """
    if config.HasField("reduction_factor"):
        aggregation = int(mask_dim * config.reduction_factor)
        if aggregation < 1:
            raise args.refuse(f"{where}.reduction_factor {config.reduction_factor} times the "
                              f"mask input's width {mask_dim} leaves no aggregation units")
    else:
        aggregation = int(config.aggregation_size)
        if aggregation < 1:
            raise args.refuse(f"{where} needs reduction_factor or a positive "
                              "aggregation_size")
    if config.HasField("output_size") and config.output_size == 0:
        raise args.refuse(f"{where}.output_size must be positive (leave it unset to keep "
                          "the input's width)")
    output_size = int(config.output_size)
    core = MaskBlockCore(net_dim, mask_dim, aggregation, int(config.projection_dim),
                         output_size, bool(config.input_layer_norm))
    return core, output_size if output_size > 0 else net_dim


def _build_mask_block(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.MaskBlock, "mask_block", required=True)
    if isinstance(args.spec, TensorSpec):
        net, mask, net_index, mask_index = args.spec, args.spec, 0, 0
    else:
        if len(args.spec) < 2 or not all(isinstance(s, TensorSpec) for s in args.spec[:2]):
            raise args.refuse("takes [net, mask_input] (two tensors) or one tensor")
        net, mask = args.spec[0], args.spec[1]
        net_index, mask_index = 0, item_offsets(args.spec)[1]
    if not net.shape or not mask.shape:
        raise args.refuse("takes tensors of at least two dimensions")
    if net.shape[:-1] != mask.shape[:-1]:
        raise args.refuse("net and mask_input must agree on every axis but the last")
    core, width = mask_block_core(args, config, net.shape[-1], mask.shape[-1])
    return BuiltLayer(MaskBlockLayer(core, net_index, mask_index),
                      tensor(*net.shape[:-1], width))


# ---- MaskNet ----------------------------------------------------------------------------


class MaskNetLayer(nn.Module):
    """MaskNet's blocks in parallel or in series, then its MLP (module docstring)."""

    def __init__(self, width: int, blocks: list[MaskBlockCore], parallel: bool,
                 input_layer_norm: bool, mlp: nn.Module) -> None:
        super().__init__()
        self.input_ln = keras_layer_norm(width) if input_layer_norm else nn.Identity()
        self.blocks = nn.ModuleList(blocks)
        self.parallel = bool(parallel)
        self.mlp = mlp

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[mlp(blocks(LN(x)))]``."""
        x = self.input_ln(xs[0])
        if self.parallel:
            outs: list[torch.Tensor] = []
            for block in self.blocks:
                outs.append(block(x, x))
            net = torch.cat(outs, dim=1)
        else:
            net = x
            for block in self.blocks:
                net = block(net, x)
        return [self.mlp(net)]


def _build_mask_net(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.MaskNet, "masknet", required=True)
    if not isinstance(args.spec, TensorSpec) or len(args.spec.shape) != 1:
        raise args.refuse("takes one [B, D] tensor")
    dim = args.spec.shape[0]
    if config.use_parallel and not config.mask_blocks:
        raise args.refuse("needs mask_blocks (use_parallel concatenates their outputs)")
    blocks: list[MaskBlockCore] = []
    widths: list[int] = []
    net_dim = dim
    for i, block_config in enumerate(config.mask_blocks):
        core, width = mask_block_core(args, block_config,
                                      dim if config.use_parallel else net_dim, dim,
                                      f"masknet.mask_blocks[{i}]")
        blocks.append(core)
        widths.append(width)
        net_dim = width
    width = sum(widths) if config.use_parallel else net_dim
    mlp, width = optional_mlp(args, width, config, "masknet")
    layer = MaskNetLayer(dim, blocks, config.use_parallel, config.input_layer_norm, mlp)
    return BuiltLayer(layer, tensor(width))


# ---- Highway ----------------------------------------------------------------------------


class HighwayStep(nn.Module):
    """One gated layer's Dense layers: the gate ``G`` and the transform ``T``."""

    def __init__(self, dim: int, gate_bias: float) -> None:
        super().__init__()
        self.gate = PlainDense(dim, dim)
        self.transform = PlainDense(dim, dim)
        with torch.no_grad():
            assert self.gate.bias is not None
            self.gate.bias.fill_(float(gate_bias))


class HighwayLayer(nn.Module):
    """EasyRec's Highway (module docstring)."""

    def __init__(self, in_dim: int, dim: int, num_layers: int, activation: nn.Module,
                 dropout: float, gate_bias: float) -> None:
        super().__init__()
        self.project = PlainDense(in_dim, dim) if dim != in_dim else nn.Identity()
        self.steps = nn.ModuleList(HighwayStep(dim, gate_bias) for _ in range(num_layers))
        self.act = OnRows(activation)
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[v]`` after the gated layers."""
        value = self.project(xs[0])
        for step in self.steps:
            gate = torch.sigmoid(step.gate(value))
            transformed = self.dropout(self.act(step.transform(value)))
            value = gate * transformed + (1.0 - gate) * value
        return [value]


def _build_highway(args: BlockArgs) -> BuiltLayer:
    message = params_message(args, pipeline_pb2.HighWayTower, "highway")
    if not isinstance(args.spec, TensorSpec) or not args.spec.shape:
        raise args.refuse("takes one tensor of at least two dimensions")
    in_dim = args.spec.shape[-1]
    emb_size = setting(args, message, "emb_size", None)
    dim = in_dim if emb_size is None else int_setting(args, "emb_size", emb_size, 1)
    num_layers = int_setting(args, "num_layers", setting(args, message, "num_layers", 1), 0)
    activation = setting(args, message, "activation", "relu")
    if not isinstance(activation, str):
        raise args.refuse(f"activation must be a name, got {activation!r}")
    dropout = float_setting(args, message, "dropout_rate", 0.0)
    if not 0.0 <= dropout < 1.0:
        raise args.refuse(f"dropout_rate must be in [0, 1), got {dropout}")
    gate_bias = float_setting(args, message, "init_gate_bias", -3.0)
    try:
        act = activation_layer(activation, dim)
    except ValueError as e:
        raise args.refuse(str(e)) from e
    layer = HighwayLayer(in_dim, dim, num_layers, act, dropout, gate_bias)
    return BuiltLayer(layer, tensor(*args.spec.shape[:-1], dim))


# ---- Gate -------------------------------------------------------------------------------


class GateLayer(nn.Module):
    """CDN's weighted sum ``sum_j w[:, j:j+1] * x_j`` (module docstring)."""

    def __init__(self, weight_index: int, count: int) -> None:
        super().__init__()
        self.weight_index = int(weight_index)
        self.others = [i for i in range(int(count)) if i != int(weight_index)]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, d]``."""
        weights = xs[self.weight_index]
        out = torch.zeros_like(xs[self.others[0]])
        for j, i in enumerate(self.others):
            out = out + weights[:, j:j + 1] * xs[i]
        return [out]


def _build_gate(args: BlockArgs) -> BuiltLayer:
    only_st_params(args)
    if args.st_params.get("mlp") is not None:
        raise args.refuse("st_params.mlp is not supported (odl's KerasLayer has no gate "
                          "message); add an MLP block after the Gate")
    items = flat_tensors(args.spec)
    if items is None or len(items) < 2:
        raise args.refuse("takes a list of at least two tensors: the weights and the "
                          "inputs to weigh")
    index = int_setting(args, "weight_index", args.st_params.get("weight_index", 0), 0)
    if index >= len(items):
        raise args.refuse(f"weight_index {index} is outside the {len(items)} inputs")
    weights = items[index]
    others = [s for i, s in enumerate(items) if i != index]
    if len(weights.shape) != 1:
        raise args.refuse(f"the weights (input {index}) must be [B, k], got {weights}")
    if weights.shape[0] < len(others):
        raise args.refuse(f"the weights (input {index}) have {weights.shape[0]} columns "
                          f"for {len(others)} inputs")
    if len(set(others)) != 1 or len(others[0].shape) != 1:
        raise args.refuse("the weighed inputs must be [B, d] tensors of one width")
    return BuiltLayer(GateLayer(index, len(items)), others[0])


register_block("MaskBlock", _build_mask_block)
register_block("MaskNet", _build_mask_net)
register_block("Highway", _build_highway)
register_block("Gate", _build_gate)
