"""Backbone layers that embed numbers: EasyRec's Periodic, AutoDis and NaryDis embeddings.

Each takes one ``[B, N]`` tensor, ``N`` numbers per example (a feature group of raw
features; odl has already normalized them by ``min_val`` / ``max_val``), and gives each
number a vector ``e_n`` of width ``E``. Output, as EasyRec returns it:

* by default the vectors concatenated, ``[B, N*E]``;
* ``output_tensor_list``: the list ``[[B, N*E], [e_1, ..., e_N]]`` (each ``[B, E]``;
  configs take the vectors with ``input_slice: '[1]'``), which wins over
* ``output_3d_tensor``: the list ``[[B, N*E], [B, N, E]]`` (not the 3-d tensor alone).

Settings come from the layer's message (``periodic_embedding``, ``auto_dis_embedding``,
``nary_dis_embedding``) or the same keys in ``st_params``, read as EasyRec's
``Parameter.get_or_default``.

* ``PeriodicEmbedding`` (``embedding_dim`` ``E`` even, ``sigma``; ``add_linear_layer``
  (true), ``linear_activation`` (``relu``)): ``v = 2 pi c_n x_n`` with learned frequencies
  ``c_n`` (``E/2`` per number, drawn from ``Normal(0, sigma)``), ``e_n = [sin v, cos v]``;
  with the linear layer ``e_n = act(e_n W_n + b_n)``, one ``E x E`` kernel per number
  (Keras's default ``glorot_uniform`` for EasyRec's ``[1, N, E, E]`` weight, whose fans are
  ``N*E`` each; biases zero). ``linear_activation`` ``linear`` (or an empty name in
  ``st_params``) is none.
* ``AutoDisEmbedding`` (``embedding_dim`` ``D``, ``num_bins`` ``K``, ``temperature`` ``t``;
  ``keep_prob`` ``a`` (0.8)): ``h = leaky_relu(w_n x_n)`` (slope 0.2, ``w_n`` ``[K]``),
  ``s = M_n h + a h`` (``M_n`` ``[K, K]``), ``p = softmax(s / t)``, ``e_n = p^T B_n`` with
  the meta-embeddings ``B_n`` ``[K, D]``. All three weights are Keras's default
  ``glorot_uniform`` with TensorFlow's fans of their EasyRec shapes (``[N, K, D]``: ``N*K``
  and ``N*D``; ``[1, N, K]``: ``N`` and ``K``; ``[N, K, K]``: ``N*K`` each).
* ``NaryDisEmbedding`` (``embedding_dim`` ``D``, ``carries`` (``[2, 9]``), ``multiplier``
  (1), ``intra_ary_pooling`` ``sum`` or ``mean``, ``num_replicas`` ``R`` (1)): the hybrid
  N-ary encoding. ``v = trunc(x * multiplier)`` as a 32-bit integer (TensorFlow's
  ``to_int32`` truncates toward zero; it is not rounded). For each carry (base) ``c`` with
  row offset ``o_c`` (the sum of the earlier carries' ``L_c = (floor(log_c(2^32 - 1)) + 1)
  * c``), the rows of EasyRec's ``nary_carry`` op are looked up in one table and pooled
  (summed, or averaged over their count): a sign row ``o_c`` (``v >= 0``) or ``o_c + 1``
  (``v < 0``), and for each base-``c`` digit ``d_p`` of ``|v|`` (position ``p`` from the
  least significant; zero has the one digit 0) the row ``o_c + 2 + p*c + d_p``. The
  carries' pooled vectors are concatenated: ``E = len(carries) * D``. Each row is ``R*D``
  wide; replica ``r`` reads columns ``r*D .. (r+1)*D`` and is output separately: with
  ``R > 1`` the output is ``[out_1 .. out_R]`` (each ``[B, N*E]``), followed by each
  replica's vector list (or 3-d tensor) when asked. The table is initialized as Keras's
  default ``glorot_uniform`` of EasyRec's ``[N * sum_c L_c, R*D]`` table.

EasyRec's oddities kept: NaryDis's rows are shared by all ``N`` numbers (the op's rows do
not depend on the column, though EasyRec allocates ``N`` times the rows), so equal values
of different features get equal vectors; the sign row is pooled with the digits (a mean
divides by the digit count plus one). odl's table has the ``sum_c L_c`` rows of one
feature's share (a 32-bit ``|v|`` never reaches past its carry's ``L_c`` rows: the two sign
rows fit in the room ``L_c`` keeps for the digits of ``2^32``).

Deviations: NaryDis's ``output_tensor_list`` gives each number's ``[B, E]`` vectors;
EasyRec's splits its ``[B*N, E]`` rows into ``N`` consecutive blocks, which mixes the
batch's examples and fails unless the batch size is a multiple of ``N``. Values outside
the 32-bit range are clamped to ``+-(2^31 - 1)`` and NaN counts as 0 (TensorFlow's cast
leaves them undefined). ``sigma`` draws ``Normal(0, |sigma|)``, which is TensorFlow's
distribution for a negative ``sigma`` too.

Refused (``ConfigError``): an input other than one ``[B, N]`` tensor; a missing
``embedding_dim``, ``sigma``, ``num_bins`` or ``temperature`` (EasyRec requires them); a
zero ``embedding_dim`` or ``num_bins`` (an empty layer) or ``temperature`` (NaN); an odd
``embedding_dim`` for PeriodicEmbedding (as EasyRec); a carry below 2 (the op throws);
``intra_ary_pooling`` other than ``sum`` / ``mean``; ``inter_ary_pooling`` other than
``concat`` (EasyRec ignores it and concatenates); ``num_replicas: 0``.

Regularization: none of these weights is an ``nn.Linear``, so the model's
``l2_regularization`` skips them, as EasyRec (which gives them no regularizer) does.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import math
from typing import Any, Optional

import torch
from google.protobuf.message import Message
from torch import nn
from torch.nn import functional as F

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.layer_settings import (
    bool_setting,
    float_setting,
    int_setting,
    params_message,
    setting,
)
from odl.models.backbone.mask_layers import OnRows
from odl.models.backbone.value_specs import Spec, TensorSpec, tensor
from odl.models.building_blocks import activation_layer
from odl.protos import pipeline_pb2

PLAIN, THREE_D, VECTOR_LIST = 0, 1, 2
INT32_MAX = 2**31 - 1
UINT32_MAX = 4294967295


# ---- shared -----------------------------------------------------------------------------


def numbers_width(args: BlockArgs) -> int:
    """``N`` of a ``[B, N]`` input.

    Raises:
        ConfigError: another input.
    """
    if not isinstance(args.spec, TensorSpec) or len(args.spec.shape) != 1:
        raise args.refuse("takes one [B, N] tensor of numbers (a raw feature group)")
    return args.spec.shape[0]


def required(args: BlockArgs, message: Optional[Message], key: str) -> Any:
    """A setting EasyRec requires, as written.

    Raises:
        ConfigError: it is not written.
    """
    present = message.HasField(key) if message is not None else key in args.st_params
    if not present:
        raise args.refuse(f"needs {key}")
    return setting(args, message, key, None)


def output_mode(args: BlockArgs, message: Optional[Message]) -> int:
    """:data:`VECTOR_LIST`, :data:`THREE_D` or :data:`PLAIN` (list wins, as EasyRec)."""
    if bool_setting(args, message, "output_tensor_list", False):
        return VECTOR_LIST
    if bool_setting(args, message, "output_3d_tensor", False):
        return THREE_D
    return PLAIN


def output_spec(mode: int, n: int, width: int) -> Spec:
    """The spec of one output: ``[B, n*width]`` and, by ``mode``, the vectors."""
    flat = tensor(n * width)
    if mode == VECTOR_LIST:
        return [flat, [tensor(width)] * n]
    if mode == THREE_D:
        return [flat, tensor(n, width)]
    return flat


def output_leaves(emb: torch.Tensor, mode: int) -> list[torch.Tensor]:
    """The leaves of :func:`output_spec` from the vectors ``[B, N, E]``."""
    flat = emb.reshape(emb.shape[0], -1)
    if mode == 2:  # VECTOR_LIST (TorchScript reads no global constants)
        return [flat] + list(emb.unbind(1))
    if mode == 1:  # THREE_D
        return [flat, emb]
    return [flat]


def glorot_bound(fan_in: int, fan_out: int) -> float:
    """Keras's ``glorot_uniform`` limit."""
    return math.sqrt(6.0 / (fan_in + fan_out))


# ---- PeriodicEmbedding ------------------------------------------------------------------


class NLinear(nn.Module):
    """One ``d x d`` Linear layer per number: ``[B, N, d]`` to ``[B, N, d]``."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        bound = glorot_bound(n * dim, n * dim)
        self.weight = nn.Parameter(torch.empty(n, dim, dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(n, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x_n W_n + b_n`` per number ``n``."""
        return torch.einsum("bni,nio->bno", x, self.weight) + self.bias


class PeriodicLayer(nn.Module):
    """Periodic embeddings (module docstring)."""

    def __init__(self, n: int, dim: int, sigma: float, linear: nn.Module,
                 mode: int) -> None:
        super().__init__()
        self.coef = nn.Parameter(torch.empty(n, dim // 2).normal_(0.0, abs(sigma)))
        self.linear = linear
        self.mode = int(mode)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs of the numbers ``xs[0]`` ``[B, N]``."""
        v = 2.0 * math.pi * self.coef * xs[0].unsqueeze(-1)
        emb = self.linear(torch.cat([torch.sin(v), torch.cos(v)], dim=-1))
        return output_leaves(emb, self.mode)


def _build_periodic(args: BlockArgs) -> BuiltLayer:
    message = params_message(args, pipeline_pb2.PeriodicEmbedding, "periodic_embedding")
    n = numbers_width(args)
    dim = int_setting(args, "embedding_dim", required(args, message, "embedding_dim"), 1)
    if dim % 2:
        raise args.refuse(f"embedding_dim must be even, got {dim}")
    required(args, message, "sigma")
    sigma = float_setting(args, message, "sigma", 0.0)
    linear: nn.Module = nn.Identity()
    if bool_setting(args, message, "add_linear_layer", True):
        name = setting(args, message, "linear_activation", "relu")
        if not isinstance(name, str):
            raise args.refuse(f"linear_activation must be a name, got {name!r}")
        try:
            act = activation_layer(name or "linear", dim)
        except ValueError as e:
            raise args.refuse(str(e)) from e
        linear = nn.Sequential(NLinear(n, dim), OnRows(act))
    mode = output_mode(args, message)
    return BuiltLayer(PeriodicLayer(n, dim, sigma, linear, mode), output_spec(mode, n, dim))


# ---- AutoDisEmbedding -------------------------------------------------------------------


class AutoDisLayer(nn.Module):
    """AutoDis embeddings (module docstring)."""

    def __init__(self, n: int, bins: int, dim: int, temperature: float, keep_prob: float,
                 mode: int) -> None:
        super().__init__()
        b = glorot_bound(n * bins, n * dim)
        self.meta_emb = nn.Parameter(torch.empty(n, bins, dim).uniform_(-b, b))
        b = glorot_bound(n, bins)
        self.proj_w = nn.Parameter(torch.empty(n, bins).uniform_(-b, b))
        b = glorot_bound(n * bins, n * bins)
        self.proj_mat = nn.Parameter(torch.empty(n, bins, bins).uniform_(-b, b))
        self.temperature = float(temperature)
        self.keep_prob = float(keep_prob)
        self.mode = int(mode)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs of the numbers ``xs[0]`` ``[B, N]``."""
        hidden = F.leaky_relu(self.proj_w * xs[0].unsqueeze(-1), 0.2)  # [B, N, K]
        y = torch.einsum("nik,bnk->bni", self.proj_mat, hidden)
        scores = torch.softmax((y + self.keep_prob * hidden) / self.temperature, dim=-1)
        emb = torch.einsum("bnk,nkd->bnd", scores, self.meta_emb)
        return output_leaves(emb, self.mode)


def _build_auto_dis(args: BlockArgs) -> BuiltLayer:
    message = params_message(args, pipeline_pb2.AutoDisEmbedding, "auto_dis_embedding")
    n = numbers_width(args)
    dim = int_setting(args, "embedding_dim", required(args, message, "embedding_dim"), 1)
    bins = int_setting(args, "num_bins", required(args, message, "num_bins"), 1)
    required(args, message, "temperature")
    temperature = float_setting(args, message, "temperature", 0.0)
    if temperature == 0.0:
        raise args.refuse("temperature must not be 0 (the scores are divided by it)")
    keep_prob = float_setting(args, message, "keep_prob", 0.8)
    mode = output_mode(args, message)
    layer = AutoDisLayer(n, bins, dim, temperature, keep_prob, mode)
    return BuiltLayer(layer, output_spec(mode, n, dim))


# ---- NaryDisEmbedding -------------------------------------------------------------------


def carry_length(carry: int) -> int:
    """EasyRec's rows per carry: ``(floor(log_carry(2^32 - 1)) + 1) * carry``."""
    return (math.floor(math.log(UINT32_MAX, carry)) + 1) * carry


def int32_digits(carry: int) -> int:
    """Base-``carry`` digits of ``2^31 - 1``, the most a 32-bit ``|v|`` has."""
    count, rest = 0, INT32_MAX
    while rest > 0:
        count, rest = count + 1, rest // carry
    return count


class NaryDisLayer(nn.Module):
    """N-ary encoded embeddings (module docstring)."""

    def __init__(self, n: int, dim: int, carries: list[int], multiplier: float, mean: bool,
                 replicas: int, mode: int) -> None:
        super().__init__()
        powers: list[int] = []
        bases: list[int] = []
        digit_rows: list[int] = []
        sign_rows: list[int] = []
        member: list[int] = []
        offset, rows = 0, 0
        for k, carry in enumerate(carries):
            sign_rows.append(offset)
            positions = int32_digits(carry)
            for p in range(positions):
                powers.append(carry ** p)
                bases.append(carry)
                digit_rows.append(offset + 2 + p * carry)
                member.append(k)
            top = min(carry - 1, INT32_MAX // carry ** (positions - 1))  # highest digit
            rows = max(rows, offset + 3 + (positions - 1) * carry + top)
            offset += carry_length(carry)
        rows = max(rows, offset)
        bound = glorot_bound(n * offset, dim * replicas)
        self.table = nn.Parameter(torch.empty(rows, dim * replicas).uniform_(-bound, bound))
        self.register_buffer("powers", torch.tensor(powers, dtype=torch.int64))
        self.register_buffer("bases", torch.tensor(bases, dtype=torch.int64))
        self.register_buffer("digit_rows", torch.tensor(digit_rows, dtype=torch.int64))
        self.register_buffer("sign_rows", torch.tensor(sign_rows, dtype=torch.int64))
        self.register_buffer("first", torch.tensor([p == 1 for p in powers]))
        self.register_buffer("member", F.one_hot(torch.tensor(member),
                                                 len(carries)).to(torch.float32))
        self.multiplier = float(multiplier)
        self.limit = INT32_MAX
        self.mean = bool(mean)
        self.dim = int(dim)
        self.replicas = int(replicas)
        self.mode = int(mode)

    def integers(self, x: torch.Tensor) -> torch.Tensor:
        """``trunc(x * multiplier)`` as int64 in the 32-bit range (NaN: 0)."""
        if self.multiplier != 1.0:
            x = x * self.multiplier
        limit = float(self.limit)
        x = torch.nan_to_num(x.double(), nan=0.0).clamp(-limit, limit)
        return torch.trunc(x).to(torch.int64)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs of the numbers ``xs[0]`` ``[B, N]``."""
        v = self.integers(xs[0])  # [B, N]
        a = v.abs().unsqueeze(-1)  # [B, N, 1]
        digits = torch.div(a, self.powers, rounding_mode="floor") % self.bases  # [B, N, P]
        present = ((a >= self.powers) | self.first).to(self.table.dtype)
        looked = F.embedding(self.digit_rows + digits, self.table) * present.unsqueeze(-1)
        pooled = torch.einsum("bnpd,pc->bncd", looked, self.member.to(self.table.dtype))
        sign = self.sign_rows + (v < 0).to(torch.int64).unsqueeze(-1)  # [B, N, C]
        pooled = pooled + F.embedding(sign, self.table)
        if self.mean:
            counts = 1.0 + torch.matmul(present, self.member.to(self.table.dtype))
            pooled = pooled / counts.unsqueeze(-1)
        b, n = v.shape[0], v.shape[1]
        flats: list[torch.Tensor] = []
        extras: list[torch.Tensor] = []
        for r in range(self.replicas):
            emb = pooled[..., r * self.dim:(r + 1) * self.dim].reshape(b, n, -1)
            leaves = output_leaves(emb, self.mode)
            flats.append(leaves[0])
            extras.extend(leaves[1:])
        return flats + extras


def _build_nary_dis(args: BlockArgs) -> BuiltLayer:
    message = params_message(args, pipeline_pb2.NaryDisEmbedding, "nary_dis_embedding")
    n = numbers_width(args)
    dim = int_setting(args, "embedding_dim", required(args, message, "embedding_dim"), 1)
    carries = setting(args, message, "carries", [2, 9])
    if not isinstance(carries, list) or not carries:
        raise args.refuse(f"carries must be a list of bases, got {carries!r}")
    carries = [int_setting(args, "carries", c, 2) for c in carries]
    multiplier = float_setting(args, message, "multiplier", 1.0)
    pooling = setting(args, message, "intra_ary_pooling", "sum")
    if pooling not in ("sum", "mean"):
        raise args.refuse(f"intra_ary_pooling must be sum or mean, got {pooling!r}")
    inter = setting(args, message, "inter_ary_pooling", "concat")
    if inter != "concat":
        raise args.refuse(f"inter_ary_pooling {inter!r} is not supported: EasyRec ignores "
                          "it and concatenates the carries (write concat)")
    replicas = int_setting(args, "num_replicas", setting(args, message, "num_replicas", 1), 1)
    mode = output_mode(args, message)
    width = len(carries) * dim
    layer = NaryDisLayer(n, dim, carries, multiplier, pooling == "mean", replicas, mode)
    if mode == PLAIN and replicas == 1:
        return BuiltLayer(layer, tensor(n * width))
    one = output_spec(mode, n, width)
    flats = [one[0] if isinstance(one, list) else one] * replicas
    extras = [one[1]] * replicas if isinstance(one, list) else []
    return BuiltLayer(layer, flats + extras)


register_block("PeriodicEmbedding", _build_periodic)
register_block("AutoDisEmbedding", _build_auto_dis)
register_block("NaryDisEmbedding", _build_nary_dis)
