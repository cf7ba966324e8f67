"""EasyRec's MaskBlock, MaskNet, Highway, Gate and numeric embedding backbone layers.

Each layer is built through the block registry and checked against a reference written here
from EasyRec's formulas (numpy over the module's own weights, perturbed so that biases and
normalization parameters count), on each input form and setting source; the scripted module
gives the same outputs, the output spec matches them, gradient reaches the parameters, and
bad inputs or settings raise ``ConfigError``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf.message import Message

from odl.config.config_error import ConfigError
from odl.models.backbone.block_registry import BuiltLayer
from odl.models.backbone.value_specs import Spec, leaves, tensor
from odl.protos import pipeline_pb2 as pb
from tests.backbone_layer_checks import B, build, inputs_for


def perturb(built: BuiltLayer, seed: int = 0) -> BuiltLayer:
    """Moves every parameter off its initial value, so that zero biases and unit scales
    cannot hide a term the reference reads."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in built.module.parameters():
            p.add_(torch.rand(p.shape, generator=g) * 0.6 - 0.3)
    return built


def run(built: BuiltLayer, xs: list[torch.Tensor]) -> list[np.ndarray]:
    """The eager outputs; checks the spec, the scripted module and the gradient."""
    built.module.eval()
    out = built.module(xs)
    assert [tuple(o.shape) for o in out] == [(B, *s.shape) for s in leaves(built.spec)]
    scripted = torch.jit.script(built.module)
    for a, b in zip(out, scripted(xs), strict=True):
        torch.testing.assert_close(a, b)
    g = torch.Generator().manual_seed(99)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in out).backward()
    params = list(built.module.parameters())
    grads = [p.grad for p in params] if params else [x.grad for x in xs]
    assert any(gr is not None and gr.abs().sum() > 0 for gr in grads)
    return arr(out)


def npy(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def arr(xs: list[torch.Tensor]) -> list[np.ndarray]:
    return [npy(x) for x in xs]


def w(dense: torch.nn.Module) -> tuple[np.ndarray, np.ndarray | float]:
    """A Dense's kernel as Keras's ``[in, out]`` and its bias (0 when off)."""
    return npy(dense.weight).T, (npy(dense.bias) if dense.bias is not None else 0.0)


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


REFUSALS: list[tuple[str, Spec, Message | None, dict[str, Any] | None, str]] = []


def refusals(name: str, rows: list[tuple[Spec, Message | None, dict | None, str]]) -> None:
    """Adds rows ``(spec, params, st_params, error pattern)`` to :func:`test_refusals`."""
    REFUSALS.extend((name, *row) for row in rows)


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def layer_norm(x: np.ndarray, ln: torch.nn.Module) -> np.ndarray:
    """Keras's LayerNormalization (epsilon 1e-3) with the module's scale and offset."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-3) * npy(ln.weight) + npy(ln.bias)


# ---- MaskBlock --------------------------------------------------------------------------


def mask_block_reference(core: torch.nn.Module, net: np.ndarray,
                         mask: np.ndarray) -> np.ndarray:
    if core.input_layer_norm:
        net = layer_norm(net, core.input_ln)
    u = mask
    if core.has_projection:
        u = u @ w(core.project)[0]
    k, b = w(core.aggregation)
    hidden = relu(u @ k + b)
    k, b = w(core.mask_weights)
    masked = net * (hidden @ k + b)
    if not core.has_output:
        return masked
    return relu(layer_norm(masked @ w(core.output_layer)[0], core.output_ln))


@pytest.mark.parametrize("spec,config,width,aggregation", [
    (tensor(6), pb.MaskBlock(aggregation_size=8), 6, 8),
    ([tensor(6), tensor(4)], pb.MaskBlock(reduction_factor=1.5, output_size=5), 5, 6),
    ([tensor(6), tensor(4), [tensor(3), tensor(2)]],
     pb.MaskBlock(aggregation_size=7, projection_dim=2, input_layer_norm=True), 6, 7),
    ([tensor(3, 6), tensor(3, 4)], pb.MaskBlock(aggregation_size=5, output_size=2), 2, 5),
])
def test_mask_block(spec, config, width, aggregation) -> None:
    built = perturb(build("MaskBlock", spec, config))
    xs = inputs_for(spec, seed=1)
    got = run(built, xs)
    x = arr(xs)
    net, mask = (x[0], x[0]) if len(x) == 1 else (x[0], x[1])  # [net, mask_input] order
    close(got[0], mask_block_reference(built.module.core, net, mask))
    first = leaves(spec)[0]
    assert built.spec == tensor(*first.shape[:-1], width)
    assert built.module.core.aggregation.out_features == aggregation


def test_mask_block_initializes_and_regularizes_as_easyrec() -> None:
    torch.manual_seed(0)
    core = build("MaskBlock", [tensor(64), tensor(32)],
                 pb.MaskBlock(aggregation_size=48, output_size=16, projection_dim=8)).module.core
    linears = {n for n, m in core.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == {"aggregation", "project"}  # the kernels EasyRec regularizes
    agg = core.aggregation.weight
    assert agg.abs().max() <= math.sqrt(6 / 8) and agg.abs().max() > 0.8 * math.sqrt(6 / 8)
    assert core.mask_weights.weight.abs().max() <= math.sqrt(6 / (48 + 64))  # glorot
    assert torch.count_nonzero(core.aggregation.bias) == 0
    assert core.output_layer.bias is None and core.project.bias is None


refusals("MaskBlock", [
    (tensor(6), pb.MaskBlock(), None, "aggregation_size"),
    (tensor(6), pb.MaskBlock(reduction_factor=0.1), None, "reduction_factor"),
    (tensor(6), pb.MaskBlock(aggregation_size=4, output_size=0), None, "output_size"),
    ([tensor(6)], pb.MaskBlock(aggregation_size=4), None, "two tensors"),
    ([[tensor(6)], tensor(6)], pb.MaskBlock(aggregation_size=4), None, "two tensors"),
    ([tensor(2, 6), tensor(3, 6)], pb.MaskBlock(aggregation_size=4), None, "every axis"),
    (tensor(6), pb.MaskNet(), None, "takes mask_block"),
    (tensor(6), None, {"aggregation_size": 4}, "mask_block"),
])


# ---- MaskNet ----------------------------------------------------------------------------


def mlp_reference(mlp: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    for m in mlp.modules():
        if isinstance(m, torch.nn.Linear):
            k, b = w(m)
            x = x @ k + b
        elif isinstance(m, torch.nn.ReLU):
            x = relu(x)
        else:
            assert isinstance(m, (torch.nn.Sequential, torch.nn.Identity)), m
    return x


def masknet_config(parallel: bool, mlp: bool, norm: bool) -> pb.MaskNet:
    config = pb.MaskNet(use_parallel=parallel, input_layer_norm=norm)
    config.mask_blocks.add(aggregation_size=8, output_size=5)
    config.mask_blocks.add(reduction_factor=0.5, input_layer_norm=True)
    if mlp:
        config.mlp.hidden_units.extend([7, 3])
    return config


@pytest.mark.parametrize("parallel,mlp,norm,width", [
    (True, False, True, 11), (True, True, False, 3), (False, False, True, 5),
    (False, True, True, 3)])
def test_mask_net(parallel, mlp, norm, width) -> None:
    built = perturb(build("MaskNet", tensor(6), masknet_config(parallel, mlp, norm)), seed=2)
    xs = inputs_for(tensor(6), seed=3)
    got = run(built, xs)
    module = built.module
    x = layer_norm(arr(xs)[0], module.input_ln) if norm else arr(xs)[0]
    if parallel:
        want = np.concatenate([mask_block_reference(b, x, x) for b in module.blocks], 1)
    else:
        want = x
        for block in module.blocks:
            want = mask_block_reference(block, want, x)
    if mlp:
        want = mlp_reference(module.mlp, want)
    close(got[0], want)
    assert built.spec == tensor(width)
    # the mask input is the (normalized) input in both modes; its width is the input's
    assert [b.aggregation.in_features for b in module.blocks] == [6, 6]


def test_mask_net_serial_without_blocks_is_the_normalized_input() -> None:
    built = perturb(build("MaskNet", tensor(4), pb.MaskNet(use_parallel=False)))
    xs = inputs_for(tensor(4))
    close(run(built, xs)[0], layer_norm(arr(xs)[0], built.module.input_ln))


BAD_MASKNET = masknet_config(True, False, True)
BAD_MASKNET.mask_blocks.add()  # no aggregation width
refusals("MaskNet", [
    (tensor(6), pb.MaskNet(), None, "needs mask_blocks"),
    (tensor(3, 6), masknet_config(True, False, True), None, r"\[B, D\]"),
    ([tensor(6), tensor(6)], masknet_config(True, False, True), None, r"\[B, D\]"),
    (tensor(6), None, None, "masknet"),
    (tensor(6), BAD_MASKNET, None, r"mask_blocks\[2\]"),
])


# ---- Highway ----------------------------------------------------------------------------


def highway_reference(module: torch.nn.Module, x: np.ndarray, act) -> np.ndarray:
    if not isinstance(module.project, torch.nn.Identity):
        k, b = w(module.project)
        x = x @ k + b
    for step in module.steps:
        k, b = w(step.gate)
        gate = sigmoid(x @ k + b)
        k, b = w(step.transform)
        x = gate * act(x @ k + b) + (1.0 - gate) * x
    return x


@pytest.mark.parametrize("spec,params,st,act,width,layers", [
    (tensor(6), None, {}, relu, 6, 1),
    (tensor(6), None, {"emb_size": 4, "num_layers": 2, "activation": "tanh",
                       "init_gate_bias": 1}, np.tanh, 4, 2),
    (tensor(3, 6), pb.HighWayTower(emb_size=6, num_layers=3), {}, relu, 6, 3),
    (tensor(5), pb.HighWayTower(emb_size=8, activation="linear"), {}, lambda v: v, 8, 1),
])
def test_highway(spec, params, st, act, width, layers) -> None:
    built = build("Highway", spec, params, st)
    gate_bias = float((st or {}).get("init_gate_bias", -3.0))
    for step in built.module.steps:
        assert torch.all(step.gate.bias == gate_bias)
        assert not isinstance(step.gate, torch.nn.Linear)  # EasyRec: unregularized
    perturb(built, seed=4)
    xs = inputs_for(spec, seed=5)
    got = run(built, xs)
    close(got[0], highway_reference(built.module, arr(xs)[0], act))
    assert built.spec == tensor(*spec.shape[:-1], width)
    assert len(built.module.steps) == layers
    assert isinstance(built.module.project, torch.nn.Identity) == (width == spec.shape[-1])


def test_highway_dropout_acts_in_training_only() -> None:
    built = build("Highway", tensor(32), pb.HighWayTower(dropout_rate=0.5, init_gate_bias=5))
    x = [torch.randn(B, 32)]
    built.module.train()
    torch.manual_seed(0)
    a = built.module(x)[0]
    b = built.module(x)[0]
    assert not torch.allclose(a, b)
    built.module.eval()
    close(npy(built.module(x)[0]), highway_reference(built.module, npy(x[0]), relu))


refusals("Highway", [
    ([tensor(6)], None, {}, "one tensor"),
    (tensor(6), None, {"emb_size": 0}, "emb_size"),
    (tensor(6), pb.HighWayTower(emb_size=0), {}, "emb_size"),
    (tensor(6), None, {"dropout_rate": 1.0}, "dropout_rate"),
    (tensor(6), None, {"activation": "swirl"}, "swirl"),
    (tensor(6), None, {"num_layers": -1}, "num_layers"),
    (tensor(6), pb.MaskBlock(), {}, "takes highway"),
])


# ---- Gate -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,st,index", [
    ([tensor(2), tensor(4), tensor(4)], {}, 0),
    ([tensor(4), tensor(3), tensor(4)], {"weight_index": 1}, 1),
    ([tensor(4), tensor(8), tensor(8), tensor(8), tensor(8)], {}, 0),  # CDN's config
])
def test_gate(spec, st, index) -> None:
    xs = inputs_for(spec, seed=6)
    built = build("Gate", spec, st=st)
    got = run(built, xs)
    x = arr(xs)
    others = [v for i, v in enumerate(x) if i != index]
    close(got[0], sum(x[index][:, j:j + 1] * v for j, v in enumerate(others)))
    assert built.spec == tensor(others[0].shape[1])
    assert xs[index].grad.abs().sum() > 0  # the weights learn


refusals("Gate", [
    ([tensor(2), tensor(4), tensor(4)], None, {"mlp": {"hidden_units": [4]}}, "mlp"),
    ([tensor(2), tensor(4), tensor(4)], None, {"weight_index": 3}, "outside"),
    ([tensor(1), tensor(4), tensor(4)], None, {}, "1 columns for 2"),
    ([tensor(2), tensor(4), tensor(5)], None, {}, "one width"),
    ([tensor(2), tensor(3, 4), tensor(3, 4)], None, {}, "one width"),
    ([tensor(2, 2), tensor(4), tensor(4)], None, {}, r"\[B, k\]"),
    ([tensor(2)], None, {}, "at least two"),
    (tensor(4), None, {}, "at least two"),
    ([tensor(2), tensor(4), tensor(4)], pb.MLP(), {}, "st_params"),
])


# ---- PeriodicEmbedding ------------------------------------------------------------------


def periodic_reference(module: torch.nn.Module, x: np.ndarray, act) -> np.ndarray:
    v = 2 * math.pi * npy(module.coef)[None] * x[:, :, None]
    emb = np.concatenate([np.sin(v), np.cos(v)], -1)  # [B, N, E]
    if isinstance(module.linear, torch.nn.Sequential):
        nl = module.linear[0]
        kernel, bias = npy(nl.weight), npy(nl.bias)
        emb = act(np.stack([emb[:, n] @ kernel[n] + bias[n] for n in range(x.shape[1])], 1))
    return emb


def check_outputs(built: BuiltLayer, got: list[np.ndarray], embs: list[np.ndarray],
                  mode: str) -> None:
    """EasyRec's return: each replica's ``[B, N*E]``, then the vectors of each as a list
    or a 3-d tensor; and its spec."""
    n, width = embs[0].shape[1:]
    flat = tensor(n * width)
    extra = {"list": [[tensor(width)] * n], "3d": [tensor(n, width)], "": []}[mode]
    want = [flat] * len(embs) + extra * len(embs)
    assert built.spec == (want if len(want) > 1 else flat)
    vectors = [v for e in embs for v in {"list": list(e.transpose(1, 0, 2)), "3d": [e],
                                         "": []}[mode]]
    assert len(got) == len(embs) + len(vectors)
    for g, want_out in zip(got, [e.reshape(B, -1) for e in embs] + vectors, strict=True):
        close(g, want_out)


@pytest.mark.parametrize("params,st,act,mode", [
    (None, {"embedding_dim": 4, "sigma": 0.5, "output_tensor_list": True}, relu, "list"),
    (pb.PeriodicEmbedding(embedding_dim=6, sigma=0.2, output_3d_tensor=True,
                          linear_activation="tanh"), {}, np.tanh, "3d"),
    (pb.PeriodicEmbedding(embedding_dim=2, sigma=1.0, add_linear_layer=False), {}, None, ""),
    (None, {"embedding_dim": 4, "sigma": 0.3, "linear_activation": "", "output_3d_tensor": 1,
            "output_tensor_list": True}, lambda v: v, "list"),
])
def test_periodic_embedding(params, st, act, mode) -> None:
    built = perturb(build("PeriodicEmbedding", tensor(3), params, st), seed=7)
    xs = inputs_for(tensor(3), seed=8)
    got = run(built, xs)
    check_outputs(built, got, [periodic_reference(built.module, arr(xs)[0], act)], mode)


def test_periodic_embedding_initializes_as_easyrec() -> None:
    torch.manual_seed(0)
    module = build("PeriodicEmbedding", tensor(20),
                   pb.PeriodicEmbedding(embedding_dim=16, sigma=0.05)).module
    assert 0.04 < module.coef.std() < 0.06 and module.coef.shape == (20, 8)
    kernel = module.linear[0].weight
    bound = math.sqrt(6 / (2 * 20 * 16))  # glorot of [1, N, E, E]: fans N*E
    assert kernel.abs().max() <= bound and kernel.abs().max() > 0.9 * bound
    assert not any(isinstance(m, torch.nn.Linear) for m in module.modules())


refusals("PeriodicEmbedding", [
    ([tensor(3)], None, {"embedding_dim": 4, "sigma": 1}, r"\[B, N\]"),
    (tensor(3, 2), None, {"embedding_dim": 4, "sigma": 1}, r"\[B, N\]"),
    (tensor(3), None, {"embedding_dim": 3, "sigma": 1}, "even"),
    (tensor(3), None, {"sigma": 1}, "needs embedding_dim"),
    (tensor(3), pb.PeriodicEmbedding(embedding_dim=4), {}, "needs sigma"),
    (tensor(3), pb.PeriodicEmbedding(sigma=1), {}, "needs embedding_dim"),
    (tensor(3), None, {"embedding_dim": 4, "sigma": "big"}, "sigma"),
    (tensor(3), pb.PeriodicEmbedding(embedding_dim=4, sigma=1, linear_activation="x"), {},
     "'x'"),
    (tensor(3), pb.AutoDisEmbedding(), {}, "takes periodic_embedding"),
])


# ---- AutoDisEmbedding -------------------------------------------------------------------


def auto_dis_reference(module: torch.nn.Module, x: np.ndarray, keep_prob: float,
                       temperature: float) -> np.ndarray:
    proj_w, proj_mat, meta = npy(module.proj_w), npy(module.proj_mat), npy(module.meta_emb)
    out = np.zeros((x.shape[0], x.shape[1], meta.shape[-1]))
    for b in range(x.shape[0]):
        for n in range(x.shape[1]):
            h = proj_w[n] * x[b, n]
            h = np.where(h > 0, h, 0.2 * h)
            s = (proj_mat[n] @ h + keep_prob * h) / temperature
            p = np.exp(s - s.max())
            out[b, n] = (p / p.sum()) @ meta[n]
    return out


@pytest.mark.parametrize("params,st,keep_prob,temperature,mode", [
    (pb.AutoDisEmbedding(embedding_dim=3, num_bins=5, temperature=0.8), {}, 0.8, 0.8, ""),
    (None, {"embedding_dim": 4, "num_bins": 6, "temperature": 0.5, "keep_prob": 0.3,
            "output_3d_tensor": True}, 0.3, 0.5, "3d"),
    (pb.AutoDisEmbedding(embedding_dim=2, num_bins=3, temperature=0.815, keep_prob=1.0,
                         output_tensor_list=True), {}, 1.0, 0.815, "list"),
])
def test_auto_dis_embedding(params, st, keep_prob, temperature, mode) -> None:
    built = perturb(build("AutoDisEmbedding", tensor(4), params, st), seed=9)
    xs = inputs_for(tensor(4), seed=10)
    got = run(built, xs)
    want = auto_dis_reference(built.module, arr(xs)[0], keep_prob, temperature)
    check_outputs(built, got, [want], mode)


def test_auto_dis_embedding_initializes_as_easyrec() -> None:
    torch.manual_seed(0)
    module = build("AutoDisEmbedding", tensor(10),
                   pb.AutoDisEmbedding(embedding_dim=16, num_bins=40, temperature=1)).module
    for param, bound in ((module.meta_emb, math.sqrt(6 / (10 * 40 + 10 * 16))),
                         (module.proj_w, math.sqrt(6 / (10 + 40))),
                         (module.proj_mat, math.sqrt(6 / (2 * 10 * 40)))):
        assert param.abs().max() <= bound and param.abs().max() > 0.9 * bound


refusals("AutoDisEmbedding", [
    (tensor(4), pb.AutoDisEmbedding(embedding_dim=3, num_bins=5), {}, "needs temperature"),
    (tensor(4), pb.AutoDisEmbedding(embedding_dim=3, num_bins=5, temperature=0), {}, "not be 0"),
    (tensor(4), pb.AutoDisEmbedding(embedding_dim=3, temperature=1), {}, "needs num_bins"),
    (tensor(4), None, {"num_bins": 3, "temperature": 1}, "needs embedding_dim"),
    (tensor(4), None, {"embedding_dim": 3, "num_bins": 0, "temperature": 1}, "num_bins"),
])


# ---- NaryDisEmbedding -------------------------------------------------------------------


def nary_rows(value: int, carries: list[int]) -> list[list[int]]:
    """The rows of EasyRec's nary_carry op per carry: the sign row, then a row per digit."""
    out, offset = [], 0
    for c in carries:
        rows = [offset + (1 if value < 0 else 0)]
        rest, position = abs(value), 0
        while True:
            rows.append(offset + 2 + position * c + rest % c)
            rest, position = rest // c, position + 1
            if rest == 0:
                break
        out.append(rows)
        offset += (math.floor(math.log(4294967295, c)) + 1) * c
    return out


def nary_reference(table: np.ndarray, x: np.ndarray, carries: list[int], dim: int,
                   multiplier: float, mean: bool, replica: int) -> np.ndarray:
    out = np.zeros((x.shape[0], x.shape[1], len(carries) * dim))
    for b in range(x.shape[0]):
        for n in range(x.shape[1]):
            v = 0.0 if np.isnan(x[b, n]) else float(np.float32(x[b, n]) * np.float32(multiplier))
            v = int(max(-(2**31 - 1), min(2**31 - 1, math.trunc(v))))
            for k, rows in enumerate(nary_rows(v, carries)):
                vec = table[rows, replica * dim:(replica + 1) * dim].sum(0)
                out[b, n, k * dim:(k + 1) * dim] = vec / len(rows) if mean else vec
    return out


NUMBERS = torch.tensor([[0.0, 2.7, -2.7], [1.0, 511.9, -1.0], [123456.0, -98765.4, 8.0],
                        [3e9, -3e9, float("nan")], [2.7, 2.7, 0.004]])


@pytest.mark.parametrize("params,st,carries,dim,multiplier,mean,replicas,mode", [
    (pb.NaryDisEmbedding(embedding_dim=3), {}, [2, 9], 3, 1.0, False, 1, ""),
    (pb.NaryDisEmbedding(embedding_dim=2, carries=[10, 3], multiplier=1000,
                         intra_ary_pooling="mean", num_replicas=2, output_tensor_list=True),
     {}, [10, 3], 2, 1000.0, True, 2, "list"),
    (None, {"embedding_dim": 2, "carries": [5], "output_3d_tensor": True, "num_replicas": 3},
     [5], 2, 1.0, False, 3, "3d"),
    (None, {"embedding_dim": 4, "carries": [2, 7, 16], "multiplier": 0.5}, [2, 7, 16], 4, 0.5,
     False, 1, ""),
])
def test_nary_dis_embedding(params, st, carries, dim, multiplier, mean, replicas,
                            mode) -> None:
    built = build("NaryDisEmbedding", tensor(3), params, st)
    xs = [NUMBERS.clone()]
    got = run(built, xs)
    table = npy(built.module.table)
    assert table.shape == (sum((math.floor(math.log(4294967295, c)) + 1) * c
                               for c in carries), dim * replicas)
    embs = [nary_reference(table, NUMBERS.numpy(), carries, dim, multiplier, mean, r)
            for r in range(replicas)]
    check_outputs(built, got, embs, mode)


def test_nary_dis_rows_follow_the_op() -> None:
    # 5 = 101b; base 9: 5. Offsets: base 2 has 32 positions * 2 = 64 rows.
    assert nary_rows(5, [2, 9]) == [[0, 3, 4, 7], [64, 66 + 5]]
    assert nary_rows(-9, [9]) == [[1, 2 + 0, 2 + 9 + 1]]
    assert nary_rows(0, [2]) == [[0, 2]]
    built = build("NaryDisEmbedding", tensor(2), pb.NaryDisEmbedding(embedding_dim=2))
    out = built.module([torch.tensor([[5.0, 5.0], [5.9, -5.0]])])[0].detach()
    table = built.module.table.detach()
    want = torch.cat([table[[0, 3, 4, 7]].sum(0), table[[64, 71]].sum(0)])
    torch.testing.assert_close(out[0, :4], want)
    torch.testing.assert_close(out[0, 4:], want)  # rows shared by the features (EasyRec)
    torch.testing.assert_close(out[1, :4], want)  # truncated, not rounded
    assert not torch.allclose(out[1, 4:], want)  # the sign row differs


refusals("NaryDisEmbedding", [
    (tensor(4), pb.NaryDisEmbedding(), {}, "needs embedding_dim"),
    (tensor(4), pb.NaryDisEmbedding(embedding_dim=2, carries=[2, 1]), {}, "carries"),
    (tensor(4), pb.NaryDisEmbedding(embedding_dim=2, intra_ary_pooling="max"), {}, "intra_ary"),
    (tensor(4), pb.NaryDisEmbedding(embedding_dim=2, inter_ary_pooling="sum"), {}, "inter_ary"),
    (tensor(4), pb.NaryDisEmbedding(embedding_dim=2, num_replicas=0), {}, "num_replicas"),
    (tensor(4), None, {"embedding_dim": 2, "carries": 9}, "carries"),
    (tensor(4), None, {"embedding_dim": 2, "multiplier": "x"}, "multiplier"),
    (tensor(4), pb.PeriodicEmbedding(), {}, "takes nary_dis_embedding"),
    ([tensor(4)], pb.NaryDisEmbedding(embedding_dim=2), None, r"\[B, N\]"),
])


@pytest.mark.parametrize("name,spec,params,st,match", REFUSALS)
def test_refusals(name, spec, params, st, match) -> None:
    with pytest.raises(ConfigError, match=match):
        build(name, spec, params, st)
