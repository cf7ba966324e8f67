"""Validation of a loaded pipeline config on its own: the rules the trainer relies on.

:func:`validate_pipeline_config` refuses, with a :class:`~odl.config.config_error.ConfigError`
naming the first offending field:

* what odl does not implement (:func:`odl.config.easyrec_compat.check_implemented`);
* a non-finite float anywhere (learning rates, weights, boundaries, ...);
* a missing ``model_dir``, and ``scheme://`` paths other than ``oss://bucket/key``
  (:func:`check_path_schemes`);
* the input sections: Kafka, DataHub or file stream online, ``train_input_path`` offline,
  the evaluation input and the dead-letter topic (:mod:`odl.config.input_validation`);
* ``data_config``: input fields, one numeric label, sample id and event time fields, sizes
  within :mod:`odl.config.limits`;
* the features and the model (:mod:`odl.config.model_validation`), vocabularies and raw value
  normalization (:mod:`odl.config.feature_settings`), the loss terms' settings
  (:mod:`odl.config.loss_settings`);
* ``train_config``: optimizers, schedules, gradient clipping, intervals, in-batch learning and
  ``incr_save_config`` (:mod:`odl.config.train_validation`).

Before checking, it rewrites the config's other spellings into one form
(:mod:`odl.config.config_forms`). The checks against the machine (writable directories,
memory, devices, the broker's client settings) are :mod:`odl.train.startup_checks`.
"""

from __future__ import annotations

import math

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.config_fields import is_map_field, join_path
from odl.config.config_forms import normalize_config_forms
from odl.config.easyrec_compat import check_implemented
from odl.config.feature_configs import NUMERIC_FIELD_TYPES, FeatureConfig
from odl.config.feature_settings import validate_feature_settings, with_vocabularies_as_buckets
from odl.config.field_formats import RTP_INPUT_TYPES, parse_selected_cols, path_scheme
from odl.config.input_validation import validate_input_sections
from odl.config.label_functions import validate_label_functions
from odl.config.loss_settings import validate_loss_settings
from odl.config.metric_settings import grouped_auc_field, grouped_auc_reduction
from odl.config.model_classes import is_multi_task_model, multi_task_model_classes
from odl.config.model_validation import validate_features, validate_model_common
from odl.config.train_validation import validate_train_config
from odl.config.vector_labels import validate_vector_labels
from odl.protos import pipeline_pb2
from odl.storage.storage_path import UnsupportedPathError, check_supported, parse_oss

__all__ = [
    "check_path_schemes",
    "validate_data_and_features",
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
    validate_input_sections(config, online)
    checked, features = _validate_data_and_features(config)
    validate_model_common(checked, features)
    validate_train_config(config)


def validate_data_and_features(config: pipeline_pb2.EasyRecConfig) -> None:
    """Checks what a feature plan relies on: ``data_config`` and the features.

    The part of :func:`validate_pipeline_config` that ``odl.features.feature_plan`` needs, for
    a reader that builds a plan from a config it did not train with (serving, from an
    export's ``pipeline.config``); input sections, the model and ``train_config`` are not
    checked.

    Args:
        config: a loaded config (rewritten into one form in place, as
            :func:`validate_pipeline_config` does).

    Raises:
        ConfigError: naming the offending field.
    """
    normalize_config_forms(config)
    check_implemented(config)
    _check_finite(config, "")
    _validate_data_and_features(config)


def _validate_data_and_features(
    config: pipeline_pb2.EasyRecConfig,
) -> tuple[pipeline_pb2.EasyRecConfig, dict[str, FeatureConfig]]:
    """``data_config``, feature settings, loss and GAUC columns, then every feature.

    Returns:
        The config as the feature checks read it (vocabularies as bucket counts) and the
        features by name.
    """
    fields = _validate_data_config(config)
    validate_feature_settings(config)
    validate_loss_settings(config)
    grouped_auc_field(config)
    grouped_auc_reduction(config)
    checked = with_vocabularies_as_buckets(config)
    return checked, validate_features(checked, fields)


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
            wanted = _default_text_error(f.default_val, f.input_type)
            if wanted:
                raise ConfigError(f"{where}.default_val",
                                  f"{f.default_val!r} is not a valid "
                                  f"{_FIELD_TYPE.Name(f.input_type)} ({wanted})")
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
    validate_label_functions(dc)
    validate_vector_labels(config, fields)
    _validate_rtp_layout(dc)
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


def _validate_rtp_layout(dc: pipeline_pb2.DatasetConfig) -> None:
    """EasyRec's RTP layout (``selected_cols``, ``rtp_separator``): RTP input types only.

    There, both complete (``odl.features.rtp_layout``).
    """
    kind = pipeline_pb2.DatasetConfig.InputType.Name(dc.input_type)
    if dc.input_type not in RTP_INPUT_TYPES:
        for name in ("selected_cols", "rtp_separator"):
            if dc.HasField(name):
                raise ConfigError(f"data_config.{name}",
                                  "read with EasyRec's RTP layout only (input_type RTPInput, "
                                  f"OdpsRTPInput or HiveRTPInput), not with {kind}")
        return
    if not dc.selected_cols:
        raise ConfigError("data_config.selected_cols",
                          f"{kind} records need it: the label columns, then the features "
                          'column, e.g. "0,3"')
    try:
        cols = parse_selected_cols(dc.selected_cols)
    except ValueError as e:
        raise ConfigError("data_config.selected_cols", str(e)) from None
    if len(cols) - 1 != len(dc.label_fields):
        raise ConfigError("data_config.selected_cols",
                          f"{dc.selected_cols!r} names {len(cols) - 1} label column(s) for "
                          f"{len(dc.label_fields)} label field(s)")
    if not dc.rtp_separator or dc.rtp_separator == dc.separator:
        raise ConfigError("data_config.rtp_separator",
                          "must not be empty and must differ from data_config.separator (the "
                          "separator of the features column)")
    if dc.record_format == pipeline_pb2.DatasetConfig.JSON:
        raise ConfigError("data_config.record_format", f"{kind} records are not JSON")


def _default_text_error(text: str, field_type: int) -> str:
    """What a numeric field's ``default_val`` must be, or "" when ``text`` is that.

    The record parser (``odl.features.record_parser``) reads the default as it reads the
    field's values: an INT32 / INT64 field an integer in int64's range, a FLOAT / DOUBLE field
    a finite number, a BOOL field ``true`` / ``false`` / ``0`` / ``1`` (any case).
    """
    if field_type == _FIELD_TYPE.BOOL:
        ok = text.lower() in ("true", "false", "0", "1")
        return "" if ok else "true, false, 0 or 1"
    if field_type in (_FIELD_TYPE.INT32, _FIELD_TYPE.INT64):
        try:
            ok = -(1 << 63) <= int(text) < (1 << 63)
        except ValueError:
            ok = False
        return "" if ok else "an integer in int64's range"
    try:
        ok = math.isfinite(float(text))
    except ValueError:
        ok = False
    return "" if ok else "a finite number"
