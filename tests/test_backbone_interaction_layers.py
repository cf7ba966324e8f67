"""EasyRec's interaction backbone layers: FM, DotInteraction, Cross, CIN, SENet, BiLinear, FiBiNet.

Each layer is built through the block registry and checked against a reference written here
from EasyRec's formulas (numpy loops over the module's own weights), on each input form;
the scripted module gives the same output, the output spec matches the output, gradient
reaches the parameters, and bad inputs or settings raise ``ConfigError``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf.message import Message

from odl.config.config_error import ConfigError
from odl.models.backbone.block_registry import BuiltLayer, block_builder
from odl.models.backbone.value_specs import Spec, leaves, tensor
from odl.protos import pipeline_pb2 as pb
from tests.backbone_layer_checks import B, build, inputs_for


def run(built: BuiltLayer, xs: list[torch.Tensor]) -> np.ndarray:
    """The eager output; checks the spec, the scripted module and the gradient."""
    built.module.eval()
    out = built.module(xs)
    specs = leaves(built.spec)
    assert [tuple(o.shape) for o in out] == [(B, *s.shape) for s in specs]
    scripted = torch.jit.script(built.module)
    for a, b in zip(out, scripted(xs), strict=True):
        torch.testing.assert_close(a, b)
    sum(o.square().sum() for o in out).backward()
    params = list(built.module.parameters())
    grads = [p.grad for p in params] if params else [x.grad for x in xs]
    assert any(gr is not None and gr.abs().sum() > 0 for gr in grads)
    return out[0].detach().double().numpy()


def arr(xs: list[torch.Tensor]) -> list[np.ndarray]:
    return [x.detach().double().numpy() for x in xs]


def w(linear: torch.nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """A Linear's kernel as Keras's ``[in, out]`` and its bias (zeros when off)."""
    k = linear.weight.detach().double().numpy().T
    b = linear.bias.detach().double().numpy() if linear.bias is not None else 0.0
    return k, b


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def refused(name: str, spec: Spec, params: Message | None = None,
            st: dict[str, Any] | None = None, match: str = "") -> None:
    with pytest.raises(ConfigError, match=match):
        build(name, spec, params, st)


FEATURES = [tensor(6)] * 4  # a feature list: 4 vectors [B, 6]


# ---- FM ---------------------------------------------------------------------------------


def fm_reference(vs: list[np.ndarray], variant: bool) -> np.ndarray:
    cross = sum(vs[i] * vs[j] for i, j in itertools.combinations(range(len(vs)), 2))
    return cross if variant else cross.sum(-1, keepdims=True)


@pytest.mark.parametrize("params,st,variant", [
    (None, {}, False), (None, {"use_variant": True}, True),
    (pb.FM(use_variant=True), {}, True), (pb.FM(), {}, False)])
def test_fm_on_a_feature_list_and_a_stacked_tensor(params, st, variant) -> None:
    xs = inputs_for(FEATURES)
    got = run(build("FM", FEATURES, params, st), xs)
    close(got, fm_reference(arr(xs), variant))
    assert got.shape == ((B, 6) if variant else (B, 1))
    stacked = [torch.stack(xs, 1).detach().requires_grad_()]
    close(run(build("FM", tensor(4, 6), params, st), stacked), got)


def test_fm_refusals() -> None:
    refused("FM", [tensor(6), tensor(4)], match="one width")
    refused("FM", tensor(6), match=r"\[B, N, D\]")
    refused("FM", [tensor(2, 6)])
    refused("FM", FEATURES, pb.SENet(), match="takes fm")
    refused("FM", FEATURES, st={"use_variant": "yes"}, match="use_variant")


# ---- DotInteraction ---------------------------------------------------------------------


def dot_reference(vs: list[np.ndarray], self_interaction: bool,
                  skip_gather: bool) -> np.ndarray:
    n = len(vs)
    dots = [[(vs[i] * vs[j]).sum(-1) for j in range(n)] for i in range(n)]
    if skip_gather:
        keep = [[j < i or (self_interaction and j == i) for j in range(n)] for i in range(n)]
        return np.stack([dots[i][j] * keep[i][j] for i in range(n) for j in range(n)], 1)
    return np.stack([dots[i][j] for i in range(n)
                     for j in range(i + 1 if self_interaction else i)], 1)


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("skip_gather", [False, True])
def test_dot_interaction(self_interaction: bool, skip_gather: bool) -> None:
    st = {"self_interaction": self_interaction, "skip_gather": skip_gather}
    xs = inputs_for(FEATURES, seed=1)
    got = run(build("DotInteraction", FEATURES, st=st), xs)
    close(got, dot_reference(arr(xs), self_interaction, skip_gather))
    width = 16 if skip_gather else (10 if self_interaction else 6)
    assert got.shape == (B, width)
    stacked = [torch.stack(xs, 1).detach().requires_grad_()]
    close(run(build("DotInteraction", tensor(4, 6), st=st), stacked), got)


def test_dot_interaction_reads_numbers_as_truth_and_defaults_off() -> None:
    assert build("DotInteraction", FEATURES, st={"self_interaction": 1}).spec == tensor(10)
    assert build("DotInteraction", FEATURES).spec == tensor(6)


def test_dot_interaction_refusals() -> None:
    refused("DotInteraction", [tensor(6), tensor(5)], match="one width")
    refused("DotInteraction", [tensor(6), [tensor(6)]])
    refused("DotInteraction", FEATURES, pb.FM(), match="st_params")


# ---- Cross ------------------------------------------------------------------------------


def cross_reference(x0: np.ndarray, x: np.ndarray, module: torch.nn.Module,
                    diag_scale: float, relu: bool) -> np.ndarray:
    linears = [m for m in module.product if isinstance(m, torch.nn.Linear)]
    h = x
    for lin in linears:
        k, b = w(lin)
        h = h @ k + b
    if relu:
        h = np.maximum(h, 0.0)
    return x0 * (h + diag_scale * x) + x


@pytest.mark.parametrize("st,diag,relu", [
    ({}, 0.0, False),
    ({"projection_dim": 3, "diag_scale": 0.5, "preactivation": "relu"}, 0.5, True),
    ({"use_bias": False, "kernel_initializer": "glorot_uniform", "diag_scale": 2}, 2.0,
     False)])
def test_cross_on_x0_and_x(st, diag, relu) -> None:
    spec = [tensor(8), tensor(8)]
    built = build("Cross", spec, st=st)
    with torch.no_grad():  # a non-zero bias, so that the reference reads it
        for m in built.module.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.uniform_(-0.5, 0.5)
    xs = inputs_for(spec, seed=2)
    got = run(built, xs)
    x0, x = arr(xs)
    close(got, cross_reference(x0, x, built.module, diag, relu))
    assert built.spec == tensor(8)
    assert (st.get("use_bias", True)) == (built.module.product[-2].bias is not None)


def test_cross_on_one_tensor_crosses_it_with_itself() -> None:
    built = build("Cross", tensor(8))
    xs = inputs_for(tensor(8), seed=3)
    x = arr(xs)[0]
    close(run(built, xs), cross_reference(x, x, built.module, 0.0, False))


def test_cross_initializes_as_keras() -> None:
    torch.manual_seed(0)
    dense = build("Cross", tensor(64)).module.product[0]
    k = dense.weight.detach()
    assert k.abs().max() <= 0.1 and 0.035 < k.std() < 0.05  # TruncatedNormal(0.05)
    assert torch.count_nonzero(dense.bias) == 0
    glorot = build("Cross", tensor(64), st={"kernel_initializer": "glorot_uniform"})
    assert glorot.module.product[0].weight.abs().max() > 0.15


@pytest.mark.parametrize("spec,st,match", [
    ([tensor(8), tensor(8)], {"diag_scale": -1.0}, "diag_scale"),
    ([tensor(8), tensor(8), tensor(8)], {}, r"\[x0, x\]"),
    ([tensor(8), tensor(4)], {}, "one shape"),
    ([tensor(8), tensor(8)], {"projection_dim": 0}, "projection_dim"),
    ([tensor(8), tensor(8)], {"kernel_initializer": "orthogonal"}, "kernel_initializer"),
    ([tensor(8), tensor(8)], {"kernel_regularizer": "l2"}, "kernel_regularizer"),
    ([tensor(8), tensor(8)], {"preactivation": "softplus"}, "softplus"),
])
def test_cross_refusals(spec, st, match) -> None:
    refused("Cross", spec, st=st, match=match)


# ---- CIN --------------------------------------------------------------------------------


def cin_reference(v: np.ndarray, module: torch.nn.Module) -> np.ndarray:
    x, pooled = v, []
    for step in module.steps:
        kernel = step.weight.detach().double().numpy()
        bias = step.bias.detach().double().numpy()
        maps = np.zeros((B, kernel.shape[0], v.shape[2]))
        for h in range(kernel.shape[0]):
            for i in range(x.shape[1]):
                for j in range(v.shape[1]):
                    maps[:, h] += kernel[h, i, j] * x[:, i] * v[:, j]
            maps[:, h] += bias[h]
        x = np.maximum(maps, 0.0)
        pooled.append(x.sum(-1))
    return np.concatenate(pooled, -1)


@pytest.mark.parametrize("params,st", [
    (pb.CIN(hidden_feature_sizes=[5, 3]), {}), (None, {"hidden_feature_sizes": [5, 3]})])
def test_cin_on_a_stacked_tensor_and_a_list(params, st) -> None:
    built = build("CIN", tensor(4, 6), params, st)
    with torch.no_grad():
        for step in built.module.steps:
            step.bias.uniform_(-0.5, 0.5)
    xs = inputs_for(tensor(4, 6), seed=4)
    got = run(built, xs)
    close(got, cin_reference(arr(xs)[0], built.module))
    assert built.spec == tensor(8)
    as_list = build("CIN", FEATURES, params, st)
    as_list.module.load_state_dict(built.module.state_dict())
    close(run(as_list, [t.detach().requires_grad_() for t in xs[0].unbind(1)]), got)


def test_cin_kernels_are_he_normal_over_tensorflows_fans() -> None:
    torch.manual_seed(0)
    steps = build("CIN", tensor(20, 4), pb.CIN(hidden_feature_sizes=[30])).module.steps
    kernel = steps[0].weight.detach()
    assert kernel.shape == (30, 20, 20)
    std = (2.0 / (20 * 30)) ** 0.5  # fan-in: H_prev * H
    assert kernel.abs().max() <= 2 * std / 0.8796 + 1e-6
    assert 0.9 * std < kernel.std() < 1.1 * std
    assert torch.count_nonzero(steps[0].bias) == 0


def test_cin_refusals() -> None:
    refused("CIN", tensor(4, 6), match="hidden_feature_sizes")
    refused("CIN", tensor(4, 6), pb.CIN(hidden_feature_sizes=[4, 0]), match=">= 1")
    refused("CIN", tensor(6), pb.CIN(hidden_feature_sizes=[4]))
    refused("CIN", tensor(4, 6), st={"hidden_feature_sizes": [4], "bias_regularizer": "l2"},
            match="bias_regularizer")


# ---- SENet ------------------------------------------------------------------------------

MIXED = [tensor(4), tensor(8), tensor(6)]


def senet_reference(vs: list[np.ndarray], module: torch.nn.Module, groups: int,
                    skip: bool, norm: bool) -> np.ndarray:
    z = []
    for v in vs:
        cut = v.reshape(B, groups, -1)
        z += [cut.max(-1), cut.mean(-1)]
    k1, b1 = w(module.reduce)
    k2, b2 = w(module.excite)
    weights = np.maximum(np.concatenate(z, 1) @ k1 + b1, 0.0) @ k2 + b2
    feats = np.concatenate(vs, 1)
    out = feats * weights + (feats if skip else 0.0)
    if norm:
        ln = module.norm
        mean, var = out.mean(-1, keepdims=True), out.var(-1, keepdims=True)
        out = (out - mean) / np.sqrt(var + 1e-3)
        out = out * ln.weight.detach().double().numpy() + ln.bias.detach().double().numpy()
    return out


@pytest.mark.parametrize("config", [
    pb.SENet(reduction_ratio=4),
    pb.SENet(reduction_ratio=2, num_squeeze_group=1, use_skip_connection=False,
             use_output_layer_norm=False)])
def test_senet(config: pb.SENet) -> None:
    built = build("SENet", MIXED, config)
    with torch.no_grad():
        for p in built.module.parameters():
            p.add_(torch.rand_like(p) * 0.2)
    xs = inputs_for(MIXED, seed=5)
    got = run(built, xs)
    close(got, senet_reference(arr(xs), built.module, config.num_squeeze_group,
                               config.use_skip_connection, config.use_output_layer_norm))
    assert built.spec == tensor(18)
    squeezed = 2 * 3 * config.num_squeeze_group
    assert built.module.reduce.out_features == max(1, squeezed // config.reduction_ratio)


def test_senet_refusals() -> None:
    refused("SENet", MIXED, match="senet")
    refused("SENet", MIXED, st={"reduction_ratio": 4}, match="senet")
    refused("SENet", MIXED, pb.SENet(num_squeeze_group=4), match="multiple of")
    refused("SENet", MIXED, pb.SENet(reduction_ratio=0), match="reduction_ratio")
    refused("SENet", tensor(3, 4), pb.SENet(), match="list")


# ---- BiLinear ---------------------------------------------------------------------------


def bilinear_reference(vs: list[np.ndarray], module: torch.nn.Module, kind: str,
                       plus: bool) -> np.ndarray:
    parts = []
    for p, (i, j) in enumerate(itertools.combinations(range(len(vs)), 2)):
        lin = module.projections[{"all": 0, "each": i, "interaction": p}[kind]]
        k, b = w(lin)
        prod = (vs[i] @ k + b) * vs[j]
        parts.append(prod.sum(-1, keepdims=True) if plus else prod)
    k, b = w(module.output)
    return np.concatenate(parts, 1) @ k + b


@pytest.mark.parametrize("kind", ["all", "each", "interaction"])
@pytest.mark.parametrize("plus", [True, False])
def test_bilinear(kind: str, plus: bool) -> None:
    spec = MIXED if kind == "interaction" else FEATURES
    built = build("BiLinear", spec, pb.Bilinear(type=kind, use_plus=plus, num_output_units=7))
    with torch.no_grad():
        for m in built.module.modules():
            if isinstance(m, torch.nn.Linear):
                m.bias.uniform_(-0.5, 0.5)
    xs = inputs_for(spec, seed=6)
    close(run(built, xs), bilinear_reference(arr(xs), built.module, kind, plus))
    assert built.spec == tensor(7)
    count = {"all": 1, "each": len(spec) - 1, "interaction": 3}[kind]
    assert len(built.module.projections) == count


def test_bilinear_from_st_params_defaults_to_interaction_plus() -> None:
    built = build("BiLinear", MIXED, st={"num_output_units": 4})
    assert len(built.module.projections) == 3 and built.module.use_plus
    assert built.module.output.in_features == 3
    assert block_builder("Bilinear") is None  # EasyRec resolves only its class name


@pytest.mark.parametrize("spec,params,st,match", [
    (FEATURES, pb.Bilinear(), {}, "num_output_units"),
    (FEATURES, None, {"type": "all"}, "num_output_units"),
    (FEATURES, pb.Bilinear(type="pair", num_output_units=3), {}, "type"),
    (MIXED, pb.Bilinear(type="each", num_output_units=3), {}, "one width"),
    ([tensor(6)], pb.Bilinear(num_output_units=3), {}, "at least 2"),
    (tensor(4, 6), pb.Bilinear(num_output_units=3), {}, "list"),
    (FEATURES, pb.SENet(), {}, "takes bilinear"),
])
def test_bilinear_refusals(spec, params, st, match) -> None:
    refused("BiLinear", spec, params, st, match)


# ---- FiBiNet ----------------------------------------------------------------------------


def test_fibinet_is_senet_and_bilinear_then_the_mlp() -> None:
    config = pb.FiBiNet(senet=pb.SENet(reduction_ratio=4),
                        bilinear=pb.Bilinear(type="each", num_output_units=9),
                        mlp=pb.MLP(hidden_units=[6, 4]))
    built = build("FiBiNet", FEATURES, config)
    assert built.spec == tensor(4)
    xs = inputs_for(FEATURES, seed=7)
    got = run(built, xs)
    m = built.module
    parts = np.concatenate([senet_reference(arr(xs), m.senet, 2, True, True),
                            bilinear_reference(arr(xs), m.bilinear, "each", True)], 1)
    want = m.mlp(torch.tensor(parts, dtype=torch.float32)).detach().double().numpy()
    close(got, want)
    assert parts.shape == (B, 24 + 9)


def test_fibinet_without_bilinear_or_mlp_is_senet() -> None:
    built = build("FiBiNet", MIXED, pb.FiBiNet(senet=pb.SENet(num_squeeze_group=1)))
    assert built.spec == tensor(18)
    xs = inputs_for(MIXED, seed=8)
    close(run(built, xs), senet_reference(arr(xs), built.module.senet, 1, True, True))


def test_fibinet_refusals() -> None:
    refused("FiBiNet", FEATURES, match="fibinet")
    refused("FiBiNet", FEATURES, pb.FiBiNet(bilinear=pb.Bilinear()), match="num_output_units")
    refused("FiBiNet", [tensor(3), tensor(6)], pb.FiBiNet(), match="multiple of")
    refused("FiBiNet", FEATURES, pb.FiBiNet(mlp=pb.MLP()), match="hidden_units")
