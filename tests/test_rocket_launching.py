"""EasyRec's and TorchEasyRec's RocketLaunching (``odl.models.rocket_launching``) on their
samples: the light network is the served output and learns from the input without moving
it; the loss is both networks' prediction losses, the hint loss and the feature-based
terms; what it cannot do is refused by field. Its six samples train, export and serve (the
light network) to parity in ``tests/test_config_compat.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.models.rocket_launching import RocketDense, layer_pairs
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule
from tests.harness import rank_dense_parameters
from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

_SAMPLE = os.path.join(_HERE, "easyrec", "rocket_launching.config")
_FEATURE_BASED = os.path.join(_HERE, "easyrec", "rocket_launching_feature_based.config")
_TZ = os.path.join(_HERE, "torcheasyrec", "rocket_launching_criteo.config")


def _model(path: str, flavor: str = "easyrec"):
    config = _small_cpu_config(try_load.load_one(path, flavor))
    config.model_dir = "unused"
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    return config, fb, tm.model


def test_the_light_network_is_served_and_reads_the_input_without_moving_it() -> None:
    config, fb, model = _model(_SAMPLE)
    dense = model.dense
    assert isinstance(dense, RocketDense) and dense.num_class == 2
    batch = fb.build(_records(config, 32, seed=1)).batch
    model.train()
    out = model(batch)
    light, booster, _ = dense.both(*model.lookup(batch), batch.dense)
    torch.testing.assert_close(out.logits, light)
    torch.testing.assert_close(out.booster, booster)
    model.eval()
    with torch.no_grad():  # predictions and serving: the light network alone
        torch.testing.assert_close(model(batch).logits, dense(*model.lookup(batch),
                                                              batch.dense))
    model.train()
    model.zero_grad()
    model.prediction_loss(model(batch).logits, batch).backward()
    assert all(p.grad is None or not p.grad.any() for p in dense.share.parameters())
    assert any(p.grad is not None and p.grad.any() for p in dense.light.parameters())
    assert all(p.grad is None or not p.grad.any() for p in dense.booster.parameters())


def test_the_loss_is_both_predictions_the_hint_and_regularization() -> None:
    config, fb, model = _model(_SAMPLE)
    batch = fb.build(_records(config, 32, seed=2)).batch
    model.kernel_l2 = model.embedding_regularization = 0.0
    model.train()
    torch.manual_seed(0)
    out = model(batch)
    ce = torch.nn.functional.cross_entropy
    labels = batch.labels  # one-hot over the 2 classes
    want = (ce(out.logits, labels) + ce(out.booster, labels)
            + torch.mean(torch.square(out.logits - out.booster.detach())))
    torch.testing.assert_close(model.loss(out, batch), want)
    # a padded batch's own rows (several ranks): the booster's logits are cut with the rest
    rows = out.rows(20)
    assert rows.logits.shape[0] == rows.booster.shape[0] == 20
    part = batch.select(torch.arange(32) < 20)
    torch.testing.assert_close(model.loss(rows, part),
                               ce(out.logits[:20], labels[:20]) + ce(out.booster[:20], labels[:20])
                               + torch.mean(torch.square(out.logits[:20]
                                                         - out.booster[:20].detach())))


def test_feature_based_distillation_pulls_light_layers_toward_the_boosters() -> None:
    """light [128, 64] against booster [256, 128, 96, 64]: layers (0, 1) and (1, 3); each
    adds -0.1 times the batch's mean cosine of the pair (the booster's side held)."""
    assert layer_pairs([128, 64], [256, 128, 96, 64]) == [(0, 1), (1, 3)]
    config, fb, model = _model(_FEATURE_BASED)
    dense = model.dense
    assert dense.pairs == [(0, 1), (1, 3)] and not dense.euclid
    seen: dict[str, torch.Tensor] = {}
    for name, layers in (("light", dense.light), ("booster", dense.booster)):
        for k, layer in enumerate(layers):
            layer.register_forward_hook(
                lambda _m, _a, o, key=f"{name}{k}": seen.__setitem__(key, o))
    batch = fb.build(_records(config, 32, seed=3)).batch
    model.train()
    _light, _booster, distillation = dense.both(*model.lookup(batch), batch.dense)
    cos = torch.nn.functional.cosine_similarity
    want = sum(-0.1 * cos(seen[f"light{i}"], seen[f"booster{j}"], dim=1).mean()
               for i, j in [(0, 1), (1, 3)])
    torch.testing.assert_close(distillation, want)


def test_torcheasyrecs_form_is_the_same_model() -> None:
    """``booster_mlp`` / ``light_mlp`` and ``losses { softmax_cross_entropy {} }``."""
    config, _fb, model = _model(_TZ, "torcheasyrec")
    rl = config.model_config.rocket_launching
    assert list(rl.booster_dnn.hidden_units) == [256, 128, 64, 32]
    assert list(rl.light_dnn.hidden_units) == [96, 64, 32]
    assert config.model_config.losses[0].loss_type == pipeline_pb2.CLASSIFICATION
    assert model.dense.pairs == [(1, 2), (2, 3)]


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda c: c.model_config.rocket_launching.ClearField("booster_dnn"),
     "model_config.rocket_launching.booster_dnn.hidden_units", ""),
    (lambda c: c.model_config.rocket_launching.__setattr__(
        "feature_distillation_function", pipeline_pb2.INNER_PRODUCT),
     "model_config.rocket_launching.feature_distillation_function", "COSINE or EUCLID"),
    (lambda c: c.model_config.variational_dropout.SetInParent(),
     "model_config.variational_dropout", "not implemented for RocketLaunching"),
    (lambda c: (c.model_config.__setattr__("num_class", 1),
                c.train_config.__setattr__("in_batch_learning", True),
                c.train_config.optimizer_config[0].adagrad_optimizer.learning_rate
                .constant_learning_rate.__setattr__("learning_rate", 0.01)),
     "model_config.rocket_launching", "does not take a booster"),
])
def test_what_rocket_launching_cannot_do_is_refused_by_field(edit, field, message) -> None:
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == field


def _rocket_rank(rank: int, world: int, steps: list) -> dict:
    """One rank training its share of ``steps``; its dense parameters after them."""
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    config.model_dir = "unused"
    return rank_dense_parameters(config, rank, steps)


def test_two_ranks_train_both_networks_as_one_model(ranks) -> None:
    """The last step's batches differ in size (a padded batch): both networks stay one set
    across the ranks, and both move."""
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    steps = [[_records(config, 32, seed=10 * k),
              _records(config, 32 if k < 2 else 20, seed=10 * k + 1)] for k in range(3)]
    got = ranks.run(_rocket_rank, 2, steps)
    for name, (value, _moved) in got[0].items():
        np.testing.assert_array_equal(value, got[1][name][0], err_msg=name)
    for net in ("dense.booster_out.weight", "dense.light_out.weight", "dense.share.0.weight"):
        assert got[0][net][1], net


@pytest.mark.parametrize(("old", "new", "field"), [
    ("num_class: 2", "num_class: 1", "model_config.losses.softmax_cross_entropy"),
    ("softmax_cross_entropy {}", "softmax_cross_entropy { label_smoothing: 0.1 }",
     "model_config.losses.softmax_cross_entropy.label_smoothing"),
])
def test_a_softmax_cross_entropy_odl_cannot_compute_is_refused_by_field(tmp_path, old, new,
                                                                          field) -> None:
    """TorchEasyRec's ``softmax_cross_entropy {}`` needs classes, and label smoothing is not
    implemented."""
    with open(_TZ, encoding="utf-8") as fh:
        text = fh.read()
    assert old in text
    path = tmp_path / "rocket_launching_criteo.config"
    path.write_text(text.replace(old, new))
    with pytest.raises(ConfigError) as err:
        try_load.load_one(str(path), "torcheasyrec")
    assert err.value.field == field
