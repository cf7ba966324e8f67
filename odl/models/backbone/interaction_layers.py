"""Backbone layers that cross features: EasyRec's ``FM``, ``DotInteraction``, ``Cross``, ``CIN``.

Below ``v_1 .. v_N`` are the features' vectors (``[B, D]`` each), ``V`` their stack
``[B, N, D]``.

* ``FM`` (``fm { use_variant }`` or ``st_params { use_variant }``; false by default): the
  factorization machine's pairwise term ``0.5 * ((sum_i v_i)^2 - sum_i v_i^2)``, element
  wise, ``[B, D]``; summed over ``D`` to ``[B, 1]`` unless ``use_variant``. Input: a list
  of ``[B, D]`` tensors of one width, or a ``[B, N, D]`` tensor. (``fm.l2_regularization``
  is not read, as in EasyRec.)
* ``DotInteraction`` (``st_params``: ``self_interaction``, ``skip_gather``; both false by
  default): DLRM's dot products ``<v_i, v_j>``; the lower triangle of ``V V^T`` read row by
  row (``j < i``, or ``j <= i`` with ``self_interaction``): ``[B, N(N-1)/2]`` (or
  ``[B, N(N+1)/2]``); with ``skip_gather`` the whole ``[B, N*N]`` matrix, its upper
  triangle set to zero. The diagonal is zeroed there too unless ``self_interaction``. Input
  as FM's.
* ``Cross`` (``st_params``: ``projection_dim`` (none: full rank), ``diag_scale`` (0),
  ``use_bias`` (true), ``preactivation`` (none), ``kernel_initializer``
  (``truncated_normal``: Keras's, stddev 0.05), ``bias_initializer`` (``zeros``)): DCN v2's
  cross ``x0 * (f(W x + b) + diag_scale * x) + x`` with ``W`` ``D x D`` or, with
  ``projection_dim`` ``p``, ``V U`` (``U``: ``D -> p`` without bias, ``V``: ``p -> D``);
  ``f`` is ``preactivation``. Input: ``[x0, x]`` (two tensors of one shape; a
  ``recurrent`` block with ``fixed_input_index: 0`` feeds each step's output back as ``x``)
  or one tensor (``x0 = x``). Output: ``x``'s shape.
* ``CIN`` (``cin { hidden_feature_sizes }`` or the same key in ``st_params``): xDeepFM's
  compressed interaction network. ``X^0 = V``; layer ``k`` (``H_k`` maps) computes
  ``X^k[h, :] = relu(sum_{i, j} W^k[h, i, j] * X^{k-1}[i, :] * X^0[j, :] + b^k[h])`` and
  pools ``sum_d X^k[h, d]``; the output concatenates the pooled maps, ``[B, sum_k H_k]``.
  Input: a ``[B, N, D]`` tensor (EasyRec's configs stack the feature list with
  ``extra_input_fn``), or a list of ``[B, D]`` tensors of one width, stacked here.

Initialization follows EasyRec: Keras Dense kernels by the named initializer, biases zero;
CIN's kernels ``[H_k, H_{k-1}, N]`` He-normal (truncated, fan-in ``H_{k-1} * H_k`` as
TensorFlow counts a 3-d shape), biases zero. CIN's kernels are plain parameters, not
``nn.Linear``, so the model's L2 term skips them, as EasyRec's (unregularized) CIN does.

EasyRec's oddities kept: ``DotInteraction`` with ``skip_gather`` and without
``self_interaction`` also zeroes the diagonal; boolean settings given as numbers count by
truth (``self_interaction: 1`` is true). Extensions and refusals: EasyRec's ``Cross``
fails to build over one tensor (its ``build`` reads ``input_shape[0][-1]``) though its
``call`` means ``x0 = x``; odl takes that meaning. ``CIN`` over a list is an odl
convenience (EasyRec needs the stacked tensor). The regularizer settings of ``Cross`` and
``CIN`` are refused (the model's ``l2_regularization`` is odl's only kernel penalty), so are
initializers other than those listed in :data:`CROSS_INITIALIZERS`, settings of the wrong
type, and a params message of another layer (EasyRec would silently ignore it).

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import math

import torch
from torch import nn

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.dense_layers import KERAS_INITIALIZERS, keras_dense
from odl.models.backbone.layer_settings import (
    bool_setting,
    int_setting,
    only_st_params,
    params_message,
    setting,
)
from odl.models.backbone.value_specs import TensorSpec, flat_tensors, tensor
from odl.models.building_blocks import activation_layer
from odl.protos import pipeline_pb2

# Keras's TruncatedNormal / RandomNormal / RandomUniform defaults (stddev / limit 0.05).
KERAS_SMALL_INIT = 0.05
CROSS_INITIALIZERS = KERAS_INITIALIZERS + ("truncated_normal", "random_normal",
                                           "random_uniform")
# TensorFlow's correction of a normal truncated at two standard deviations.
_TRUNCATION_STD = 0.87962566103423978

def feature_stack(args: BlockArgs) -> tuple[bool, int, int]:
    """The input as features ``[B, N, D]``.

    A list of ``[B, D]`` tensors of one width is stacked; a ``[B, N, D]`` tensor is taken
    as it is.

    Returns:
        ``(from_list, N, D)``; ``from_list``: the leaves are stacked on axis 1.

    Raises:
        ConfigError: another input.
    """
    if isinstance(args.spec, TensorSpec):
        if len(args.spec.shape) != 2:
            raise args.refuse("takes a [B, N, D] tensor or a list of [B, D] tensors")
        return False, args.spec.shape[0], args.spec.shape[1]
    items = flat_tensors(args.spec)
    if not items or any(len(s.shape) != 1 for s in items):
        raise args.refuse("takes a list of [B, D] tensors or a [B, N, D] tensor")
    if len(set(items)) != 1:
        raise args.refuse("all features must have one width (EasyRec stacks them)")
    return True, len(items), items[0].shape[0]


def stack_features(xs: list[torch.Tensor], from_list: bool) -> torch.Tensor:
    """``[B, N, D]`` from the leaves of a :func:`feature_stack` input."""
    return torch.stack(xs, dim=1) if from_list else xs[0]


# ---- FM ---------------------------------------------------------------------------------


class FMLayer(nn.Module):
    """FM's pairwise term over stacked features (module docstring)."""

    def __init__(self, from_list: bool, use_variant: bool) -> None:
        super().__init__()
        self.from_list = from_list
        self.use_variant = use_variant

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, 1]`` (``[B, D]`` with ``use_variant``)."""
        v = stack_features(xs, self.from_list)
        total = v.sum(dim=1)
        cross = total * total - (v * v).sum(dim=1)
        if self.use_variant:
            return [0.5 * cross]
        return [0.5 * cross.sum(dim=-1, keepdim=True)]


def _build_fm(args: BlockArgs) -> BuiltLayer:
    message = params_message(args, pipeline_pb2.FM, "fm")
    from_list, _, dim = feature_stack(args)
    use_variant = bool_setting(args, message, "use_variant", False)
    return BuiltLayer(FMLayer(from_list, use_variant), tensor(dim if use_variant else 1))


# ---- DotInteraction ---------------------------------------------------------------------


class DotInteractionLayer(nn.Module):
    """DLRM's pairwise dot products (module docstring).

    The kept positions are plain lists (not buffers): constants of the config, so that no
    checkpoint or export holds them.
    """

    kept: list[int]
    zeroed: list[int]

    def __init__(self, from_list: bool, num_features: int, self_interaction: bool,
                 skip_gather: bool) -> None:
        super().__init__()
        n = int(num_features)
        self.from_list = from_list
        self.skip_gather = skip_gather
        self.width = n * n
        # row-major positions in V V^T: the lower triangle, with the diagonal if asked
        keep = [j < i or (self_interaction and j == i) for i in range(n) for j in range(n)]
        self.kept = [k for k, on in enumerate(keep) if on]
        self.zeroed = [k for k, on in enumerate(keep) if not on]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kept products, ``[B, len(kept)]`` (``[B, N*N]`` with ``skip_gather``)."""
        v = stack_features(xs, self.from_list)
        products = torch.bmm(v, v.transpose(1, 2)).reshape(v.shape[0], self.width)
        if self.skip_gather:
            zeroed = torch.tensor(self.zeroed, dtype=torch.long, device=products.device)
            return [products.index_fill(1, zeroed, 0.0)]
        kept = torch.tensor(self.kept, dtype=torch.long, device=products.device)
        return [products.index_select(1, kept)]


def _build_dot_interaction(args: BlockArgs) -> BuiltLayer:
    only_st_params(args)
    from_list, n, _ = feature_stack(args)
    self_interaction = bool_setting(args, None, "self_interaction", False)
    skip_gather = bool_setting(args, None, "skip_gather", False)
    width = n * n if skip_gather else (n * (n + 1) // 2 if self_interaction
                                       else n * (n - 1) // 2)
    layer = DotInteractionLayer(from_list, n, self_interaction, skip_gather)
    return BuiltLayer(layer, tensor(width))


# ---- Cross ------------------------------------------------------------------------------


def cross_dense(in_dim: int, units: int, use_bias: bool, initializer: str,
                bias_initializer: str = "zeros") -> nn.Linear:
    """A Keras Dense for ``Cross``.

    The kernel by :func:`keras_dense`'s initializers or Keras's ``truncated_normal`` /
    ``random_normal`` / ``random_uniform`` (scale 0.05); the bias ``zeros`` or ``ones``.

    Raises:
        ValueError: another initializer.
    """
    name = initializer.lower()
    if name not in CROSS_INITIALIZERS:
        raise ValueError(f"kernel_initializer {initializer!r} is not one of "
                         f"{', '.join(CROSS_INITIALIZERS)}")
    if bias_initializer.lower() not in ("zeros", "ones"):
        raise ValueError(f"bias_initializer {bias_initializer!r} is not zeros or ones")
    layer = keras_dense(in_dim, units, use_bias,
                        name if name in KERAS_INITIALIZERS else "zeros")
    with torch.no_grad():
        s = KERAS_SMALL_INIT
        if name == "truncated_normal":
            nn.init.trunc_normal_(layer.weight, 0.0, s, -2 * s, 2 * s)
        elif name == "random_normal":
            layer.weight.normal_(0.0, s)
        elif name == "random_uniform":
            layer.weight.uniform_(-s, s)
        if layer.bias is not None and bias_initializer.lower() == "ones":
            layer.bias.fill_(1.0)
    return layer


class CrossLayer(nn.Module):
    """DCN v2's cross of ``x0`` and ``x`` (module docstring)."""

    def __init__(self, product: nn.Module, diag_scale: float, two_inputs: bool) -> None:
        super().__init__()
        self.product = product
        self.diag_scale = float(diag_scale)
        self.two_inputs = two_inputs

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[x0 * (f(W x + b) + diag_scale * x) + x]``."""
        x0 = xs[0]
        x = xs[1] if self.two_inputs else xs[0]
        prod = self.product(x)
        if self.diag_scale != 0.0:
            prod = prod + self.diag_scale * x
        return [x0 * prod + x]


def _build_cross(args: BlockArgs) -> BuiltLayer:
    only_st_params(args)
    items = flat_tensors(args.spec)
    if isinstance(args.spec, TensorSpec):
        spec, two = args.spec, False
    elif items is not None and len(items) == 2:
        spec, two = items[1], True
        if items[0] != items[1]:
            raise args.refuse("x0 and x must have one shape")
    else:
        raise args.refuse("takes [x0, x] (two tensors of one shape) or one tensor")
    if not spec.shape:
        raise args.refuse("takes tensors of at least two dimensions")
    p = args.st_params
    for key in ("kernel_regularizer", "bias_regularizer"):
        if p.get(key) is not None:
            raise args.refuse(f"st_params.{key} is not supported: odl's only kernel "
                              "penalty is model_params.l2_regularization")
    dim = spec.shape[-1]
    projection = p.get("projection_dim")
    diag_scale = p.get("diag_scale", 0.0)
    if isinstance(diag_scale, bool) or not isinstance(diag_scale, (int, float)) \
            or not diag_scale >= 0 or math.isinf(diag_scale):
        raise args.refuse(f"st_params.diag_scale must be a number >= 0, got {diag_scale!r}")
    use_bias = bool_setting(args, None, "use_bias", True)
    preactivation = p.get("preactivation") or "linear"
    init = p.get("kernel_initializer", "truncated_normal")
    bias_init = p.get("bias_initializer", "zeros")
    for key, value in (("preactivation", preactivation), ("kernel_initializer", init),
                       ("bias_initializer", bias_init)):
        if not isinstance(value, str):
            raise args.refuse(f"st_params.{key} must be a name, got {value!r}")
    try:
        act = activation_layer(preactivation, dim)
        if projection is None:
            product = nn.Sequential(cross_dense(dim, dim, use_bias, init, bias_init), act)
        else:
            rank = int_setting(args, "st_params.projection_dim", projection, 1)
            product = nn.Sequential(cross_dense(dim, rank, False, init),
                                    cross_dense(rank, dim, use_bias, init, bias_init), act)
    except ValueError as e:
        raise args.refuse(str(e)) from e
    return BuiltLayer(CrossLayer(product, float(diag_scale), two), spec)


# ---- CIN --------------------------------------------------------------------------------


class CINStep(nn.Module):
    """One CIN layer: ``relu(sum_{i,j} W[h, i, j] x[i] * x0[j] + b[h])``."""

    def __init__(self, maps: int, previous: int, fields: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(maps, previous, fields))
        self.bias = nn.Parameter(torch.zeros(maps))
        fan_in = previous * maps  # TensorFlow's fans of a 3-d kernel
        std = math.sqrt(2.0 / fan_in) / _TRUNCATION_STD
        with torch.no_grad():
            nn.init.trunc_normal_(self.weight, 0.0, std, -2 * std, 2 * std)

    def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, H_prev, D]``, ``x0`` ``[B, N, D]`` to ``[B, H, D]``."""
        b, d = x.shape[0], x.shape[2]
        z = (x.unsqueeze(2) * x0.unsqueeze(1)).reshape(b, -1, d)  # [B, H_prev * N, D]
        w = self.weight.reshape(self.weight.shape[0], -1)
        return torch.relu(torch.matmul(w, z) + self.bias.unsqueeze(-1))


class CINLayer(nn.Module):
    """xDeepFM's compressed interaction network (module docstring)."""

    def __init__(self, from_list: bool, fields: int, sizes: list[int]) -> None:
        super().__init__()
        self.from_list = from_list
        previous = [int(fields)] + [int(s) for s in sizes[:-1]]
        self.steps = nn.ModuleList(CINStep(int(h), p, int(fields))
                                   for h, p in zip(sizes, previous, strict=True))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, sum_k H_k]``: each layer's maps summed over ``D``, concatenated."""
        x0 = stack_features(xs, self.from_list)
        x = x0
        pooled: list[torch.Tensor] = []
        for step in self.steps:
            x = step(x, x0)
            pooled.append(x.sum(dim=-1))
        return [torch.cat(pooled, dim=-1)]


def _build_cin(args: BlockArgs) -> BuiltLayer:
    message = params_message(args, pipeline_pb2.CIN, "cin")
    for key in ("kernel_regularizer", "bias_regularizer"):
        if message is None and args.st_params.get(key) is not None:
            raise args.refuse(f"st_params.{key} is not supported: odl's only kernel "
                              "penalty is model_params.l2_regularization")
    sizes = setting(args, message, "hidden_feature_sizes", [])
    if not isinstance(sizes, list) or not sizes:
        raise args.refuse("needs hidden_feature_sizes (a list of at least one size)")
    sizes = [int_setting(args, "hidden_feature_sizes", s, 1) for s in sizes]
    from_list, n, _ = feature_stack(args)
    return BuiltLayer(CINLayer(from_list, n, sizes), tensor(sum(sizes)))


register_block("FM", _build_fm)
register_block("DotInteraction", _build_dot_interaction)
register_block("Cross", _build_cross)
register_block("CIN", _build_cin)
