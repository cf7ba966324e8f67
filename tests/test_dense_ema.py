"""TorchEasyRec's dense EMA (``dense_optimizer.ema``, odl.train.dense_ema): the average of the
dense parameters, checkpointed, evaluated and served where ``use_dense_ema`` says."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from odl.config.config_error import ConfigError
from odl.config.train_validation import validate_train_config
from odl.protos import pipeline_pb2
from tests.test_optimizers import MODEL, records
from tests.test_table_optimizers import module

EMA = ("sparse_optimizer { adagrad_optimizer { lr: 0.05 } constant_learning_rate {} } "
       "dense_optimizer { adam_optimizer { lr: 0.02 } constant_learning_rate {} "
       "ema { decay: 0.8 } } in_batch_learning: false")


def test_the_average_is_torchs_averaged_model_of_the_dense_parameters() -> None:
    """After every step the average equals torch's AveragedModel (TorchEasyRec's DenseEMA)
    updated with the same parameters; the parameters themselves train as without it."""
    tm, fb = module(EMA)
    plain, _ = module(EMA.replace("ema { decay: 0.8 }", ""))
    reference = AveragedModel(tm.model.dense, multi_avg_fn=get_ema_multi_avg_fn(0.8),
                              use_buffers=False)
    names = [f"dense.{n}" for n, _ in tm.model.dense.named_parameters()]
    for step in range(5):
        batch = fb.build(records(48, 40 + step)).batch
        tm.train_step(batch)
        plain.train_step(batch)
        reference.update_parameters(tm.model.dense)
        want = dict(zip(names, reference.module.parameters(), strict=True))
        got = tm.dense_ema.averages()
        for name in names:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    live = tm.dense_parameters()
    for name, t in plain.dense_parameters().items():
        torch.testing.assert_close(live[name], t, rtol=0, atol=0)
    assert any(not torch.equal(got[n], live[n]) for n in names)  # it lags the parameters


def test_evaluation_and_serving_follow_use_dense_ema() -> None:
    tm, fb = module(EMA)
    assert tm.serves_dense_ema and tm.evaluates_dense_ema
    fresh = {k: v.clone() for k, v in tm.served_dense_parameters().items()}
    for name, t in tm.dense_parameters().items():  # nothing averaged yet: the parameters
        assert torch.equal(fresh[name], t)
    for step in range(3):
        tm.train_step(fb.build(records(48, step)).batch)
    served, live = tm.served_dense_parameters(), tm.dense_parameters()
    averages = {k: v.clone() for k, v in tm.dense_ema.averages().items()}
    assert all(torch.equal(served[n], averages[n]) for n in averages)
    assert any(not torch.equal(served[n], live[n]) for n in averages)
    before = {k: v.clone() for k, v in live.items()}
    batch = fb.build(records(64, 9)).batch
    with tm.dense_ema.swapped():
        assert all(torch.equal(tm.dense_parameters()[n], averages[n]) for n in averages)
        with_average = tm.predict(batch)
    assert all(torch.equal(tm.dense_parameters()[n], before[n]) for n in before)
    assert not np.allclose(with_average, tm.predict(batch))

    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(EMA, config.train_config)
    config.export_config.use_dense_ema = False
    config.eval_config.use_dense_ema = False
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    off = TrainModule(config, FeatureBuilder(config), device="cpu")
    assert off.dense_ema is not None and not off.serves_dense_ema
    assert not off.evaluates_dense_ema
    off.train_step(batch)
    assert all(torch.equal(off.served_dense_parameters()[n], t)
               for n, t in off.dense_parameters().items())


def test_checkpoint_restores_the_average_and_one_without_restarts_it() -> None:
    tm, fb = module(EMA)
    batches = [fb.build(records(40, 60 + k)).batch for k in range(5)]
    for b in batches[:2]:
        tm.train_step(b)
    state = tm.state_dict_for_checkpoint()
    assert int(state["dense_ema"]["__n_averaged__"]) == 2
    restored, _ = module(EMA)
    restored.load_checkpoint_state(state)
    for b in batches[2:]:
        tm.train_step(b)
        restored.train_step(b)
    for name, t in tm.dense_ema.averages().items():
        torch.testing.assert_close(restored.dense_ema.averages()[name], t, rtol=0, atol=0)
    # a checkpoint of a run without ema: the average starts from the restored parameters
    del state["dense_ema"]
    again, _ = module(EMA)
    again.load_checkpoint_state(state)
    assert again.dense_ema.n_averaged == 0
    again.train_step(batches[2])
    for name, t in again.dense_parameters().items():
        if name in again.dense_ema.averages():
            assert torch.equal(again.dense_ema.averages()[name], t)


def test_published_versions_and_exports_serve_the_average(tmp_path) -> None:
    """A published version's dense variables are the average; an export of the checkpoint
    predicts in serving what the trainer predicts with the average swapped in."""
    from odl.checkpoint.checkpoint_manager import CheckpointManager
    from odl.config.config_redaction import config_to_text
    from odl.export.exporter import export_checkpoint
    from publisher.delta_decoder import decode_chunk
    from publisher.delta_sink import SentOffsets
    from publisher.id_maps import build_id_maps
    from publisher.incremental_publisher import IncrementalPublisher
    from publisher.publisher_factory import dense_variable_shapes, published_table_dims
    from publisher.version_assembler import VersionAssembler
    from serving_plugin.serving_model import ServingModel
    from tests.test_publisher import _FakeSink, _tracker

    class Sink(_FakeSink):
        def __init__(self) -> None:
            self.sent: list[list[bytes]] = []

        def send(self, version, generation, chunks, timeout=30.0):  # noqa: ANN001, ANN202
            self.sent.append(list(chunks))
            return SentOffsets(len(self.sent) - 1, len(self.sent) - 1)

    tm, fb = module(EMA)
    tracker = _tracker(tm)
    maps = build_id_maps(dense_variable_shapes(tm), published_table_dims(tm))
    sink = Sink()
    pub = IncrementalPublisher(tm, maps, tracker, sink, "gen", "m", sparse_save_steps=1,
                               dense_save_steps=1, start_step=tm.global_step)
    pub.start()
    tm.set_touched_rows_hook(tracker.record)
    try:
        for step in range(3):
            tm.train_step(fb.build(records(48, 70 + step)).batch)
            pub.maybe_publish(tm.global_step, {0: tm.global_step}, None, None)
        assert pub.flush(timeout=10)
    finally:
        tm.set_touched_rows_hook(None)
    asm = VersionAssembler()
    last = [asm.add(decode_chunk(c)) for chunks in sink.sent for c in chunks][-1]
    dnames = maps.dense_names()
    averages = tm.dense_ema.averages()
    assert last.dense and all(
        np.array_equal(arr, averages[dnames[vid]].numpy()) for vid, arr in last.dense.items())

    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(EMA, config.train_config)
    config.model_dir = str(tmp_path / "model_dir")
    path = CheckpointManager(config.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 128},
        {"source": "kafka", "topic": "t"}, config_to_text(config), generation="gen0")
    export = export_checkpoint(config, path, str(tmp_path / "exports"),
                               warn_without_topic=False).path
    served = ServingModel.load(os.path.dirname(export))
    values = records(100, 99)
    batch = fb.build(values).batch
    with tm.dense_ema.swapped():
        want = tm.predict(batch)
    got, rejected = served.predict_values(values)
    assert rejected == []
    assert np.abs(np.asarray(got) - want).max() <= 1e-6
    assert np.abs(np.asarray(got) - tm.predict(batch)).max() > 1e-4  # not the live ones


@pytest.mark.parametrize("edit, field", [
    ("train_config { dense_optimizer { ema { decay: 1.5 } } }",
     "train_config.dense_optimizer.ema.decay"),
    ("eval_config { use_dense_ema: true }", "eval_config.use_dense_ema"),
    ("export_config { use_dense_ema: true }", "export_config.use_dense_ema"),
])
def test_ema_settings_are_refused_by_field(edit: str, field: str) -> None:
    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(EMA.replace("ema { decay: 0.8 }", ""), config.train_config)
    text_format.Merge(edit, config)
    with pytest.raises(ConfigError) as info:
        validate_train_config(config)
    assert info.value.field == field


def test_a_recovery_from_published_averages_goes_on_averaging() -> None:
    """After the parameters take a published average (a recovery from the delta topic), the
    average starts there and the next step averages into it rather than copying."""
    from odl.train.crash_recovery import _recovered_dense_ema

    tm, fb = module(EMA)
    for step in range(2):
        tm.train_step(fb.build(records(48, 80 + step)).batch)
    published = {k: v.clone() for k, v in tm.dense_ema.averages().items()}
    with torch.no_grad():  # what apply_recovered_state writes
        for name, t in tm.dense_parameters().items():
            if name in published:
                t.copy_(published[name])
    _recovered_dense_ema(tm)
    assert all(torch.equal(tm.dense_ema.averages()[n], published[n]) for n in published)
    tm.train_step(fb.build(records(48, 90)).batch)
    live = tm.dense_parameters()
    for name, avg in tm.dense_ema.averages().items():
        torch.testing.assert_close(avg, 0.8 * published[name] + 0.2 * live[name], rtol=1e-6,
                                   atol=1e-7)
