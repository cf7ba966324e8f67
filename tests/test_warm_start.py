"""Offline training from files, then an online warm start from its checkpoint (with a var map)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.harness.topic_records import produce
from odl.kafka.topic_admin import end_offsets
from odl.models.model_registry import check_pipeline_config
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import REPO

PARTS = 2


def _write_csv(path, n, seed):
    batch = SyntheticCtrStream(seed=seed).next_batch(n)
    with open(path, "wb") as f:
        for v in batch.encode("csv"):
            f.write(v + b"\n")
    return batch


def _offline_model_dir(tmp_path, steps: int = 60) -> str:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _write_csv(data_dir / "part-0.csv", 3000, seed=31)
    _write_csv(data_dir / "part-1.csv", 3000, seed=32)
    model_dir = tmp_path / "offline"
    cfg = tmp_path / "offline.config"
    cfg.write_text(deepfm_config_text(str(model_dir), batch_size=100))
    res = subprocess.run(
        [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", str(cfg),
         "--train_input_path", str(data_dir / "*.csv"), "--device", "cpu", "--status_port", "-1",
         "--edit_config_json", json.dumps({"train_config.num_steps": steps})],
        capture_output=True, text=True, cwd=REPO, timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return str(model_dir)


def test_offline_training_reads_csv_and_parquet(tmp_path):
    batch = SyntheticCtrStream(seed=33).next_batch(500)
    pq.write_table(pa.Table.from_pylist(batch.to_records()), tmp_path / "a.parquet")
    _write_csv(tmp_path / "b.csv", 300, seed=34)
    model_dir = tmp_path / "m"
    cfg = tmp_path / "p.config"
    cfg.write_text(deepfm_config_text(str(model_dir), batch_size=100))
    config = load_pipeline_config(str(cfg))
    config.train_input_path = f"{tmp_path}/a.parquet,{tmp_path}/b.csv"
    check_pipeline_config(config, online=False)
    trainer = Trainer(config, TrainerOptions(online=False, device="cpu", status_port=-1))
    assert trainer.run() == 0
    assert trainer.stop_reason == "end of input"
    assert trainer.samples_trained == 800
    assert trainer.records_rejected == {}
    ckpt = read_checkpoint(list_checkpoints(str(model_dir))[-1])
    assert ckpt.global_step == 8


def _first_step_loss(config_text: str, tmp_path, name: str, bootstrap: str, topic: str) -> float:
    path = tmp_path / f"{name}.config"
    path.write_text(config_text)
    config = load_pipeline_config(str(path))
    config.train_config.num_steps = 1
    # the loss at the starting state: in-batch learning would shift the step's predictions
    # by what the batch's earlier records teach
    config.train_config.in_batch_learning = False
    check_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    assert trainer.run() == 0
    assert trainer.module.global_step == 1
    return trainer.last_loss


@pytest.mark.slow
def test_warm_start_lowers_the_starting_loss(kafka_bootstrap, kafka_topic_factory, tmp_path):
    offline_dir = _offline_model_dir(tmp_path)
    topic = kafka_topic_factory(partitions=PARTS)
    batch = SyntheticCtrStream(seed=35).next_batch(400)
    produce(kafka_bootstrap, topic, batch.encode("csv"), PARTS)
    assert sum(end_offsets(kafka_bootstrap, topic).values()) == 400
    base = dict(server=kafka_bootstrap, topic=topic, batch_size=400)
    cold = _first_step_loss(deepfm_config_text(str(tmp_path / "cold"), **base), tmp_path, "cold",
                            kafka_bootstrap, topic)
    warm_text = deepfm_config_text(
        str(tmp_path / "warm"), extra_train=f'fine_tune_checkpoint: "{offline_dir}"', **base
    )
    warm = _first_step_loss(warm_text, tmp_path, "warm", kafka_bootstrap, topic)
    # the offline model has learned the stream's base rate and id effects; a fresh one has not
    assert warm < cold - 0.02, (warm, cold)


@pytest.mark.slow
def test_warm_start_var_map_loads_renamed_tables(tmp_path):
    offline_dir = _offline_model_dir(tmp_path, steps=5)
    offline = read_checkpoint(list_checkpoints(offline_dir)[-1]).state["model"]
    # the new model calls feature C1 "C1_v2": its tables must come from the old C1 tables
    text = deepfm_config_text(str(tmp_path / "new"))
    text = text.replace('feature_configs { input_names: "C1" ',
                        'feature_configs { feature_name: "C1_v2" input_names: "C1" ')
    text = text.replace('feature_names: "C1" ', 'feature_names: "C1_v2" ')
    var_map = tmp_path / "var_map.txt"
    var_map.write_text(
        "ebc.embedding_bags.C1_v2.weight\tebc.embedding_bags.C1.weight\n"
        "ebc.embedding_bags.C1_v2_wide.weight\tebc.embedding_bags.C1_wide.weight\n"
    )
    text = text.replace(
        "train_config {",
        f'train_config {{\n  fine_tune_checkpoint: "{offline_dir}"\n'
        f'  fine_tune_ckpt_var_map: "{var_map}"',
    )
    path = tmp_path / "new.config"
    path.write_text(text)
    config = load_pipeline_config(str(path))
    check_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    trainer.restore()
    tables = trainer.module.embedding_tables()
    assert torch.equal(tables["C1_v2"].cpu(), offline["ebc.embedding_bags.C1.weight"])
    assert torch.equal(tables["C2"].cpu(), offline["ebc.embedding_bags.C2.weight"])
    for name, value in trainer.module.dense_parameters().items():
        assert torch.equal(value.cpu(), offline[name]), name
