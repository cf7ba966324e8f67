"""The whole loop: trainer publishes versions, serving replays them onto an older export, and
serving's predictions equal the trainer's at the same step."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from prometheus_client import generate_latest

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.http_client import get_json, post_json
from odl.harness.topic_records import produce
from odl.kafka.topic_admin import end_offsets
from publisher.fs_sink import list_versions
from serving_plugin.serving_service import ServingService
from tests.harness import as_model, run_in_process, write_config

PARTS = 3


def _incr_save(kind: str, where: str, value_type: str = "FP32", chunk: int = 900000) -> str:
    sink = (f'kafka {{ server: "{where.split("|")[0]}" topic: "{where.split("|")[1]}" }}'
            if kind == "kafka" else f'fs {{ incr_save_dir: "{where}" }}')
    return (f"incr_save_config {{ sparse_save_steps: 3 dense_save_steps: 3 {sink} "
            f"value_type: {value_type} max_chunk_bytes: {chunk} }}")


# Every id feature's table dynamic (EasyRec's model-wide form), small enough to evict.
DYNAMIC_TABLES = 'model_class: "DeepFM"\n  ev_params { filter_freq: 2 max_capacity: 120 }'



def _train_with_publishing(tmp_path, bootstrap, topic_factory, incr: str, n: int = 1500,
                           dynamic: bool = False, model: str = "DeepFM"):
    topic = topic_factory(partitions=PARTS)
    batch = SyntheticCtrStream(seed=41).next_batch(n)
    produce(bootstrap, topic, batch.encode("csv"), PARTS)
    ends = end_offsets(bootstrap, topic)
    cfg = write_config(tmp_path, bootstrap, topic, batch_size=100, extra_train=incr)
    text = open(cfg).read().replace("save_checkpoints_steps: 50", "save_checkpoints_steps: 4")
    if dynamic:
        text = text.replace('model_class: "DeepFM"', DYNAMIC_TABLES).replace(
            "log_step_count_steps: 20", "log_step_count_steps: 5")
    text = as_model(text, model)
    open(cfg, "w").write(text.replace("keep_checkpoint_max: 3", "keep_checkpoint_max: 10"))
    trainer = run_in_process(cfg, ends)
    return trainer, cfg


def _check_serving_parity(tmp_path, trainer, cfg, bootstrap, serving_kafka: bool = True,
                          tolerance: float = 1e-6):
    model_dir = trainer.model_dir
    final_step = trainer.module.global_step
    ckpts = list_checkpoints(model_dir)
    early = ckpts[0]  # a checkpoint well before the final step
    assert read_checkpoint(early).global_step < final_step
    config = load_pipeline_config(cfg)
    export = export_checkpoint(config, early, str(tmp_path / "export"))
    assert os.path.dirname(export.path) == str(tmp_path / "export")
    service = ServingService(str(tmp_path / "export"))
    port = service.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        status = {}
        while time.time() < deadline:
            status = get_json(url + "/status", timeout=10) or {}
            if status.get("version") == final_step:
                break
            time.sleep(0.2)
        assert status.get("version") == final_step, status
        records = SyntheticCtrStream(seed=99).next_batch(1000).encode("csv")
        served = post_json(url + "/predict", b"\n".join(records))
        assert served["version"] == final_step
        built = FeatureBuilder(config).build(records)
        expected = trainer.module.predict(built.batch)
        got = np.asarray(served["probabilities"], dtype=np.float64)
        diff = float(np.abs(got - expected).max())
        assert diff <= tolerance, diff
        return status, diff
    finally:
        service.stop()


@pytest.mark.parametrize("model", ["DeepFM", "WideAndDeep", "MultiTower", "DCN"])
def test_serving_replay_matches_trainer_predictions(
    kafka_bootstrap, kafka_topic_factory, tmp_path, model
):
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), model=model,
    )
    dense = trainer.module.model.dense
    if model in ("DeepFM", "WideAndDeep"):
        assert type(dense).__name__ == "DeepFMDense" and dense.use_fm == (model == "DeepFM")
    else:  # one tower per group for MultiTower; a DNN and a cross network for DCN
        kinds = [type(t).__name__ for t in dense.towers]
        assert kinds == (["Sequential", "Sequential"] if model == "MultiTower"
                         else ["Sequential", "CrossNet"])
    pub = trainer.publisher.status()
    assert pub["last_version"] == trainer.module.global_step
    status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert status["versions_applied"] >= 2
    # the final checkpoint records where replay continues after the last version: just
    # after its last chunk, i.e. at its transaction's commit marker, the topic's last offset
    last = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
    assert last.source["delta_topic_offset"] == end_offsets(kafka_bootstrap, delta_topic)[0] - 1


def test_dynamic_tables_replay_matches_trainer_predictions(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), dynamic=True,
    )
    tables = trainer.status()["dynamic_tables"]
    assert tables == trainer.module.dynamic_status()
    metrics = generate_latest(trainer.metrics.registry).decode()
    for key in ("live_rows", "capacity", "admitted", "rejected", "evicted", "memory_bytes"):
        assert f'odl_dynamic_table_{key}{{table="C1"}}' in metrics, key
    assert sum(t["evicted"] for t in tables.values()) > 0  # full tables evicted
    assert sum(t["rejected"] for t in tables.values()) > 0  # ids seen once got no row
    status, _ = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert status["versions_applied"] >= 2
    for name, st in status["dynamic_tables"].items():
        base = name[: -len("_wide")] if name.endswith("_wide") else name
        assert st["live_rows"] == tables[base]["live_rows"], name


def test_chunked_fp16_versions_replay_within_tolerance(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    delta_topic = f"odl-deltas-fp16-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}", value_type="FP16", chunk=20000),
    )
    # many chunks per version; fp16 values: documented tolerance 2e-3 on probabilities
    assert trainer.publisher.status()["last_chunks"] > 1
    _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap, tolerance=2e-3)


def test_fs_sink_writes_the_same_versions_as_kafka(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    incr_dir = tmp_path / "incr"
    trainer, _ = _train_with_publishing(tmp_path, kafka_bootstrap, kafka_topic_factory,
                                        _incr_save("fs", str(incr_dir)))
    versions = [int(os.path.basename(p).split("-")[0]) for p in list_versions(str(incr_dir))]
    assert len(versions) >= 2
    assert versions == sorted(versions)
    assert versions[-1] == trainer.module.global_step


def test_idle_input_publishes_the_last_steps(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """Steps-based publishing alone would hold back the tail of a burst until more data came."""
    import threading

    from odl.config.config_validation import validate_pipeline_config
    from odl.train.trainer import Trainer, TrainerOptions

    topic = kafka_topic_factory(partitions=PARTS)
    produce(kafka_bootstrap, topic, SyntheticCtrStream(seed=42).next_batch(700).encode("csv"),
            PARTS)
    ends = end_offsets(kafka_bootstrap, topic)
    delta_topic = f"odl-deltas-idle-{os.getpid()}-{time.time_ns()}"
    incr = _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}").replace(
        "sparse_save_steps: 3 dense_save_steps: 3",
        "sparse_save_steps: 1000 dense_save_steps: 1000",
    )
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=100, extra_train=incr)
    config = load_pipeline_config(cfg)
    validate_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    runner = threading.Thread(target=trainer.run, daemon=True)
    runner.start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            pos = dict(trainer.positions)
            published = (trainer.publisher.status().get("last_version")
                         if trainer.publisher is not None else None)
            if pos == ends and published == trainer.module.global_step:
                break
            time.sleep(0.1)
        assert dict(trainer.positions) == ends
        # the whole burst is published while the trainer keeps running, not only at its stop
        assert trainer.publisher.status()["last_version"] == trainer.module.global_step
        assert trainer.state == "training"
    finally:
        trainer.request_stop("test done")
        runner.join(60)
