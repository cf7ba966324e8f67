"""EasyRec's FM (``odl/models/fm.py``) and the model registry every class registers in."""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.model_classes import IMPLEMENTED_MODEL_CLASSES, MODEL_MESSAGES
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import (
    build_model,
    check_pipeline_config,
    model_class_of,
    registered_model_classes,
)
from odl.train.train_module import TrainModule
from tests.harness import REPO, as_model

FM_CONFIG = """
model_dir: "/tmp/unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "samples" group: "g" }
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  input_fields { input_name: "c3" }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "c1" hash_bucket_size: 200 embedding_dim: 8 }
  features { input_names: "c2" hash_bucket_size: 200 embedding_dim: 8 }
  features { input_names: "c3" feature_type: TagFeature separator: "|"
             hash_bucket_size: 100 embedding_dim: 8 }
}
model_config {
  model_class: "FM"
  feature_groups { group_name: "wide" feature_names: ["c1", "c2", "c3", "x"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c1", "c2", "c3"] wide_deep: DEEP }
  fm { }
  NUM_CLASS
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.05 } } } }
  optimizer_config { adam_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.001 } } } }
}
"""

RECORDS = [b"1,0.5,a,b,x|y", b"0,-1.25,c,b,z", b"1,2.0,a,d,", b"0,0.0,e,f,x|x|w"]


def _config(num_class: int = 1, edit: tuple[str, str] = ("", "")):
    text = FM_CONFIG.replace("NUM_CLASS", f"num_class: {num_class}" if num_class > 1 else "")
    return parse_pipeline_config_text(text.replace(*edit) if edit[0] else text)


@pytest.mark.parametrize("num_class", [1, 3])
def test_fm_logits_are_first_order_terms_plus_the_fm_term(num_class: int) -> None:
    """logit = bias + sum of the wide rows + w . dense + sum_d FM (Linear(FM) for C > 1)."""
    config = _config(num_class)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    torch.manual_seed(3)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    with torch.no_grad():  # non-zero first-order parameters, so each term shows
        dense.bias.copy_(torch.linspace(-0.3, 0.2, num_class))
        dense.wide_dense.weight.copy_(torch.full_like(dense.wide_dense.weight, 0.7))
    batch = fb.build(RECORDS).batch
    deep, wide = tm.model.lookup(batch)
    v = deep.detach().numpy().reshape(len(RECORDS), 3, 8).astype(np.float64)
    fm = 0.5 * (v.sum(axis=1) ** 2 - (v ** 2).sum(axis=1))
    first = (wide.detach().numpy().reshape(len(RECORDS), 3, num_class).sum(axis=1)
             + batch.dense.numpy() @ dense.wide_dense.weight.detach().numpy().T
             + dense.bias.detach().numpy())
    if num_class == 1:
        expected = first[:, 0] + fm.sum(axis=1)
    else:
        w, b = dense.fm_out.weight.detach().numpy(), dense.fm_out.bias.detach().numpy()
        expected = first + fm @ w.T + b
    got = tm.model(batch).logits.detach().numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    scripted = torch.jit.script(dense)  # what odl-export writes and odl-serve runs
    assert torch.equal(scripted(deep, wide, batch.dense), dense(deep, wide, batch.dense))


def test_fm_learns_the_synthetic_stream() -> None:
    """Trained online on the Criteo-like stream (100 steps of 256), FM ranks the next records
    well above chance (0.63 here; DeepFM 0.70)."""
    config = parse_pipeline_config_text(as_model(deepfm_config_text("/tmp/unused"), "FM"))
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    tm = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=5)
    for _ in range(100):
        tm.train_step(fb.build(stream.next_batch(256).encode("csv")).batch)
    held = stream.next_batch(4000)
    scores = tm.predict(fb.build(held.encode("csv")).batch)
    labels = np.asarray(held.labels).astype(bool)
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    auc = (ranks[labels].sum() - labels.sum() * (labels.sum() + 1) / 2) / (
        labels.sum() * (~labels).sum())
    assert auc > 0.6, auc


@pytest.mark.parametrize("edit, field", [
    (('feature_groups { group_name: "wide"', 'feature_groups { group_name: "w"'),
     "model_config.feature_groups"),
    (("fm { }", "fm { l2_regularization: -1 }"), "model_config.fm.l2_regularization"),
    (('"c2" hash_bucket_size: 200 embedding_dim: 8', '"c2" hash_bucket_size: 200 '
      "embedding_dim: 4"), "model_config.feature_groups[1].feature_names"),
])
def test_fm_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_config(edit=edit), online=True)
    assert info.value.field == field


# x as EasyRec's projected raw feature (embedding_dim, no boundaries) in the deep group too
_PROJECTED = ('features { input_names: "x" feature_type: RawFeature }',
              'features { input_names: "x" feature_type: RawFeature embedding_dim: DIM }')
_X_IN_DEEP = ('feature_names: ["c1", "c2", "c3"] wide_deep: DEEP',
              'feature_names: ["c1", "c2", "c3", "x"] wide_deep: DEEP')


def _projected_config(dim: int):
    text = FM_CONFIG.replace("NUM_CLASS", "").replace(*_X_IN_DEEP)
    return parse_pipeline_config_text(
        text.replace(_PROJECTED[0], _PROJECTED[1].replace("DIM", str(dim))))


def test_fm_reads_projected_raw_features_as_vectors_and_serves_them() -> None:
    """A projected raw feature x of the deep group is one more FM vector, x * p (EasyRec's
    raw feature projection); in the wide group it stays a first-order term."""
    config = _projected_config(8)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    torch.manual_seed(5)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    batch = fb.build(RECORDS).batch
    deep, wide = tm.model.lookup(batch)
    x = batch.dense.numpy()[:, 0].astype(np.float64)
    p = dense.projection.weight.detach().numpy().astype(np.float64)  # [1, 8]
    v = np.concatenate([deep.detach().numpy().reshape(len(RECORDS), 3, 8),
                        (x[:, None] * p)[:, None, :]], axis=1)
    fm = 0.5 * (v.sum(axis=1) ** 2 - (v ** 2).sum(axis=1))
    first = (wide.detach().numpy().reshape(len(RECORDS), 3).sum(axis=1)
             + x * float(dense.wide_dense.weight.detach()[0, 0]) + float(dense.bias.detach()))
    np.testing.assert_allclose(tm.model(batch).logits.detach().numpy(), first + fm.sum(axis=1),
                               rtol=1e-5, atol=1e-6)
    scripted = torch.jit.script(dense)  # what odl-export writes and odl-serve runs
    assert torch.equal(scripted(deep, wide, batch.dense), dense(deep, wide, batch.dense))
    before = dense.projection.weight.detach().clone()
    tm.train_step(batch)
    assert not torch.equal(before, dense.projection.weight.detach())  # it learns


def test_fm_refuses_projected_raw_features_of_another_dim() -> None:
    """EasyRec's fm_on_criteo.config: raw features projected to 10 among ids of 16; FM stacks
    the group's vectors (EasyRec's FM layer too), so the dims must agree."""
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_projected_config(4), online=True)
    assert info.value.field == "model_config.feature_groups[1].feature_names"


def test_fm_named_by_its_message_alone_is_fm() -> None:
    """TorchEasyRec names a model by its message: ``fm {}`` without model_class is FM."""
    config = _config(edit=('model_class: "FM"', ""))
    check_pipeline_config(config, online=True)
    assert model_class_of(config.model_config).name == "FM"
    assert type(build_model(config, FeatureBuilder(config))).__name__ == "FM"


def test_every_class_the_proto_declares_is_registered_by_one_module() -> None:
    registered = registered_model_classes()
    assert sorted(registered) == sorted(IMPLEMENTED_MODEL_CLASSES)
    assert MODEL_MESSAGES["FM"] == "fm"
    assert registered["FM"].build.__module__ == "odl.models.fm"


# the installed packages (pyproject.toml: all but odl.harness and odl.demos), where a model
# class is named by its registering module only
_STACK = ("odl", "publisher", "serving_plugin")
_NOT_INSTALLED = ("odl/harness", "odl/demos")
# the backbone's layers are named by EasyRec's layer class names, another namespace than the
# model classes (its FM and MaskNet layers are not the FM and MaskNet models)
_LAYER_NAMES = ("odl/models/backbone",)


def _code_strings(path: str) -> set[str]:
    """String constants of a module's code (docstrings aside)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant):
            skip.add(id(body[0].value))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in skip}


def test_a_model_class_is_named_only_by_the_module_that_registers_it() -> None:
    registered = registered_model_classes()
    modules = {name: entry.build.__module__.replace(".", "/") + ".py"
               for name, entry in registered.items()}
    named: dict[str, list[str]] = {}
    for top in _STACK:
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            if os.path.relpath(root, REPO).startswith(_NOT_INSTALLED + _LAYER_NAMES):
                continue
            for f in files:
                if f.endswith(".py") and not f.endswith("_pb2.py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, REPO)
                    for name in _code_strings(path) & set(registered):
                        if rel != modules[name]:
                            named.setdefault(name, []).append(rel)
    assert named == {}
