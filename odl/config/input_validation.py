"""Validation of a pipeline config's input sections: what is read, and where dead letters go.

:func:`validate_input_sections` checks, with a
:class:`~odl.config.config_error.ConfigError` naming the first offending field:

* online, exactly one of ``kafka_train_input`` (servers as host:port, topic, group, at most
  one start position, a dead-letter topic other than the input topic),
  ``datahub_train_input`` (project, topic, endpoint or region, the start as EasyRec writes
  it) and ``file_stream_input`` (``train_data_dir``, a ``split_interval`` dividing a day,
  ``start_day`` / ``end_day`` as YYYYMMDD);
* online, the evaluation input: one of ``kafka_eval_input`` and ``datahub_eval_input``, not
  the training topic;
* ``data_config.dead_letter_topic`` / ``dead_letter_server``: a Kafka topic on a known broker
  (the server is required unless the input is ``kafka_train_input``);
* offline, ``train_input_path``.
"""

from __future__ import annotations

import datetime as dt
import re

from odl.config.config_error import ConfigError
from odl.config.field_formats import parse_datahub_offsets, parse_offset_info, parse_offset_time
from odl.protos import pipeline_pb2
from odl.storage.storage_path import UnsupportedPathError, check_supported

__all__ = ["eval_reads_training_topic", "validate_input_sections"]


def validate_input_sections(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Checks the training and evaluation inputs the run reads; raises on the first problem.

    Args:
        config: a loaded config.
        online: True for ``odl-train --online`` (a stream), False for file input.

    Raises:
        ConfigError: naming the offending field.
    """
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


def eval_reads_training_topic(config: pipeline_pb2.EasyRecConfig) -> bool:
    """Whether the eval input names the training topic (EasyRec's online-training form).

    The evaluation then reads that topic with positions of its own and scores records that
    training may already have learned from: a trailing figure, unlike the progressive
    metrics, which score each record before training on it.
    """
    k, t = config.kafka_eval_input, config.kafka_train_input
    if k.topic:
        return k.topic == t.topic and k.server == t.server
    d, dt = config.datahub_eval_input, config.datahub_train_input
    return bool(d.topic) and (d.project, d.topic) == (dt.project, dt.topic) and (
        d.endpoint or d.region) == (dt.endpoint or dt.region)


def _validate_datahub_eval(config: pipeline_pb2.EasyRecConfig) -> None:
    """``datahub_eval_input``: one eval input and a valid section."""
    d = config.datahub_eval_input
    if config.kafka_eval_input.topic:
        raise ConfigError("datahub_eval_input", "give one of kafka_eval_input and "
                                                "datahub_eval_input")
    _validate_datahub_section(d, "datahub_eval_input")


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
    """``kafka_eval_input``: a topic on a known broker; on the training topic, another group."""
    k = config.kafka_eval_input
    if not k.server.strip():
        raise ConfigError("kafka_eval_input.server", "required with kafka_eval_input.topic")
    _check_servers("kafka_eval_input.server", k.server)
    if not k.group.strip():
        raise ConfigError("kafka_eval_input.group", "must not be empty")
    t = config.kafka_train_input
    if eval_reads_training_topic(config) and k.group.strip() == t.group.strip():
        # EasyRec's online-training form: the same topic, another consumer group
        raise ConfigError("kafka_eval_input.group", "must differ from kafka_train_input.group "
                                                    "when the evaluation reads the training "
                                                    "topic")
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


def _validate_offline_input(config: pipeline_pb2.EasyRecConfig) -> None:
    path = config.train_input_path.strip()
    if not path:
        raise ConfigError("train_input_path", "required for offline training (a glob of CSV or "
                                              "Parquet files); use --online for Kafka input")

