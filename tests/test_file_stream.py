"""PaddleRec-style file streams: splits read in time order once complete (donefile), late and
missing splits, day boundaries, restarts inside a file, end_day, and the trainer on it."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
from prometheus_client import generate_latest

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.harness.topic_records import make_records
from odl.inputs.file_stream_source import (
    FILE_KEY,
    RECORD_KEY,
    SPLIT_KEY,
    FileStreamSource,
    FileStreamStart,
    split_minute,
)
from odl.models.model_registry import check_pipeline_config
from odl.train.sample_ledger import read_ledger
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import as_model, as_wide_and_deep

DONE = "to.hadoop.done"


def _write_split(root, day: str, hhmm: str, parts: list[list[bytes]], done: bool = True) -> None:
    d = os.path.join(root, day, hhmm)
    os.makedirs(d, exist_ok=True)
    for i, lines in enumerate(parts):
        with open(os.path.join(d, f"part-{i:05d}"), "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))
    if done:
        open(os.path.join(d, DONE), "wb").close()


def _source(root, day="20261124", checkpoint=None, **kw) -> FileStreamSource:
    args = {"batch_size": 4, "split_interval": 5, "data_donefile": DONE,
            "data_sleep_second": 0.0, "batch_timeout_ms": 20} | kw
    src = FileStreamSource(str(root), FileStreamStart(checkpoint, day), **args)
    src.open()
    return src


def _drain(src: FileStreamSource, want: int, timeout: float = 20.0) -> list[tuple]:
    """Reads batches until ``want`` records arrived (a batch may bring more; the assert says
    when it did); returns (value, positions after its batch)."""
    out: list[tuple] = []
    stop = threading.Event()
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        b = src.read_batch(stop)
        if b is not None:
            out += [(v, dict(b.positions)) for v in b.values]
    assert len(out) == want, (len(out), want)
    return out


def _lines(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def test_splits_in_time_order_across_a_day_and_files(tmp_path):
    _write_split(tmp_path, "20261124", "2355", [_lines("a0", 3), _lines("a1", 2)])
    _write_split(tmp_path, "20261125", "0000", [_lines("b0", 5)])
    _write_split(tmp_path, "20261124", "2350", [_lines("z", 2)])
    src = _source(tmp_path, checkpoint={SPLIT_KEY: split_minute("20261124", "2350")})
    got = [v for v, _ in _drain(src, 12)]
    assert got == _lines("z", 2) + _lines("a0", 3) + _lines("a1", 2) + _lines("b0", 5)
    # the last batch ended with its split: past its only file, still in that split
    assert src.positions == {SPLIT_KEY: split_minute("20261125", "0000"), FILE_KEY: 1,
                             RECORD_KEY: 0}


def test_donefile_later_than_the_data(tmp_path):
    _write_split(tmp_path, "20261124", "0000", [_lines("x", 6)], done=False)
    src = _source(tmp_path)
    stop = threading.Event()
    got: list[bytes] = []

    def read() -> None:
        while not stop.is_set() and len(got) < 6:
            b = src.read_batch(stop)
            if b is not None:
                got.extend(b.values)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while src.looks < 3 and time.monotonic() < deadline:  # it looked, and waited
        time.sleep(0.01)
    assert src.looks >= 3 and got == []
    open(os.path.join(tmp_path, "20261124", "0000", DONE), "wb").close()
    t.join(10)
    stop.set()
    assert got == _lines("x", 6)


def test_late_split_is_read_in_order_and_a_missing_one_skipped(tmp_path):
    _write_split(tmp_path, "20261124", "0000", [_lines("s0", 2)])
    _write_split(tmp_path, "20261124", "0010", [_lines("s10", 2)])
    _write_split(tmp_path, "20261124", "0005", [_lines("s5", 2)], done=False)
    src = _source(tmp_path, missing_split_wait_secs=30.0)
    assert [v for v, _ in _drain(src, 2)] == _lines("s0", 2)
    # 0005 is late (0010 is complete): it is waited for, and read first once complete
    open(os.path.join(tmp_path, "20261124", "0005", DONE), "wb").close()
    assert [v for v, _ in _drain(src, 4)] == _lines("s5", 2) + _lines("s10", 2)
    assert src.skipped_splits == 0
    # 0015 never comes; 0020 is complete: 0015 is skipped after the wait, and counted
    _write_split(tmp_path, "20261124", "0020", [_lines("s20", 2)])
    src.missing_wait = 0.2
    t0 = time.monotonic()
    assert [v for v, _ in _drain(src, 2)] == _lines("s20", 2)
    assert time.monotonic() - t0 >= 0.2
    assert src.skipped_splits == 1


def test_restart_inside_a_file_reads_every_record_once(tmp_path):
    _write_split(tmp_path, "20261124", "0000", [_lines("p0", 7), _lines("p1", 5)])
    _write_split(tmp_path, "20261124", "0005", [_lines("q0", 6)])
    everything = _lines("p0", 7) + _lines("p1", 5) + _lines("q0", 6)
    for batches in range(1, 5):  # a checkpoint after 1, 2, 3, 4 batches of 4
        src = _source(tmp_path)
        trained: list[bytes] = []
        positions: dict = {}
        while len(trained) < 4 * batches:
            b = src.read_batch(threading.Event())
            if b is not None:
                trained += b.values
                positions = dict(b.positions)
        assert len(trained) == 4 * batches  # batches never span short: files are ready
        rest = _drain(_source(tmp_path, checkpoint=positions), len(everything) - len(trained))
        assert trained + [v for v, _ in rest] == everything, batches


def test_end_day_ends_the_stream(tmp_path):
    _write_split(tmp_path, "20261124", "2355", [_lines("d1", 3)])
    _write_split(tmp_path, "20261125", "0000", [_lines("d2", 3)])
    src = _source(tmp_path, checkpoint={SPLIT_KEY: split_minute("20261124", "2355")},
                  end_day="20261124")
    assert [v for v, _ in _drain(src, 3)] == _lines("d1", 3)
    with pytest.raises(StopIteration):
        src.read_batch(threading.Event())


def test_without_donefile_a_split_is_complete_once_a_later_one_exists(tmp_path):
    _write_split(tmp_path, "20261124", "0000", [_lines("n", 2)], done=False)
    src = _source(tmp_path, data_donefile="")
    stop = threading.Event()

    def stop_after_looks() -> None:
        deadline = time.monotonic() + 10
        while src.looks < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()

    threading.Thread(target=stop_after_looks, daemon=True).start()
    assert src.read_batch(stop) is None and src.looks >= 3  # looked, found nothing complete
    _write_split(tmp_path, "20261124", "0005", [], done=False)
    assert [v for v, _ in _drain(src, 2)] == _lines("n", 2)


def _config(tmp_path, data_dir: str, end_day: str) -> str:
    """The DeepFM on a file stream; in-batch learning off (these are the stream's plumbing
    tests, cheaper with the batched step; as in ``tests.harness.write_config``)."""
    text = deepfm_config_text(str(tmp_path / "model_dir"), batch_size=50,
                              extra_train="in_batch_learning: false")
    fs = (f'file_stream_input {{ train_data_dir: "{data_dir}" split_interval: 60 '
          f'start_day: "20261124" end_day: "{end_day}" data_donefile: "{DONE}" '
          f"data_sleep_second: 0 missing_split_wait_secs: 0 }}")
    return re.sub(r"kafka_train_input \{[^}]*\}", fs, text, count=1)


def _train(tmp_path, text: str, ledger: str) -> Trainer:
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1,
                                             sample_ledger=ledger))
    assert trainer.run() == 0
    assert trainer.stop_reason == "end of input"
    return trainer


def test_trainer_reads_a_file_stream_exactly_once_across_a_restart(tmp_path):
    data = tmp_path / "data"
    ids, values = make_records(900, seed=5)
    chunks = [values[i : i + 150] for i in range(0, 900, 150)]
    _write_split(data, "20261124", "2200", [chunks[0], chunks[1][:70]])
    _write_split(data, "20261124", "2300", [chunks[1][70:], chunks[2]])
    _write_split(data, "20261125", "0000", [chunks[3]])
    # the second day's last split: 0100 .. 2200 never come (skipped: missing_split_wait_secs 0)
    _write_split(data, "20261125", "2300", [chunks[4], chunks[5]])
    ledger = str(tmp_path / "ledger.tsv")
    first = _train(tmp_path, _config(tmp_path, str(data), "20261124"), ledger)
    assert first.samples_trained == 450  # the first day's splits (0000 .. 2100 skipped)
    # one split per pass: pass 23 (2200) and pass 24 (2300), each with its progressive AUC
    passes = first.status()["passes"]
    assert [(p["day"], p["pass"], p["samples"]) for p in passes["passes"]] == [
        ("20261124", 23, 220), ("20261124", 24, 230)]  # batches end with their split
    assert all(0.0 < p["auc"] < 1.0 and p["logloss"] > 0 for p in passes["passes"])
    source = first.status()["input"]["source"]  # as the input process last reported
    assert source["skipped_splits"] == 22 and source["splits_read"] >= 1  # 0000 .. 2100
    metrics = generate_latest(first.metrics.registry).decode()
    assert "odl_pass_samples 230.0" in metrics
    # checkpoint_per_pass 1: a checkpoint at each pass's end (before the next pass's records)
    steps = sorted(read_checkpoint(c).global_step for c in list_checkpoints(first.model_dir))
    assert steps == [5, 10]  # pass 23: 220 samples = 4 batches of 50 and one of 20
    second = _train(tmp_path, _config(tmp_path, str(data), "20261125"), ledger)
    assert second.samples_trained == 450  # only the second day: the checkpoint resumed
    trained = [sid for _g, _s, sid in read_ledger(ledger)]
    assert sorted(trained) == sorted(ids) and len(set(trained)) == len(trained)
    assert second.positions == {SPLIT_KEY: split_minute("20261125", "2300"), FILE_KEY: 1,
                                RECORD_KEY: 150}


def test_file_stream_config_errors(tmp_path):
    text = _config(tmp_path, str(tmp_path / "data"), "20261125")
    for bad, field in (('start_day: "20261124"', "start_day"),
                       ("split_interval: 60", "split_interval")):
        broken = text.replace(bad, {"start_day": 'start_day: "2026-11-24"',
                                    "split_interval": "split_interval: 7"}[field])
        with pytest.raises(ConfigError, match=field):
            check_pipeline_config(parse_pipeline_config_text(broken), online=True)


def test_datagen_writes_splits_the_source_reads(tmp_path, capsys):
    from odl.cli.datagen_cli import main as datagen

    assert datagen(["--split-dir", str(tmp_path), "--day", "20261124", "--start", "2350",
                    "--splits", "3", "--count", "7", "--parts", "2", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["splits"] == ["20261124/2350", "20261124/2355", "20261125/0000"]
    assert sorted(os.listdir(tmp_path / "20261125" / "0000")) == [
        "part-00000", "part-00001", DONE]
    src = _source(tmp_path, checkpoint={SPLIT_KEY: split_minute("20261124", "2350")},
                  end_day="20261125", missing_split_wait_secs=0.0)
    got = _drain(src, 21)
    assert len({v for v, _ in got}) == 21  # every record once (sample ids differ)
    assert datagen(["--split-dir", str(tmp_path), "--splits", "1"]) == 2  # no --count


# Every id feature's table dynamic and small enough to evict: deltas carry deletes.
_DYNAMIC = 'model_class: "DeepFM"\n  ev_params { filter_freq: 2 max_capacity: 120 }'
# C1 as a PaddleRec table whose only maintenance is the day's shrink (rows shown under 8
# times without a click score under 0.8 and are deleted then); the rest fixed-size
_SHRINK = ('hash_bucket_size: 2000 ctr_accessor_param { embedx_threshold: 0 delete_threshold: '
           '0.8 shrink_interval_steps: 100000 capacity: 400 base_threshold: 0 '
           'delta_threshold: 0 } }')


def _saves_config(tmp_path, data_dir: str, saves: str, extra_train: str = "",
                  dynamic: str = _DYNAMIC) -> str:
    text = _config(tmp_path, data_dir, "20261125").replace('model_class: "DeepFM"', dynamic)
    text = text.replace("missing_split_wait_secs: 0", f'missing_split_wait_secs: 0 '
                        f'model_save_path: "{saves}" train_auc_samples: 100')
    return text.replace("train_config {", "train_config {\n  " + extra_train, 1)


def _serve_from(base: str, saves: str):
    from serving_plugin.serving_service import ServingService

    service = ServingService(base, delta_dir=saves)
    assert service.follower is not None
    service.follower.catch_up()
    return service


def _parity(service, trainer, seed: int, records: list[bytes] | None = None) -> float:
    from odl.features.feature_builder import FeatureBuilder

    records = records or make_records(300, seed=seed)[1]
    fb = FeatureBuilder(trainer.config)
    want = trainer.module.predict(fb.build(records).batch)
    got = service.model.predict_batch(fb.build(records).batch)
    return float(abs(want - got).max())


def _write_two_days(data, model: str = "DeepFM") -> tuple[list[str], list[bytes]]:
    ids, values = make_records(1200, seed=8, model=model)
    chunks = [values[i : i + 200] for i in range(0, 1200, 200)]
    _write_split(data, "20261124", "2200", [chunks[0]])
    _write_split(data, "20261124", "2300", [chunks[1][:120], chunks[1][120:]])
    _write_split(data, "20261125", "0000", [chunks[2], chunks[3]])
    # splits that are not whole batches: a split's last batch is short, never mixed with the
    # next split (or counted in a day past end_day)
    _write_split(data, "20261125", "0100", [chunks[4], chunks[5][:30]])
    _write_split(data, "20261125", "2300", [chunks[5][30:]])
    return ids, values


def _train_all_once(tmp_path, text: str, ids: list[str]) -> Trainer:
    """Trains a saving config's two days to the end: every record once (ledger)."""
    from odl.export.exporter import export_checkpoint

    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1,
                                             sample_ledger=ledger,
                                             export_base=export_checkpoint))
    assert trainer.run() == 0 and trainer.samples_trained == len(ids)
    assert sorted(sid for _g, _s, sid in read_ledger(ledger)) == sorted(ids)
    return trainer


def _shrinking_saves_config(tmp_path, data_dir: str, saves: str) -> str:
    """A saving config with C1 a table shrunk at each day's end and C2 a dynamic one."""
    text = _saves_config(tmp_path, data_dir, saves, dynamic='model_class: "DeepFM"')
    text = text.replace('input_names: "C1" feature_type: IdFeature embedding_dim: 8 '
                        'hash_bucket_size: 2000 }',
                        'input_names: "C1" feature_type: IdFeature embedding_dim: 8 ' + _SHRINK)
    return text.replace('input_names: "C2" feature_type: IdFeature embedding_dim: 8 '
                        'hash_bucket_size: 2000 }',
                        'input_names: "C2" feature_type: IdFeature embedding_dim: 8 '
                        'hash_bucket_size: 2000 ev_params { filter_freq: 2 max_capacity: 60 } }')


def test_day_and_pass_saves_replay_in_order_to_serving_parity(tmp_path):

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data)
    text = _shrinking_saves_config(tmp_path, str(data), str(saves))
    trainer = _train_all_once(tmp_path, text, ids)
    # the layout: a starting base (the day before the first split), per pass a delta and a
    # checkpoint (checkpoint_per_pass 1), a base at each day's end
    day1, day2 = sorted(os.listdir(saves / "20261124")), sorted(os.listdir(saves / "20261125"))
    assert sorted(os.listdir(saves)) == ["20261123", "20261124", "20261125"]
    assert day1 == ["23", "24", "base", "delta_23", "delta_24"]
    assert day2 == ["1", "2", "24", "base", "delta_1", "delta_2", "delta_24"]
    final_step = trainer.module.global_step
    assert read_checkpoint(str(saves / "20261125" / "24")).global_step == final_step
    passes = trainer.status()["passes"]["passes"]
    assert [(p["day"], p["pass"]) for p in passes] == [
        ("20261124", 23), ("20261124", 24), ("20261125", 1), ("20261125", 2), ("20261125", 24)]
    # train AUC: each pass's sampled records scored after training on the pass; the model
    # fits what it trained on better than it predicted it
    assert all(p["train_auc_samples"] >= 100 and 0 < p["train_auc"] <= 1 for p in passes)
    assert sum(p["train_auc"] for p in passes) > sum(p["auc"] for p in passes)
    assert "odl_pass_train_auc" in generate_latest(trainer.metrics.registry).decode()
    shrunk = trainer.module.dynamic.tables["C1"].counters
    assert shrunk.expired > 0 and shrunk.expired == shrunk.evicted  # only the days' shrinks
    metrics = generate_latest(trainer.metrics.registry).decode()
    assert "odl_pass_deltas_total 5.0" in metrics and "odl_day_bases_total 3.0" in metrics
    # serving: the starting base + every delta in (day, pass) order = the trainer's model
    # a delta not complete yet (no marker) holds back the later ones: deltas apply in order
    marker = next((saves / "20261124" / "delta_24").glob("*.delta.done"))
    marker.rename(marker.with_name("held-back"))
    first = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert first.follower.deltas_applied == 1  # 20261124/delta_23 only
    marker.with_name("held-back").rename(marker)
    first.follower.catch_up()
    assert first.follower.deltas_applied == 5
    assert first.model.state.version == trainer.module.global_step
    assert _parity(first, trainer, 31) <= 1e-6
    assert _parity(first, trainer, 0, values) <= 1e-6  # every id trained on
    # the first day's base + the second day's deltas: the same model
    second = _serve_from(str(saves / "20261124" / "base"), str(saves))
    assert second.follower.deltas_applied == 3
    assert _parity(second, trainer, 0, values) <= 1e-6
    assert first.status()["pass_deltas"]["last_applied"] == "20261125/delta_24"
    assert first.metrics.deletes._value.get() > 0  # evictions reached serving as deletes
    # the last day's base alone is the final model
    last = _serve_from(str(saves / "20261125" / "base"), str(saves))
    assert last.follower.deltas_applied == 0 and _parity(last, trainer, 0, values) <= 1e-6


@pytest.mark.parametrize("model", ["DeepFM", "WideAndDeep", "MultiTower", "MultiTowerDIN",
                                   "DCN", "DCNV2", "MMoE", "DBMTL", "FM"])
def test_restart_inside_a_pass_keeps_every_record_once_and_the_pass_delta_whole(tmp_path,
                                                                               model):
    from odl.export.exporter import export_checkpoint

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data, model=model)
    ledger = str(tmp_path / "ledger.tsv")
    # stopped at step 22, inside the last pass (20261125/24: steps 22 .. 25), with a
    # checkpoint there; the restart must still write that pass's whole delta, rows touched
    # before the stop included (every id admitted: rare ids touched only before the stop)
    runs = []
    for extra in ("num_steps: 22", ""):
        text = _saves_config(tmp_path, str(data), str(saves), extra,
                             dynamic='model_class: "DeepFM"\n  ev_params { max_capacity: 4000 }')
        if model == "WideAndDeep":  # with final_dnn: [wide, deep] joined by a tower
            text = as_wide_and_deep(text, final_dnn=True)
        else:
            text = as_model(text, model)
        config = parse_pipeline_config_text(text)
        trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1,
                                                 sample_ledger=ledger,
                                                 export_base=export_checkpoint))
        assert trainer.run() == 0
        if not runs:
            assert trainer.module.global_step == 22
            assert not os.path.exists(saves / "20261125" / "delta_24")
        runs.append(trainer)
    assert os.path.exists(saves / "20261125" / "delta_24")
    trained = [sid for _g, _s, sid in read_ledger(ledger)]
    assert sorted(trained) == sorted(ids) and len(set(trained)) == len(trained)
    service = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert service.model.state.version == runs[1].module.global_step
    assert _parity(service, runs[1], 34, values[-170:]) <= 1e-6  # the last pass's records


def test_kafka_publishing_and_pass_deltas_both_reach_serving_parity(kafka_bootstrap,
                                                                    kafka_topic_factory, tmp_path):
    from odl.export.exporter import export_checkpoint
    from serving_plugin.serving_service import ServingService

    data, saves = tmp_path / "data", tmp_path / "saves"
    _ids, values = _write_two_days(data)
    topic = kafka_topic_factory(prefix="fs-deltas", create=False)
    incr = (f'incr_save_config {{ sparse_save_steps: 3 dense_save_steps: 3 kafka {{ server: '
            f'"{kafka_bootstrap}" topic: "{topic}" }} }}')
    config = parse_pipeline_config_text(_saves_config(tmp_path, str(data), str(saves), incr))
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1,
                                             export_base=export_checkpoint))
    assert trainer.run() == 0 and trainer.samples_trained == 1200
    final = trainer.module.global_step
    assert trainer.status()["publisher"]["last_version"] == final
    # the delta topic, replayed onto an export of the first pass's checkpoint
    export = export_checkpoint(config, str(saves / "20261124" / "23"), str(tmp_path / "export"))
    kafka = ServingService(export.path)
    assert kafka.replayer is not None
    kafka.replayer.start()
    try:
        deadline = time.monotonic() + 60
        while kafka.model.state.version != final and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kafka.model.state.version == final
        assert _parity(kafka, trainer, 0, values) <= 1e-6
    finally:
        kafka.stop()
    # the pass deltas: the same model; each writer got every delete
    files = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert _parity(files, trainer, 0, values) <= 1e-6
    assert files.metrics.deletes._value.get() > 0 and kafka.metrics.deletes._value.get() > 0


def test_recovery_past_the_checkpoint_still_ends_the_pass_it_was_in(kafka_bootstrap,
                                                                   kafka_topic_factory, tmp_path):
    """A trainer publishing a version every step to Kafka stops right after the first pass's
    last record and its last checkpoint is lost (a kill after publishing): the next start
    recovers to the last version, resumes the pass that version ended inside, and ends it at
    the next pass's first batch (its delta and checkpoint copy); the deltas serve the model."""
    import shutil

    from odl.export.exporter import export_checkpoint

    data, saves = tmp_path / "data", tmp_path / "saves"
    _ids, values = _write_two_days(data)
    topic = kafka_topic_factory(prefix="fs-recover", create=False)
    incr = (f'incr_save_config {{ sparse_save_steps: 1 dense_save_steps: 1 kafka {{ server: '
            f'"{kafka_bootstrap}" topic: "{topic}" }} }}')
    text = _saves_config(tmp_path, str(data), str(saves), incr)
    model_dir = str(tmp_path / "model_dir")
    for num_steps in (4, 0):  # pass 23 (split 2200): 200 records, 4 batches of 50
        config = parse_pipeline_config_text(text.replace(
            "train_config {", f"train_config {{\n  num_steps: {num_steps}", 1)
            if num_steps else text)
        trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1,
                                                 export_base=export_checkpoint))
        assert trainer.run() == 0
        if num_steps:
            assert not os.path.exists(saves / "20261124" / "delta_23")  # not ended yet
            last = list_checkpoints(model_dir)[-1]
            assert read_checkpoint(last).global_step == 4
            shutil.rmtree(last)  # killed after publishing version 4, before its checkpoint
    assert trainer.recovery is not None and trainer.recovery["version"] == 4
    assert sorted(os.listdir(saves / "20261124")) == ["23", "24", "base", "delta_23",
                                                      "delta_24"]
    assert _parity(_serve_from(str(saves / "20261123" / "base"), str(saves)), trainer, 0,
                   values) <= 1e-6


def _checkpoint_steps_by_generation(model_dir: str) -> dict[str, int]:
    """Generation -> the last step it checkpointed (the state its successor restored)."""
    last: dict[str, int] = {}
    for path in list_checkpoints(model_dir):
        with open(os.path.join(path, "MANIFEST.json")) as f:
            manifest = json.load(f)
        gen = manifest.get("generation", "")
        last[gen] = max(last.get(gen, -1), int(manifest["global_step"]))
    return last


@pytest.mark.slow
def test_kill_9_inside_passes_every_record_once_and_deltas_replay_to_the_last_base(tmp_path):
    import signal
    import subprocess

    from odl.harness.exactly_once_audit import reflected_exactly_once
    from odl.harness.trainer_process import start_cli_trainer

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data)
    text = _saves_config(tmp_path, str(data), str(saves)).replace(
        "save_checkpoints_steps: 50", "save_checkpoints_steps: 3").replace(
        "keep_checkpoint_max: 3", "keep_checkpoint_max: 100")
    cfg = tmp_path / "pipeline.config"
    cfg.write_text(text)
    ledger, log = str(tmp_path / "ledger.tsv"), str(tmp_path / "train.log")

    def trained() -> int:
        return len(read_ledger(ledger)) if os.path.exists(ledger) else 0

    # two kills inside passes (ledger lines of all runs so far), then a run to the end
    for kill_at in (350, 800):
        proc = start_cli_trainer(str(cfg), log, "--sample_ledger", ledger)
        try:
            deadline = time.monotonic() + 120
            while trained() < kill_at and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert proc.poll() is None, open(log).read()[-3000:]
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(30)
    final = start_cli_trainer(str(cfg), log, "--sample_ledger", ledger)
    try:
        assert final.wait(180) == 0, open(log).read()[-3000:]
    except subprocess.TimeoutExpired:
        final.kill()
        raise
    # what each run trained up to its last checkpoint is in the model, the rest was retrained
    lost, twice = reflected_exactly_once(ids, read_ledger(ledger),
                                         _checkpoint_steps_by_generation(str(tmp_path /
                                                                             "model_dir")))
    assert not lost and not twice, (len(lost), len(twice))
    # the starting base + every pass delta (some rewritten by a retrained pass) = the last base
    chain = _serve_from(str(saves / "20261123" / "base"), str(saves))
    last = _serve_from(str(saves / "20261125" / "base"), str(saves))
    assert chain.model.state.version == last.model.state.version
    from odl.features.feature_builder import FeatureBuilder

    fb = FeatureBuilder(parse_pipeline_config_text(text))
    got = chain.model.predict_batch(fb.build(values).batch)
    want = last.model.predict_batch(fb.build(values).batch)
    assert float(abs(got - want).max()) <= 1e-6


def test_bad_records_of_a_file_stream_are_dead_lettered_with_their_split(kafka_bootstrap,
                                                                         kafka_topic_factory,
                                                                         tmp_path):
    from odl.harness.topic_records import read_messages
    from odl.inputs.dead_letter import REASON_HEADER, SOURCE_HEADER

    data = tmp_path / "data"
    ids, values = make_records(200, seed=12)
    bad = [b"not,a,record", b"also-bad"]
    _write_split(data, "20261124", "2300", [values[:100], values[100:150] + bad + values[150:]])
    text = _config(tmp_path, str(data), "20261124")
    dlq = kafka_topic_factory(prefix="fs-dlq", create=False)
    text = text.replace("batch_size: 50", f'batch_size: 50 dead_letter_topic: "{dlq}"')
    config = parse_pipeline_config_text(text)
    with pytest.raises(ConfigError, match="dead_letter_server"):  # no Kafka input to borrow
        check_pipeline_config(config, online=True)
    config.data_config.dead_letter_server = kafka_bootstrap
    check_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    assert trainer.run() == 0 and trainer.samples_trained == 200
    assert trainer.records_rejected == {"field_count": 2}
    letters = read_messages(kafka_bootstrap, dlq, 2)
    assert [v for v, _h in letters] == bad  # unchanged, where they were in the split
    split = str(data / "20261124" / "2300")
    assert [h[SOURCE_HEADER].decode() for _v, h in letters] == [f"{split}/1/50", f"{split}/1/51"]
    assert all(h[REASON_HEADER] == b"field_count" for _v, h in letters)


def test_file_stream_and_day_pass_saves_on_oss(oss, tmp_path):
    """train_data_dir and model_save_path on OSS (the loopback double): same layout, same
    exactly-once reading, and serving from the OSS base plus the OSS deltas."""
    from odl.storage import file_store

    local = tmp_path / "local-data"
    ids, values = _write_two_days(local)
    data, saves = "oss://odl-test/stream", "oss://odl-test/saves"
    file_store.upload_tree(str(local), data, last=(DONE,))
    trainer = _train_all_once(tmp_path, _saves_config(tmp_path, data, saves), ids)
    assert file_store.list_dir(saves)[0] == ["20261123", "20261124", "20261125"]
    assert "delta_24" in file_store.list_dir(f"{saves}/20261125")[0]
    service = _serve_from(f"{saves}/20261123/base", saves)
    assert service.follower.deltas_applied == 5
    assert _parity(service, trainer, 0, values) <= 1e-6


def test_grouped_auc_metric_reports_gauc_by_its_grouping_column(tmp_path):
    """TorchEasyRec's metrics { grouped_auc { grouping_key } }: GAUC beside AUC."""
    from odl.features.feature_builder import FeatureBuilder

    data = tmp_path / "data"
    _ids, values = make_records(600, seed=12)
    _write_split(data, "20261124", "2300", [values])
    text = _config(tmp_path, str(data), "20261124").replace(
        'model_class: "DeepFM"',
        'model_class: "DeepFM"\n  metrics { auc {} }\n'
        '  metrics { grouped_auc { grouping_key: "C9" } }')
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    built = FeatureBuilder(config).build(values[:200]).batch
    c9 = [v.split(b",")[3 + 13 + 8] for v in values[:200]]  # C9: 3 meta, 13 dense, C1..C8
    keys = built.group_keys.tolist()
    for i in range(1, 200):  # the same C9 value, the same group; different values differ
        assert (keys[i] == keys[0]) == (c9[i] == c9[0])
    trainer = _train(tmp_path, text, str(tmp_path / "ledger.tsv"))
    progressive = trainer._status.document()["progressive"]
    assert 0.0 <= progressive["gauc"] <= 1.0 and progressive["samples"] == 600
    assert "odl_progressive_gauc" in generate_latest(trainer.metrics.registry).decode()
