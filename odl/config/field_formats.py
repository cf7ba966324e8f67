"""Config fields whose string value has a syntax of its own.

* ``kafka_train_input.offset_info``: JSON, ``{"timestamp": <unix seconds>}`` or
  ``{"<partition>": <offset>, ...}`` (:func:`parse_offset_info`);
* ``train_config.dead_line``: ``"%Y%m%d %H:%M:%S"`` in local time, EasyRec's form, or unix
  seconds (:func:`parse_dead_line`);
* ``datahub_train_input.offset_info`` / ``offset_time``: EasyRec's DataHub start forms
  (:func:`parse_datahub_offsets`);
* paths: a ``scheme://`` prefix marks a remote path (:func:`path_scheme`);
* ``data_config.selected_cols``: EasyRec's RTP columns, by index ``"0,3"`` or by name
  ``"clk,features"`` (:func:`parse_selected_cols`).

The validator calls these parsers to check the fields; the trainer calls them again to use
the values.
"""

from __future__ import annotations

import calendar
import json
import math
import re
import time
from typing import Any, Optional

from odl.config.config_error import ConfigError
from odl.config.config_fields import describe_value
from odl.protos import pipeline_pb2

__all__ = ["parse_datahub_offsets", "parse_dead_line", "parse_offset_info", "path_scheme"]

_DEAD_LINE_FORMAT = "%Y%m%d %H:%M:%S"
_URL_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*)://")


def parse_offset_info(
    text: str, field: str = "kafka_train_input.offset_info"
) -> tuple[str, Any] | None:
    """Parse a Kafka ``offset_info`` JSON string.

    Args:
        text: ``{"timestamp": <unix seconds>}`` or ``{"<partition>": <offset>, ...}``;
            empty means "not set".
        field: field path used in errors.

    Returns:
        ``("timestamp", seconds: float)``, ``("offsets", {partition: offset})`` or None.

    Raises:
        ConfigError: not JSON, or not one of the two forms.

    """
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(field, f"not valid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(field, 'expected {"timestamp": <unix seconds>} or '
                                 '{"<partition>": <offset>, ...}')
    if "timestamp" in data:
        ts = data["timestamp"]
        if len(data) != 1:
            raise ConfigError(field, '"timestamp" cannot be combined with partition offsets')
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
                or ts < 0:
            raise ConfigError(field, f"timestamp must be a non-negative number of unix seconds, "
                                     f"got {describe_value(ts)}")
        if ts > 1e11:
            raise ConfigError(field, f"timestamp {ts} looks like milliseconds; give unix seconds")
        return ("timestamp", float(ts))
    offsets: dict[int, int] = {}
    for key, value in data.items():
        if not re.fullmatch(r"\d+", str(key)):
            raise ConfigError(field, f"key {key!r} is neither \"timestamp\" nor a partition "
                                     f"number")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(field, f"offset of partition {key} must be a non-negative "
                                     f"integer, got {describe_value(value)}")
        offsets[int(key)] = value
    return ("offsets", offsets)


def parse_dead_line(text: str, field: str = "train_config.dead_line") -> float | None:
    """Parse ``train_config.dead_line``.

    Args:
        text: ``"%Y%m%d %H:%M:%S"`` in local time (EasyRec's form, e.g. ``20260508 23:59:59``)
            or unix seconds; empty means "not set".
        field: field path used in errors.

    Returns:
        Unix seconds, or None when empty.

    Raises:
        ConfigError: neither form.

    """
    if text is None or not text.strip():
        return None
    text = text.strip()
    try:
        return time.mktime(time.strptime(text, _DEAD_LINE_FORMAT))
    except (ValueError, OverflowError):
        pass
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(field, f"expected \"YYYYmmdd HH:MM:SS\" or unix seconds, got "
                                 f"{text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(field, f"expected non-negative unix seconds, got {text!r}")
    return value


def path_scheme(path: str) -> str | None:
    """The URL scheme of a path (``"oss"`` for ``oss://bucket/key``), None for a local path.

    Args:
        path: a path from the config.

    Returns:
        The scheme in lower case, or None.
    """
    m = _URL_SCHEME.match(path or "")
    return m.group(1).lower() if m else None


def parse_datahub_offsets(offset_info: str, offset_time: str) -> dict[str, Any]:
    """The start a ``datahub_train_input`` asks for.

    Args:
        offset_info: JSON: ``{"<shard>": {"cursor": "<cursor>"}, ...}``,
            ``{"<shard>": <sequence>, ...}`` or ``{"timestamp": <unix seconds>}``; "" = none.
        offset_time: ``"YYYYMMDD HH:MM:SS"`` (UTC) or unix seconds as a string; "" = none.

    Returns:
        ``{"timestamp_s": float}``, ``{"cursors": {shard: str}, "sequences": {shard: int}}``
        (either may be empty), or ``{}`` (each shard's oldest record).

    Raises:
        ValueError: naming what is malformed.
    """
    if offset_info:
        try:
            doc = json.loads(offset_info)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError("must be a JSON object")
        if "timestamp" in doc:
            ts = doc["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
                raise ValueError('"timestamp" must be unix seconds >= 0')
            return {"timestamp_s": float(ts)}
        cursors: dict[int, str] = {}
        sequences: dict[int, int] = {}
        for shard, value in doc.items():
            if not str(shard).isdigit():
                raise ValueError(f"shard id {shard!r} is not a number")
            if isinstance(value, dict) and isinstance(value.get("cursor"), str):
                cursors[int(shard)] = value["cursor"]
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                sequences[int(shard)] = value
            else:
                raise ValueError(f'shard "{shard}": expected {{"cursor": "..."}} or a '
                                 "sequence >= 0")
        return {"cursors": cursors, "sequences": sequences}
    seconds = parse_offset_time(offset_time)
    return {"timestamp_s": seconds} if seconds is not None else {}


def parse_offset_time(offset_time: str) -> Optional[float]:
    """Unix seconds of an EasyRec ``offset_time``.

    Args:
        offset_time: unix seconds (``"1650765731"``) or ``"YYYYMMDD HH:MM:SS"`` (UTC);
            "" = none.

    Returns:
        The seconds, or None when empty.

    Raises:
        ValueError: neither form, or a number that looks like milliseconds.
    """
    text = (offset_time or "").strip()
    if not text:
        return None
    if text.isdigit():
        seconds = float(text)
        if seconds > 1e11:
            raise ValueError(f"{text} looks like milliseconds; give unix seconds")
        return seconds
    try:
        return float(calendar.timegm(time.strptime(text, _DEAD_LINE_FORMAT)))
    except ValueError:
        raise ValueError(f"{text!r} is neither unix seconds nor 'YYYYMMDD HH:MM:SS'") from None


# the input types whose records have EasyRec's RTP layout (odl.features.rtp_layout)
RTP_INPUT_TYPES = frozenset({pipeline_pb2.DatasetConfig.RTPInput,
                             pipeline_pb2.DatasetConfig.OdpsRTPInput,
                             pipeline_pb2.DatasetConfig.HiveRTPInput})


def parse_selected_cols(text: str) -> list[int]:
    """``data_config.selected_cols``' column indices: the label columns, then the features'.

    By index (EasyRec's ``RTPInput``): ``"0,3"`` -> ``[0, 3]``, columns of the record that are
    not named are not read. By name (EasyRec's ``OdpsRTPInput``, a table's columns, e.g.
    ``"clk,features"``): a record holds the named columns, in the order named, so the names
    stand for ``[0, 1, ...]``.

    Raises:
        ValueError: neither all indices nor all names, fewer than two, a negative index, or
            one twice.
    """
    parts = [x.strip() for x in text.split(",")]
    if len(set(parts)) != len(parts):
        raise ValueError(f"{text!r} names a column twice")
    if all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", x) for x in parts):
        cols = list(range(len(parts)))
    else:
        try:
            cols = [int(x) for x in parts]
        except ValueError:
            raise ValueError(f"{text!r} is neither a comma-separated list of column indices "
                             "nor one of column names") from None
    if len(cols) < 2 or min(cols) < 0:
        raise ValueError(f"{text!r} needs the label columns and last the features column "
                         "(indices >= 0)")
    return cols
