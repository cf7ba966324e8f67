"""EasyRec's backbone packages and contrastive learning (``odl/models/backbone/
block_packages.py``, ``contrastive_layers.py``).

The auxiliary losses agree with numpy ports of EasyRec's TF formulas; SeqAugment's crop, mask
and reorder keep CL4SRec's invariants; EasyRec's contrastive sample
(``contrastive_learning_on_movielens``, tables cut small) shares one set of weights between
a package's calls, draws dropout anew per call, adds the loss in training only, skips the
contrastive branch at prediction time and learns it; a trainer fed from the broker publishes
deltas that serving replays to the trainer's predictions; misuse is refused by field.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from torch import nn

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.backbone.contrastive_layers import SeqAugment
from odl.models.backbone.graph_modules import GroupRead
from odl.models.backbone.value_specs import tensor
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2 as pb
from odl.train.train_module import TrainModule
from tests.backbone_layer_checks import build
from tests.harness import rank_dense_parameters
from tests.model_checks import serving_replay_diff
from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

# ---- the losses against EasyRec's formulas -----------------------------------------------


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def _info_nce(q: np.ndarray, p: np.ndarray, t: float) -> float:
    logits = q @ p.T / t
    return float(-np.mean(np.diag(_log_softmax(logits))))


def _nce(zi: np.ndarray, zj: np.ndarray, t: float) -> float:
    """EasyRec's nce_loss step by step: positives, the tiled mask, the boolean mask."""
    b = zi.shape[0]
    z = np.concatenate([zi, zj], axis=0)
    sim = z @ z.T / t
    positives = np.concatenate([np.diag(sim[b:, :b]), np.diag(sim[:b, b:])]).reshape(-1, 1)
    mask = np.tile(~np.eye(b, dtype=bool), (2, 2))
    negatives = sim[mask].reshape(2 * b, -1)
    logits = np.concatenate([positives, negatives], axis=1)
    return float(-np.mean(_log_softmax(logits)[:, 0]))


@pytest.mark.parametrize("loss_type", ["l2_loss", "info_nce", "nce_loss"])
def test_auxiliary_losses_are_easyrecs(loss_type: str) -> None:
    rng = np.random.default_rng(3)
    x1, x2 = rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
    spec = tensor(4)
    layer = build("AuxiliaryLoss", [spec, spec], st={
        "loss_type": loss_type, "loss_weight": 0.3, "temperature": 0.2})
    got = layer.module([torch.tensor(x1, dtype=torch.float64),
                        torch.tensor(x2, dtype=torch.float64)])[0]
    want = {"l2_loss": float(np.mean(((x1 - x2) ** 2).sum(axis=1))),
            "info_nce": _info_nce(x1, x2, 0.2), "nce_loss": _nce(x1, x2, 0.2)}[loss_type]
    assert abs(float(got) - 0.3 * want) <= 1e-9
    scripted = torch.jit.script(layer.module)
    assert abs(float(scripted([torch.tensor(x1), torch.tensor(x2)])[0]) - 0.3 * want) < 1e-9


# ---- SeqAugment ----------------------------------------------------------------------------

L, D = 10, 3


def _augment(mask: float, crop: float, reorder: float) -> SeqAugment:
    spec = [tensor(L, D), tensor()]
    layer = build("SeqAugment", spec, pb.SequenceAugment(mask_rate=mask, crop_rate=crop,
                                                         reorder_rate=reorder))
    assert layer.spec == spec
    return layer.module


def _sequences(b: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Items with distinct nonzero rows (item k of record r: r * 100 + k + 1 in column 0),
    zero past each length (0 .. L)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, L + 1, (b,), generator=g)
    seq = torch.zeros(b, L, D)
    for r in range(b):
        n = int(lengths[r])
        seq[r, :n, 0] = torch.arange(1, n + 1) + 100.0 * r
        seq[r, :n, 1:] = torch.randn(n, D - 1, generator=g)
    return seq, lengths.to(torch.float32)


def test_seq_augment_crops_masks_and_reorders_as_cl4srec() -> None:
    seq, n = _sequences()
    torch.manual_seed(1)
    crop = _augment(0.0, 0.5, 0.0).train()
    out, out_n = crop([seq, n])
    for r in range(seq.shape[0]):
        length, keep = int(n[r]), int(np.floor(float(n[r]) * 0.5))
        assert int(out_n[r]) == keep
        kept = out[r, :keep]
        if keep:  # consecutive items of the sequence, moved to the front
            start = int(kept[0, 0] - 100 * r - 1)
            torch.testing.assert_close(kept, seq[r, start:start + keep])
            assert start + keep <= length
        assert bool((out[r, keep:] == 0).all())

    mask = _augment(0.5, 1.0, 0.0).train()
    out, out_n = mask([seq, n])
    assert torch.equal(out_n, n)
    for r in range(seq.shape[0]):
        length = int(n[r])
        masked = (out[r] != seq[r]).any(dim=1)
        assert int(masked.sum()) == int(np.floor(length * 0.5))  # drawn among the items
        assert not bool(masked[length:].any())
        assert bool((out[r][masked] == mask.mask.detach()).all())

    reorder = _augment(0.0, 1.0, 0.5).train()
    out, out_n = reorder([seq, n])
    assert torch.equal(out_n, n)
    moved_somewhere = False
    for r in range(seq.shape[0]):
        length, count = int(n[r]), int(np.floor(float(n[r]) * 0.5))
        changed = (out[r] != seq[r]).any(dim=1).nonzero().flatten().tolist()
        if changed:  # a shuffle inside one window of `count` consecutive items
            moved_somewhere = True
            assert max(changed) - min(changed) < count and max(changed) < length
        order = out[r, :length, 0].sort().values
        torch.testing.assert_close(order, seq[r, :length, 0])  # the same items
    assert moved_somewhere

    both = _augment(0.6, 0.2, 0.6)
    both.eval()  # at prediction time the sequence passes unchanged
    out, out_n = both([seq, n])
    assert torch.equal(out, seq) and torch.equal(out_n, n)
    torch.jit.script(both)


# ---- EasyRec's contrastive sample ------------------------------------------------------------

def _movielens() -> pb.EasyRecConfig:
    return _small_cpu_config(try_load.load_one(
        os.path.join(_HERE, "easyrec", "contrastive_learning_on_movielens.config"), "easyrec"))


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    config = _movielens()
    config.model_dir = str(tmp_path_factory.mktemp("cl") / "model_dir")
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    return config, fb, TrainModule(config, fb, device="cpu")


def test_a_package_called_three_times_has_one_set_of_weights(movielens) -> None:
    """item_tower runs twice for the contrastive loss and once for the prediction, with one
    MLP; the prediction's call reads its input layer without dropout (reset_input)."""
    _config, _fb, tm = movielens
    dense = tm.model.dense
    linears = {id(m) for m in dense.modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 2 + 2 + 2 + 1  # user MLP, item MLP, top MLP, the logit layer
    item_inputs = [n.layer.layer for n in dense.graph.nodes if isinstance(n.layer, GroupRead)]
    assert len(item_inputs) == 3
    rates = [g.dropout.p if isinstance(g.dropout, nn.Dropout) else 0.0 for g in item_inputs]
    assert rates == pytest.approx([0.1, 0.1, 0.0])
    # the two contrastive calls, their loss: not run at prediction time
    skipped = [n for n in dense.graph.nodes if n.skip_in_eval]
    assert len(skipped) == 5 and dense.has_aux_loss and len(dense.graph.aux_index) == 1


def test_the_contrastive_loss_joins_training_only_and_is_learned(movielens) -> None:
    config, fb, tm = movielens
    model = tm.model
    batch = fb.build(_records(config, 32, seed=50)).batch

    def aux_loss() -> float:
        model.train()
        torch.manual_seed(7)  # the same dropout draws each time
        with torch.no_grad():
            out = model(batch)
        assert out.aux_loss is not None
        return float(out.aux_loss)

    first = aux_loss()
    model.train()
    with torch.no_grad():  # the two calls draw their own dropout: the views differ
        assert float(model(batch).aux_loss) != float(model(batch).aux_loss)
    model.eval()
    with torch.no_grad():
        out = model(batch)
        assert float(out.aux_loss) == 0.0
        torch.testing.assert_close(model(batch).logits, out.logits)  # deterministic
    model.train()
    for step in range(60):
        tm.train_step(fb.build(_records(config, 32, seed=100 + step)).batch)
    assert aux_loss() < 0.8 * first


def _contrastive_config(model_dir: str):
    from odl.config.pipeline_config import load_pipeline_config

    config = load_pipeline_config(os.path.join(os.path.dirname(_HERE), "..", "bench",
                                               "configs",
                                               "movielens_contrastive_as_written.config"))
    config.model_dir = model_dir
    config.data_config.batch_size = 32
    return config


@pytest.mark.parametrize("in_batch", [True, False])
def test_the_contrastive_loss_is_learned_with_and_without_in_batch_learning(tmp_path,
                                                                            in_batch) -> None:
    """bench/configs/movielens_contrastive_as_written.config (Adagrad tables): the step that
    shifts each record by its batch's earlier ones trains the auxiliary loss too."""
    config = _contrastive_config(str(tmp_path / "m"))
    config.train_config.in_batch_learning = in_batch
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(_records(config, 32, seed=50)).batch

    def aux_loss() -> float:
        torch.manual_seed(7)
        with torch.no_grad():
            return float(tm.model(batch).aux_loss)

    first = aux_loss()
    for step in range(60):
        tm.train_step(fb.build(_records(config, 32, seed=100 + step)).batch)
    gain = tm.in_batch_gain.value if tm.in_batch_gain is not None else 0.0
    assert (gain != 0.0) == in_batch  # the shift ran, or did not
    assert aux_loss() < 0.8 * first


def _contrastive_rank(rank: int, world: int, model_dir: str, steps: list) -> dict:
    """One rank training its share of ``steps``; its dense parameters after them."""
    return rank_dense_parameters(_contrastive_config(model_dir), rank, steps)


def test_two_ranks_train_one_set_of_package_weights(ranks, tmp_path) -> None:
    """Two ranks, the last step's batches of different sizes (padding): the shared package
    weights and every other dense parameter stay one set across the ranks and move."""
    config = _contrastive_config(str(tmp_path / "unused"))
    steps = [[_records(config, 32, seed=10 * k), _records(config, 32 if k < 3 else 20,
                                                          seed=10 * k + 1)]
             for k in range(4)]
    got = ranks.run(_contrastive_rank, 2, str(tmp_path / "m"), steps)
    assert set(got[0]) == set(got[1])
    for name, (value, moved) in got[0].items():
        np.testing.assert_array_equal(value, got[1][name][0], err_msg=name)
        assert moved or "bias" in name, name


def test_a_contrastive_rank_model_replays_from_the_broker_to_the_trainers_predictions(
        kafka_bootstrap, kafka_topic_factory, tmp_path) -> None:
    """The Criteo-like RankModel with its deep tower as a package, called twice under an
    info_nce loss and once for the logit: trained from Kafka with publishing, an early
    export plus the replayed deltas predict what the trainer predicts."""
    mlp = 'blocks { name: "deep_tower" inputs { feature_group_name: "deep" }'
    package = ('packages { name: "tower" blocks { name: "deep_in" inputs { '
               'feature_group_name: "deep" } input_layer { dropout_rate: 0.2 } }\n'
               '      blocks { name: "deep_mlp" inputs { block_name: "deep_in" }')
    logit = 'blocks { name: "deep_logit" inputs { block_name: "deep_tower" }'
    calls = ('}\n    blocks { name: "cl" inputs { package_name: "tower" } inputs { '
             'package_name: "tower" } merge_inputs_into_list: true keras_layer { class_name: '
             '"AuxiliaryLoss" st_params { fields { key: "loss_type" value { string_value: '
             '"info_nce" } } } } }\n'
             '    blocks { name: "deep_tower" inputs { block_name: "cl" ignore_input: true } '
             'inputs { package_name: "tower" reset_input { } } }\n    ' + logit)
    status, diff = serving_replay_diff("RankModel", "BackboneDense", tmp_path, kafka_bootstrap,
                                       kafka_topic_factory, edits=((mlp, package),
                                                                   (logit, calls)))
    assert status["versions_applied"] >= 2 and diff <= 1e-6


# ---- refusals --------------------------------------------------------------------------------

_TOWER = ('packages { name: "p" blocks { name: "i" inputs { feature_group_name: "item" } '
          'input_layer { } } blocks { name: "e" inputs { block_name: "i" } keras_layer { '
          'class_name: "MLP" mlp { hidden_units: [8] } } } }\n')
_CL = ('blocks { name: "cl" inputs { package_name: "p" } inputs { package_name: "p" } '
       'merge_inputs_into_list: true keras_layer { class_name: "AuxiliaryLoss" st_params { '
       'fields { key: "loss_type" value { string_value: "info_nce" } } } } }\n')


@pytest.mark.parametrize("backbone, field, words", [
    (_TOWER + 'blocks { name: "top" inputs { use_package_input: true } }',
     "model_config.backbone.blocks[0].inputs[0].use_package_input", "only a package"),
    ('packages { name: "p" blocks { name: "a" inputs { package_name: "q" } } }\n'
     'packages { name: "q" blocks { name: "b" inputs { package_name: "p" } } }\n'
     'blocks { name: "top" inputs { package_name: "p" } }',
     "model_config.backbone.packages", "cycle"),
    (_TOWER + _CL + 'blocks { name: "top" inputs { block_name: "cl" } inputs { '
     'package_name: "p" } }',
     "model_config.backbone.blocks[1].inputs[0]", "ignore_input"),
    (_TOWER + _CL + 'concat_blocks: "cl"', "model_config.backbone.concat_blocks",
     "ignore_input"),
    (_TOWER + 'blocks { name: "a" inputs { package_name: "p" } }\n'
     'blocks { name: "top" inputs { block_name: "a" } inputs { package_name: "p" '
     'reset_input { do_layer_norm: true } } }', "model_config.backbone.packages[0].blocks[0]",
     "normalization"),
    (_TOWER + 'blocks { name: "top" inputs { package_name: "p" } inputs { package_name: "p" }'
     ' merge_inputs_into_list: true keras_layer { class_name: "AuxiliaryLoss" st_params { '
     'fields { key: "loss_type" value { string_value: "triplet" } } } } }\n'
     'blocks { name: "out" inputs { block_name: "top" ignore_input: true } inputs { '
     'package_name: "p" } }', "model_config.backbone.blocks[0].keras_layer", "loss_type"),
    (_TOWER + 'blocks { name: "top" inputs { package_name: "p" } inputs { package_name: "p" }'
     ' merge_inputs_into_list: true repeat { num_repeat: 2 keras_layer { class_name: '
     '"AuxiliaryLoss" st_params { fields { key: "loss_type" value { string_value: "l2_loss" }'
     ' } } } } }', "model_config.backbone.blocks[0].repeat", "one keras_layer"),
    (_TOWER + 'blocks { name: "top" inputs { package_name: "p" } keras_layer { class_name: '
     '"SeqAugment" seq_aug { } } }', "model_config.backbone.blocks[0].keras_layer",
     "output_seq_and_normal_feature"),
    (_TOWER + 'blocks { name: "top" inputs { feature_group_name: "user" package_input: "p" } }',
     "model_config.backbone.blocks[0].inputs[0].package_input", "package_name"),
])
def test_package_and_contrastive_misuse_is_refused_by_field(backbone, field, words) -> None:
    config = _movielens()
    mc = config.model_config
    mc.backbone.Clear()
    text_format.Parse(backbone, mc.backbone)
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(config, online=True)
    assert info.value.field.startswith(field), (info.value.field, str(info.value))
    assert words in str(info.value)


def test_a_multi_task_backbone_adds_the_auxiliary_loss_in_training(tmp_path) -> None:
    """MultiTaskModel over a backbone with the contrastive block: the loss is the tasks'
    plus the auxiliary one in training; at prediction time there is none, and the scripted
    export predicts what the model predicts."""
    import dataclasses

    from odl.export.dense_export import script_dense

    config = _movielens()
    config.model_dir = str(tmp_path / "m")
    mc = config.model_config
    mc.backbone.Clear()
    text_format.Parse(_TOWER + _CL + 'blocks { name: "top" inputs { block_name: "cl" '
                      'ignore_input: true } inputs { package_name: "p" } }', mc.backbone)
    mc.model_class = "MultiTaskModel"
    mc.model_params.task_towers.add(tower_name="ctr", label_name="label")
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(_records(config, 32, seed=5)).batch
    model = tm.model
    model.train()
    out = model(batch)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    without = model.loss(dataclasses.replace(out, aux_loss=None), batch)
    torch.testing.assert_close(model.loss(out, batch) - without, out.aux_loss)
    tm.train_step(batch)
    model.eval()
    with torch.no_grad():
        out = model(batch)
        assert float(out.aux_loss) == 0.0
        pooled = model.lookup(batch)
        scripted = script_dense(model)
        torch.testing.assert_close(scripted(*pooled, batch.dense), out.logits)
    model.train()
