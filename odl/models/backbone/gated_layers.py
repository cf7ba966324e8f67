"""EasyRec's ``PPNet`` backbone layer (PEPNet): an MLP whose layers are scaled by gates.

Input ``[x, g]`` (two tensors ``[B, d_x]``, ``[B, d_g]``; EasyRec's configs merge two
groups into a list). The gates read ``c = concat(x, g)`` (``x`` without gradient through
this path) with ``full_gate_input`` (default true), else ``g``; the gates are computed once
from it. A gate of width ``u`` is
EasyRec's ``GateNN``::

    gate(c) = 2 * sigmoid(W_2 act(BN?(W_1 c [+ b_1])) [+ b_2])

(``W_1`` to ``hidden_dim``, unset: ``u``; biases only without ``use_bn``; He-uniform
kernels; Dropout after the activation in training). The MLP (``mlp``, EasyRec's MLP layer:
``odl.models.backbone.dense_layers``) runs layer by layer, every layer's output but the
last's multiplied by a gate of its width; in ``mode: "lazy"`` the last's too; in ``"eager"``
(the message's default) the input is gated first instead (``gate_params.output_dim`` must
be ``d_x``). Output: the last layer's, ``[B, last hidden unit]``.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from typing import Optional

import torch
from torch import nn

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.dense_layers import (
    LastAxisBatchNorm,
    easyrec_dense_layers,
    keras_dense,
)
from odl.models.backbone.value_specs import flat_tensors, tensor
from odl.models.building_blocks import activation_layer
from odl.protos import pipeline_pb2


def build_gate(in_dim: int, units: int, settings: pipeline_pb2.GateNN) -> nn.Sequential:
    """EasyRec's GateNN from ``in_dim`` to ``units`` gates (module docstring).

    Raises:
        ValueError: an unknown activation, a dropout >= 1.
    """
    hidden = int(settings.hidden_dim) if settings.HasField("hidden_dim") else int(units)
    bias = not settings.use_bn
    layers: list[nn.Module] = [keras_dense(in_dim, hidden, bias, "he_uniform")]
    if settings.use_bn:
        layers.append(LastAxisBatchNorm(hidden))
    layers.append(activation_layer(settings.activation, hidden))
    rate = float(settings.dropout_rate)
    if rate >= 1.0:
        raise ValueError(f"gate_params.dropout_rate {rate} must be below 1")
    if rate > 0:
        layers.append(nn.Dropout(rate))
    layers += [keras_dense(hidden, units, bias, "he_uniform"), nn.Sigmoid()]  # 2x: caller
    return nn.Sequential(*layers)


class GatedStep(nn.Module):
    """One MLP layer, then (when it has one) the product with its gate over the gate input."""

    def __init__(self, layer: nn.Module, gate: Optional[nn.Module]) -> None:
        super().__init__()
        self.layer = layer
        self.gate = gate

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``layer(x) [* 2 * gate(g)]``."""
        y = self.layer(x)
        gate = self.gate
        if gate is not None:
            y = y * (2.0 * gate(g))
        return y


class PPNetLayer(nn.Module):
    """PPNet (module docstring): the eager mode's input gate, then the gated steps."""

    __constants__ = ["full_gate_input"]

    def __init__(self, first_gate: Optional[nn.Module], steps: list[GatedStep],
                 full_gate_input: bool) -> None:
        super().__init__()
        self.first_gate = first_gate
        self.steps = nn.ModuleList(steps)
        self.full_gate_input = bool(full_gate_input)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[the gated MLP's output]``."""
        x = xs[0]
        g = xs[1]
        if self.full_gate_input:
            g = torch.cat([x.detach(), g], dim=-1)
        first = self.first_gate
        if first is not None:
            x = x * (2.0 * first(g))
        for step in self.steps:
            x = step(x, g)
        return [x]


def _build_ppnet(args: BlockArgs) -> BuiltLayer:
    items = flat_tensors(args.spec)
    if not items or len(items) != 2 or any(len(t.shape) != 1 for t in items):
        raise args.refuse("takes [x, gate input], two [B, d] tensors")
    p = args.params if isinstance(args.params, pipeline_pb2.PPNet) else None
    if p is None or not p.mlp.hidden_units:
        raise args.refuse("needs ppnet { mlp { hidden_units } }")
    if p.mode not in ("lazy", "eager"):
        raise args.refuse(f'mode must be "lazy" or "eager", got {p.mode!r}')
    x_dim, g_dim = items[0].shape[0], items[1].shape[0]
    gate_in = x_dim + g_dim if p.full_gate_input else g_dim
    mlp = p.mlp
    units = [int(u) for u in mlp.hidden_units]
    drops = [float(d) for d in mlp.dropout_ratio]
    lazy = p.mode == "lazy"
    try:
        first = None
        if not lazy:  # eager: the input is gated first
            out_dim = int(p.gate_params.output_dim)
            if out_dim != x_dim:
                raise ValueError(f"eager mode gates the input: gate_params.output_dim "
                                 f"({out_dim}) must be the input's width ({x_dim})")
            first = build_gate(gate_in, x_dim, p.gate_params)
        steps: list[GatedStep] = []
        width = x_dim
        for i, u in enumerate(units):
            last = i == len(units) - 1
            layer = nn.Sequential(*easyrec_dense_layers(
                width, u, bool(mlp.use_final_bn if last else mlp.use_bn),
                drops[i] if i < len(drops) else 0.0,
                mlp.final_activation if last else mlp.activation, mlp.initializer,
                bool(mlp.use_final_bias if last else mlp.use_bias),
                bool(mlp.use_bn_after_activation)))
            # a gate after every layer but the last; after the last too when lazy
            gate = build_gate(gate_in, u, p.gate_params) if (not last or lazy) else None
            steps.append(GatedStep(layer, gate))
            width = u
    except ValueError as e:
        raise args.refuse(str(e)) from e
    return BuiltLayer(PPNetLayer(first, steps, p.full_gate_input), tensor(width))


register_block("PPNet", _build_ppnet)
