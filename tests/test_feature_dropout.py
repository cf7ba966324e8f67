"""EasyRec's variational dropout of a feature group (``model_config.variational_dropout``):
its formulas against a numpy port of EasyRec's layer, the feature ranking it learns, ESMM,
MMoE and DBMTL with it (noise in training only, the penalty in the loss, the scripted dense
part equal to the trained one) and its refusals by field. Serving parity of EasyRec's own
samples with it is ``tests/test_config_compat.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.models.feature_dropout import FeatureDropout
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from tests.test_esmm_ple_models import _module_and_batch, _scripted_equal, _text

VARIATIONAL = ("  esmm {", "  variational_dropout { regularization_lambda: 0.5 }\n  esmm {")


def _assert_penalty_in_loss(tm, batch, layers: list[FeatureDropout], lam: float) -> None:  # noqa: ANN001
    """The model's loss holds ``lam / B * sum(1 - p)`` of every layer, and nothing else of
    theirs (the loss with their lambdas at 0 is that much less)."""
    with torch.no_grad():
        output = tm.model(batch)
        with_penalty = float(tm.model.loss(output, batch))
        for m in layers:
            assert m.regularization_lambda == lam
            m.regularization_lambda = 0.0
        without = float(tm.model.loss(output, batch))
        for m in layers:
            m.regularization_lambda = lam
    keep = sum(float((1.0 - torch.sigmoid(m.logit_p.detach())).sum()) for m in layers)
    assert with_penalty - without == pytest.approx(lam / batch.labels.shape[0] * keep, rel=1e-4)


def _numpy_layer(x: np.ndarray, logit_p: np.ndarray, columns: list[int], u: np.ndarray | None,
                 lam: float) -> tuple[np.ndarray, float]:
    """EasyRec's ``VariationalDropoutLayer`` in numpy: the output (``u`` None: evaluation)
    and the penalty."""
    eps = np.finfo(float).eps
    p = 1.0 / (1.0 + np.exp(-logit_p.astype(np.float64)))
    if u is None:
        out = x * (1.0 - p)[columns]
    else:
        approx = np.log(p + eps) - np.log(1 - p + eps) + np.log(u + eps) - np.log(1 - u + eps)
        keep = 1.0 - 1.0 / (1.0 + np.exp(-approx / 0.1))
        out = x * keep[:, columns]
    return out, lam / x.shape[0] * float((1.0 - p).sum())


@pytest.mark.parametrize("embedding_wise", [False, True])
def test_variational_dropout_follows_easyrecs_layer(embedding_wise: bool) -> None:
    settings = pipeline_pb2.VariationalDropoutLayer(
        regularization_lambda=0.03, embedding_wise_variational_dropout=embedding_wise)
    torch.manual_seed(3)
    layer = FeatureDropout([2, 3, 1], settings)
    n = 6 if embedding_wise else 3
    assert layer.logit_p.shape == (n,) and float(layer.logit_p.abs().max()) <= (3 / n) ** 0.5
    columns = list(range(6)) if embedding_wise else [0, 0, 1, 1, 1, 2]
    x = torch.randn(16, 6)
    logit_p = layer.logit_p.detach().numpy()
    layer.eval()
    want, penalty = _numpy_layer(x.numpy(), logit_p, columns, None, 0.03)
    np.testing.assert_allclose(layer(x).detach().numpy(), want, rtol=1e-6, atol=1e-7)
    assert float(layer.penalty(16)) == pytest.approx(penalty, rel=1e-6)
    layer.train()
    torch.manual_seed(11)
    got = layer(x).detach().numpy()
    torch.manual_seed(11)
    u = torch.rand(16, n).numpy()  # the layer's uniform noise, drawn again
    want, _ = _numpy_layer(x.numpy(), logit_p, columns, u.astype(np.float64), 0.03)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, layer.eval()(x).detach().numpy())  # noise in training only


def test_variational_dropout_ranks_a_noise_feature_below_the_informative_ones() -> None:
    """What the layer is for (Dropout Feature Ranking): trained with the loss and its penalty,
    the drop probability of a feature the labels do not depend on ends well above those of
    the features they do."""
    torch.manual_seed(0)
    drop = FeatureDropout([1, 1, 1], pipeline_pb2.VariationalDropoutLayer())
    linear = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam([*drop.parameters(), *linear.parameters()], lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(600):
        x = torch.randn(256, 3, generator=gen)
        y = (torch.rand(256, generator=gen) < torch.sigmoid(2 * x[:, 0] - 1.5 * x[:, 1])).float()
        logit = linear(drop(x)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        opt.zero_grad()
        (loss + drop.penalty(256)).backward()
        opt.step()
    p = torch.sigmoid(drop.logit_p).tolist()
    assert p[2] > 4 * max(p[0], p[1]), p


def test_esmm_with_variational_dropout_trains_with_noise_and_predicts_without() -> None:
    """Each input group's features pass the layer before its DNN (``groups.<g>.0.logit_p``);
    the loss holds the penalty; predictions are the evaluation form, repeatable and equal to
    the scripted dense part that odl-export writes and odl-serve runs."""
    tm, batch, _config = _module_and_batch(_text("ESMM", VARIATIONAL))
    dense = tm.model.dense
    names = [n for n, _p in dense.named_parameters() if n.endswith("logit_p")]
    assert names == ["groups.0.0.logit_p"]
    layer = dense.groups[0][0]
    assert isinstance(layer, FeatureDropout)
    assert len(layer.logit_p) == len(tm.model.pooled_layout[0].lookups) + len(
        dense.group_dense[0])  # one probability per pooled and dense feature
    first = tm.predict(batch)
    assert np.array_equal(first, tm.predict(batch))
    tm.model.eval()  # (serving runs the scripted part in evaluation)
    assert _scripted_equal(tm, batch)
    _assert_penalty_in_loss(tm, batch, [layer], 0.5)
    tm.model.train()
    before = layer.logit_p.detach().clone()
    tm.train_step(batch)
    assert not torch.equal(before, layer.logit_p.detach())  # the dense optimizer trains it


@pytest.mark.parametrize("model", ["DBMTL", "MMoE"])
def test_multi_task_models_drop_their_groups_input_before_the_bottom(model: str) -> None:
    """MMoE and DBMTL take the layer over their group's input, as EasyRec's input layer does
    for every model: one probability per pooled lookup and dense column
    (``dense.dropout.logit_p``), the penalty in the loss, noise in training only, the scripted
    dense part (odl-export's, odl-serve's) equal to the trained one."""
    field = "dbmtl" if model == "DBMTL" else "mmoe"
    tm, batch, _config = _module_and_batch(_text(model, (
        f"  {field} {{", f"  variational_dropout {{ regularization_lambda: 0.5 }}\n  {field} {{")))
    dense = tm.model.dense
    assert [n for n, _p in dense.named_parameters() if n.endswith("logit_p")] == [
        "dropout.logit_p"]
    layer = dense.dropout
    assert len(layer.logit_p) == len(tm.model.pooled_layout[0].lookups) + len(dense.dense_idx)
    first = tm.predict(batch)
    assert np.array_equal(first, tm.predict(batch))
    tm.model.eval()
    assert _scripted_equal(tm, batch)
    _assert_penalty_in_loss(tm, batch, [layer], 0.5)
    tm.model.train()
    with torch.no_grad():
        a, b = tm.model(batch).logits, tm.model(batch).logits
    assert not torch.equal(a, b)  # a fresh mask at every training forward
    before = layer.logit_p.detach().clone()
    tm.train_step(batch)
    assert not torch.equal(before, layer.logit_p.detach())


def test_multi_tower_drops_each_dnn_towers_input() -> None:
    """MultiTower: each tower's input masked before its DNN (``towers.<i>.0.logit_p``), the
    penalties of every tower in the loss, the scripted dense part equal to the trained one."""
    from tests.test_optimizers import MODEL, records
    from tests.test_table_optimizers import module, tables_config

    towers = MODEL[: MODEL.index("model_config")] + """
model_config {
  model_class: "MultiTower"
  feature_groups { group_name: "a" feature_names: ["c1", "x"] }
  feature_groups { group_name: "b" feature_names: ["c2"] }
  multi_tower { towers { input: "a" dnn { hidden_units: [8] } }
                towers { input: "b" dnn { hidden_units: [8] } } final_dnn { hidden_units: [4] } }
  variational_dropout { regularization_lambda: 0.5 }
}
"""
    tm, fb = module(tables_config("adagrad_optimizer"), towers)
    batch = fb.build(records(64, 3)).batch
    dense = tm.model.dense
    names = [n for n, _p in dense.named_parameters() if n.endswith("logit_p")]
    assert names and all(n.startswith("towers.") and n.endswith(".0.logit_p") for n in names)
    layers = [m for m in dense.modules() if isinstance(m, FeatureDropout)]
    assert sum(len(m.logit_p) for m in layers) == len(tm.model.pooled_layout[0].lookups) + sum(
        len(c) for c in dense.tower_dense)
    tm.model.eval()
    assert _scripted_equal(tm, batch)
    _assert_penalty_in_loss(tm, batch, layers, 0.5)


def test_fm_drops_its_wide_group_and_its_vectors() -> None:
    """FM: the wide group's lookups (and dense columns) and the FM vectors each masked
    (``wide_dropout``, ``fm_dropout``), one probability per feature, the penalties in the
    loss, the scripted dense part equal to the trained one."""
    from tests.test_optimizers import MODEL, records
    from tests.test_table_optimizers import module, tables_config

    fm = MODEL[: MODEL.index("model_config")] + """
model_config {
  model_class: "FM"
  feature_groups { group_name: "wide" feature_names: ["c1", "c2", "x"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c1", "c2"] wide_deep: DEEP }
  fm { }
  variational_dropout { regularization_lambda: 0.5 }
}
"""
    tm, fb = module(tables_config("adagrad_optimizer"), fm)
    batch = fb.build(records(64, 4)).batch
    dense = tm.model.dense
    assert sorted(n for n, _p in dense.named_parameters() if n.endswith("logit_p")) == [
        "fm_dropout.logit_p", "wide_dropout.logit_p"]
    assert len(dense.wide_dropout.logit_p) == 3 and len(dense.fm_dropout.logit_p) == 2
    tm.model.eval()
    assert _scripted_equal(tm, batch)
    _assert_penalty_in_loss(tm, batch, [dense.wide_dropout, dense.fm_dropout], 0.5)
    tm.model.train()
    before = dense.fm_dropout.logit_p.detach().clone()
    tm.train_step(batch)
    assert not torch.equal(before, dense.fm_dropout.logit_p.detach())


def test_deepfm_drops_its_wide_and_deep_groups_and_fm_reads_the_dropped_vectors() -> None:
    """DeepFM: the wide group's input and the deep group's (its lookups, then its dense
    columns) each masked; FM and the DNN read the masked deep input; the scripted dense part
    equals the trained one; the penalties join the loss."""
    from tests.test_optimizers import MODEL, records
    from tests.test_table_optimizers import module, tables_config

    model = MODEL.replace("  deepfm {", "  variational_dropout { regularization_lambda: 0.5 }\n"
                                       "  deepfm {")
    tm, fb = module(tables_config("adagrad_optimizer"), model)
    batch = fb.build(records(64, 5)).batch
    dense = tm.model.dense
    assert sorted(n for n, _p in dense.named_parameters() if n.endswith("logit_p")) == [
        "deep_dropout.logit_p", "wide_dropout.logit_p"]
    assert len(dense.deep_dropout.logit_p) == dense.num_deep + len(dense.deep_dense_idx)
    assert len(dense.wide_dropout.logit_p) == dense.num_wide + len(dense.wide_dense_idx)
    tm.model.eval()
    assert _scripted_equal(tm, batch)
    # evaluation scales the deep vectors by 1 - p before FM reads them: zeroing one feature's
    # keep probability (p -> 1) takes that feature out of the prediction
    with torch.no_grad():
        base = tm.model(batch).logits.clone()
        dense.deep_dropout.logit_p[0] = 50.0
        assert not torch.allclose(tm.model(batch).logits, base)
        dense.deep_dropout.logit_p[0] = 0.0
    _assert_penalty_in_loss(tm, batch, [dense.wide_dropout, dense.deep_dropout], 0.5)


@pytest.mark.parametrize("model, edit, field", [
    ("DCN", ("  dcn {", "  variational_dropout {}\n  dcn {"),
     "model_config.variational_dropout"),
    ("ESMM", ("  esmm {", "  variational_dropout { regularization_lambda: -1 }\n  esmm {"),
     "model_config.variational_dropout.regularization_lambda"),
])
def test_variational_dropout_is_refused_by_field(model: str, edit: tuple[str, str],
                                                 field: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(_text(model, edit)), online=True)
    assert info.value.field == field, info.value


def test_variational_dropout_over_an_esmm_group_with_sequences_is_refused(tmp_path) -> None:
    """EasyRec's ESMM sample whose group reads a sequence by target attention, given
    variational dropout: refused by field (the layer covers pooled and dense features)."""
    from tests.test_config_compat import _HERE, try_load

    with open(f"{_HERE}/easyrec/esmm_on_sequence_feature_taobao.config", encoding="utf-8") as f:
        text = f.read()
    assert "sequence_features" in text
    path = tmp_path / "esmm.config"
    path.write_text(text.replace("  esmm {", "  variational_dropout {}\n  esmm {", 1))
    with pytest.raises(ConfigError) as info:
        try_load.load_one(str(path), "easyrec")
    assert info.value.field == "model_config.variational_dropout", info.value
    assert "sequences" in info.value.message
