"""Start-up limits and checks: configs that would die at start are refused with exit code 2.

Each case runs ``odl-train`` (in-process through ``train_cli.main``, a few as real
subprocesses) and expects exit code 2 and one stderr line naming the field, before anything
is allocated: size bounds, non-finite floats, the memory estimate, paths (``model_dir``,
``fine_tune_checkpoint``, ``scheme://``), ``--edit_config_json`` depth, librdkafka settings
(never echoing a secret), the table optimizer on the resolved device and ``--device``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from odl.cli import train_cli
from odl.config.config_edit import apply_edit_config_json
from odl.config.config_error import ConfigError
from odl.config.pipeline_config import load_pipeline_config
from tests.harness import REPO

# odl.train.memory_estimate, optimizer_support and startup_checks are imported inside the
# tests, so that each test stands on its own.
MEMORY_FRACTION_ENV = "ODL_MAX_MEMORY_FRACTION"

ONLINE = f"{REPO}/samples/deepfm_online.config"
OFFLINE = f"{REPO}/samples/deepfm_offline.config"
GIB = 1 << 30
SECRET = "pw-Secret-9f3e"


def run_cli(*args: str, config: str = ONLINE, online: bool = True,
            validate_only: bool = True) -> tuple[int, str, str]:
    """``odl-train`` in-process; returns ``(exit code, stdout, stderr)``."""
    argv = ["--pipeline_config_path", config, "--device", "cpu", "--log_level", "CRITICAL"]
    if online:
        argv.append("--online")
    if validate_only:
        argv.append("--validate_only")
    logging.getLogger().setLevel(logging.CRITICAL)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train_cli.main(argv + list(args))
    return rc, out.getvalue(), err.getvalue()


def refused(result: tuple[int, str, str], field: str, *fragments: str) -> str:
    """Asserts exit code 2 and one stderr line naming ``field``; returns the line."""
    rc, _out, err = result
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert lines[0].startswith(f"odl-train: invalid config field '{field}': "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def edits(model_dir: Path, doc: dict) -> list[str]:
    return ["--model_dir", str(model_dir), "--edit_config_json", json.dumps(doc)]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tmp_path / "m"


@pytest.fixture
def host_memory(monkeypatch: pytest.MonkeyPatch):
    """Pins the available host memory (16 GiB unless changed) so results do not depend on
    the machine running the tests."""
    from odl.train import memory_estimate

    state = {"bytes": 16 * GIB}
    monkeypatch.setattr(memory_estimate, "available_host_memory",
                        lambda: memory_estimate.AvailableMemory(state["bytes"], "host"))
    monkeypatch.delenv(MEMORY_FRACTION_ENV, raising=False)
    return state


# --------------------------------------------------------------------------- valid


def test_sample_configs_validate_without_side_effects(tmp_path: Path, host_memory) -> None:
    target = tmp_path / "new" / "model"
    rc, out, err = run_cli("--model_dir", str(target))
    assert (rc, out.strip()) == (0, "config OK"), err
    assert not (tmp_path / "new").exists()  # the write probe leaves nothing behind
    rc, out, err = run_cli("--model_dir", str(target), "--train_input_path", "x/*.csv",
                           config=OFFLINE, online=False)
    assert (rc, out.strip()) == (0, "config OK"), err


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("doc, field, fragment", [
    ({"feature_configs[0].hash_bucket_size": 1e12}, "feature_configs[0].hash_bucket_size",
     "1,000,000,000,000 rows is above the limit of 2,147,483,647"),
    ({"feature_configs[0].hash_bucket_size": 0, "feature_configs[0].num_buckets": 2**31},
     "feature_configs[0].num_buckets", "limit"),
    ({"model_config.deepfm.dnn.hidden_units": [1e9]},
     "model_config.deepfm.dnn.hidden_units[0]", "limit of 65,536"),
    ({"model_config.deepfm.dnn.hidden_units": [8] * 65}, "model_config.deepfm.dnn.hidden_units",
     "65 layers"),
    ({"data_config.batch_size": 1e9}, "data_config.batch_size", "limit of 1,048,576"),
    ({"feature_configs[embedding_dim=16].embedding_dim": 8192},
     "feature_configs[0].embedding_dim", "limit"),
    ({"model_config.deepfm.wide_output_dim": 100000,
      "model_config.deepfm.final_dnn": {"hidden_units": [8]}},
     "model_config.deepfm.wide_output_dim", "limit"),
    ({"train_config.metrics_window_samples": 4e9}, "train_config.metrics_window_samples",
     "limit"),
    ({"data_config.fetch_interval_ms": 400000}, "data_config.fetch_interval_ms", "300000"),
    ({"data_config.num_workers": 100000}, "data_config.num_workers", "limit"),
])
def test_sizes_above_the_limits_are_refused(model_dir: Path, doc: dict, field: str,
                                            fragment: str) -> None:
    refused(run_cli(*edits(model_dir, doc)), field, fragment)


LR = ("train_config.optimizer_config[0].adagrad_optimizer.learning_rate."
      "constant_learning_rate.learning_rate")


@pytest.mark.parametrize("doc, field", [
    ({LR: "inf"}, LR),
    ({LR: "nan"}, LR),
    ({"train_config.optimizer_config[1].adam_optimizer.learning_rate.constant_learning_rate"
      ".learning_rate": "1e39"},  # overflows float32 to inf
     "train_config.optimizer_config[1].adam_optimizer.learning_rate.constant_learning_rate"
     ".learning_rate"),
    ({"model_config.embedding_regularization": "nan"}, "model_config.embedding_regularization"),
    ({"model_config.deepfm.l2_regularization": "inf"}, "model_config.deepfm.l2_regularization"),
])
def test_non_finite_optimizer_inputs_are_refused(model_dir: Path, doc: dict, field: str) -> None:
    refused(run_cli(*edits(model_dir, doc)), field, "must be a finite number")


def test_inf_learning_rate_in_the_config_text(tmp_path: Path) -> None:
    text = re.sub(r"learning_rate: [0-9.]+", "learning_rate: inf", Path(ONLINE).read_text(),
                  count=1)
    assert "learning_rate: inf" in text
    path = tmp_path / "p.config"
    path.write_text(text)
    refused(run_cli("--model_dir", str(tmp_path / "m"), config=str(path)), LR, "finite")


# --------------------------------------------------------------------------- memory


def test_tables_beyond_the_host_memory_are_refused_with_the_estimate(
        model_dir: Path, host_memory) -> None:
    line = refused(run_cli(*edits(model_dir, {"feature_configs[0].hash_bucket_size": 1.5e8,
                                              "feature_configs[1].hash_bucket_size": 1.5e8})),
                   "feature_configs", "150,000,000 rows x 16", "16.0 GiB available",
                   "80%", "--max_memory_fraction")
    assert "adagrad state" in line


def test_memory_fraction_can_be_changed(model_dir: Path, host_memory,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    big = edits(model_dir, {"feature_configs[0].hash_bucket_size": 1.5e8,
                            "feature_configs[1].hash_bucket_size": 1.5e8})
    assert run_cli(*big, "--max_memory_fraction", "0")[0] == 0  # check off: nothing allocated
    monkeypatch.setenv(MEMORY_FRACTION_ENV, "0.001")
    refused(run_cli("--model_dir", str(model_dir)), "feature_configs", "at most 0.1%")
    assert run_cli("--model_dir", str(model_dir), "--max_memory_fraction", "0.9")[0] == 0
    monkeypatch.setenv(MEMORY_FRACTION_ENV, "lots")
    refused(run_cli("--model_dir", str(model_dir)), "ODL_MAX_MEMORY_FRACTION")
    refused(run_cli("--model_dir", str(model_dir), "--max_memory_fraction", "nan"),
            "--max_memory_fraction")


def test_dense_part_beyond_memory_names_the_dnn(model_dir: Path, host_memory) -> None:
    host_memory["bytes"] = 2 * GIB
    refused(run_cli(*edits(model_dir, {"model_config.deepfm.dnn.hidden_units": [65536, 8192]})),
            "model_config.deepfm.dnn.hidden_units", "dense part")


def test_cgroup_limit_lowers_the_available_memory(tmp_path: Path) -> None:
    from odl.train.memory_estimate import available_host_memory

    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/odl-train.service\n")
    unit = tmp_path / "fs" / "system.slice" / "odl-train.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text(f"{GIB}\n")
    (unit / "memory.current").write_text(f"{256 << 20}\n")
    (unit / "memory.stat").write_text(f"anon 1\ninactive_file {56 << 20}\n")
    (tmp_path / "fs" / "system.slice" / "memory.max").write_text("max\n")
    got = available_host_memory(str(tmp_path / "fs"), str(proc))
    assert got.bytes == GIB - (200 << 20) and str(unit) in got.source
    # cgroup v1, with the "no limit" value on the parent
    proc.write_text("5:memory:/docker/abc\n1:cpu:/docker/abc\n")
    v1 = tmp_path / "fs" / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (tmp_path / "fs" / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    got = available_host_memory(str(tmp_path / "fs"), str(proc))
    assert got.bytes == GIB and "docker" in got.source
    (v1 / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    assert available_host_memory(str(tmp_path / "fs"), str(proc)).source == "host"


@pytest.mark.parametrize("edit", [
    {},
    {"model_config.deepfm.final_dnn": {"hidden_units": [32, 16], "use_bn": True},
     "model_config.deepfm.wide_output_dim": 3,
     "model_config.feature_groups[0].wide_deep": "WIDE_AND_DEEP",
     "feature_configs[1].embedding_name": "C1", "feature_configs[1].hash_bucket_size": 10000,
     "model_config.deepfm.dnn.use_bn": True,
     "model_config.feature_groups[1].feature_names": ["C1", "C2", "C3", "I1", "I1_bucket"]},
])
def test_memory_estimate_follows_the_model(edit: dict) -> None:
    """Tables and dense parameters of the estimate are those the model builder makes."""
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import build_model
    from odl.train.memory_estimate import estimate_memory

    config = load_pipeline_config(ONLINE, edit)
    model = build_model(config, FeatureBuilder(config))  # tables on the meta device
    est = estimate_memory(config, "cpu")
    tables = {c.name: (c.num_embeddings, c.embedding_dim)
              for c in model.ebc.embedding_bag_configs()}
    assert {t.name: (t.rows, t.dim) for t in est.tables} == tables
    assert est.table_bytes == 4 * sum(r * d for r, d in tables.values())
    assert est.table_state_bytes == est.table_bytes  # element-wise adagrad: one per value
    assert est.dense_parameters == sum(p.numel() for p in model.dense.parameters())
    assert est.host_bytes == (2 * est.sparse_bytes + est.dense_bytes + est.activation_bytes
                              + est.metrics_bytes + est.runtime_bytes)


@pytest.mark.parametrize("text, sparse, dense", [
    ("optimizer_config { sgd_optimizer {} }", "sgd", "sgd"),
    ("optimizer_config { adam_optimizer {} } optimizer_config { adagrad_optimizer {} }",
     "adam", "adagrad"),
    ("sparse_optimizer { rowwise_adagrad_optimizer {} } dense_optimizer { sgd_optimizer {} }",
     "rowwise_adagrad", "sgd"),
    ("sparse_optimizer { adam_optimizer {} } dense_optimizer { adagrad_optimizer {} }",
     "adam", "adagrad"),
    ("", "adagrad", "adam"),
])
def test_optimizer_choices_agree_with_the_builder(text: str, sparse: str, dense: str) -> None:
    from google.protobuf import text_format

    from odl.config.optimizer_support import optimizer_choices
    from odl.protos import pipeline_pb2
    from odl.train.optimizer_builder import optimizer_specs

    tc = text_format.Parse(text, pipeline_pb2.TrainConfig())
    specs = optimizer_specs(tc)
    choices = optimizer_choices(tc)
    assert (specs[0].kind, specs[1].kind) == (choices[0].kind, choices[1].kind) == (sparse, dense)


def test_estimate_state_per_optimizer() -> None:
    from odl.train.memory_estimate import estimate_memory

    config = load_pipeline_config(ONLINE)
    rows_x_dim = estimate_memory(config, "cpu").table_bytes // 4
    rows = sum(t.rows for t in estimate_memory(config, "cpu").tables)
    for text, floats in (("sgd_optimizer {}", 0), ("adagrad_optimizer {}", rows_x_dim),
                         ("adam_optimizer {}", 2 * rows_x_dim),
                         # an accumulator per value, a count of decays per row
                         ("adagrad_decay_optimizer {}", rows_x_dim + rows)):
        apply_edit_config_json(config, {"train_config.optimizer_config[0]": text})
        assert estimate_memory(config, "cpu").table_state_bytes == 4 * floats
    apply_edit_config_json(config, {"train_config.optimizer_config": None,
                                    "train_config.sparse_optimizer":
                                        "rowwise_adagrad_optimizer {}",
                                    "train_config.dense_optimizer": "sgd_optimizer {}"})
    assert estimate_memory(config, "cpu").table_state_bytes == 4 * rows
    apply_edit_config_json(config, {"train_config.sparse_optimizer":
                                    "rowwise_adagrad_optimizer { weight_decay: 0.01 "
                                    "weight_decay_mode: L2 }"})
    assert estimate_memory(config, "cpu").table_state_bytes == 4 * rows  # row-sparse, per row
    cuda = estimate_memory(config, "cuda")
    assert cuda.device_bytes == cuda.sparse_bytes + cuda.dense_bytes + cuda.activation_bytes
    assert cuda.host_bytes < estimate_memory(config, "cpu").host_bytes


# --------------------------------------------------------------------------- paths


def test_model_dir_that_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("x")
    refused(run_cli("--model_dir", str(afile)), "model_dir", "not a directory")
    refused(run_cli("--model_dir", str(afile / "sub")), "model_dir", "not a directory")
    refused(run_cli("--model_dir", "/etc/passwd"), "model_dir", "not a directory")


def test_model_dir_that_is_not_writable() -> None:
    refused(run_cli("--model_dir", "/proc/self"), "model_dir", "not a writable directory")
    refused(run_cli("--model_dir", "/proc/self/odl"), "model_dir")


@pytest.mark.parametrize("args, field, says", [
    (["--model_dir", "oss://bucket/odl/model"], "model_dir", "OSS_ACCESS_KEY_ID"),
    (["--model_dir", "oss://bucket"], "model_dir", "not the bucket root"),
    (["--model_dir", "hdfs://nn:8020/odl"], "model_dir", "hdfs:// paths are not supported"),
    (["--fine_tune_checkpoint", "s3://bucket/ckpt"], "train_config.fine_tune_checkpoint",
     "s3:// paths are not supported"),
    (["--edit_config_json", json.dumps({"train_config.incr_save_config": {
        "fs": {"incr_save_dir": "oss://bucket/deltas"}}})],
     "train_config.incr_save_config.fs.incr_save_dir", "OSS_ENDPOINT"),
    (["--train_input_path", "hdfs://nn/data/*.csv"], "train_input_path", "not supported"),
])
def test_paths_odl_cannot_use_are_refused(tmp_path: Path, args: list[str], field: str,
                                          says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other schemes are refused; oss:// without credentials names the missing variables."""
    for var in ("OSS_ACCESS_KEY_ID", "OSS_ACCESS_KEY_SECRET", "OSS_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    base = [] if args[0] == "--model_dir" else ["--model_dir", str(tmp_path / "m")]
    offline = field == "train_input_path"
    refused(run_cli(*base, *args, config=OFFLINE if offline else ONLINE, online=not offline),
            field, says)
    assert not os.path.exists("oss:") and not os.path.exists("hdfs:")


def test_fine_tune_checkpoint_must_resolve(tmp_path: Path) -> None:
    from odl.checkpoint.checkpoint_manager import CheckpointManager

    empty = tmp_path / "empty"
    empty.mkdir()
    md = ["--model_dir", str(tmp_path / "m")]
    refused(run_cli(*md, "--fine_tune_checkpoint", str(empty)),
            "train_config.fine_tune_checkpoint", "no complete checkpoint")
    refused(run_cli(*md, "--fine_tune_checkpoint", str(tmp_path / "nope")),
            "train_config.fine_tune_checkpoint", "does not exist")
    refused(run_cli(*md, "--fine_tune_checkpoint", "/etc/passwd"),
            "train_config.fine_tune_checkpoint")
    base = tmp_path / "base"
    ckpt = CheckpointManager(str(base)).save(3, {"model": {}}, {}, {}, "")
    assert run_cli(*md, "--fine_tune_checkpoint", str(base))[0] == 0
    assert run_cli(*md, "--fine_tune_checkpoint", ckpt)[0] == 0
    # model_dir holds a checkpoint: the start resumes it and never reads fine_tune_checkpoint
    assert run_cli("--model_dir", str(base), "--fine_tune_checkpoint", str(empty))[0] == 0


def test_normal_start_is_refused_before_the_trainer_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import odl.train.trainer as trainer_module

    class Built(Exception):
        pass

    def no_trainer(*_a, **_k):
        raise Built("the trainer must not be built for a refused config")

    monkeypatch.setattr(trainer_module, "Trainer", no_trainer)
    refused(run_cli("--model_dir", "oss://bucket/m", validate_only=False), "model_dir")
    refused(run_cli("--model_dir", "/proc/self", validate_only=False), "model_dir")
    refused(run_cli(*edits(tmp_path / "m", {"data_config.batch_size": 1e9}),
                    validate_only=False), "data_config.batch_size")
    assert not os.path.exists("oss:") and not (tmp_path / "m").exists()
    # a config that passes every check goes on to build the trainer, model_dir created
    with pytest.raises(Built):
        run_cli("--model_dir", str(tmp_path / "m"), validate_only=False)
    assert (tmp_path / "m").is_dir() and not os.listdir(tmp_path / "m")


# --------------------------------------------------------------------------- edit_config_json


@pytest.mark.parametrize("depth", [20000, 65])
def test_deeply_nested_edit_config_json(model_dir: Path, depth: int) -> None:
    doc = '{"a":' * depth + "1" + "}" * depth
    refused(run_cli("--model_dir", str(model_dir), "--edit_config_json", doc),
            "edit_config_json", "nested")


# --------------------------------------------------------------------------- kafka settings


JAAS = ('org.apache.kafka.common.security.plain.PlainLoginModule required username="u" '
        f'password="{SECRET}";')


@pytest.mark.parametrize("doc, field, fragment", [
    ({"kafka_train_input.kafka_config": {"sasl.jaas.config": JAAS}},
     "kafka_train_input.kafka_config", "JAAS"),
    ({"kafka_train_input.kafka_config": {
        "security.protocol": "SSL", "ssl.key.location": "/no/such/key.pem",
        "ssl.certificate.location": "/no/such/cert.pem", "ssl.key.password": SECRET}},
     "kafka_train_input.kafka_config", "ssl."),
    ({"kafka_train_input.kafka_config": {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "NOPE", "sasl.password": SECRET}},
     "kafka_train_input.kafka_config", "NOPE"),
    # the secret echoed through another setting's value is masked too
    ({"kafka_train_input.kafka_config": {"sasl.password": SECRET,
                                         "security.protocol": SECRET}},
     "kafka_train_input.kafka_config", "***"),
    ({"kafka_train_input.kafka_config": {"enable.idempotence": "true", "acks": "0"},
      "data_config.dead_letter_topic": "odl_dead"},
     "kafka_train_input.kafka_config", "producer"),
    ({"train_config.incr_save_config.kafka.kafka_config": {"acks": "1",
                                                           "sasl.password": SECRET}},
     "train_config.incr_save_config.kafka.kafka_config", "acks"),
])
def test_settings_librdkafka_refuses(model_dir: Path, doc: dict, field: str,
                                     fragment: str) -> None:
    line = refused(run_cli(*edits(model_dir, doc)), field, "librdkafka refuses", fragment)
    assert SECRET not in line


def test_dead_letter_producer_is_checked_only_when_used(model_dir: Path) -> None:
    rc, _out, err = run_cli(*edits(model_dir, {"kafka_train_input.kafka_config":
                                               {"enable.idempotence": "true", "acks": "0"}}))
    assert rc == 0, err


# --------------------------------------------------------------------------- device




def test_cuda_requested_without_cuda(model_dir: Path) -> None:
    import torch

    from odl.train import startup_checks

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refused(run_cli("--model_dir", str(model_dir), "--device", "cuda"), "--device", "CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        startup_checks.resolve_device_type("cuda")
    assert startup_checks.resolve_device_type("auto") == "cpu"


# --------------------------------------------------------------------------- real processes


def test_real_processes_exit_2_with_one_line(tmp_path: Path) -> None:
    cases = [
        (["--model_dir", str(tmp_path / "m"), "--edit_config_json",
          '{"feature_configs[0].hash_bucket_size": 1e12}'],
         "feature_configs[0].hash_bucket_size"),
        (["--model_dir", "/proc/self"], "model_dir"),
    ]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", ONLINE, "--online",
         "--device", "cpu", *args],  # a normal start, not --validate_only
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": REPO}) for args, _ in cases]
    for proc, (_args, field) in zip(procs, cases, strict=True):
        out, err = proc.communicate(timeout=120)
        lines = [ln for ln in err.splitlines() if ln.startswith("odl-train")]
        assert proc.returncode == 2 and "Traceback" not in err, err
        assert len(lines) == 1 and f"'{field}'" in lines[0], err


def test_memory_estimate_counts_dynamic_tables_and_their_index() -> None:
    """A dynamic table is its capacity plus its id index and counters, as the engine builds."""
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.dynamic.model_tables import DynamicTables
    from odl.train.memory_estimate import estimate_memory

    config = load_pipeline_config(ONLINE, {
        "model_config.ev_params": {"max_capacity": 4096},
        "feature_configs[1].zch": {"zch_size": 1024, "lfu": {}},
        "feature_configs[2].ev_params": {"filter_freq": 2, "max_capacity": 2048},
    })
    fb = FeatureBuilder(config)
    specs = {s.name: s for s in fb.table_specs if s.dynamic is not None}
    est = estimate_memory(config, "cpu")
    rows = {t.name: t.rows for t in est.tables}
    for name, spec in specs.items():
        assert rows[name] == spec.dynamic.capacity
    engine = DynamicTables({n: s.dynamic for n, s in specs.items()},
                           {n: s.feature_names for n, s in specs.items()})
    index_bytes = sum(t.map_bytes() for t in engine.tables.values())
    assert est.table_state_bytes - est.table_bytes == index_bytes


@pytest.mark.parametrize("sample", ["wide_and_deep_online", "multi_tower_online",
                                    "dcn_online", "dcn_v2_online", "din_online",
                                    "mmoe_online", "dbmtl_online", "esmm_online",
                                    "ple_online", "masknet_online",
                                    "wukong_online"])
def test_memory_estimate_follows_every_model_class(sample: str) -> None:
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import build_model
    from odl.train.memory_estimate import estimate_memory

    config = load_pipeline_config(ONLINE.replace("deepfm_online", sample))
    model = build_model(config, FeatureBuilder(config))
    est = estimate_memory(config, "cpu")
    tables = {c.name: (c.num_embeddings, c.embedding_dim)
              for c in model.ebc.embedding_bag_configs()}
    assert {t.name: (t.rows, t.dim) for t in est.tables} == tables
    assert est.dense_parameters == sum(p.numel() for p in model.dense.parameters())



def test_memory_of_several_ranks_is_each_ranks_share() -> None:
    """With ranks each holds its share of the tables: a model too large for one 16 GiB host
    fits 8 hosts of one rank each, not 8 ranks on that one host; on CUDA each device holds
    a share. A dynamic table's index counts whole on every rank unless split by id."""
    from odl.train.memory_estimate import AvailableMemory, check_memory, estimate_memory

    big = {"feature_configs[0].hash_bucket_size": 1.5e8,
           "feature_configs[1].hash_bucket_size": 1.5e8}
    config = load_pipeline_config(ONLINE, big)
    host = AvailableMemory(16 * GIB, "host")
    with pytest.raises(ConfigError, match="feature_configs"):
        check_memory(config, "cpu", 0.8, host_available=host)
    apart = check_memory(config, "cpu", 0.8, host_available=host, ranks=8, ranks_on_host=1)
    assert apart.rank_sparse_bytes < apart.sparse_bytes / 7
    with pytest.raises(ConfigError, match="8 ranks \\(8 on this host\\)"):
        check_memory(config, "cpu", 0.8, host_available=host, ranks=8, ranks_on_host=8)
    one, four = estimate_memory(config, "cuda"), estimate_memory(config, "cuda", 4, 4)
    assert four.device_bytes < one.device_bytes / 3
    dynamic = load_pipeline_config(ONLINE, {
        "feature_configs[1].zch": {"zch_size": 4_000_000, "lru": {}}})
    index = sum(t.map_bytes for t in estimate_memory(dynamic, "cpu").tables)
    whole, split = (estimate_memory(load_pipeline_config(ONLINE, {
        "feature_configs[1].zch": {"zch_size": 4_000_000, "lru": {}},
        "train_config.dynamic_index_partitions": p}), "cpu", 4, 1) for p in (1, 4))
    assert whole.rank_sparse_bytes - split.rank_sparse_bytes == index - index // 4


def test_release_freed_memory_hands_freed_heap_blocks_back():
    """Blocks freed between live ones stay resident under glibc until ``malloc_trim``."""
    import numpy as np
    import psutil

    from odl.train.host_memory import release_freed_memory

    me = psutil.Process()
    big = np.ones(2 << 20)  # 16 MiB, mapped; once freed, glibc serves 1 MiB blocks from heaps
    del big
    blocks = [np.ones(1 << 17) for _ in range(400)]  # 1 MiB each
    held = me.memory_info().rss
    del blocks[::2]  # 200 MiB freed in holes between live blocks: the heap cannot shrink
    before = me.memory_info().rss
    assert held - before < 50 << 20  # freed, still resident
    assert release_freed_memory()
    assert before - me.memory_info().rss > 100 << 20
    del blocks
