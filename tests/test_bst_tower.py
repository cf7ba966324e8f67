"""EasyRec's MultiTowerBST (``multi_tower.bst_towers``, ``odl.models.bst_tower``): the BST
tower equals a line-by-line numpy port of EasyRec's ``MultiTowerBST.bst`` on its weights;
hidden positions are hidden from the target's token; what it cannot read is refused by field.
EasyRec's two samples (``bst_on_taobao``, ``multi_tower_bst``) train, export and serve to
parity in ``tests/test_config_compat.py``."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.bst_tower import BSTTower
from odl.models.model_registry import check_pipeline_config
from odl.train.train_module import TrainModule
from tests.test_config_compat import _HERE, _small_cpu_config, try_load

_SAMPLE = os.path.join(_HERE, "easyrec", "bst_on_taobao.config")


def _easyrec_bst(tower: BSTTower, keys, hist, lengths, seq_size: int, head_count: int):
    """EasyRec's ``MultiTowerBST.bst`` in numpy (float64), on ``tower``'s weights."""
    w = {n: p.detach().double().numpy() for n, p in tower.named_parameters()}

    def dense(x, name):  # tf.layers.dense: x @ kernel + bias (torch keeps kernel.T)
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def layer_norm(x, name):
        mean = x.mean(-1, keepdims=True)
        var = np.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-6) * w[f"{name}.weight"] + w[f"{name}.bias"]

    batch, n_hist = hist.shape[0], hist.shape[1]
    if seq_size > n_hist:  # tf.pad to seq_size - 1 positions
        hist = np.concatenate([hist, np.zeros((batch, seq_size - n_hist - 1, hist.shape[2]))],
                              axis=1)
    else:
        hist = hist[:, :seq_size - 1]
    all_ids = np.concatenate([hist, keys[:, None, :]], axis=1)
    emb_dim = all_ids.shape[2]
    hist_mask = np.arange(seq_size - 1)[None, :] < lengths[:, None]
    mask = np.concatenate([hist_mask, np.ones((batch, 1), dtype=bool)], axis=1)
    masks = np.tile(mask, [1, seq_size]).reshape(-1, seq_size, seq_size)
    outs = []
    part = int(math.ceil(emb_dim / head_count))
    for head, start in enumerate(range(0, emb_dim, part)):
        width = min(part, emb_dim - start)
        cols = all_ids[:, :, start:start + width]
        q = dense(cols, f"heads.{head}.query")
        k = dense(cols, f"heads.{head}.key")
        v = dense(cols, f"heads.{head}.value")
        scores = q @ k.transpose(0, 2, 1)
        scores = np.where(masks, scores, -2.0**32 + 1)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores = scores / scores.sum(-1, keepdims=True)
        outs.append(scores @ v)
    att = dense(np.concatenate(outs, axis=2), "merge")
    tmp = layer_norm(all_ids + att, "norm1")
    net = layer_norm(tmp + dense(tmp, "feed_forward"), "norm2")
    return net.reshape(batch, seq_size * emb_dim)


@pytest.mark.parametrize("width, positions, seq_len, heads", [
    (30, 8, 6, 4),   # uneven head slices (8, 8, 8, 6); the sequence cut to 5 positions
    (16, 3, 7, 2),   # the sequence padded to 6 positions
    (12, 4, 5, 3),   # exactly seq_len - 1 positions
])
def test_the_tower_is_easyrecs(width, positions, seq_len, heads) -> None:
    torch.manual_seed(0)
    tower = BSTTower(width, positions, seq_len, heads)
    rng = np.random.default_rng(1)
    batch = 7
    keys = rng.normal(size=(batch, width))
    hist = rng.normal(size=(batch, positions, width))
    lengths = np.array([0, 1, 2, positions, positions + 3, 1, 3], dtype=np.float64)
    x = np.concatenate([keys, hist.reshape(batch, -1), lengths[:, None]], axis=1)
    got = tower(torch.tensor(x, dtype=torch.float32)).detach().double().numpy()
    want = _easyrec_bst(tower, keys, hist, lengths, seq_len, heads)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_the_targets_token_does_not_see_positions_past_the_length() -> None:
    torch.manual_seed(0)
    width, positions, seq_len = 8, 6, 7
    tower = BSTTower(width, positions, seq_len, 2)
    x = torch.randn(4, width * (1 + positions) + 1)
    x[:, -1] = torch.tensor([0.0, 2.0, 3.0, 6.0])
    out = tower(x).reshape(4, seq_len, width)
    changed = x.clone()
    for row, length in enumerate([0, 2, 3, 6]):
        end = width * (1 + positions)
        changed[row, width * (1 + length):end] += torch.randn(end - width * (1 + length))
    again = tower(changed).reshape(4, seq_len, width)
    torch.testing.assert_close(again[:, -1], out[:, -1])  # the target's token
    assert not torch.allclose(again[0, 0], out[0, 0])  # a hidden position's own row moves
    torch.testing.assert_close(tower(x[:2]), tower(x)[:2])  # records do not mix


def _sample():
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    config.model_dir = "unused"
    return config


def test_easyrecs_sample_builds_a_bst_tower_beside_its_towers() -> None:
    """``bst_on_taobao``: towers over "user" and "item", a BST tower of seq_len 50 and 4
    heads over brand and category (16 + 16 wide) and their sequences."""
    config = _sample()
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    bst = [t for t in tm.model.dense.towers if isinstance(t, BSTTower)]
    assert len(bst) == 1 and len(tm.model.dense.towers) == 3
    assert (bst[0].width, bst[0].seq_len, len(bst[0].heads)) == (32, 50, 4)
    assert bst[0].out_width == 50 * 32


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda c: c.model_config.multi_tower.bst_towers[0].__setattr__("input", "nope"),
     "model_config.multi_tower.bst_towers[0].input", "no model_config.seq_att_groups"),
    (lambda c: c.model_config.multi_tower.bst_towers[0].__setattr__("seq_len", 1),
     "model_config.multi_tower.bst_towers[0].seq_len", "must be >= 2"),
    (lambda c: c.model_config.multi_tower.bst_towers[0].__setattr__("multi_head_size", 0),
     "model_config.multi_tower.bst_towers[0].multi_head_size", "must be >= 1"),
])
def test_what_a_bst_tower_cannot_read_is_refused_by_field(edit, field, message) -> None:
    config = _sample()
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == field


def test_bst_towers_of_another_class_are_ignored_with_a_warning(caplog) -> None:
    config = _sample()
    config.model_config.model_class = "MultiTower"
    with caplog.at_level(logging.WARNING):
        check_pipeline_config(config, online=True)
    assert "bst_towers has no effect with model_class 'MultiTower'" in caplog.text
