"""The online source of a pipeline config: Kafka, DataHub or a file stream.

``kafka_train_input``, ``datahub_train_input`` or ``file_stream_input``: one place decides
which source reads the stream and with which arguments, for both online layouts (the input
process and in-process threads): :func:`online_source_args` turns the
config (and restored positions) into picklable start rules and keyword arguments, with a
``"kind"`` key; :func:`build_source` makes the source from them.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from odl.config.field_formats import parse_offset_info, parse_offset_time
from odl.inputs.datahub_source import (
    DatahubSource,
    DatahubStart,
    datahub_endpoint,
    parse_datahub_start,
)
from odl.inputs.file_stream_source import FileStreamSource, FileStreamStart
from odl.inputs.kafka_source import KafkaSource
from odl.inputs.start_positions import StartPositions, start_positions_from_config
from odl.protos import pipeline_pb2

Start = Union[StartPositions, DatahubStart, FileStreamStart]


def online_input_kind(config: pipeline_pb2.EasyRecConfig) -> str:
    """``"datahub"``, ``"file_stream"`` or ``"kafka"``: which online input the config sets."""
    if config.HasField("datahub_train_input"):
        return "datahub"
    if config.HasField("file_stream_input"):
        return "file_stream"
    return "kafka"


def online_input_name(config: pipeline_pb2.EasyRecConfig) -> str:
    """The stream's name for status and checkpoints.

    The Kafka topic, DataHub's ``project/topic`` or the file stream's ``train_data_dir``.
    """
    kind = online_input_kind(config)
    if kind == "datahub":
        d = config.datahub_train_input
        return f"{d.project}/{d.topic}"
    if kind == "file_stream":
        return config.file_stream_input.train_data_dir.rstrip("/")
    return config.kafka_train_input.topic


def online_source_args(config: pipeline_pb2.EasyRecConfig,
                       restored_positions: Optional[dict[int, int]],
                       rank: int = 0, world_size: int = 1,
                       ) -> tuple[Start, dict[str, Any]]:
    """The start rules and source keyword arguments (plus ``"kind"``) of the online input.

    ``rank`` / ``world_size``: a Kafka or DataHub source of one of several ranks reads only
    its share of the partitions / shards (``odl.inputs.partition_assignment``), a file stream
    its batch of each group of batches (``odl.inputs.file_stream_source``).
    """
    dc = config.data_config
    if online_input_kind(config) == "file_stream":
        f = config.file_stream_input
        return FileStreamStart(restored_positions, f.start_day), {
            "kind": "file_stream",
            "train_data_dir": f.train_data_dir,
            "batch_size": dc.batch_size,
            "split_interval": f.split_interval,
            "end_day": f.end_day,
            "data_donefile": f.data_donefile,
            "data_sleep_second": f.data_sleep_second,
            "missing_split_wait_secs": f.missing_split_wait_secs,
            "file_pattern": f.file_pattern,
            "batch_timeout_ms": dc.batch_timeout_ms,
            "rank": rank,
            "world_size": world_size,
        }
    if online_input_kind(config) == "datahub":
        d = config.datahub_train_input
        start = parse_datahub_start(d.offset_info, d.offset_time, restored_positions)
        return start, {
            "kind": "datahub",
            "endpoint": datahub_endpoint(d.endpoint, d.region),
            "access_id": d.akId,
            "access_key": d.akSecret,
            "project": d.project,
            "topic": d.topic,
            "batch_size": dc.batch_size,
            "batch_timeout_ms": dc.batch_timeout_ms,
            "shard_num": d.shard_num,
            "rank": rank,
            "world_size": world_size,
        }
    ki = config.kafka_train_input
    start = start_positions_from_config(
        parse_offset_info(ki.offset_info) if ki.offset_info else None,
        parse_offset_time(ki.offset_time) or 0,
        list(ki.offset),
        restored_positions,
    )
    return start, {
        "kind": "kafka",
        "servers": ki.server,
        "topic": ki.topic,
        "group": ki.group,
        "batch_size": dc.batch_size,
        "batch_timeout_ms": dc.batch_timeout_ms,
        "fetch_interval_ms": dc.fetch_interval_ms,
        "kafka_config": dict(ki.kafka_config),
        "rank": rank,
        "world_size": world_size,
    }


def build_source(start: Start, args: dict[str, Any]) -> Union[KafkaSource, DatahubSource,
                                                             FileStreamSource]:
    """The source ``online_source_args`` describes (not yet open)."""
    args = dict(args)
    kind = args.pop("kind", "kafka")
    if kind == "file_stream":
        assert isinstance(start, FileStreamStart)
        return FileStreamSource(start=start, **args)
    if kind == "datahub":
        assert isinstance(start, DatahubStart)
        return DatahubSource(start=start, **args)
    assert isinstance(start, StartPositions)
    return KafkaSource(start=start, **args)


def source_status(source: Any) -> dict[str, Any]:
    """A source's own report for ``/status`` (a file stream's splits); empty when it has none."""
    report = getattr(source, "status_report", None)
    return dict(report()) if report is not None else {}


def source_retention(source: Any) -> Optional[dict[str, Any]]:
    """A source's retention risk report (Kafka's, ``odl.inputs.retention_risk``).

    Returns:
        The report as a dict; None for a source without one (DataHub, a file stream) and
        before the first.
    """
    report = getattr(source, "retention_report", None)
    return report() if report is not None else None
