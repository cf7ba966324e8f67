"""EasyRec's AutoInt (``model_class: "AutoInt"``, ``odl.models.autoint``): an interacting
layer equals a numpy port of EasyRec's ``MultiHeadAttention`` (``use_res``); EasyRec's
samples read as its tokens; what AutoInt cannot read is refused by field. Its three samples
train, export and serve to parity in ``tests/test_config_compat.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.autoint import AutoIntDense, InteractingLayer
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule
from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

_MOVIELENS = os.path.join(_HERE, "easyrec", "autoint_on_movielens.config")
_SEQUENCES = os.path.join(_HERE, "easyrec", "autoint_on_sequence_feature_taobao.config")


def _easyrec_interacting_layer(layer: InteractingLayer, x: np.ndarray) -> np.ndarray:
    """EasyRec's ``MultiHeadAttention(use_res=True)`` in numpy, on ``layer``'s weights."""
    w = {n: p.detach().double().numpy().T for n, p in layer.named_parameters()}  # kernels
    heads, size = layer.heads, layer.size

    def split(t):  # [bs, F, H * S] -> [bs, H, F, S]
        return t.reshape(t.shape[0], t.shape[1], heads, size).transpose(0, 2, 1, 3)

    q, k, v = split(x @ w["query.weight"]), split(x @ w["key.weight"]), split(x @ w["value.weight"])
    product = q @ k.transpose(0, 1, 3, 2) / (size ** -0.5)
    weights = np.exp(product - product.max(-1, keepdims=True))
    weights = weights / weights.sum(-1, keepdims=True)
    out = (weights @ v).transpose(0, 2, 1, 3)
    out = out.reshape(out.shape[0], out.shape[1], heads * size)
    return np.maximum(out + x @ w["res.weight"], 0.0)


@pytest.mark.parametrize("width, heads, size", [(16, 2, 32), (64, 2, 32), (8, 3, 5)])
def test_an_interacting_layer_is_easyrecs(width, heads, size) -> None:
    torch.manual_seed(0)
    layer = InteractingLayer(width, heads, size)
    x = np.random.default_rng(2).normal(size=(6, 9, width))
    got = layer(torch.tensor(x, dtype=torch.float32)).detach().double().numpy()
    np.testing.assert_allclose(got, _easyrec_interacting_layer(layer, x), atol=2e-5)


def _sample(path: str):
    config = _small_cpu_config(try_load.load_one(path, "easyrec"))
    config.model_dir = "unused"
    return config


@pytest.mark.parametrize("path, tokens", [(_MOVIELENS, 7), (_SEQUENCES, 16 + 2 + 2)],
                         ids=["movielens", "sequences"])
def test_easyrecs_samples_read_as_its_tokens(path, tokens) -> None:
    """``autoint_on_movielens``: 7 features of 16; ``autoint_on_sequence_feature_taobao``: 16
    features, then the target attention's two attended sequences and two keys (EasyRec's
    ``feature_num + seq_key_num``); three layers of 2 heads of 32; a logit over all of it."""
    config = _sample(path)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    assert isinstance(dense, AutoIntDense)
    assert (dense.tokens, dense.dim, len(dense.layers)) == (tokens, 16, 3)
    assert dense.out.in_features == tokens * 2 * 32
    batch = fb.build(_records(config, 16, seed=2)).batch
    assert tm.model(batch).logits.shape == (16,)


_FT = pipeline_pb2.FeatureConfig.FeatureType


def _edit_feature(config, name: str, **fields) -> None:
    (fc,) = [f for f in config.feature_config.features if f.input_names[0] == name]
    for key, value in fields.items():
        setattr(fc, key, value)


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda c: c.model_config.autoint.__setattr__("multi_head_size", 0),
     "model_config.autoint.multi_head_size", "must be 1 to"),
    (lambda c: c.model_config.autoint.__setattr__("l2_regularization", -1.0),
     "model_config.autoint.l2_regularization", "must be >= 0"),
    # a dense value: no embedding, no token
    (lambda c: _edit_feature(c, "gender", feature_type=_FT.RawFeature, embedding_dim=0,
                             num_buckets=0),
     "model_config.feature_groups[0].feature_names", "has no embedding_dim"),
    (lambda c: _edit_feature(c, "user_id", embedding_dim=8),
     "model_config.feature_groups[0].feature_names", "one embedding_dim"),
])
def test_what_autoint_cannot_read_is_refused_by_field(edit, field, message) -> None:
    config = _sample(_MOVIELENS)
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field.startswith(field), err.value.field
