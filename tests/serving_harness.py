"""Helpers for export / serving tests: trained checkpoints, records, delta versions."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from confluent_kafka import Producer

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.pipeline_config import config_to_text, parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.kafka.client_settings import producer_config
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule
from tests.online_harness import make_records

# Every feature kind and model option serving must reproduce: multi-valued ids,
# integer ids in a shared-name table, a combo, bucketized raw, dense raw in the wide group
# (wide linear term) and a deep subset of dense columns, wide_output_dim 3 (stored as 4),
# batch norm, dropout and a final DNN.
EXOTIC_CONFIG = """
model_dir: "{model_dir}"
data_config {{
  batch_size: 64
  input_fields {{ input_name: "label" input_type: INT32 }}
  input_fields {{ input_name: "x" input_type: FLOAT }}
  input_fields {{ input_name: "y" input_type: FLOAT default_val: "0.5" }}
  input_fields {{ input_name: "u" }}
  input_fields {{ input_name: "tags" }}
  input_fields {{ input_name: "n" input_type: INT64 }}
  label_fields: "label"
  separator: ";"
}}
feature_config {{
  features {{ input_names: "x" feature_type: RawFeature }}
  features {{ input_names: "y" feature_type: RawFeature }}
  features {{ feature_name: "xb" input_names: "x" feature_type: RawFeature
              boundaries: [-1, 0, 1] embedding_dim: 8 }}
  features {{ input_names: "u" hash_bucket_size: 300 embedding_dim: 8 }}
  features {{ input_names: "tags" hash_bucket_size: 200 embedding_dim: 8 }}
  features {{ input_names: "n" num_buckets: 50 embedding_dim: 8 embedding_name: "shared" }}
  features {{ feature_name: "uc" input_names: ["u", "n"] feature_type: ComboFeature
              hash_bucket_size: 100 embedding_dim: 8 }}
}}
model_config {{
  model_class: "DeepFM"
  feature_groups {{ group_name: "wide" feature_names: ["u", "tags", "xb", "y"] wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" feature_names: ["u", "tags", "n", "uc", "xb", "x"]
                   wide_deep: DEEP }}
  deepfm {{
    dnn {{ hidden_units: [16, 8] use_bn: true dropout_ratio: [0.1, 0.0] }}
    final_dnn {{ hidden_units: [8] }}
    wide_output_dim: 3
  }}
}}
train_config {{
  sparse_optimizer {{ adagrad_optimizer {{ lr: 0.1 }} }}
  dense_optimizer {{ adam_optimizer {{ lr: 0.01 }} }}
  seed: 3
}}
"""


def exotic_records(n: int, seed: int = 0) -> list[bytes]:
    """Random CSV records for ``EXOTIC_CONFIG`` (empty tags, empty y, negative ints)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = f"{rng.gauss(0, 1.5):.4f}"
        y = "" if rng.random() < 0.2 else f"{rng.random():.3f}"
        u = f"u{rng.randrange(400)}"
        tags = "|".join(f"t{rng.randrange(60)}" for _ in range(rng.randrange(0, 4)))
        num = str(rng.randrange(-30, 90))
        label = str(int(rng.random() < 0.3))
        out.append(";".join([label, x, y, u, tags, num]).encode())
    return out


def synthetic_records(n: int, seed: int = 0, fmt: str = "csv") -> list[bytes]:
    """Records of the datagen schema."""
    return make_records(n, seed=seed, fmt=fmt)[1]


@dataclass
class TrainedCheckpoint:
    """A checkpoint written from a ``TrainModule`` trained on a few batches.

    Attributes:
        config: the pipeline config.
        feature_builder: its feature builder.
        module: the trained module (its state equals the checkpoint's).
        model_dir: the model directory.
        path: the checkpoint directory.
        records: function ``(n, seed) -> records`` of the config's schema.
    """

    config: pipeline_pb2.EasyRecConfig
    feature_builder: FeatureBuilder
    module: TrainModule
    model_dir: str
    path: str
    records: object


def train_checkpoint(
    root: str,
    kind: str = "synthetic",
    steps: int = 8,
    delta_offset: int | None = None,
    extra_source: dict | None = None,
) -> TrainedCheckpoint:
    """Trains a module a few steps and writes one checkpoint.

    Args:
        root: directory for model_dir.
        kind: ``"synthetic"`` (datagen schema, 8 id features) or ``"exotic"``.
        steps: training steps of 64 records.
        delta_offset: recorded as positions.json ``delta_topic_offset`` when given.
        extra_source: more keys for positions.json.

    Returns:
        The checkpoint and the module.
    """
    model_dir = os.path.join(root, "model_dir")
    if kind == "synthetic":
        text = deepfm_config_text(model_dir, buckets=500, dim=8,
                                  sparse_fields=tuple(f"C{i}" for i in range(1, 9)),
                                  kafka_extra='kafka_config { key: "sasl.password" '
                                              'value: "hunter2" }')
        records = synthetic_records
    else:
        text = EXOTIC_CONFIG.format(model_dir=model_dir)
        records = exotic_records
    config = parse_pipeline_config_text(text)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    vals = records(64 * steps, 101)
    for i in range(steps):
        res = fb.build(vals[i * 64 : (i + 1) * 64])
        tm.train_step(res.batch)
    source = {"source": "kafka", "topic": "samples"}
    if delta_offset is not None:
        source["delta_topic_offset"] = delta_offset
    source.update(extra_source or {})
    path = CheckpointManager(model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 64 * steps}, source,
        config_to_text(config), generation="gen0")
    return TrainedCheckpoint(config, fb, tm, model_dir, path, records)


def produce(bootstrap: str, topic: str, values: list[bytes]) -> list[int]:
    """Produces values to partition 0 in order; returns their offsets."""
    producer = Producer(producer_config(bootstrap))
    offsets: list[int] = []
    errors: list[str] = []

    def cb(err, msg) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            offsets.append(msg.offset())

    for v in values:
        producer.produce(topic, value=v, partition=0, on_delivery=cb)
    assert producer.flush(30) == 0
    assert not errors, errors
    return offsets


@torch.no_grad()
def apply_to_module(tm: TrainModule, maps, dense: dict, sparse: dict) -> None:
    """Applies a version's values (by id) to a TrainModule, the trainer-side reference."""
    dense_names = maps.dense_names()
    table_names = maps.table_names()
    params = tm.dense_parameters()
    for vid, arr in dense.items():
        params[dense_names[vid]].copy_(torch.from_numpy(np.asarray(arr, np.float32)))
    tables = tm.embedding_tables()
    for tid, (ids, vals) in sparse.items():
        t = tables[table_names[tid]]
        v = torch.from_numpy(np.asarray(vals, np.float32))
        t[torch.from_numpy(ids), : v.shape[1]] = v
