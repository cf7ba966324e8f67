"""EasyRec's CMBF and UNITER models (``model_class: "CMBF"`` / ``"Uniter"``,
``odl.models.multimodal_models``) on EasyRec's own samples: the layer DBMTL's bottoms use,
then ``final_dnn`` and the logits; what they learn; what they cannot read refused by field.
Every sample of theirs trains, exports and serves to parity in
``tests/test_config_compat.py``; the layers' tokens and masking are
``tests/test_multimodal_bottoms.py``'s."""

from __future__ import annotations

import os

import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.cmbf import CMBFBottom
from odl.models.model_registry import check_pipeline_config
from odl.models.multimodal_models import MultimodalDense
from odl.models.uniter import UniterBottom
from odl.train.train_module import TrainModule
from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

_CMBF = os.path.join(_HERE, "easyrec", "cmbf_on_movielens.config")
_UNITER = os.path.join(_HERE, "easyrec", "uniter_on_movielens.config")
_IMAGE_ONLY = os.path.join(_HERE, "easyrec", "uniter_on_movielens_only_image_feature.config")


def _sample(path: str):
    config = _small_cpu_config(try_load.load_one(path, "easyrec"))
    config.model_dir = "unused"
    return config


@pytest.mark.parametrize("path, layer", [(_CMBF, CMBFBottom), (_UNITER, UniterBottom)],
                         ids=["cmbf", "uniter"])
def test_the_layer_then_final_dnn_then_the_logit(path, layer) -> None:
    """The dense part is the layer (as DBMTL's bottom), ``final_dnn`` [256, 64] and one
    logit; a record's logit is that chain over its own inputs."""
    config = _sample(path)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    assert isinstance(dense, MultimodalDense) and isinstance(dense.layer, layer)
    linears = [m for m in dense.final_dnn.modules() if isinstance(m, torch.nn.Linear)]
    assert [m.out_features for m in linears] == [256, 64] and dense.out.out_features == 1
    assert linears[0].in_features == dense.layer.out_width
    batch = fb.build(_records(config, 16, seed=3)).batch
    tm.model.eval()
    with torch.no_grad():
        (group,) = tm.model.lookup(batch)
        x = torch.cat([group, batch.dense[:, dense.dense_idx]], dim=1)
        want = dense.out(dense.final_dnn(dense.layer(x))).squeeze(1)
        torch.testing.assert_close(tm.model(batch).logits, want)


def test_cmbf_learns_a_labels_dependence_on_its_inputs() -> None:
    """Trained on a batch whose labels follow its records, the loss on that batch falls, and
    the tables and the layer both move."""
    config = _sample(_CMBF)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(_records(config, 32, seed=5)).batch
    torch.manual_seed(0)
    batch.labels = (torch.rand(batch.labels.shape) < 0.5).to(batch.labels.dtype)
    layer = [p.detach().clone() for p in tm.model.dense.layer.parameters()]
    tables = [t.detach().clone() for t in tm.model.ebc.parameters()]
    losses = [float(tm.train_step(batch).loss) for _ in range(25)]
    assert min(losses[-5:]) < 0.8 * losses[0], losses
    assert any(not torch.equal(a, b) for a, b in
               zip(layer, tm.model.dense.layer.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in
               zip(tables, tm.model.ebc.parameters(), strict=True))


def test_a_uniter_step_moves_the_layer_and_the_tables() -> None:
    """A step moves the layer and the tables (the sample's 512-wide transformer takes too
    many CPU steps here for a short test to show its loss falling, as CMBF's does)."""
    config = _sample(_UNITER)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(_records(config, 32, seed=5)).batch
    layer = [p.detach().clone() for p in tm.model.dense.layer.parameters()]
    tables = [t.detach().clone() for t in tm.model.ebc.parameters()]
    tm.train_step(batch)
    assert any(not torch.equal(a, b) for a, b in
               zip(layer, tm.model.dense.layer.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in
               zip(tables, tm.model.ebc.parameters(), strict=True))


@pytest.mark.parametrize(("path", "edit", "field", "message"), [
    (_UNITER, lambda c: c.model_config.uniter.config.__setattr__("num_attention_heads", 3),
     "model_config.uniter.config.num_attention_heads", "must divide hidden_size"),
    (_UNITER, lambda c: c.model_config.uniter.ClearField("config"),
     "model_config.uniter.config", "needs uniter"),
    (_CMBF, lambda c: c.model_config.cmbf.config.__setattr__("text_head_size", 0),
     "model_config.cmbf.config.text_head_size", "must be set"),
    (_CMBF, lambda c: (c.model_config.feature_groups.pop(2),  # the text group
                       [g.__setattr__("group_name", g.group_name + "_x")
                        for g in c.model_config.feature_groups]),
     "model_config.feature_groups", "cmbf reads the groups"),
    (_CMBF, lambda c: c.model_config.variational_dropout.SetInParent(),
     "model_config.variational_dropout", "not implemented for CMBF"),
])
def test_what_they_cannot_read_is_refused_by_field(path, edit, field, message) -> None:
    config = _sample(path)
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == field


def test_a_model_of_raw_values_alone_is_refused_by_field() -> None:
    """EasyRec's image-only samples: no feature with a table, nothing odl's models train."""
    with pytest.raises(ConfigError, match="at least one table") as err:
        _sample(_IMAGE_ONLY)
    assert err.value.field == "model_config.feature_groups"
