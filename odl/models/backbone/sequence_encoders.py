"""Backbone layers over raw sequences: EasyRec's ``DIN``, ``BST`` and ``TextCNN``.

Their input is an input layer's ``output_seq_and_normal_feature`` value ``[S, n, t]``:
``S`` the sequences ``[B, L, D]`` (positions at or past a sequence's length are zero
vectors), ``n`` the lengths ``[B]`` and ``t`` the target (the group's other features)
``[B, T]``, absent when the group has none. ``m_j = [j < n]`` is the length mask.

* ``DIN`` (``din { attention_dnn, need_target_feature (true), attention_normalizer
  (softmax) }``; needs ``t`` and ``T <= D``): ``q`` is ``t`` padded with zeros to ``D``;
  per position ``s_j = MLP([q, S_j, q - S_j, q * S_j])`` (``attention_dnn`` with its last
  layer linear, with bias and without batch normalization; its last width must be 1);
  ``s_j = -2^32 + 1`` where ``m_j = 0``; ``w = softmax_j(s)`` or
  ``w = sigmoid(s / sqrt(D))``; output ``sum_j w_j S_j[:T]`` (``[B, T]``), then ``q``
  appended with ``need_target_feature`` (``[B, T + D]``).
* ``BST`` (``bst { hidden_size H, num_hidden_layers, num_attention_heads,
  intermediate_size, hidden_act (gelu), hidden_dropout_prob (0.1),
  attention_probs_dropout_prob (0.1), max_position_embeddings P (512), initializer_range
  r (0.02), output_all_token_embeddings (true), target_item_position (head),
  reserve_target_position (true) }``): BERT's encoder over the tokens
  ``X = [relu(t W_t)] + S'`` (``head``) or ``S' + [relu(t W_t)]`` (``tail``), where
  ``S'`` is ``S`` padded with zero positions to ``P`` (``output_all_token_embeddings``) and
  projected by ``relu(S W_s)`` when ``D != H`` (``W_t`` likewise when ``T != H``); the
  target is joined with ``head`` / ``tail`` when ``t`` is given (``ignore`` drops it) and
  counts as valid. ``E = LayerNorm(X + pos[:N])``, dropout; per layer, with heads of
  ``H / heads`` columns, ``A = softmax(Q K^T / sqrt(H / heads) - 10000 (1 - m_key))``,
  dropout on ``A``; ``Y = LayerNorm(E + dropout(A V W_o))``,
  ``E' = LayerNorm(Y + dropout(act(Y W_1) W_2))``. Output: every token's vector flattened,
  ``[B, N H]`` (``N`` = ``P + 1`` with the target, ``P`` without), or, with
  ``output_all_token_embeddings: false``, the first token's ``[B, H]``.
* ``TextCNN`` (``text_cnn { filter_sizes, num_filters, pad_sequence_length,
  activation (relu), mlp }``): ``S`` padded with zero positions or cut to
  ``pad_sequence_length`` (0: kept at ``L``); per pair ``(k, f)`` of ``filter_sizes`` and
  ``num_filters`` a Keras Conv1D (``f`` filters, width ``k``, valid padding) with the
  activation, its maximum over positions; concatenated (``[B, sum f]``), then EasyRec's
  ``MLP`` when ``mlp`` is set (``[B, last hidden unit]``). The lengths and target are not
  read; padding positions are convolved and pooled.

Initialization: ``BST``'s dense kernels and position table are truncated normals (cut at 2
standard deviations, TensorFlow's ``truncated_normal_initializer``), biases zero, layer
normalizations' epsilon 1e-12; its projections ``W_s``, ``W_t`` and the MLPs' layers are
Keras's (:func:`~odl.models.backbone.dense_layers.keras_dense`); Conv1D kernels
Glorot-uniform over ``k * D`` in and ``k * f`` out, biases zero. Dropout acts only in
training. Regularization as EasyRec's: the MLPs and ``BST``'s projections are ``nn.Linear``
(the model's L2 term counts them); ``BST``'s transformer weights are plain parameters and
Conv1D is a convolution, neither counted, as EasyRec gives them no regularizer.

EasyRec's oddities kept: ``DIN`` with ``T < D`` appends the zero-padded target, so its
output is ``[B, T + D]``; with a length of 0 its softmax weighs every (zero) position
equally, giving zeros. ``BST`` ignores ``use_position_embeddings`` (position embeddings are
always added) and draws the position table with stddev 0.02 whatever ``initializer_range``
(EasyRec passes neither on); the mask acts on keys only (padding positions are encoded and,
with ``output_all_token_embeddings``, part of the output); a sequence of length 0 without a
target attends every position by its scores (EasyRec adds -10000 to them all, which leaves the
softmax unchanged but for float32 rounding; odl adds nothing there). ``TextCNN`` pairs
``filter_sizes`` and ``num_filters`` up to the shorter list (Python's ``zip``).

Deviations: the MLPs' batch normalization is odl's default, off unless written
(``dense_layers``); EasyRec pads a batch to its longest sequence where odl keeps ``L``
positions, which changes only ``DIN``'s attention-MLP normalization statistics (batch norm
or ``dice``, which also see padding positions) and ``TextCNN`` with
``pad_sequence_length: 0`` (more all-padding windows in the maximum; EasyRec warns this
setting is unstable); Keras's ``gelu`` of ``TextCNN`` is the exact one.

Refused: a missing target for ``DIN`` or ``T > D``; an ``attention_dnn`` without hidden
units or whose last width is not 1; an unknown normalizer or activation; for ``BST`` unset
or zero sizes, ``H`` not a multiple of the heads, ``L > P`` (EasyRec's run-time assert), a
target joined with ``T != D``, and the forms EasyRec cannot run or that depend on the batch:
``output_all_token_embeddings`` without a joined target but with
``reserve_target_position`` (a mask one position longer than the tokens), and
``output_all_token_embeddings: false`` with a joined target (same) or with ``tail`` /
``ignore`` (the batch's last padded position); a ``TextCNN`` kernel wider than the
positions; dropout outside [0, 1); a params message of another layer.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.dense_layers import build_easyrec_mlp, keras_dense, optional_mlp
from odl.models.backbone.layer_settings import params_message
from odl.models.backbone.value_specs import flat_tensors, tensor
from odl.models.building_blocks import activation_layer
from odl.protos import pipeline_pb2

DIN_MASKED_SCORE = -(2.0**32) + 1.0
BERT_MASK_ADDER = -10000.0
BERT_LAYER_NORM_EPS = 1e-12
POSITION_INIT_STDDEV = 0.02  # EasyRec's embedding_postprocessor default
TARGET_POSITIONS = ("head", "tail", "ignore")
# Keras's activation names a Conv1D takes (``gelu``: Keras's exact one).
KERAS_CONV_ACTIVATIONS = {"relu": nn.ReLU, "linear": nn.Identity, "tanh": nn.Tanh,
                          "sigmoid": nn.Sigmoid, "elu": nn.ELU, "selu": nn.SELU,
                          "swish": nn.SiLU, "softplus": nn.Softplus, "gelu": nn.GELU}


def sequence_input(args: BlockArgs) -> tuple[int, int, int]:
    """``(L, D, T)`` of an ``output_seq_and_normal_feature`` input; ``T`` 0 without target.

    Raises:
        ConfigError: another input.
    """
    items = flat_tensors(args.spec)
    if (items is None or len(items) not in (2, 3) or len(items[0].shape) != 2
            or items[1].shape != () or (len(items) == 3 and len(items[2].shape) != 1)):
        raise args.refuse("takes [sequences [B, L, D], lengths [B], targets [B, T]] (an "
                          "input_layer with output_seq_and_normal_feature: true)")
    positions, dim = items[0].shape
    if positions < 1 or dim < 1:
        raise args.refuse("needs sequences of at least one position and column")
    return positions, dim, items[2].shape[0] if len(items) == 3 else 0


def length_mask(lengths: torch.Tensor, positions: int) -> torch.Tensor:
    """``[B, positions]``: true where the position is within the length."""
    index = torch.arange(positions, device=lengths.device, dtype=lengths.dtype)
    return index.unsqueeze(0) < lengths.unsqueeze(1)


def _dropout_rate(args: BlockArgs, key: str, value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise args.refuse(f"{key} must be in [0, 1), got {value}")
    return float(value)


# ---- DIN --------------------------------------------------------------------------------


class DINLayer(nn.Module):
    """DIN's target attention over a sequence (module docstring)."""

    __constants__ = ["pad", "target_dim", "sigmoid", "need_target", "scale", "masked"]

    def __init__(self, attention: nn.Module, seq_dim: int, target_dim: int, sigmoid: bool,
                 need_target: bool) -> None:
        super().__init__()
        self.attention = attention
        self.pad = int(seq_dim) - int(target_dim)
        self.target_dim = int(target_dim)
        self.sigmoid = sigmoid
        self.need_target = need_target
        self.scale = float(seq_dim) ** 0.5
        self.masked = DIN_MASKED_SCORE

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, T]`` (``[B, T + D]`` with ``need_target_feature``)."""
        keys, lengths, query = xs[0], xs[1], xs[2]
        if self.pad > 0:
            query = F.pad(query, [0, self.pad])
        b, n, d = keys.shape[0], keys.shape[1], keys.shape[2]
        q = query.unsqueeze(1).expand(b, n, d)
        din_all = torch.cat([q, keys, q - keys, q * keys], dim=-1).reshape(b * n, 4 * d)
        scores = self.attention(din_all).reshape(b, n)
        scores = torch.where(length_mask(lengths, n), scores,
                             torch.full_like(scores, self.masked))
        if self.sigmoid:
            weights = torch.sigmoid(scores / self.scale)
        else:
            weights = torch.softmax(scores, dim=-1)
        out = torch.bmm(weights.unsqueeze(1), keys[:, :, : self.target_dim]).squeeze(1)
        if self.need_target:
            out = torch.cat([out, query], dim=-1)
        return [out]


def _build_din(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.DINEncoder, "din", required=True)
    _, dim, target_dim = sequence_input(args)
    if target_dim == 0:
        raise args.refuse("needs the target (the group's non-sequence features): the input "
                          "has only [sequences, lengths]")
    if target_dim > dim:
        raise args.refuse(f"the target's width {target_dim} is larger than the sequence's "
                          f"{dim}")
    normalizer = config.attention_normalizer
    if normalizer not in ("softmax", "sigmoid"):
        raise args.refuse(f"din.attention_normalizer {normalizer!r} is not softmax or "
                          "sigmoid")
    units = list(config.attention_dnn.hidden_units)
    if not units or units[-1] != 1:
        raise args.refuse("din.attention_dnn needs hidden_units ending in 1 (one score per "
                          f"position), got {units}")
    mlp = pipeline_pb2.MLP()
    mlp.CopyFrom(config.attention_dnn)
    mlp.use_final_bn, mlp.use_final_bias, mlp.final_activation = False, True, "linear"
    try:
        attention, _ = build_easyrec_mlp(4 * dim, mlp)
    except ValueError as e:
        raise args.refuse(f"din.attention_dnn: {e}") from e
    need_target = bool(config.need_target_feature)
    layer = DINLayer(attention, dim, target_dim, normalizer == "sigmoid", need_target)
    return BuiltLayer(layer, tensor(target_dim + (dim if need_target else 0)))


# ---- BST --------------------------------------------------------------------------------


def truncated_normal_(t: torch.Tensor, stddev: float) -> torch.Tensor:
    """TensorFlow's ``truncated_normal_initializer(stddev)``: redrawn beyond 2 stddev."""
    with torch.no_grad():
        if stddev <= 0.0:
            return t.zero_()
        return nn.init.trunc_normal_(t, 0.0, stddev, -2.0 * stddev, 2.0 * stddev)


class BertDense(nn.Module):
    """A dense layer of EasyRec's transformer, ``x W^T + b`` (not counted by the L2 term)."""

    def __init__(self, in_dim: int, out_dim: int, stddev: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(truncated_normal_(torch.empty(out_dim, in_dim), stddev))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., out_dim]``."""
        return F.linear(x, self.weight, self.bias)


class BertLayer(nn.Module):
    """One encoder layer: masked multi-head self-attention, then the feed-forward layer."""

    __constants__ = ["heads", "head_dim"]

    def __init__(self, hidden: int, heads: int, intermediate: int, act: nn.Module,
                 hidden_dropout: float, attention_dropout: float, stddev: float) -> None:
        super().__init__()
        self.heads = int(heads)
        self.head_dim = int(hidden) // int(heads)
        self.query = BertDense(hidden, hidden, stddev)
        self.key = BertDense(hidden, hidden, stddev)
        self.value = BertDense(hidden, hidden, stddev)
        self.attention_output = BertDense(hidden, hidden, stddev)
        self.attention_norm = nn.LayerNorm(hidden, eps=BERT_LAYER_NORM_EPS)
        self.intermediate = BertDense(hidden, intermediate, stddev)
        self.act = act
        self.output = BertDense(intermediate, hidden, stddev)
        self.output_norm = nn.LayerNorm(hidden, eps=BERT_LAYER_NORM_EPS)
        self.attention_dropout = nn.Dropout(attention_dropout)
        self.hidden_dropout = nn.Dropout(hidden_dropout)

    def forward(self, x: torch.Tensor, adder: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, N, H]``, ``adder`` ``[B, 1, 1, N]`` (0 or -10000) to ``[B, N, H]``."""
        b, n, h = x.shape[0], x.shape[1], x.shape[2]
        flat = x.reshape(b * n, h)  # EasyRec's transformer runs on [B * N, H]
        q = self.query(flat).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.key(flat).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(flat).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.head_dim))
        probs = self.attention_dropout(torch.softmax(scores + adder, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).reshape(b * n, h)
        attended = self.attention_norm(
            self.hidden_dropout(self.attention_output(context)) + flat)
        out = self.output(self.act(self.intermediate(attended)))
        return self.output_norm(self.hidden_dropout(out) + attended).reshape(b, n, h)


class BSTLayer(nn.Module):
    """BST's transformer over the target and the sequence (module docstring).

    ``target_at``: 0 the target is not joined, 1 at the head, 2 at the tail.
    """

    __constants__ = ["pad", "target_at", "output_all", "adder"]

    def __init__(self, seq_project: nn.Module, target_project: nn.Module,
                 layers: list[BertLayer], hidden: int, table_rows: int, pad: int,
                 target_at: int, output_all: bool, hidden_dropout: float) -> None:
        super().__init__()
        self.seq_project = seq_project
        self.target_project = target_project
        self.position = nn.Parameter(truncated_normal_(torch.empty(table_rows, hidden),
                                                       POSITION_INIT_STDDEV))
        self.embedding_norm = nn.LayerNorm(hidden, eps=BERT_LAYER_NORM_EPS)
        self.embedding_dropout = nn.Dropout(hidden_dropout)
        self.layers = nn.ModuleList(layers)
        self.pad = int(pad)
        self.target_at = int(target_at)
        self.output_all = output_all
        self.adder = BERT_MASK_ADDER

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, N * H]`` (every token) or ``[B, H]`` (the first)."""
        seq, lengths = xs[0], xs[1]
        if self.pad > 0:
            seq = F.pad(seq, [0, 0, 0, self.pad])
        b = seq.shape[0]
        mask = length_mask(lengths, seq.shape[1]).to(seq.dtype)
        x = self.seq_project(seq)
        if self.target_at != 0:
            target = self.target_project(xs[2]).unsqueeze(1)
            valid = torch.ones(b, 1, dtype=mask.dtype, device=mask.device)
            if self.target_at == 1:
                x, mask = torch.cat([target, x], dim=1), torch.cat([valid, mask], dim=1)
            else:
                x, mask = torch.cat([x, target], dim=1), torch.cat([mask, valid], dim=1)
        x = self.embedding_dropout(self.embedding_norm(x + self.position[: x.shape[1]]))
        # a row without a valid key: its scores unshifted (EasyRec's -10000 shifts them all
        # alike, the same softmax less float32's rounding at 10000)
        adder = (1.0 - mask) * self.adder * mask.amax(dim=1, keepdim=True)
        adder = adder.unsqueeze(1).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, adder)
        if self.output_all:
            return [x.reshape(b, -1)]
        return [x[:, 0]]


def _bst_projection(in_dim: int, hidden: int) -> nn.Module:
    """EasyRec's ``relu(x W)`` to ``hidden`` (a TF1 dense: Glorot-uniform) or the identity."""
    if in_dim == hidden:
        return nn.Identity()
    return nn.Sequential(keras_dense(in_dim, hidden, True, "glorot_uniform"), nn.ReLU())


def _build_bst(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.BSTEncoder, "bst", required=True)
    positions, dim, target_dim = sequence_input(args)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if not config.HasField(key) or (getattr(config, key) < 1
                                        and key != "num_hidden_layers"):
            raise args.refuse(f"bst.{key} must be set" + (
                "" if key == "num_hidden_layers" else " (>= 1)"))
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    if hidden % heads:
        raise args.refuse(f"bst.hidden_size {hidden} is not a multiple of "
                          f"num_attention_heads {heads}")
    max_position = int(config.max_position_embeddings)
    if positions > max_position:
        raise args.refuse(f"the sequences' {positions} positions exceed "
                          f"bst.max_position_embeddings {max_position}: set the sequence "
                          "features' max_seq_len (EasyRec's run-time assertion)")
    where = config.target_item_position
    if where not in TARGET_POSITIONS:
        raise args.refuse(f"bst.target_item_position {where!r} is not one of "
                          f"{', '.join(TARGET_POSITIONS)}")
    joined = target_dim > 0 and where != "ignore"
    output_all = bool(config.output_all_token_embeddings)
    reserve = bool(config.reserve_target_position)
    if output_all and not joined and reserve:
        raise args.refuse("without a target joined (no target in the input, or "
                          "target_item_position: ignore) EasyRec cannot run "
                          "reserve_target_position: true with output_all_token_embeddings "
                          "(its mask is one position longer than the tokens); set "
                          "reserve_target_position: false")
    if not output_all and (joined or where != "head"):
        raise args.refuse("output_all_token_embeddings: false takes no joined target "
                          "(EasyRec's mask then misses the target's position) and only "
                          "target_item_position: head (EasyRec's tail / ignore output the "
                          "batch's last padded position)")
    if joined and target_dim != dim:
        raise args.refuse(f"the target's width {target_dim} differs from the sequence's "
                          f"{dim}")
    hidden_dropout = _dropout_rate(args, "bst.hidden_dropout_prob",
                                   config.hidden_dropout_prob)
    attention_dropout = _dropout_rate(args, "bst.attention_probs_dropout_prob",
                                      config.attention_probs_dropout_prob)
    stddev = float(config.initializer_range)
    if stddev < 0:
        raise args.refuse(f"bst.initializer_range must be >= 0, got {stddev}")
    intermediate = int(config.intermediate_size)
    try:
        layers = [BertLayer(hidden, heads, intermediate,
                            activation_layer(config.hidden_act, intermediate),
                            hidden_dropout, attention_dropout, stddev)
                  for _ in range(int(config.num_hidden_layers))]
    except ValueError as e:
        raise args.refuse(f"bst.hidden_act: {e}") from e
    table_rows = max_position + (1 if joined or reserve else 0)
    tokens = (max_position + (1 if joined else 0)) if output_all else positions
    layer = BSTLayer(_bst_projection(dim, hidden),
                     _bst_projection(target_dim, hidden) if joined else nn.Identity(),
                     layers, hidden, table_rows,
                     max_position - positions if output_all else 0,
                     (1 if where == "head" else 2) if joined else 0, output_all,
                     hidden_dropout)
    return BuiltLayer(layer, tensor(tokens * hidden if output_all else hidden))


# ---- TextCNN ----------------------------------------------------------------------------


def keras_conv1d(in_dim: int, filters: int, width: int) -> nn.Conv1d:
    """Keras's Conv1D (valid padding): Glorot-uniform kernel, zero bias."""
    conv = nn.Conv1d(int(in_dim), int(filters), int(width))
    bound = math.sqrt(6.0 / (width * in_dim + width * filters))
    with torch.no_grad():
        conv.weight.uniform_(-bound, bound)
        conv.bias.zero_()
    return conv


class TextCNNLayer(nn.Module):
    """TextCNN over a sequence (module docstring)."""

    __constants__ = ["positions"]

    def __init__(self, convs: list[nn.Conv1d], act: nn.Module, mlp: nn.Module,
                 positions: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.act = act
        self.mlp = mlp
        self.positions = int(positions)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[B, sum(num_filters)]``, or the MLP's output."""
        seq = xs[0]
        if seq.shape[1] < self.positions:
            seq = F.pad(seq, [0, 0, 0, self.positions - seq.shape[1]])
        elif seq.shape[1] > self.positions:
            seq = seq[:, : self.positions]
        t = seq.transpose(1, 2)  # [B, D, positions]
        pooled: list[torch.Tensor] = []
        for conv in self.convs:
            pooled.append(self.act(conv(t)).amax(dim=2))
        return [self.mlp(torch.cat(pooled, dim=-1))]


def _build_text_cnn(args: BlockArgs) -> BuiltLayer:
    config = params_message(args, pipeline_pb2.TextCNN, "text_cnn", required=True)
    length, dim, _ = sequence_input(args)
    pairs = list(zip(config.filter_sizes, config.num_filters, strict=False))
    if not pairs or any(k < 1 or f < 1 for k, f in pairs):
        raise args.refuse("text_cnn needs filter_sizes and num_filters (numbers >= 1; "
                          f"got {list(config.filter_sizes)} and {list(config.num_filters)})")
    positions = int(config.pad_sequence_length) or length
    if max(k for k, _ in pairs) > positions:
        raise args.refuse(f"a text_cnn filter of {max(k for k, _ in pairs)} positions is "
                          f"wider than the {positions} positions convolved")
    name = config.activation
    if name not in KERAS_CONV_ACTIVATIONS:
        raise args.refuse(f"text_cnn.activation {name!r} is not one of "
                          f"{', '.join(KERAS_CONV_ACTIVATIONS)}")
    width = sum(int(f) for _, f in pairs)
    mlp, width = optional_mlp(args, width, config, "text_cnn")
    convs = [keras_conv1d(dim, int(f), int(k)) for k, f in pairs]
    layer = TextCNNLayer(convs, KERAS_CONV_ACTIVATIONS[name](), mlp, positions)
    return BuiltLayer(layer, tensor(width))


register_block("DIN", _build_din)
register_block("BST", _build_bst)
register_block("TextCNN", _build_text_cnn)
