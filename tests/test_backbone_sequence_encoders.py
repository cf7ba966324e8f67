"""EasyRec's sequence backbone layers: DIN, BST and TextCNN.

Each layer is built through the block registry over an ``output_seq_and_normal_feature``
input (``[sequences, lengths, targets]``, positions past a length zero) and checked against
a reference written here from EasyRec's code (numpy loops per sample over the module's own
weights, perturbed so that no bias or scale is trivially zero or one), on sequences of
different lengths (0 included), with and without targets; the scripted module gives the same
output, the output spec matches the output, gradient reaches the parameters, predictions are
deterministic and bad inputs or settings raise ``ConfigError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from google.protobuf.message import Message
from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.block_registry import BuiltLayer
from odl.models.backbone.value_specs import Spec, leaves, tensor
from odl.protos import pipeline_pb2 as pb
from tests.backbone_layer_checks import B, build

LENGTHS = [0.0, 1.0, 3.0, 2.0, 4.0]  # with L = 4: empty, partial and full sequences
Act = Callable[[np.ndarray], np.ndarray]


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def identity(x: np.ndarray) -> np.ndarray:
    return x


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def msg(kind: type, text: str) -> Message:
    return text_format.Parse(text, kind())


def seq_spec(length: int, dim: int, target: int | None) -> Spec:
    spec: list = [tensor(length, dim), tensor()]
    if target is not None:
        spec.append(tensor(target))
    return spec


def seq_inputs(length: int, dim: int, target: int | None, seed: int = 0,
               lengths: list[float] | None = None) -> list[torch.Tensor]:
    """``[sequences, lengths(, targets)]`` as the input layer gives them."""
    g = torch.Generator().manual_seed(seed)
    n = torch.tensor([min(v, length) for v in (lengths or LENGTHS)])
    seq = torch.randn(B, length, dim, generator=g)
    seq = seq * (torch.arange(length).unsqueeze(0) < n.unsqueeze(1)).unsqueeze(-1).float()
    xs = [seq.requires_grad_(), n]
    if target is not None:
        xs.append(torch.randn(B, target, generator=g).requires_grad_())
    return xs


def perturb(module: nn.Module, seed: int = 1) -> None:
    """Moves every parameter off its initial value (zero biases, unit scales)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def run(built: BuiltLayer, xs: list[torch.Tensor]) -> np.ndarray:
    """The eval-mode output; checks the spec, determinism, scripting and the gradient."""
    module = built.module.eval()
    out = module(xs)
    assert [tuple(o.shape) for o in out] == [(B, *s.shape) for s in leaves(built.spec)]
    torch.testing.assert_close(module(xs), out, rtol=0, atol=0)
    scripted = torch.jit.script(module)
    for a, b in zip(out, scripted(xs), strict=True):
        torch.testing.assert_close(a, b)
    module.zero_grad()
    sum(o.square().sum() for o in out).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
    return out[0].detach().double().numpy()


def arr(xs: list[torch.Tensor]) -> list[np.ndarray]:
    return [x.detach().double().numpy() for x in xs]


def np_param(p: torch.Tensor) -> np.ndarray:
    return p.detach().double().numpy()


def mlp_ref(x: np.ndarray, seq: nn.Module, acts: list[Act]) -> np.ndarray:
    """An MLP without normalization: per Linear ``act(x W^T + b)``."""
    linears = [m for m in seq.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == len(acts)
    for lin, act in zip(linears, acts, strict=True):
        x = x @ np_param(lin.weight).T
        if lin.bias is not None:
            x = x + np_param(lin.bias)
        x = act(x)
    return x


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def refused(name: str, spec: Spec, params: Message | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build(name, spec, params)


# ---- DIN --------------------------------------------------------------------------------


def din_ref(built: BuiltLayer, xs: list[torch.Tensor], sigmoid: bool,
            need_target: bool) -> np.ndarray:
    """EasyRec's DIN per sample: the MLP's score per position, masked, normalized."""
    seqs, lengths, targets = arr(xs)
    _, length, dim = seqs.shape
    width = targets.shape[1]
    rows = []
    for b in range(B):
        q = np.concatenate([targets[b], np.zeros(dim - width)])
        scores = np.empty(length)
        for j in range(length):
            k = seqs[b, j]
            x = np.concatenate([q, k, q - k, q * k])
            scores[j] = mlp_ref(x, built.module.attention, [relu, identity])[0]
            if j >= lengths[b]:
                scores[j] = -(2.0**32) + 1
        with np.errstate(over="ignore"):
            w = 1 / (1 + np.exp(-scores / math.sqrt(dim))) if sigmoid else softmax(scores)
        out = sum(w[j] * seqs[b, j, :width] for j in range(length))
        rows.append(np.concatenate([out, q]) if need_target else out)
    return np.stack(rows)


DIN_MLP = "attention_dnn { hidden_units: [6, 1] }"


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
@pytest.mark.parametrize("need_target", [True, False])
def test_din_matches_easyrec(normalizer: str, need_target: bool) -> None:
    params = msg(pb.DINEncoder, f"{DIN_MLP} attention_normalizer: '{normalizer}' "
                                f"need_target_feature: {str(need_target).lower()}")
    built = build("DIN", seq_spec(4, 6, 6), params)
    assert built.spec == tensor(12 if need_target else 6)
    perturb(built.module)
    xs = seq_inputs(4, 6, 6)
    got = run(built, xs)
    close(got, din_ref(built, xs, normalizer == "sigmoid", need_target))
    if normalizer == "softmax":  # length 0: equal weights over zero positions
        np.testing.assert_allclose(got[0, :6], 0.0, atol=1e-7)


def test_din_narrow_target_is_padded_and_appended() -> None:
    built = build("DIN", seq_spec(4, 8, 5), msg(pb.DINEncoder, DIN_MLP))
    assert built.spec == tensor(5 + 8)  # EasyRec appends the padded target
    perturb(built.module)
    xs = seq_inputs(4, 8, 5, seed=3)
    got = run(built, xs)
    close(got, din_ref(built, xs, False, True))
    np.testing.assert_array_equal(got[:, 5 + 5:], 0.0)


def test_din_attention_mlp_is_easyrec_din_layer() -> None:
    """The last layer is linear with bias and no batch norm, whatever the config says."""
    params = msg(pb.DINEncoder, "attention_dnn { hidden_units: [6, 1] use_final_bn: true "
                                "final_activation: 'relu' use_final_bias: false }")
    built = build("DIN", seq_spec(4, 6, 6), params)
    linears = [m for m in built.module.attention.modules() if isinstance(m, nn.Linear)]
    assert linears[0].bias is None and linears[1].bias is not None
    assert not any(isinstance(m, (nn.ReLU, nn.BatchNorm1d))
                   for m in list(built.module.attention)[2:])
    perturb(built.module)
    xs = seq_inputs(4, 6, 6, seed=5)
    close(run(built, xs), din_ref(built, xs, False, True))


def test_din_sample_config_with_dice() -> None:
    """EasyRec's din_backbone_on_taobao: dice in the attention MLP over [B, L, 4D]."""
    params = msg(pb.DINEncoder, "attention_dnn { hidden_units: [32, 1] activation: 'dice' }"
                                " need_target_feature: true")
    built = build("DIN", seq_spec(4, 6, 6), params)
    xs = seq_inputs(4, 6, 6)
    built.module.train()
    trained = built.module(xs)[0]
    assert trained.shape == (B, 12) and torch.isfinite(trained).all()
    run(built, xs)


def test_din_refusals() -> None:
    din = msg(pb.DINEncoder, DIN_MLP)
    refused("DIN", seq_spec(4, 6, None), din, "needs the target")
    refused("DIN", seq_spec(4, 6, 8), din, "larger than the sequence")
    refused("DIN", tensor(4, 6), din, "takes \\[sequences")
    refused("DIN", [tensor(4, 6), tensor(3), tensor(6)], din, "takes \\[sequences")
    refused("DIN", seq_spec(4, 6, 6), msg(pb.DINEncoder, "attention_dnn { hidden_units: [4] }"),
            "ending in 1")
    refused("DIN", seq_spec(4, 6, 6), pb.DINEncoder(), "ending in 1")
    refused("DIN", seq_spec(4, 6, 6),
            msg(pb.DINEncoder, DIN_MLP + " attention_normalizer: 'tanh'"), "normalizer")
    refused("DIN", seq_spec(4, 6, 6),
            msg(pb.DINEncoder, "attention_dnn { hidden_units: [4, 1] activation: 'nope' }"),
            "attention_dnn")
    refused("DIN", seq_spec(4, 6, 6), None, "din")
    refused("DIN", seq_spec(4, 6, 6), msg(pb.MLP, "hidden_units: 1"), "din")


# ---- BST --------------------------------------------------------------------------------


def layer_norm(x: np.ndarray, norm: nn.LayerNorm) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-12) * np_param(norm.weight) + np_param(norm.bias)


def dense(x: np.ndarray, layer: nn.Module) -> np.ndarray:
    return x @ np_param(layer.weight).T + np_param(layer.bias)


def project(x: np.ndarray, module: nn.Module) -> np.ndarray:
    if isinstance(module, nn.Identity):
        return x
    return relu(dense(x, module[0]))


def bst_ref(built: BuiltLayer, xs: list[torch.Tensor], pad_to: int, target_at: str,
            output_all: bool, act: Act = gelu_tanh) -> np.ndarray:
    """EasyRec's BST per sample: the tokens, position embeddings, BERT's encoder."""
    m = built.module
    arrays = arr(xs)
    seqs, lengths = arrays[0], arrays[1]
    rows = []
    for b in range(B):
        seq = seqs[b]
        if pad_to > len(seq):
            seq = np.vstack([seq, np.zeros((pad_to - len(seq), seq.shape[1]))])
        valid = [1.0 if j < lengths[b] else 0.0 for j in range(len(seq))]
        x = project(seq, m.seq_project)
        if target_at != "none":
            tgt = project(arrays[2][b], m.target_project)[None]
            x = np.vstack([tgt, x] if target_at == "head" else [x, tgt])
            valid = [1.0] + valid if target_at == "head" else valid + [1.0]
        n = len(x)
        e = layer_norm(x + np_param(m.position)[:n], m.embedding_norm)
        adder = (1.0 - np.array(valid)) * -10000.0
        for layer in m.layers:
            heads, size = layer.heads, layer.head_dim
            q, k, v = dense(e, layer.query), dense(e, layer.key), dense(e, layer.value)
            context = np.zeros_like(e)
            for h in range(heads):
                cols = slice(h * size, (h + 1) * size)
                for i in range(n):
                    scores = np.array([q[i, cols] @ k[j, cols] / math.sqrt(size) + adder[j]
                                       for j in range(n)])
                    context[i, cols] = softmax(scores) @ v[:, cols]
            y = layer_norm(dense(context, layer.attention_output) + e, layer.attention_norm)
            ffn = dense(act(dense(y, layer.intermediate)), layer.output)
            e = layer_norm(ffn + y, layer.output_norm)
        rows.append(e.reshape(-1) if output_all else e[0])
    return np.stack(rows)


BST = ("hidden_size: 8 num_hidden_layers: 2 num_attention_heads: 2 intermediate_size: 12 "
       "max_position_embeddings: 6 ")


@pytest.mark.parametrize("position", ["head", "tail"])
def test_bst_with_target_matches_easyrec(position: str) -> None:
    """Default output: every token of [target, sequence padded to P] (D != H: projected)."""
    built = build("BST", seq_spec(4, 6, 6),
                  msg(pb.BSTEncoder, BST + f"target_item_position: '{position}'"))
    assert built.spec == tensor((6 + 1) * 8)
    assert built.module.position.shape == (7, 8)
    perturb(built.module)
    xs = seq_inputs(4, 6, 6, seed=2)
    close(run(built, xs), bst_ref(built, xs, 6, position, True))


def test_bst_without_projection_or_target() -> None:
    """D == H, no target, reserve_target_position false: [B, P * H]."""
    params = msg(pb.BSTEncoder, BST + "reserve_target_position: false hidden_act: 'relu'")
    built = build("BST", seq_spec(4, 8, None), params)
    assert isinstance(built.module.seq_project, nn.Identity)
    assert built.spec == tensor(6 * 8) and built.module.position.shape == (6, 8)
    perturb(built.module)
    xs = seq_inputs(4, 8, None, seed=4)
    close(run(built, xs), bst_ref(built, xs, 6, "none", True, relu))


def test_bst_ignored_target_is_not_read() -> None:
    params = msg(pb.BSTEncoder, BST + "target_item_position: 'ignore' "
                                      "reserve_target_position: false")
    built = build("BST", seq_spec(6, 8, 8), params)  # L == P: no padding
    assert built.spec == tensor(6 * 8)
    perturb(built.module)
    xs = seq_inputs(6, 8, 8, seed=6, lengths=[0.0, 6.0, 2.0, 5.0, 1.0])
    got = run(built, xs)
    close(got, bst_ref(built, xs, 6, "none", True))
    other = [xs[0], xs[1], torch.randn(B, 8)]
    np.testing.assert_array_equal(built.module(other)[0].detach().numpy(), got)


def test_bst_first_token() -> None:
    """output_all_token_embeddings false, no target: the first position's vector [B, H]."""
    params = msg(pb.BSTEncoder, BST + "output_all_token_embeddings: false")
    built = build("BST", seq_spec(4, 6, None), params)
    assert built.spec == tensor(8)
    assert built.module.position.shape == (7, 8)  # reserve_target_position: P + 1 rows
    perturb(built.module)
    xs = seq_inputs(4, 6, None, seed=7)
    close(run(built, xs), bst_ref(built, xs, 0, "none", False))


def test_bst_sample_config_and_dropout_only_in_training() -> None:
    """EasyRec's bst_backbone_on_taobao settings (P = 50, H = 128, 2 heads, 2 layers)."""
    params = msg(pb.BSTEncoder, "hidden_size: 128 num_attention_heads: 2 num_hidden_layers: 2 "
                                "intermediate_size: 128 hidden_act: 'gelu' "
                                "max_position_embeddings: 50 hidden_dropout_prob: 0.1 "
                                "attention_probs_dropout_prob: 0")
    built = build("BST", seq_spec(10, 32, 32), params)
    assert built.spec == tensor(51 * 128)
    xs = seq_inputs(10, 32, 32)
    module = built.module.train()
    first, second = module(xs)[0], module(xs)[0]
    assert not torch.equal(first, second)
    module.eval()
    torch.testing.assert_close(module(xs)[0], module(xs)[0], rtol=0, atol=0)
    no_dropout = build("BST", seq_spec(4, 6, 6), msg(pb.BSTEncoder, BST + (
        "hidden_dropout_prob: 0 attention_probs_dropout_prob: 0")))
    small = seq_inputs(4, 6, 6)
    trained = no_dropout.module.train()(small)[0]
    torch.testing.assert_close(no_dropout.module.eval()(small)[0], trained)


def test_bst_initialization_and_regularized_layers() -> None:
    params = msg(pb.BSTEncoder, "hidden_size: 64 num_hidden_layers: 1 num_attention_heads: 4 "
                                "intermediate_size: 256 initializer_range: 0.05 "
                                "max_position_embeddings: 200")
    module = build("BST", seq_spec(4, 32, 32), params).module
    layer = module.layers[0]
    for p in (layer.query.weight, layer.intermediate.weight, layer.output.weight):
        values = p.detach()
        assert values.abs().max() <= 0.1 + 1e-6  # truncated at 2 stddev
        assert 0.035 < values.std() < 0.05  # a truncated normal of stddev 0.05
    assert torch.count_nonzero(layer.query.bias) == 0
    position = module.position.detach()
    assert position.abs().max() <= 0.04 + 1e-6 and 0.014 < position.std() < 0.02
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    assert linears == [module.seq_project[0], module.target_project[0]]  # L2 counts these
    bound = math.sqrt(6.0 / (32 + 64))  # Glorot uniform
    assert linears[0].weight.abs().max() <= bound


def test_bst_refusals() -> None:
    spec = seq_spec(4, 6, 6)
    refused("BST", spec, msg(pb.BSTEncoder, "num_hidden_layers: 1 num_attention_heads: 2 "
                                            "intermediate_size: 4"), "hidden_size must be set")
    refused("BST", spec, msg(pb.BSTEncoder, BST.replace("intermediate_size: 12",
                                                        "intermediate_size: 0")),
            "intermediate_size")
    refused("BST", spec, msg(pb.BSTEncoder, BST.replace("heads: 2", "heads: 3")),
            "not a multiple")
    refused("BST", seq_spec(7, 6, 6), msg(pb.BSTEncoder, BST), "max_position_embeddings 6")
    refused("BST", seq_spec(4, 6, 5), msg(pb.BSTEncoder, BST), "width 5 differs")
    refused("BST", seq_spec(4, 6, None), msg(pb.BSTEncoder, BST), "reserve_target_position")
    refused("BST", spec, msg(pb.BSTEncoder, BST + "target_item_position: 'ignore'"),
            "reserve_target_position")
    refused("BST", spec, msg(pb.BSTEncoder, BST + "output_all_token_embeddings: false"),
            "joined target")
    refused("BST", seq_spec(4, 6, None), msg(pb.BSTEncoder, BST + (
        "output_all_token_embeddings: false target_item_position: 'tail'")), "tail")
    refused("BST", spec, msg(pb.BSTEncoder, BST + "target_item_position: 'middle'"),
            "target_item_position")
    refused("BST", spec, msg(pb.BSTEncoder, BST + "hidden_act: 'nope'"), "hidden_act")
    refused("BST", spec, msg(pb.BSTEncoder, BST + "hidden_dropout_prob: 1.0"),
            "hidden_dropout_prob")
    refused("BST", spec, msg(pb.BSTEncoder, BST + "initializer_range: -1"),
            "initializer_range")
    refused("BST", [tensor(4, 6)], msg(pb.BSTEncoder, BST), "takes \\[sequences")
    refused("BST", spec, msg(pb.DINEncoder, DIN_MLP), "bst")


# ---- TextCNN ----------------------------------------------------------------------------


def text_cnn_ref(built: BuiltLayer, xs: list[torch.Tensor], positions: int,
                 act: Act = relu) -> np.ndarray:
    """EasyRec's TextCNN: valid Conv1D per filter size, max over positions, concat."""
    seqs = arr(xs)[0]
    rows = []
    for b in range(B):
        seq = seqs[b][:positions]
        if len(seq) < positions:
            seq = np.vstack([seq, np.zeros((positions - len(seq), seq.shape[1]))])
        pooled = []
        for conv in built.module.convs:
            w, bias = np_param(conv.weight), np_param(conv.bias)  # [f, D, k], [f]
            k = w.shape[2]
            outs = [np.einsum("fdk,kd->f", w, seq[i:i + k]) + bias
                    for i in range(positions - k + 1)]
            pooled.append(act(np.stack(outs)).max(axis=0))
        rows.append(np.concatenate(pooled))
    return np.stack(rows)


TEXT_CNN = "filter_sizes: [2, 3] num_filters: [4, 3] "


@pytest.mark.parametrize("pad_len, length", [(6, 4), (3, 5), (0, 4)])
def test_text_cnn_matches_easyrec(pad_len: int, length: int) -> None:
    """Padded to, cut to, or kept at the positions; the target is not read."""
    built = build("TextCNN", seq_spec(length, 5, 5),
                  msg(pb.TextCNN, TEXT_CNN + f"pad_sequence_length: {pad_len}"))
    assert built.spec == tensor(7)
    perturb(built.module)
    xs = seq_inputs(length, 5, 5, seed=8)
    got = run(built, xs)
    close(got, text_cnn_ref(built, xs, pad_len or length))
    other = [xs[0], xs[1], torch.randn(B, 5)]
    np.testing.assert_array_equal(built.module(other)[0].detach().numpy(), got)


def test_text_cnn_sample_config_with_mlp() -> None:
    """EasyRec's text_cnn_on_movielens: kernels 2, 3, 4; an MLP on the pooled filters."""
    params = msg(pb.TextCNN, "filter_sizes: [2, 3, 4] num_filters: [16, 8, 8] "
                             "pad_sequence_length: 14 mlp { hidden_units: [12, 6] }")
    built = build("TextCNN", seq_spec(10, 5, None), params)
    assert built.spec == tensor(6)
    perturb(built.module)
    xs = seq_inputs(10, 5, None, seed=9)
    want = mlp_ref(text_cnn_ref(built, xs, 14), built.module.mlp, [relu, relu])
    close(run(built, xs), want)


def test_text_cnn_pairs_to_the_shorter_list_and_activation() -> None:
    params = msg(pb.TextCNN, "filter_sizes: [2, 3, 4] num_filters: [4, 3] "
                             "pad_sequence_length: 5 activation: 'tanh'")
    built = build("TextCNN", seq_spec(5, 5, None), params)
    assert built.spec == tensor(7) and len(built.module.convs) == 2
    perturb(built.module)
    xs = seq_inputs(5, 5, None, seed=10)
    close(run(built, xs), text_cnn_ref(built, xs, 5, np.tanh))


def test_text_cnn_keras_initialization() -> None:
    params = msg(pb.TextCNN, "filter_sizes: [3] num_filters: [64] pad_sequence_length: 8")
    conv = build("TextCNN", seq_spec(8, 32, None), params).module.convs[0]
    bound = math.sqrt(6.0 / (3 * 32 + 3 * 64))
    assert conv.weight.abs().max() <= bound and conv.weight.abs().max() > 0.9 * bound
    assert torch.count_nonzero(conv.bias) == 0


def test_text_cnn_refusals() -> None:
    spec = seq_spec(4, 5, None)
    refused("TextCNN", spec, msg(pb.TextCNN, "filter_sizes: [5] num_filters: [2]"),
            "wider than the 4 positions")
    refused("TextCNN", spec, msg(pb.TextCNN, "pad_sequence_length: 4"), "filter_sizes")
    refused("TextCNN", spec, msg(pb.TextCNN, "filter_sizes: [2] num_filters: [0]"),
            "filter_sizes")
    refused("TextCNN", spec, msg(pb.TextCNN, TEXT_CNN + "activation: 'dice'"), "activation")
    refused("TextCNN", spec, msg(pb.TextCNN, TEXT_CNN + "mlp { }"), "text_cnn.mlp")
    refused("TextCNN", tensor(4, 5), msg(pb.TextCNN, TEXT_CNN), "takes \\[sequences")
    refused("TextCNN", spec, None, "text_cnn")
