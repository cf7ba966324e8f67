"""The whole loop: trainer publishes versions, serving replays them onto an older export, and
serving's predictions equal the trainer's at the same step."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from prometheus_client import generate_latest

import odl.config.dynamic_table_config as dynamic_table_config
from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.conversion_labels import conversion_labels
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.http_client import get_json, post_json
from odl.harness.model_configs import MULTI_TASK_MODELS, as_model_config_text, records_for_model
from odl.harness.topic_records import produce
from odl.kafka.topic_admin import end_offsets
from publisher.fs_sink import list_versions
from serving_plugin.serving_service import ServingService
from serving_plugin.serving_tier import DiskTierSettings
from tests.harness import as_model, run_in_process, write_config

PARTS = 3


def _incr_save(kind: str, where: str, value_type: str = "FP32", chunk: int = 900000) -> str:
    sink = (f'kafka {{ server: "{where.split("|")[0]}" topic: "{where.split("|")[1]}" }}'
            if kind == "kafka" else f'fs {{ incr_save_dir: "{where}" }}')
    return (f"incr_save_config {{ sparse_save_steps: 3 dense_save_steps: 3 {sink} "
            f"value_type: {value_type} max_chunk_bytes: {chunk} }}")


# Every id feature's table dynamic (EasyRec's model-wide form), small enough to evict.
DYNAMIC_TABLES = 'model_class: "DeepFM"\n  ev_params { filter_freq: 2 max_capacity: 120 }'
# tables that grow (no capacity written) from 32 rows, to at most GROWING_CAP here
GROWING_TABLES = 'model_class: "DeepFM"\n  ev_params { filter_freq: 2 init_capacity: 32 }'
GROWING_CAP = 512



# model_dir -> the records _train_with_publishing sent
_SENT: dict[str, object] = {}


def _train_with_publishing(tmp_path, bootstrap, topic_factory, incr: str, n: int = 1500,
                           dynamic: bool | str = False, model: str = "DeepFM",
                           edits: tuple[tuple[str, str], ...] = (), records_model: str = ""):
    topic = topic_factory(partitions=PARTS)
    stream = SyntheticCtrStream(seed=41)
    batch = stream.next_batch(n)
    values = records_for_model(records_model or model, stream, batch)
    produce(bootstrap, topic, values, PARTS)
    ends = end_offsets(bootstrap, topic)
    cfg = write_config(tmp_path, bootstrap, topic, batch_size=100, extra_train=incr)
    text = open(cfg).read().replace("save_checkpoints_steps: 50", "save_checkpoints_steps: 4")
    if dynamic:
        text = text.replace('model_class: "DeepFM"',
                            dynamic if isinstance(dynamic, str) else DYNAMIC_TABLES).replace(
            "log_step_count_steps: 20", "log_step_count_steps: 5")
    if dynamic == GROWING_TABLES:  # no capacity written anywhere: the tables grow
        text = re.sub(r"hash_bucket_size: \d+", "", text)
    text = as_model(text, model)
    for edit in edits:
        assert edit[0] in text, edit[0]
        text = text.replace(*edit)
    open(cfg, "w").write(text.replace("keep_checkpoint_max: 3", "keep_checkpoint_max: 10"))
    trainer = run_in_process(cfg, ends)
    _SENT[trainer.config.model_dir] = batch
    return trainer, cfg


def _check_serving_parity(tmp_path, trainer, cfg, bootstrap, serving_kafka: bool = True,
                          tolerance: float = 1e-6, records_model: str = "",
                          disk_tier: DiskTierSettings | None = None,
                          served_out: list | None = None, stream_seed: int = 99):
    """Serving (an early export + replay) predicts what the trainer predicts, every output.

    ``disk_tier``: serve from RAM and disk; ``served_out`` gets the served outputs;
    ``stream_seed``: the requests' stream (99: ids the trainer never saw; 41: its records).
    """
    model_dir = trainer.model_dir
    final_step = trainer.module.global_step
    ckpts = list_checkpoints(model_dir)
    early = ckpts[0]  # a checkpoint well before the final step
    assert read_checkpoint(early).global_step < final_step
    config = load_pipeline_config(cfg)
    if not os.path.isdir(tmp_path / "export"):
        export = export_checkpoint(config, early, str(tmp_path / "export"))
        assert os.path.dirname(export.path) == str(tmp_path / "export")
    service = ServingService(str(tmp_path / "export"), disk_tier=disk_tier)
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
        stream = SyntheticCtrStream(seed=stream_seed)
        sample = stream.next_batch(1000)
        outputs = trainer.module.model.output_names
        records = records_for_model(records_model or trainer.config.model_config.model_class,
                                    stream, sample)
        served = post_json(url + "/predict", b"\n".join(records))
        assert served["version"] == final_step
        assert list(served["outputs"]) == list(outputs)
        built = FeatureBuilder(config).build(records)
        expected = trainer.module.predict(built.batch).reshape(len(records), -1)
        got = np.stack([served["outputs"][n] for n in outputs], axis=1)
        if served_out is not None:
            served_out.append(got)
        assert served["probabilities"] == served["outputs"][outputs[0]]
        diff = float(np.abs(got - expected).max())
        assert diff <= tolerance, diff
        if len(outputs) > 1:  # requests may leave out every label column
            dc = config.data_config
            labels = {i for i, f in enumerate(dc.input_fields) if f.input_name in dc.label_fields}
            bare = [b",".join(v for i, v in enumerate(r.split(b",")) if i not in labels)
                    for r in records]
            again = post_json(url + "/predict", b"\n".join(bare))
            assert again["outputs"] == served["outputs"]
        return status, diff
    finally:
        service.stop()


@pytest.mark.parametrize("model", ["DeepFM", "WideAndDeep", "MultiTower", "MultiTowerDIN",
                                   "DCN", "DCNV2", "MMoE", "DBMTL", "FM"])
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
    elif model in MULTI_TASK_MODELS:  # two tasks; MMoE mixes experts, DBMTL relates cvr
        assert trainer.module.model.output_names == ("ctr", "cvr")
        assert (dense.experts is not None) == (model == "MMoE")
        assert [h.relations for h in dense.heads] == ([[], []] if model == "MMoE" else [[], [0]])
        tasks = trainer.tasks.summary()
        sent = _SENT[trainer.config.model_dir]
        assert set(tasks) == {"ctr", "cvr"} and tasks["cvr"]["samples"] == 1500
        # each task is scored on its own label column (the window holds all 1500)
        assert tasks["ctr"]["positive_rate"] == pytest.approx(sent.labels.mean(), abs=1e-6)
        assert tasks["cvr"]["positive_rate"] == pytest.approx(
            conversion_labels(sent, 41).mean(), abs=1e-6)
    elif model == "MultiTowerDIN":  # the deep tower, then target attention over hist_C3
        assert [type(t).__name__ for t in dense.towers] == ["Sequential", "TargetAttention"]
        assert dense.towers[1].seq_len == 5 and dense.towers[1].width == 8
    elif model == "FM":  # first-order terms (the dense features' too) and the FM term only
        assert type(dense).__name__ == "FMDense" and dense.fm_out is None
        assert dense.wide_dense.in_features == 13 and dense.num_deep == 26
    elif model == "DCNV2":  # the v2 cross network (no backbone), then the deep DNN
        assert [type(m).__name__ for m in dense.towers[0]] == ["Sequential", "CrossNetV2"]
        assert len(dense.towers) == 2 and len(dense.towers[0][1].layers) == 2
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


@pytest.mark.parametrize("model", ["WideAndDeep", "MMoE"])
def test_mixed_embedding_dims_replay_to_parity(kafka_bootstrap, kafka_topic_factory, tmp_path,
                                               model):
    """EasyRec concatenates embeddings of different dims: C2 16 and C5 10 wide among 8s.

    C5's table is stored 12 wide (fbgemm needs a multiple of 4) and read, published and
    exported at 10.
    """
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    edits = tuple((f'input_names: "{c}" feature_type: IdFeature embedding_dim: 8',
                   f'input_names: "{c}" feature_type: IdFeature embedding_dim: {d}')
                  for c, d in (("C2", 16), ("C5", 10)))
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), model=model, edits=edits)
    group = trainer.module.model.pooled_layout[0]
    dims = dict(zip((f for f, _t in group.lookups), group.dims, strict=True))
    assert group.dim == 0 and (dims["C2"], dims["C5"], dims["C1"]) == (16, 10, 8)
    assert trainer.module.embedding_tables()["C5"].shape[1] == 12
    _status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert diff <= 1e-6


def test_projected_raw_features_replay_to_parity(kafka_bootstrap, kafka_topic_factory,
                                                 tmp_path):
    """EasyRec's projected raw features (I1, I2 with an embedding_dim) join DeepFM's FM."""
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    edits = tuple((f'feature_configs {{ input_names: "{f}" feature_type: RawFeature }}',
                   f'feature_configs {{ input_names: "{f}" feature_type: RawFeature '
                   "embedding_dim: 8 }") for f in ("I1", "I2"))
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), edits=edits)
    dense = trainer.module.model.dense
    assert dense.num_projected == 2 and tuple(dense.projection.weight.shape) == (2, 8)
    assert dense.use_fm and len(dense.deep_dense_idx) == 11  # I3..I13 stay raw DNN inputs
    _status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert diff <= 1e-6


@pytest.mark.parametrize("model, combiner", [
    ("DeepFM", "text_cnn { filter_sizes: [2, 3] num_filters: [4, 4] pad_sequence_length: 5 }"),
    ("DCN", "attention {}"),
    ("WideAndDeep", "target attention"),  # the group's sequence_features
    ("MultiTower", "target attention"),
])
def test_sequence_combiners_in_a_feature_group_replay_to_parity(
        kafka_bootstrap, kafka_topic_factory, tmp_path, model, combiner):
    """A SequenceFeature (hist_C3) in the deep group, combined into one vector (EasyRec's
    sequence_combiner; for DeepFM as wide as the FM vectors, so FM includes it)."""
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    din = as_model_config_text(deepfm_config_text("/unused"), "MultiTowerDIN")
    field = next(line for line in din.splitlines() if '"hist_C3" input_type' in line)
    feature = next(line for line in din.splitlines() if 'input_names: "hist_C3"' in line)
    field_edit = ('  input_fields { input_name: "C26" input_type: STRING }\n',
                  '  input_fields { input_name: "C26" input_type: STRING }\n' + field + "\n")
    if combiner == "target attention":  # from C3 over hist_C3, appended to the group
        edits = (field_edit, ("model_config {", feature + "\nmodel_config {"),
                 ("wide_deep: DEEP }", 'wide_deep: DEEP sequence_features { group_name: "s" '
                  'seq_att_map { key: "C3" hist_seq: "hist_C3" } '
                  "seq_dnn { hidden_units: [8, 1] } } }"))
    else:
        edits = (field_edit,
                 ("model_config {", feature[:-1] + f"sequence_combiner {{ {combiner} }} }}\n"
                                    "model_config {"),
                 ('feature_names: "I13" wide_deep: DEEP', 'feature_names: "I13" '
                  'feature_names: "hist_C3" wide_deep: DEEP'))
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), model=model, edits=edits,
        records_model="MultiTowerDIN")
    dense = trainer.module.model.dense
    if model in ("DeepFM", "WideAndDeep"):
        assert dense.num_sequences == 1 and dense.use_fm == (model == "DeepFM")
        assert type(dense.sequences.combiners[0]).__name__ == (
            "TextCNN" if model == "DeepFM" else "TargetAttention")
    else:
        assert type(dense.towers[0][0]).__name__ == "GroupSequences"
    _status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap,
                                          records_model="MultiTowerDIN")
    assert diff <= 1e-6


@pytest.mark.parametrize("growing", [False, True])
def test_dynamic_tables_replay_matches_trainer_predictions(
    kafka_bootstrap, kafka_topic_factory, tmp_path, monkeypatch, growing
):
    """Also with tables that grow while the trainer publishes and checkpoints (increments)."""
    monkeypatch.setattr(dynamic_table_config, "EV_DEFAULT_MAX_CAPACITY", GROWING_CAP)
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"),
        dynamic=GROWING_TABLES if growing else True,
    )
    if growing:
        assert trainer.module.growth.events  # grown while training
    tables = trainer.status()["dynamic_tables"]
    assert tables == trainer.module.dynamic_status()
    metrics = generate_latest(trainer.metrics.registry).decode()
    for key in ("live_rows", "capacity", "admitted", "rejected", "evicted", "memory_bytes"):
        assert f'odl_dynamic_table_{key}{{table="C1"}}' in metrics, key
    assert sum(t["evicted"] for t in tables.values()) > 0  # full tables evicted
    assert sum(t["rejected"] for t in tables.values()) > 0  # ids seen once got no row
    served: list = []  # requests of trained records: their ids have rows
    status, _ = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap,
                                      served_out=served, stream_seed=41)
    assert status["versions_applied"] >= 2
    for name, st in status["dynamic_tables"].items():
        base = name[: -len("_wide")] if name.endswith("_wide") else name
        assert st["live_rows"] == tables[base]["live_rows"], name
    # the same export and versions served with 16 rows a table in RAM, the rest on disk:
    # the same predictions, bit for bit (the requests read hundreds of rows on disk)
    tier = DiskTierSettings(str(tmp_path / "serve_tier"), ram_rows=16)
    tiered, _ = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap, disk_tier=tier,
                                      served_out=served, stream_seed=41)
    assert np.array_equal(served[0], served[1])
    assert tiered["versions_applied"] == status["versions_applied"]
    for name, st in tiered["dynamic_tables"].items():
        assert st["live_rows"] == status["dynamic_tables"][name]["live_rows"], name
        assert st["ram_live"] <= 16 and st["ram_live"] + st["disk_rows"] == st["live_rows"]
    assert sum(st["disk_rows"] for st in tiered["dynamic_tables"].values()) > 100


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

    from odl.models.model_registry import check_pipeline_config
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
    check_pipeline_config(config, online=True)
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
