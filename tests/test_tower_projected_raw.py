"""EasyRec's projected raw features (a RawFeature with ``embedding_dim`` and no
``boundaries``: ``value * p``, ``p`` learned) in the tower models' groups: MultiTower, DCN,
DCNV2. EasyRec's own sample (``taobao_multi_tower_boundary_test``) trains, exports and serves
to parity in ``tests/test_config_compat.py``."""

from __future__ import annotations

import re

import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.models.building_blocks import ProjectedTail
from odl.models.model_registry import build_model
from tests.harness import load_config_text

DIM = 8


def _text(model: str, projected: int = 2, dims: tuple[int, ...] = (DIM,)) -> str:
    """The model over the test features, its first ``projected`` dense features projected
    (feature k with ``dims[k % len(dims)]``)."""
    text = as_model_config_text(deepfm_config_text("/tmp/odl-tower-proj-unused", dim=DIM,
                                                   buckets=50, hidden_units=(16,)), model)
    raw = re.findall(r'feature_configs \{ input_names: "(\w+)" feature_type: RawFeature \}',
                     text)
    for k, name in enumerate(raw[:projected]):
        text = text.replace(f'input_names: "{name}" feature_type: RawFeature }}',
                            f'input_names: "{name}" feature_type: RawFeature '
                            f"embedding_dim: {dims[k % len(dims)]} }}")
    return text


def _model_and_batch(text: str, n: int = 32):
    config = load_config_text(text)
    fb = FeatureBuilder(config)
    m = build_model(config, fb)
    m.ebc = m.ebc.__class__(tables=m.layout.configs, device=torch.device("cpu"))
    batch = fb.build(SyntheticCtrStream(seed=7).next_batch(n).encode("csv")).batch
    return m, fb, batch


@pytest.mark.parametrize("model", ["MultiTower", "DCN", "DCNV2"])
def test_a_towers_projected_values_become_their_learned_vectors(model):
    """The tower network reads its lookups, its other dense values, then ``value * p`` per
    projected feature; ``p`` learns."""
    text = _text(model)
    m, fb, batch = _model_and_batch(text)
    tails = [(i, t[0]) for i, t in enumerate(m.dense.towers)
             if isinstance(t, torch.nn.Sequential) and isinstance(t[0], ProjectedTail)]
    assert tails, "no tower projects"
    i, tail = tails[0]
    weight = tail.projection.weight
    assert tuple(weight.shape) == (2, DIM)
    seen = []
    hook = m.dense.towers[i][1].register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight))
        m(batch)
    hook.remove()
    projected_names = [fc.feature_name for fc in feature_configs(load_config_text(text))
                       if fc.feature_type == fc.RawFeature and fc.embedding_dim > 0]
    cols = [fb.dense_feature_columns[n][0] for n in projected_names]
    idx = [fb.dense_feature_names.index(c) for c in cols]
    values = batch.dense[:, idx]  # [B, 2]
    want = (values.unsqueeze(2) * weight.detach().unsqueeze(0)).reshape(len(values), -1)
    got = seen[0][:, -2 * DIM:]
    assert torch.allclose(got, want, atol=1e-6)
    # the columns before: everything the tower reads but the projected values
    assert seen[0].shape[1] == m.dense.tower_cols[i + 1] - m.dense.tower_cols[i] + len(
        m.dense.tower_dense[i]) - 2 + 2 * DIM
    loss = m.loss(m(batch), batch)
    loss.backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_variational_dropout_masks_each_projected_vector_as_one_feature():
    text = _text("MultiTower").replace(
        "model_config {", "model_config {\n  variational_dropout { regularization_lambda: 0.01 }",
        1)
    m, _fb, batch = _model_and_batch(text)
    tower = m.dense.towers[0]
    tail, dropout = tower[0], tower[1][0]
    assert isinstance(tail, ProjectedTail)
    # one probability per feature: the deep group's lookups, its dense values, 2 vectors
    k = dropout.columns[-1]
    assert dropout.columns[-2 * DIM:] == [k - 1] * DIM + [k] * DIM
    assert m(batch).logits.shape == (32,)


@pytest.mark.parametrize("text, fragment", [
    (_text("MultiTower", dims=(DIM, 4)), "need one embedding_dim"),
    (_text("DCN", dims=(4, DIM)), "need one embedding_dim"),
])
def test_a_towers_projected_features_of_two_widths_are_refused_by_field(text, fragment):
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.field.endswith(".feature_names") and fragment in str(e.value)
