"""EasyRec's PPNet backbone layer (``odl/models/backbone/gated_layers.py``) against its
formula, written out here layer by layer."""

from __future__ import annotations

import pytest
import torch

from odl.config.config_error import ConfigError
from odl.models.backbone.block_registry import BlockArgs, block_builder
from odl.models.backbone.value_specs import tensor
from odl.protos import pipeline_pb2


def _ppnet(mode: str, full: bool = True, units=(6, 3), x_dim: int = 5, g_dim: int = 4,
           **gate):
    p = pipeline_pb2.PPNet(mode=mode, full_gate_input=full,
                           mlp=pipeline_pb2.MLP(hidden_units=list(units)),
                           gate_params=pipeline_pb2.GateNN(**gate))
    return block_builder("PPNet")(BlockArgs("PPNet", p, [tensor(x_dim), tensor(g_dim)], "w"))


def _gate(seq: torch.nn.Sequential, c: torch.Tensor) -> torch.Tensor:
    """GateNN by hand: Dense, ReLU, Dense, 2 * sigmoid."""
    h = torch.relu(c @ seq[0].weight.T + seq[0].bias)
    return 2 * torch.sigmoid(h @ seq[2].weight.T + seq[2].bias)


def _dense(layer: torch.nn.Sequential, x: torch.Tensor, relu: bool = True) -> torch.Tensor:
    y = x @ layer[0].weight.T  # EasyRec's MLP: no bias unless asked
    return torch.relu(y) if relu else y


@pytest.mark.parametrize("full", [True, False])
def test_lazy_ppnet_gates_every_layers_output(full: bool) -> None:
    built = _ppnet("lazy", full)
    m = built.module
    torch.manual_seed(0)
    x, g = torch.randn(7, 5), torch.randn(7, 4)
    c = torch.cat([x, g], dim=1) if full else g
    h = _dense(m.steps[0].layer, x) * _gate(m.steps[0].gate, c)
    want = _dense(m.steps[1].layer, h) * _gate(m.steps[1].gate, c)
    torch.testing.assert_close(m([x, g])[0], want)
    torch.testing.assert_close(torch.jit.script(m)([x, g])[0], want)
    assert built.spec == tensor(3) and m.first_gate is None


def test_eager_ppnet_gates_the_input_and_the_hidden_layers_not_the_last() -> None:
    built = _ppnet("eager", output_dim=5, hidden_dim=8)
    m = built.module
    x, g = torch.randn(7, 5), torch.randn(7, 4)
    c = torch.cat([x, g], dim=1)
    h = _dense(m.steps[0].layer, x * _gate(m.first_gate, c)) * _gate(m.steps[0].gate, c)
    want = _dense(m.steps[1].layer, h)
    assert m.steps[1].gate is None and m.first_gate[0].out_features == 8
    torch.testing.assert_close(m([x, g])[0], want)


def test_the_gates_do_not_send_gradient_into_x_through_the_gate_input() -> None:
    m = _ppnet("lazy").module
    x = torch.randn(4, 5, requires_grad=True)
    g = torch.randn(4, 4)
    for step in m.steps:  # the layers pass x on unchanged, only the gates read it
        torch.nn.init.zeros_(step.layer[0].weight)
    m([x, g])[0].sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) == 0.0
    assert all(p.grad is not None for p in m.steps[0].gate.parameters())


@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "lazy", "x_dim": 5, "g_dim": 4, "units": ()}, "hidden_units"),
    ({"mode": "sometimes"}, "mode"),
    ({"mode": "eager", "output_dim": 3}, "output_dim"),
])
def test_ppnet_settings_it_cannot_take_are_refused(kwargs, words) -> None:
    with pytest.raises(ConfigError, match=words):
        _ppnet(**kwargs)
    with pytest.raises(ConfigError, match="two"):
        block_builder("PPNet")(BlockArgs("PPNet", pipeline_pb2.PPNet(), tensor(5), "w"))
