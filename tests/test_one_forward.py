"""One forward: training, export and serving run the same dense code on the same inputs."""

from __future__ import annotations

import ast
import os
import re

import numpy as np
import pytest
import torch

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.export.dense_export import script_dense
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.train.train_module import TrainModule
from serving_plugin.export_reader import pooled_inputs_of
from serving_plugin.serving_model import ServingModel
from tests.harness import EXOTIC_CONFIG, REPO, exotic_records

# The exotic config (wide dense feature, BatchNorm, dropout, final_dnn, shared table, combo
# feature) with one mean-pooled table: TorchRec then emits pooled columns out of layout order.
MIXED_POOLING = EXOTIC_CONFIG.replace(
    'input_names: "tags" hash_bucket_size: 200',
    'input_names: "tags" hash_bucket_size: 200 combiner: "mean"')


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("one_forward"))
    config = parse_pipeline_config_text(MIXED_POOLING.format(model_dir=os.path.join(root, "md")))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    records = exotic_records(64 * 6, 5)
    for i in range(6):
        tm.train_step(fb.build(records[i * 64 : (i + 1) * 64]).batch)
    path = CheckpointManager(config.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 64 * 6}, {"source": "kafka"},
        config_to_text(config), generation="g")
    export = export_checkpoint(config, path, os.path.join(root, "exports")).path
    batch = fb.build(exotic_records(200, 9)).batch
    return tm, export, batch, fb


def test_lookup_reorders_mixed_pooling(trained):
    tm, _export, _batch, _fb = trained
    model = tm.dmp.module
    gathers = [g for plan in model._gathers.values() for g in plan]  # noqa: SLF001
    assert any(g.index is not None for g in gathers)


def test_exported_dense_model_is_the_training_dense_module(trained):
    tm, export, batch, _fb = trained
    model = tm.dmp.module
    scripted = torch.jit.load(os.path.join(export, "dense_model.pt"))
    dense_cls = type(model.dense)
    # The file holds the training class itself, under the trainer's parameter names
    # (TorchScript inserts ___torch_mangle_N. when a class was scripted before in-process).
    qualified = re.sub(r"___torch_mangle_\d+\.", "",
                       scripted.dense._c._type().qualified_name())  # noqa: SLF001
    assert qualified == f"__torch__.{dense_cls.__module__}.{dense_cls.__qualname__}"
    assert {n for n, _ in scripted.named_parameters()} == {
        f"dense.{n}" for n, _ in model.dense.named_parameters()}
    # Bit-identical logits on the training model's own pooled inputs, and on arbitrary ones.
    model.eval()
    try:
        with torch.no_grad():
            out = model(batch)
            assert torch.equal(scripted(*out.pooled, batch.dense), out.logits)
            gen = torch.Generator().manual_seed(1)
            pooled = [torch.randn(50, g.width, generator=gen) for g in model.pooled_layout]
            dense = torch.randn(50, batch.dense.shape[1], generator=gen)
            assert torch.equal(scripted(*pooled, dense), model.dense(*pooled, dense))
            assert torch.equal(script_dense(model)(*pooled, dense), model.dense(*pooled, dense))
    finally:
        model.train()


def test_serving_feeds_the_dense_part_what_training_feeds_it(trained):
    tm, export, batch, _fb = trained
    model = tm.dmp.module
    serving = ServingModel.load(export)
    assert pooled_inputs_of(serving.signature) == model.pooled_layout
    model.eval()
    try:
        with torch.no_grad():
            out = model(batch)
            values = batch.sparse.values()
            lengths = batch.sparse.lengths().to(torch.int64).view(-1, batch.size)
            counts = lengths.sum(dim=1)
            starts = torch.cumsum(counts, 0) - counts
            pooled = [g.pooled(values, lengths, counts, starts, batch.size)
                      for g in serving._groups]  # noqa: SLF001
            for got, want in zip(pooled, out.pooled, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            assert torch.equal(serving.dense_module(*out.pooled, batch.dense), out.logits)
    finally:
        model.train()
    np.testing.assert_allclose(serving.predict_batch(batch), tm.predict(batch), rtol=0, atol=1e-6)


def test_no_serving_or_export_copy_of_model_code():
    """Nothing outside odl/models defines a forward (the export's root only delegates)."""
    for pkg in ("serving_plugin", os.path.join("odl", "export")):
        for name in os.listdir(os.path.join(REPO, pkg)):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(REPO, pkg, name)) as f:
                tree = ast.parse(f.read())
            defs = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
            assert "forward" not in defs, f"{pkg}/{name} defines a forward"


def test_loss_reads_only_its_arguments(trained):
    tm, _export, batch, fb = trained
    model = tm.dmp.module
    other = fb.build(exotic_records(64, 77)).batch
    out = model(batch)
    first = model.loss(out, batch)
    model(other)  # a later forward leaves nothing the loss reads
    assert torch.equal(model.loss(out, batch), first)
    assert not [k for k, v in vars(model).items() if isinstance(v, torch.Tensor)]


def test_old_signature_without_pooled_inputs_reads_as_deep_and_wide():
    sig = {"deep_lookups": [["a", "t"], ["b", "t"]], "wide_lookups": [["a", "t_wide"]],
           "deep_dim": 8, "wide_output_dim": 3}
    deep, wide = pooled_inputs_of(sig)
    assert (deep.name, deep.lookups, deep.dim, deep.width) == ("deep", (("a", "t"), ("b", "t")),
                                                               8, 16)
    assert (wide.name, wide.lookups, wide.dim) == ("wide", (("a", "t_wide"),), 3)
