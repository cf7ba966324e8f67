"""The shared model blocks against their formulas, written out here independently."""

from __future__ import annotations

import pytest
import torch

from odl.models.building_blocks import (
    CrossNet,
    CrossNetV2,
    ExpertGates,
    build_mlp,
    fm_term,
)
from odl.models.sequence_layers import AttentionLayout, TargetAttention
from odl.protos import pipeline_pb2


def test_fm_term_is_the_sum_of_pairwise_products():
    v = torch.randn(3, 4, 5)
    want = sum(v[:, i] * v[:, j] for i in range(4) for j in range(i + 1, 4))
    assert torch.allclose(fm_term(v), want, atol=1e-5)


def test_cross_network_v1():
    torch.manual_seed(0)
    net = CrossNet(6, 2)
    with torch.no_grad():
        net.biases.normal_()
    x0 = torch.randn(4, 6)
    x = x0
    for layer in range(2):
        w, b = net.weights[layer], net.biases[layer]
        x = x0 * (x @ w).unsqueeze(1) + b + x
    assert torch.allclose(net(x0), x, atol=1e-6)
    assert torch.allclose(torch.jit.script(net)(x0), x, atol=1e-6)


def test_cross_network_v2_is_low_rank():
    torch.manual_seed(0)
    net = CrossNetV2(6, 3, 2)
    x0 = torch.randn(4, 6)
    x = x0
    for layer in net.layers:
        u, v = layer[0].weight, layer[1]  # U: 6 -> 2 (no bias), V: 2 -> 6
        assert u.shape == (2, 6) and layer[0].bias is None and v.weight.shape == (6, 2)
        x = x0 * (x @ u.T @ v.weight.T + v.bias) + x
    assert torch.allclose(net(x0), x, atol=1e-5)
    assert torch.allclose(torch.jit.script(net)(x0), x, atol=1e-5)


def test_expert_gates_mix_the_experts_by_each_tasks_softmax():
    torch.manual_seed(0)
    dnn = pipeline_pb2.DNN(hidden_units=[6])
    gates = ExpertGates(5, [dnn] * 3, num_tasks=2)
    x = torch.randn(4, 5)
    got = gates(x)
    experts = torch.stack([e(x) for e in gates.experts], dim=1)  # [B, E, H]
    for t, gate in enumerate(gates.gates):
        g = torch.softmax(gate.out(x), dim=1)
        want = sum(g[:, e : e + 1] * experts[:, e] for e in range(3))
        assert torch.allclose(got[t], want, atol=1e-6)
    assert torch.jit.script(gates)(x)[1].shape == (4, 6)


def test_mlp_layers_and_identity():
    mlp, width = build_mlp(5, pipeline_pb2.DNN(hidden_units=[4, 3], use_bn=True,
                                                dropout_ratio=[0.0, 0.5]))
    kinds = [type(m).__name__ for m in mlp]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d", "ReLU", "Dropout"]
    assert width == 3
    identity, same = build_mlp(5, pipeline_pb2.DNN())
    x = torch.randn(2, 5)
    assert same == 5 and torch.equal(identity(x), x)


def test_target_attention_attends_over_the_positions_within_the_length():
    torch.manual_seed(0)
    att = TargetAttention(AttentionLayout.plain(4), seq_len=3,
                          dnn=pipeline_pb2.DNN(hidden_units=[5, 1]))
    assert [type(m).__name__ for m in att.mlp] == ["Linear", "ReLU", "Linear"]  # score: plain
    b = 6
    k = torch.randn(b, 4)
    h = torch.randn(b, 3, 4)
    length = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 1.0])
    x = torch.cat([k, h.reshape(b, 12), length.unsqueeze(1)], dim=1)
    got = att(x)
    for i in range(b):
        n = int(length[i])
        if n == 0:  # every position masked: uniform weights over the (zero) padding in a batch
            continue
        scores = torch.stack([att.mlp(torch.cat([k[i], h[i, p], k[i] - h[i, p],
                                                 k[i] * h[i, p]])).squeeze() for p in range(n)])
        w = torch.softmax(scores, dim=0)
        want = torch.cat([(w.unsqueeze(1) * h[i, :n]).sum(0), k[i]])
        assert torch.allclose(got[i], want, atol=1e-5), i
    assert torch.allclose(torch.jit.script(att)(x), got, atol=1e-6)


def test_raw_projection_scales_each_feature_row_by_its_value():
    from odl.models.building_blocks import RawProjection

    proj = RawProjection([1, 1], 3)
    values = torch.tensor([[2.0, -1.0], [0.0, 0.5]])
    out = proj(values)
    w = proj.weight
    want = torch.cat([values[:, :1] * w[0], values[:, 1:] * w[1]], dim=1)
    assert torch.allclose(out, want) and out.shape == (2, 6)


def test_raw_projection_of_several_values_sums_each_value_times_its_row():
    """A RawFeature of raw_input_dim d projects to sum_k v_k * p_k (EasyRec's weighted ids)."""
    from odl.models.building_blocks import RawProjection

    torch.manual_seed(0)
    proj = RawProjection([1, 3], 4)  # a one-value feature, then a three-value one
    values = torch.randn(5, 4)
    out = proj(values)
    w = proj.weight
    first = values[:, :1] * w[0]
    second = values[:, 1:] @ w[1:]
    assert out.shape == (5, 8)
    assert torch.allclose(out, torch.cat([first, second], dim=1), atol=1e-6)
    assert list(proj.state_dict()) == ["weight"]  # only the rows are checkpointed
    scripted = torch.jit.script(proj)
    assert torch.equal(scripted(values), out)


def test_attention_pool_and_text_cnn_combine_a_sequence():
    from odl.models.sequence_layers import AttentionPool, GroupSequences, TextCNN

    torch.manual_seed(0)
    b, n, d = 3, 4, 2
    h = torch.randn(b, n, d)
    length = torch.tensor([[4.0], [2.0], [0.0]])
    x = torch.cat([h.reshape(b, n * d), length], dim=1)
    pool = AttentionPool(d, n)
    got = pool(x)
    for i in range(2):
        k = int(length[i])
        w = torch.softmax((h[i, :k] @ pool.score.weight.T).squeeze(1), dim=0)
        assert torch.allclose(got[i], (w.unsqueeze(1) * h[i, :k]).sum(0), atol=1e-6)
    settings = pipeline_pb2.TextCNN(filter_sizes=[2, 3], num_filters=[3, 1],
                                    pad_sequence_length=5)
    cnn = TextCNN(d, n, settings)
    out = cnn(x)
    padded = torch.cat([h, torch.zeros(b, 1, d)], dim=1)  # zero-padded to 5 positions
    want = []
    for conv, k in zip(cnn.convs, (2, 3), strict=True):
        windows = torch.stack([padded[:, p : p + k].reshape(b, -1) for p in range(5 - k + 1)],
                              dim=1)  # [B, windows, k * d] position-major
        kernel = conv.weight.permute(0, 2, 1).reshape(conv.weight.shape[0], -1)
        want.append(torch.relu(windows @ kernel.T + conv.bias).max(dim=1).values)
    assert out.shape == (b, 4) and torch.allclose(out, torch.cat(want, dim=1), atol=1e-5)
    # a group: [regular (1) | sequence | raw (2) | length] -> [regular | combined | raw]
    group = GroupSequences(1, [(n * d, pool)], 2)
    xg = torch.cat([torch.ones(b, 1), h.reshape(b, n * d), torch.full((b, 2), 7.0), length],
                   dim=1)
    got = group(xg)
    assert torch.allclose(got, torch.cat([torch.ones(b, 1), pool(x), torch.full((b, 2), 7.0)],
                                         dim=1))
    assert torch.allclose(torch.jit.script(group)(xg), got)


def test_target_attention_torcheasyrec_encoder_scores_with_a_linear_and_drops_the_key():
    torch.manual_seed(1)
    att = TargetAttention(AttentionLayout.plain(2), seq_len=3,
                          dnn=pipeline_pb2.DNN(hidden_units=[4]), encoder=True)
    assert att.out_width == 2
    k = torch.randn(2, 2)
    h = torch.randn(2, 3, 2)
    length = torch.tensor([[3.0], [1.0]])
    got = att(torch.cat([k, h.reshape(2, 6), length], dim=1))
    for i in range(2):
        n = int(length[i])
        feats = torch.stack([torch.cat([k[i], h[i, p], k[i] - h[i, p], k[i] * h[i, p]])
                             for p in range(n)])
        scores = att.mlp[1](torch.relu(att.mlp[0][0](feats))).squeeze(1)
        w = torch.softmax(scores, dim=0)
        assert torch.allclose(got[i], (w.unsqueeze(1) * h[i, :n]).sum(0), atol=1e-6)


def test_dnn_activations_are_easyrecs_functions():
    """Each EasyRec activation name is its function; dice is DIN's Dice."""
    from odl.models.building_blocks import Dice, activation_layer

    x = torch.randn(5, 3)
    want = {
        "relu": torch.relu(x), "tf.nn.relu": torch.relu(x), "linear": x,
        "gelu": 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))),
        "tf.nn.gelu": 0.5 * x * (1 + torch.erf(x / 2**0.5)),
        "leaky_relu": torch.where(x > 0, x, 0.2 * x), "prelu": torch.where(x > 0, x, 0.2 * x),
        "elu": torch.where(x > 0, x, torch.exp(x) - 1), "tanh": torch.tanh(x),
        "swish": x * torch.sigmoid(x), "sigmoid": torch.sigmoid(x),
        "selu": 1.0507009873554805 * torch.where(x > 0, x, 1.6732632423543772 * (torch.exp(x) - 1)),
    }
    for name, expected in want.items():
        assert torch.allclose(activation_layer(name, 3)(x), expected, atol=1e-6), name
    dice = activation_layer("dice", 3)
    assert isinstance(dice, Dice) and torch.equal(dice.alpha, torch.zeros(3))
    with torch.no_grad():
        dice.alpha.copy_(torch.tensor([0.5, -1.0, 2.0]))
    p = torch.sigmoid((x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-9))
    assert torch.allclose(dice(x), dice.alpha * (1 - p) * x + p * x, atol=1e-5)  # batch stats
    dice.eval()  # predictions and serving: the running statistics
    rm, rv = dice.norm.running_mean, dice.norm.running_var
    p = torch.sigmoid((x - rm) / torch.sqrt(rv + 1e-9))
    assert torch.allclose(dice(x), dice.alpha * (1 - p) * x + p * x, atol=1e-5)
    assert torch.allclose(torch.jit.script(dice)(x), dice(x))
    mlp, _ = build_mlp(3, pipeline_pb2.DNN(hidden_units=[4, 2], activation="dice"))
    assert [type(m).__name__ for m in mlp] == ["Linear", "Dice", "Linear", "Dice"]
    with pytest.raises(ValueError, match="not supported"):
        activation_layer("softsign", 3)


def test_target_attention_scores_only_the_positions_within_the_lengths():
    """The padding's scores are replaced, so scoring the valid positions alone is the same
    attention, values and gradients; an MLP with batch normalization scores them all."""
    torch.manual_seed(3)
    dnn = pipeline_pb2.DNN(hidden_units=[6, 1])
    att = TargetAttention(AttentionLayout.plain(4), seq_len=5, dnn=dnn)
    assert att.score_valid_only
    every = TargetAttention(AttentionLayout.plain(4), seq_len=5, dnn=dnn)
    every.load_state_dict(att.state_dict())
    every.score_valid_only = False
    x = torch.randn(7, 4 + 5 * 4 + 1)
    x[:, -1] = torch.tensor([0.0, 1.0, 5.0, 2.0, 3.0, 0.0, 4.0])
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = att(xa), every(xb)
    assert torch.allclose(ya, yb, atol=1e-6)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad, atol=1e-5)
    for pa, pb in zip(att.parameters(), every.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-5)
    assert torch.allclose(torch.jit.script(att)(x), ya, atol=1e-6)
    normed = pipeline_pb2.DNN(hidden_units=[6, 1], use_bn=True)
    assert not TargetAttention(AttentionLayout.plain(4), seq_len=5, dnn=normed).score_valid_only
