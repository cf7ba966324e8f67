"""Checks every model class passes, shared by the per-model test files: it learns the
Criteo-like stream, an export plus the replayed deltas serve the trainer's predictions, and a
file stream stopped inside a pass and restarted trains every record once."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from odl.config.pipeline_config import parse_pipeline_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import as_model
from tests.test_file_stream import _parity, _saves_config, _serve_from, _write_two_days
from tests.test_online_parity import (
    _check_serving_parity,
    _incr_save,
    _train_with_publishing,
)


def stream_auc(model: str, steps: int) -> float:
    """AUC on 4,000 new records after ``steps`` online steps of 256 on the Criteo-like
    stream (the datagen config as ``model``)."""
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.datagen.synthetic_ctr import SyntheticCtrStream

    config = parse_pipeline_config_text(as_model(deepfm_config_text("/tmp/unused"), model))
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    tm = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=5)
    for _ in range(steps):
        tm.train_step(fb.build(stream.next_batch(256).encode("csv")).batch)
    held = stream.next_batch(4000)
    scores = tm.predict(fb.build(held.encode("csv")).batch)
    labels = np.asarray(held.labels).astype(bool)
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    return float((ranks[labels].sum() - labels.sum() * (labels.sum() + 1) / 2) / (
        labels.sum() * (~labels).sum()))


def serving_replay_diff(model: str, dense_class: str, tmp_path, kafka_bootstrap,
                        kafka_topic_factory, edits: tuple[tuple[str, str], ...] = ()
                        ) -> tuple[dict, float]:
    """Trains ``model`` (its config text with ``edits`` replaced) from Kafka with publishing;
    returns serving's status and the max abs difference between the replayed export's and
    the trainer's predictions."""
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), model=model, edits=edits)
    assert type(trainer.module.model.dense).__name__ == dense_class
    assert trainer.publisher.status()["last_version"] == trainer.module.global_step
    return _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)


def restart_inside_a_pass(model: str, tmp_path, config_edit=lambda text: text) -> float:
    """A file stream of ``model`` stopped at step 22 and restarted: asserts every record
    trained exactly once (the sample ledger); returns the max abs difference between serving
    (the first day's base + the pass deltas) and the restarted trainer."""
    from odl.export.exporter import export_checkpoint

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data, model=model)
    ledger = str(tmp_path / "ledger.tsv")
    runs = []
    for extra in ("num_steps: 22", ""):
        text = as_model(config_edit(_saves_config(tmp_path, str(data), str(saves), extra)),
                        model)
        trainer = Trainer(parse_pipeline_config_text(text),
                          TrainerOptions(online=True, device="cpu", status_port=-1,
                                         sample_ledger=ledger, export_base=export_checkpoint))
        assert trainer.run() == 0
        runs.append(trainer)
    assert runs[0].module.global_step == 22
    trained = [sid for _g, _s, sid in read_ledger(ledger)]
    assert sorted(trained) == sorted(ids) and len(set(trained)) == len(trained)
    service = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert service.model.state.version == runs[1].module.global_step
    return _parity(service, runs[1], 34, values[-170:])
