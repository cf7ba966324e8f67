"""Validation of a loaded pipeline config on its own: the rules the trainer relies on.

:func:`validate_pipeline_config` refuses, with a :class:`~odl.config.config_error.ConfigError`
naming the first offending field:

* what odl does not implement (:func:`odl.config.easyrec_compat.check_implemented`);
* a non-finite float anywhere (learning rates, weights, boundaries, ...);
* a missing ``model_dir``, and ``scheme://`` paths other than ``oss://bucket/key``
  (:func:`check_path_schemes`);
* the input: ``kafka_train_input`` online (servers as host:port, topic, group, at most one
  start position, a dead-letter topic other than the input topic), or
  ``datahub_train_input`` (project, topic, endpoint or region, the start as EasyRec writes
  it; no dead-letter topic), or ``file_stream_input`` (``train_data_dir``, a
  ``split_interval`` dividing a day, ``start_day`` / ``end_day`` as YYYYMMDD; no
  dead-letter topic), only one of them; ``train_input_path`` offline;
* ``data_config``: input fields, one numeric label, sample id and event time fields, sizes
  within :mod:`odl.config.limits`;
* the features and the model (:mod:`odl.config.model_validation`), vocabularies and raw value
  normalization (:mod:`odl.config.feature_settings`), the loss terms' settings
  (:mod:`odl.config.loss_settings`);
* ``train_config``: one optimizer form (EasyRec's ``optimizer_config`` or TorchEasyRec's
  ``sparse_optimizer`` + ``dense_optimizer``) with valid rates, schedules and optimizer
  settings, at most one gradient clipping form, stop and logging intervals,
  ``dead_line``, the fine-tune var map, and ``incr_save_config`` (where versions go, chunk
  size).

The checks against the machine (writable directories, memory, devices, the broker's client
settings) are :mod:`odl.train.startup_checks`.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.config_fields import is_map_field, join_path
from odl.config.easyrec_compat import check_implemented, normalize_config_forms
from odl.config.feature_configs import NUMERIC_FIELD_TYPES
from odl.config.feature_settings import validate_feature_settings, with_vocabularies_as_buckets
from odl.config.field_formats import (
    parse_datahub_offsets,
    parse_dead_line,
    parse_offset_info,
    parse_offset_time,
    path_scheme,
)
from odl.config.loss_settings import (
    POINTWISE_LOSS_TYPES,
    num_classes,
    regression_outputs,
    validate_loss_settings,
)
from odl.config.metric_settings import grouped_auc_field, grouped_auc_reduction
from odl.config.model_classes import is_multi_task_model, multi_task_model_classes
from odl.config.model_validation import validate_features, validate_model_common
from odl.config.optimizer_support import (
    IN_BATCH_TABLE_KINDS,
    PER_RECORD_TABLE_KINDS,
    optimizer_choices,
    table_kernel_kind,
)
from odl.protos import pipeline_pb2
from odl.storage.storage_path import UnsupportedPathError, check_supported, parse_oss

__all__ = [
    "MAX_DELTA_CHUNK_BYTES",
    "MIN_DELTA_CHUNK_BYTES",
    "check_path_schemes",
    "validate_pipeline_config",
]

_FIELD_TYPE = pipeline_pb2.DatasetConfig.FieldType


def validate_pipeline_config(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Check the cross-field rules the trainer relies on; raises on the first problem.

    Args:
        config: a loaded config.
        online: True for ``odl-train --online`` (Kafka input), False for file input.

    Raises:
        ConfigError: naming the offending field.

    """
    normalize_config_forms(config)
    check_implemented(config)
    _check_finite(config, "")
    if not config.model_dir:
        raise ConfigError("model_dir", "required (set it in the config or pass --model_dir)")
    check_path_schemes(config, online)
    if online:
        inputs = [f for f in ("kafka_train_input", "datahub_train_input", "file_stream_input")
                  if config.HasField(f)]
        if len(inputs) > 1:
            raise ConfigError(inputs[1], "give one online input: kafka_train_input, "
                                         "datahub_train_input or file_stream_input")
        if config.HasField("datahub_train_input"):
            _validate_datahub(config)
        elif config.HasField("file_stream_input"):
            _validate_file_stream(config)
        else:
            _validate_kafka(config)
        if config.kafka_eval_input.topic:
            _validate_kafka_eval(config)
        if config.HasField("datahub_eval_input"):
            _validate_datahub_eval(config)
    else:
        _validate_offline_input(config)
    fields = _validate_data_config(config)
    validate_feature_settings(config)
    validate_loss_settings(config)
    grouped_auc_field(config)
    grouped_auc_reduction(config)
    checked = with_vocabularies_as_buckets(config)
    features = validate_features(checked, fields)
    validate_model_common(checked, features)
    _validate_train(config)


def _check_finite(msg: Message, prefix: str) -> None:
    """Refuses inf / nan in every float and double field (learning rates, weights, ...)."""
    for fd, value in msg.ListFields():
        path = join_path(prefix, fd.name)
        if is_map_field(fd):
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                for key in value:
                    _check_finite(value[key], f"{path}.{key}")
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if fd.is_repeated:
                for i, sub in enumerate(value):
                    _check_finite(sub, f"{path}[{i}]")
            else:
                _check_finite(value, path)
        elif fd.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
            items = list(enumerate(value)) if fd.is_repeated else [(None, value)]
            for i, x in items:
                if not math.isfinite(x):
                    where = path if i is None else f"{path}[{i}]"
                    raise ConfigError(where, f"must be a finite number, got {x}")


def _validate_datahub(config: pipeline_pb2.EasyRecConfig) -> None:
    _validate_datahub_section(config.datahub_train_input, "datahub_train_input")
    _validate_dead_letter(config, "datahub_train_input")


def _validate_datahub_section(d: pipeline_pb2.DatahubServer, where: str) -> None:
    """A ``DatahubServer`` section: project, topic, endpoint and start settings."""
    for name in ("project", "topic"):
        if not getattr(d, name).strip():
            raise ConfigError(f"{where}.{name}", "required")
    endpoint = d.endpoint or d.region
    if not endpoint:
        raise ConfigError(f"{where}.endpoint", "required (or region, e.g. cn-hangzhou)")
    if d.endpoint and not re.match(r"^https?://[^/\s]+/?$", d.endpoint):
        raise ConfigError(f"{where}.endpoint", f"{d.endpoint!r} is not an http(s):// URL")
    if d.offset_info and d.offset_time:
        raise ConfigError(f"{where}.offset_time", "give one of offset_info and offset_time")
    try:
        parse_datahub_offsets(d.offset_info, d.offset_time)
    except ValueError as exc:
        field = "offset_info" if d.offset_info else "offset_time"
        raise ConfigError(f"{where}.{field}", str(exc)) from None


def _validate_datahub_eval(config: pipeline_pb2.EasyRecConfig) -> None:
    """``datahub_eval_input``: one eval input, a valid section, not the training topic."""
    d = config.datahub_eval_input
    if config.kafka_eval_input.topic:
        raise ConfigError("datahub_eval_input", "give one of kafka_eval_input and "
                                                "datahub_eval_input")
    _validate_datahub_section(d, "datahub_eval_input")
    t = config.datahub_train_input
    if (d.project, d.topic) == (t.project, t.topic) and (d.endpoint or d.region) == (
            t.endpoint or t.region):
        raise ConfigError("datahub_eval_input.topic", "must differ from datahub_train_input's "
                                                      "(the evaluation scores held-out records)")


def _validate_file_stream(config: pipeline_pb2.EasyRecConfig) -> None:
    f = config.file_stream_input
    if not f.train_data_dir.strip():
        raise ConfigError("file_stream_input.train_data_dir", "required")
    if not 1 <= f.split_interval <= 1440 or 1440 % f.split_interval:
        raise ConfigError("file_stream_input.split_interval",
                          f"must divide a day (1440 minutes), got {f.split_interval}")
    for name in ("start_day", "end_day"):
        value = getattr(f, name)
        if not value and name == "end_day":
            continue
        try:
            dt.datetime.strptime(value, "%Y%m%d")
        except ValueError:
            raise ConfigError(f"file_stream_input.{name}",
                              f"expected YYYYMMDD, got {value!r}") from None
    if f.end_day and f.end_day < f.start_day:
        raise ConfigError("file_stream_input.end_day", "is before start_day")
    if f.model_save_path:
        try:
            check_supported(f.model_save_path)
        except UnsupportedPathError as exc:
            raise ConfigError("file_stream_input.model_save_path", str(exc)) from None
    _validate_dead_letter(config, "file_stream_input")


def _validate_kafka(config: pipeline_pb2.EasyRecConfig) -> None:
    if not config.HasField("kafka_train_input"):
        raise ConfigError("kafka_train_input", "required for online training "
                                               "(kafka_train_input { server topic group }, "
                                               "datahub_train_input { ... } or "
                                               "file_stream_input { ... })")
    k = config.kafka_train_input
    if not k.server.strip():
        raise ConfigError("kafka_train_input.server", "required: the bootstrap servers, "
                                                      "host:port[,host:port...]")
    _check_servers("kafka_train_input.server", k.server)
    if not k.topic.strip():
        raise ConfigError("kafka_train_input.topic", "required: the topic to train on")
    if not k.group.strip():
        raise ConfigError("kafka_train_input.group", "must not be empty")
    starts = [name for name, used in (("offset", len(k.offset) > 0),
                                      ("offset_info", bool(k.offset_info.strip())),
                                      ("offset_time", bool(k.offset_time.strip()))) if used]
    if len(starts) > 1:
        raise ConfigError(f"kafka_train_input.{starts[1]}",
                          f"give only one start position; {' and '.join(starts)} are both set")
    try:
        parse_offset_time(k.offset_time)
    except ValueError as exc:
        raise ConfigError("kafka_train_input.offset_time", str(exc)) from None
    parse_offset_info(k.offset_info)
    if k.offset and k.partitions and len(k.offset) > k.partitions:
        raise ConfigError("kafka_train_input.offset",
                          f"{len(k.offset)} offsets given for {k.partitions} partitions")
    if any(o < 0 for o in k.offset):
        raise ConfigError("kafka_train_input.offset", "offsets must be >= 0")
    _validate_dead_letter(config, "kafka_train_input")
    dlq = config.data_config.dead_letter_topic
    same_server = (not config.data_config.dead_letter_server
                   or config.data_config.dead_letter_server == k.server)
    if dlq and dlq == k.topic and same_server:
        raise ConfigError("data_config.dead_letter_topic",
                          "must differ from kafka_train_input.topic (rejected records would be "
                          "read again)")


def _validate_kafka_eval(config: pipeline_pb2.EasyRecConfig) -> None:
    """``kafka_eval_input``: a topic on a known broker, not the training topic."""
    k = config.kafka_eval_input
    if not k.server.strip():
        raise ConfigError("kafka_eval_input.server", "required with kafka_eval_input.topic")
    _check_servers("kafka_eval_input.server", k.server)
    if not k.group.strip():
        raise ConfigError("kafka_eval_input.group", "must not be empty")
    t = config.kafka_train_input
    if k.topic == t.topic and k.server == t.server:
        raise ConfigError("kafka_eval_input.topic", "must differ from kafka_train_input.topic "
                                                    "(the evaluation scores held-out records)")
    try:
        parse_offset_time(k.offset_time)
    except ValueError as exc:
        raise ConfigError("kafka_eval_input.offset_time", str(exc)) from None
    parse_offset_info(k.offset_info, "kafka_eval_input.offset_info")


def _check_servers(path: str, servers: str) -> None:
    """Refuses a bootstrap list that is not ``host:port[,host:port...]``."""
    for server in servers.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(path, f"expected host:port[,host:port...], got {server.strip()!r}")


def _validate_dead_letter(config: pipeline_pb2.EasyRecConfig, input_name: str) -> None:
    """``data_config.dead_letter_topic`` / ``_server``: a Kafka topic on a known broker."""
    dc = config.data_config
    dlq = dc.dead_letter_topic
    if not dlq:
        return
    if dlq.strip() != dlq:
        raise ConfigError("data_config.dead_letter_topic", f"{dlq!r} has surrounding spaces")
    if dc.dead_letter_server:
        _check_servers("data_config.dead_letter_server", dc.dead_letter_server)
    elif input_name != "kafka_train_input":
        raise ConfigError("data_config.dead_letter_server",
                          f"required for dead letters with {input_name}: the bootstrap servers "
                          "of the Kafka cluster that holds dead_letter_topic")


def check_path_schemes(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Refuses paths odl cannot use: local paths and ``oss://bucket/key`` only.

    Checked: ``model_dir``, ``train_input_path`` (offline), ``file_stream_input.train_data_dir``
    (online), ``train_config.fine_tune_checkpoint``,
    ``train_config.fine_tune_ckpt_var_map`` and ``train_config.incr_save_config.fs
    .incr_save_dir``.

    Args:
        config: the config.
        online: the training mode (``train_input_path`` is read only offline).

    Raises:
        ConfigError: naming the first field holding another scheme (``hdfs://``, ``s3://``)
            or an ``oss://`` path without a bucket.

    """
    tc = config.train_config
    paths = [("model_dir", config.model_dir)]
    if not online:
        paths.append(("train_input_path", config.train_input_path))
    elif config.HasField("file_stream_input"):
        paths.append(("file_stream_input.train_data_dir",
                      config.file_stream_input.train_data_dir))
    paths += [("train_config.fine_tune_checkpoint", tc.fine_tune_checkpoint),
              ("train_config.fine_tune_ckpt_var_map", tc.fine_tune_ckpt_var_map)]
    if tc.incr_save_config.WhichOneof("incr_update") == "fs":
        paths.append(("train_config.incr_save_config.fs.incr_save_dir",
                      tc.incr_save_config.fs.incr_save_dir))
    for field, path in paths:
        try:
            check_supported(path)
        except UnsupportedPathError as exc:
            raise ConfigError(field, str(exc)) from None
    if path_scheme(config.model_dir) == "oss" and not parse_oss(config.model_dir).key:
        raise ConfigError("model_dir", "give a prefix inside the bucket "
                                       "(oss://bucket/prefix), not the bucket root")


def _validate_offline_input(config: pipeline_pb2.EasyRecConfig) -> None:
    path = config.train_input_path.strip()
    if not path:
        raise ConfigError("train_input_path", "required for offline training (a glob of CSV or "
                                              "Parquet files); use --online for Kafka input")


def _validate_data_config(config: pipeline_pb2.EasyRecConfig) -> dict[str, int]:
    dc = config.data_config
    if not config.HasField("data_config"):
        raise ConfigError("data_config", "required (input_fields, label_fields, batch_size)")
    if dc.batch_size <= 0:
        raise ConfigError("data_config.batch_size", "must be > 0")
    if dc.batch_size > limits.MAX_BATCH_SIZE:
        raise ConfigError("data_config.batch_size",
                          f"{dc.batch_size} is above the limit of {limits.MAX_BATCH_SIZE:,}")
    if dc.fetch_interval_ms > limits.MAX_FETCH_INTERVAL_MS:
        raise ConfigError("data_config.fetch_interval_ms",
                          f"{dc.fetch_interval_ms} is above librdkafka's limit of "
                          f"{limits.MAX_FETCH_INTERVAL_MS} (fetch.queue.backoff.ms)")
    if dc.num_workers > limits.MAX_NUM_WORKERS:
        raise ConfigError("data_config.num_workers",
                          f"{dc.num_workers} is above the limit of {limits.MAX_NUM_WORKERS}")
    if not dc.separator:
        raise ConfigError("data_config.separator", "must not be empty")
    if not dc.input_fields:
        raise ConfigError("data_config.input_fields", "required: the record columns in order")
    fields: dict[str, int] = {}
    for i, f in enumerate(dc.input_fields):
        where = f"data_config.input_fields[{i}]"
        if not f.input_name:
            raise ConfigError(f"{where}.input_name", "required")
        if f.input_name in fields:
            raise ConfigError(f"{where}.input_name",
                              f"duplicate input field {f.input_name!r} (also input_fields"
                              f"[{list(fields).index(f.input_name)}])")
        fields[f.input_name] = f.input_type
        if f.default_val and f.input_type in NUMERIC_FIELD_TYPES:
            ok = (f.default_val.lower() in ("true", "false", "0", "1")
                  if f.input_type == _FIELD_TYPE.BOOL else _is_number(f.default_val))
            if not ok:
                raise ConfigError(f"{where}.default_val",
                                  f"{f.default_val!r} is not a valid "
                                  f"{_FIELD_TYPE.Name(f.input_type)}")
    if not dc.label_fields:
        raise ConfigError("data_config.label_fields", "required (the label column)")
    if len(dc.label_fields) > 1 and not is_multi_task_model(config.model_config):
        raise ConfigError("data_config.label_fields",
                          f"{len(dc.label_fields)} label fields need a multi-task model "
                          f"({', '.join(multi_task_model_classes())}); "
                          f"{config.model_config.model_class or 'this model'} trains on one")
    for i, label in enumerate(dc.label_fields):
        if label not in fields:
            raise ConfigError(f"data_config.label_fields[{i}]",
                              f"label {label!r} is not an input field")
        if fields[label] not in NUMERIC_FIELD_TYPES:
            raise ConfigError(f"data_config.label_fields[{i}]",
                              f"label {label!r} must be a numeric field")
        if label in dc.label_fields[:i]:
            raise ConfigError(f"data_config.label_fields[{i}]", f"label {label!r} repeats")
    if dc.sample_id_field and dc.sample_id_field not in fields:
        raise ConfigError("data_config.sample_id_field",
                          f"{dc.sample_id_field!r} is not an input field")
    if dc.event_time_field:
        if dc.event_time_field not in fields:
            raise ConfigError("data_config.event_time_field",
                              f"{dc.event_time_field!r} is not an input field")
        if fields[dc.event_time_field] not in NUMERIC_FIELD_TYPES:
            raise ConfigError("data_config.event_time_field",
                              f"{dc.event_time_field!r} must be a numeric field (unix seconds)")
    return fields


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _validate_in_batch_learning(config: pipeline_pb2.EasyRecConfig) -> None:
    """The wide rate, ``per_record_adagrad``'s settings, ``in_batch_learning``'s model."""
    tc = config.train_config
    m = tc.wide_learning_rate_multiplier
    if not (0 < m <= limits.MAX_WIDE_LR_MULTIPLIER) or not math.isfinite(m):
        raise ConfigError("train_config.wide_learning_rate_multiplier",
                          f"must be > 0 and at most {limits.MAX_WIDE_LR_MULTIPLIER:g}, got {m:g}")
    gain = tc.per_record_adagrad_max_gain
    if not (1 <= gain <= limits.MAX_PER_RECORD_GAIN):
        raise ConfigError("train_config.per_record_adagrad_max_gain",
                          f"must be at least 1 and at most {limits.MAX_PER_RECORD_GAIN:g}, "
                          f"got {gain:g}")
    if tc.per_record_adagrad:
        field = "train_config.per_record_adagrad"
        sparse, _ = optimizer_choices(tc)
        if table_kernel_kind(sparse.kind) not in PER_RECORD_TABLE_KINDS:
            raise ConfigError(field, f"needs (row-wise) Adagrad tables; the tables train with "
                                     f"{sparse.kind}")
        if not tc.in_batch_learning:
            raise ConfigError(field, "needs in_batch_learning: true (without it the larger "
                                     "steps overshoot; docs/training.md#per-record-adagrad)")
    if tc.in_batch_sequential and tc.in_batch_learning:
        field = "train_config.in_batch_sequential"
        mc = config.model_config
        types = [t.loss_type for t in mc.losses] or [mc.loss_type]
        coupled = [pipeline_pb2.LossType.Name(t) for t in types
                   if t not in POINTWISE_LOSS_TYPES]
        if coupled:
            raise ConfigError(field, f"needs losses of one record each; {', '.join(coupled)} "
                                     "couples the batch's records (set it to false)")
    if not tc.in_batch_learning:
        return
    field = "train_config.in_batch_learning"
    outputs = max(len(regression_outputs(config)), num_classes(config))
    if outputs != 1:
        raise ConfigError(field, f"needs a model with one output; this "
                                 f"{config.model_config.model_class} has {outputs}")
    sparse, _ = optimizer_choices(tc)
    if table_kernel_kind(sparse.kind) not in IN_BATCH_TABLE_KINDS:
        raise ConfigError(field, f"needs SGD or (row-wise) Adagrad tables; the tables "
                                 f"train with {sparse.kind}")


def _validate_train(config: pipeline_pb2.EasyRecConfig) -> None:
    tc = config.train_config
    where = "train_config"
    opts = list(tc.optimizer_config)
    tzrec = tc.HasField("sparse_optimizer") or tc.HasField("dense_optimizer")
    if opts and tzrec:
        raise ConfigError(f"{where}.optimizer_config",
                          "give either optimizer_config (EasyRec) or sparse_optimizer + "
                          "dense_optimizer (TorchEasyRec), not both")
    if opts:
        if len(opts) > 2:
            raise ConfigError(f"{where}.optimizer_config",
                              f"1 entry (all parameters) or 2 (embeddings, dense) are supported, "
                              f"got {len(opts)}")
        for i, opt in enumerate(opts):
            _validate_easyrec_optimizer(opt, f"{where}.optimizer_config[{i}]")
    elif tzrec:
        for name in ("sparse_optimizer", "dense_optimizer"):
            if not tc.HasField(name):
                raise ConfigError(f"{where}.{name}",
                                  "sparse_optimizer and dense_optimizer go together")
            _validate_tzrec_optimizer(getattr(tc, name), f"{where}.{name}")
    else:
        raise ConfigError(f"{where}.optimizer_config",
                          "no optimizer configured: set optimizer_config (EasyRec) or "
                          "sparse_optimizer + dense_optimizer (TorchEasyRec)")
    _validate_grad_clipping(tc, where)
    if tc.HasField("num_steps") and tc.num_steps == 0:
        raise ConfigError(f"{where}.num_steps", "must be > 0 (leave it unset to run until "
                                                "stopped)")
    if tc.log_step_count_steps <= 0:
        raise ConfigError(f"{where}.log_step_count_steps", "must be > 0")
    if tc.keep_checkpoint_max > 100000:
        raise ConfigError(f"{where}.keep_checkpoint_max", "unreasonably large (0 keeps all)")
    if not tc.stop_signal_poll_secs > 0 or not math.isfinite(tc.stop_signal_poll_secs):
        raise ConfigError(f"{where}.stop_signal_poll_secs", "must be > 0")
    if tc.metrics_window_samples <= 0:
        raise ConfigError(f"{where}.metrics_window_samples", "must be > 0")
    if tc.metrics_window_samples > limits.MAX_METRICS_WINDOW_SAMPLES:
        raise ConfigError(f"{where}.metrics_window_samples",
                          f"{tc.metrics_window_samples:,} is above the limit of "
                          f"{limits.MAX_METRICS_WINDOW_SAMPLES:,}")
    parse_dead_line(tc.dead_line)
    _validate_in_batch_learning(config)
    if tc.fine_tune_ckpt_var_map and not os.path.isfile(tc.fine_tune_ckpt_var_map):
        raise ConfigError(f"{where}.fine_tune_ckpt_var_map",
                          f"file not found: {tc.fine_tune_ckpt_var_map}")
    if tc.fine_tune_ckpt_var_map and not tc.fine_tune_checkpoint:
        raise ConfigError(f"{where}.fine_tune_ckpt_var_map",
                          "set fine_tune_checkpoint too (the map renames its parameters)")
    if tc.HasField("incr_save_config"):
        _validate_incr_save(tc.incr_save_config, f"{where}.incr_save_config")


# Largest delta chunk: the delta topic is created with max.message.bytes = 16 MiB.
MAX_DELTA_CHUNK_BYTES = 16 << 20
MIN_DELTA_CHUNK_BYTES = 4096


def _validate_incr_save(isc: Any, where: str) -> None:
    if not (isc.sparse_save_steps or isc.dense_save_steps or isc.sparse_save_secs
            or isc.dense_save_secs):
        raise ConfigError(f"{where}.sparse_save_steps",
                          "set at least one of sparse_save_steps, dense_save_steps, "
                          "sparse_save_secs, dense_save_secs (> 0)")
    kind = isc.WhichOneof("incr_update")
    if kind is None:
        raise ConfigError(f"{where}.kafka", "choose where versions go: kafka { server topic } "
                                            "or fs { incr_save_dir }")
    if kind == "kafka":
        if not isc.kafka.server:
            raise ConfigError(f"{where}.kafka.server", "required (host:port list)")
        if not isc.kafka.topic:
            raise ConfigError(f"{where}.kafka.topic", "required")
    elif not isc.fs.incr_save_dir:
        raise ConfigError(f"{where}.fs.incr_save_dir", "must not be empty")
    if not MIN_DELTA_CHUNK_BYTES <= isc.max_chunk_bytes <= MAX_DELTA_CHUNK_BYTES:
        raise ConfigError(f"{where}.max_chunk_bytes",
                          f"must be in [{MIN_DELTA_CHUNK_BYTES}, {MAX_DELTA_CHUNK_BYTES}]")


def _validate_easyrec_optimizer(opt: Any, where: str) -> None:
    kind = opt.WhichOneof("optimizer")
    if kind is None:
        raise ConfigError(where, "choose an optimizer (sgd_optimizer, momentum_optimizer, "
                                 "adagrad_optimizer, adam_optimizer, adamw_optimizer, "
                                 "lazy_adam_optimizer or ftrl_optimizer)")
    inner = getattr(opt, kind)
    _validate_easyrec_lr(inner.learning_rate, f"{where}.{kind}.learning_rate")
    w = f"{where}.{kind}"
    if kind in ("adam_optimizer", "adamw_optimizer", "lazy_adam_optimizer"):
        _check_betas(inner, w)
    if kind == "adamw_optimizer" and not 0 <= inner.weight_decay < 1:
        raise ConfigError(f"{w}.weight_decay", "must be in [0, 1) (the decay per step)")
    if kind == "momentum_optimizer" and not 0 <= inner.momentum_optimizer_value < 1:
        raise ConfigError(f"{w}.momentum_optimizer_value", "must be in [0, 1)")
    if kind == "adagrad_optimizer" and inner.initial_accumulator_value < 0:
        raise ConfigError(f"{w}.initial_accumulator_value", "must be >= 0")
    if kind == "ftrl_optimizer":
        if not inner.learning_rate_power <= 0:
            raise ConfigError(f"{w}.learning_rate_power", "must be <= 0")
        if not inner.initial_accumulator_value > 0:
            raise ConfigError(f"{w}.initial_accumulator_value", "must be > 0")
        for name in ("l1_reg", "l2_reg", "l2_shrinkage_reg"):
            if not getattr(inner, name) >= 0:
                raise ConfigError(f"{w}.{name}", "must be >= 0")


def _validate_easyrec_lr(lr: Any, lr_where: str) -> None:
    which = lr.WhichOneof("learning_rate")
    if which == "constant_learning_rate":
        if not lr.constant_learning_rate.learning_rate > 0:
            raise ConfigError(f"{lr_where}.constant_learning_rate.learning_rate", "must be > 0")
    elif which == "exponential_decay_learning_rate":
        e = lr.exponential_decay_learning_rate
        ew = f"{lr_where}.exponential_decay_learning_rate"
        if not e.initial_learning_rate > 0:
            raise ConfigError(f"{ew}.initial_learning_rate", "must be > 0")
        if e.decay_steps <= 0:
            raise ConfigError(f"{ew}.decay_steps", "must be > 0")
        if not 0 < e.decay_factor <= 1:
            raise ConfigError(f"{ew}.decay_factor", "must be in (0, 1]")
        if e.min_learning_rate < 0:
            raise ConfigError(f"{ew}.min_learning_rate", "must be >= 0")
        if e.burnin_learning_rate < 0:
            raise ConfigError(f"{ew}.burnin_learning_rate", "must be >= 0")
        if e.burnin_learning_rate > 0 and e.burnin_steps == 0:
            raise ConfigError(f"{ew}.burnin_steps", "must be > 0 when burnin_learning_rate "
                                                    "is set")
    elif which == "cosine_decay_learning_rate":
        c = lr.cosine_decay_learning_rate
        cw = f"{lr_where}.cosine_decay_learning_rate"
        if not c.learning_rate_base > 0:
            raise ConfigError(f"{cw}.learning_rate_base", "must be > 0")
        if not 0 <= c.warmup_learning_rate <= c.learning_rate_base:
            raise ConfigError(f"{cw}.warmup_learning_rate",
                              "must be in [0, learning_rate_base]")
        if not c.total_steps > c.warmup_steps + c.hold_base_rate_steps:
            raise ConfigError(f"{cw}.total_steps",
                              f"must be > warmup_steps + hold_base_rate_steps "
                              f"({c.warmup_steps + c.hold_base_rate_steps}), got "
                              f"{c.total_steps}")
    elif which == "poly_decay_learning_rate":
        p = lr.poly_decay_learning_rate
        pw = f"{lr_where}.poly_decay_learning_rate"
        if not p.learning_rate_base > 0:
            raise ConfigError(f"{pw}.learning_rate_base", "required, > 0")
        if p.total_steps <= 0:
            raise ConfigError(f"{pw}.total_steps", "required, > 0")
        if not p.power > 0:
            raise ConfigError(f"{pw}.power", "required, > 0 (1: linear)")
        if not 0 <= p.end_learning_rate:
            raise ConfigError(f"{pw}.end_learning_rate", "must be >= 0")


def _validate_tzrec_optimizer(opt: Any, where: str) -> None:
    kind = opt.WhichOneof("optimizer")
    if kind is None:
        raise ConfigError(where, "choose an optimizer (e.g. adagrad_optimizer { lr: 0.05 })")
    inner = getattr(opt, kind)
    w = f"{where}.{kind}"
    if not inner.lr > 0:
        raise ConfigError(f"{w}.lr", "must be > 0")
    fields = inner.DESCRIPTOR.fields_by_name
    if "beta1" in fields:
        _check_betas(inner, w)
    for name in ("weight_decay", "initial_accumulator_value", "dampening"):
        if name in fields and not getattr(inner, name) >= 0:
            raise ConfigError(f"{w}.{name}", "must be >= 0")
    if "eps" in fields and not inner.eps > 0:
        raise ConfigError(f"{w}.eps", "must be > 0")
    if "momentum" in fields:
        if not 0 <= inner.momentum < 1:
            raise ConfigError(f"{w}.momentum", "must be in [0, 1)")
        if inner.nesterov and (inner.momentum == 0 or inner.dampening != 0):
            raise ConfigError(f"{w}.nesterov", "needs momentum > 0 and dampening 0")
    which = opt.WhichOneof("learning_rate")
    if which == "exponential_decay_learning_rate":
        e = opt.exponential_decay_learning_rate
        ew = f"{where}.exponential_decay_learning_rate"
        size = "decay_size" if e.HasField("decay_size") else "decay_steps"
        if getattr(e, size) <= 0:
            raise ConfigError(f"{ew}.{size}", "must be > 0")
        factor = ("decay_rate" if e.HasField("decay_rate") and not e.HasField("decay_factor")
                  else "decay_factor")
        if not 0 < getattr(e, factor) <= 1:
            raise ConfigError(f"{ew}.{factor}", "must be in (0, 1]")
        if e.min_learning_rate < 0:
            raise ConfigError(f"{ew}.min_learning_rate", "must be >= 0")
        _check_tzrec_warmup(e, ew)
    elif which == "cosine_annealing_learning_rate":
        c = opt.cosine_annealing_learning_rate
        cw = f"{where}.cosine_annealing_learning_rate"
        if c.T_max <= 0:
            raise ConfigError(f"{cw}.T_max", "required, > 0 (steps)")
        if c.min_learning_rate < 0:
            raise ConfigError(f"{cw}.min_learning_rate", "must be >= 0")
        _check_tzrec_warmup(c, cw)


def _check_tzrec_warmup(msg: Any, where: str) -> None:
    if msg.by_epoch:
        raise ConfigError(f"{where}.by_epoch", "schedules by epoch are not implemented (a "
                                               "stream has no epochs): give sizes in steps")
    if msg.warmup_learning_rate < 0:
        raise ConfigError(f"{where}.warmup_learning_rate", "must be >= 0")


def _validate_grad_clipping(tc: Any, where: str) -> None:
    if not tc.gradient_clipping_by_norm >= 0 or not math.isfinite(tc.gradient_clipping_by_norm):
        raise ConfigError(f"{where}.gradient_clipping_by_norm", "must be >= 0 (0: no clipping)")
    if not tc.HasField("grad_clipping"):
        return
    gc = tc.grad_clipping
    gw = f"{where}.grad_clipping"
    kind = gc.clipping_type.strip().lower()
    if kind not in ("norm", "value", "none"):
        raise ConfigError(f"{gw}.clipping_type", f"expected norm, value or none, got "
                                                 f"{gc.clipping_type!r}")
    if kind != "none" and tc.gradient_clipping_by_norm > 0:
        raise ConfigError(f"{gw}", "give gradient_clipping_by_norm (EasyRec) or grad_clipping "
                                   "(TorchEasyRec), not both")
    if not gc.max_gradient > 0 or not math.isfinite(gc.max_gradient):
        raise ConfigError(f"{gw}.max_gradient", "must be > 0")
    if not gc.norm_type > 0:
        raise ConfigError(f"{gw}.norm_type", "must be > 0 (2.0: L2, inf: max)")


def _check_betas(inner: Any, where: str) -> None:
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(inner, name) < 1:
            raise ConfigError(f"{where}.{name}", "must be in [0, 1)")

