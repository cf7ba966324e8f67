"""Online sample source: one Alibaba Cloud DataHub topic, read with ``pydatahub``.

Contract (the same as ``kafka_source.KafkaSource``, so the input pipeline, the input process,
checkpoints and crash recovery treat both alike):

* Positions are ``{int(shard_id): next sequence to read}``. Records carry the shard as their
  partition, the sequence as their offset and DataHub's system time (ms) as their timestamp.
* Start: positions restored from a checkpoint win (SEQUENCE cursors); else
  ``offset_info`` (``{"<shard>": {"cursor": "..."}}``, ``{"<shard>": <sequence>}`` or
  ``{"timestamp": s}``) or ``offset_time``; else each shard's oldest record. A start sequence
  that has expired (below the shard's oldest record) continues at the oldest with a warning
  naming how many records were lost to retention; never silently.
* BLOB topics carry one CSV or JSON record per DataHub record, exactly like Kafka message
  values. TUPLE topics are turned into a JSON object ``{field: value}`` per record (``null``
  for a null field), which the record parser reads by ``input_fields`` name: fields the config
  does not name are ignored, missing ones take their ``default_val``.
* Shards are read round-robin, up to ``batch_size`` records per batch; a partial batch goes
  out after ``batch_timeout_ms``. Shard split and merge: a CLOSED shard is read to its end
  (DataHub answers "sealed"), and a shard whose parents are known is read only after all of
  them are finished, so records of one key keep their order. The shard list is refreshed every
  ``_SHARD_REFRESH_SECS`` and whenever a shard ends.
* Several ranks (``rank`` of ``world_size``): a rank reads the shards
  ``odl.inputs.partition_assignment.shard_rank`` gives it, new ones from splits and merges
  included; its positions name only those. A child waits for the parents its own rank reads;
  one whose parent another rank reads starts at once (DataHub has closed the parent by then,
  but the other rank may still be reading its last records), so across ranks one key's
  records keep their order only to within that rank's lag at the split. A rank that owns no
  shard at start is an error.
* Throttling (LimitExceeded), server errors, timeouts and connection errors are retried with
  exponential backoff (0.1 s doubling to 2 s), interruptible by the stop event; while they
  last ``broker_error`` says why (``/status`` ``input.broker_error``, ``odl_broker_up 0``).
  Nothing is skipped or lost.
* Credentials: ``akId`` / ``akSecret`` from the config, else ``DATAHUB_ACCESS_KEY_ID`` /
  ``DATAHUB_ACCESS_KEY_SECRET``; the secret is never logged. Records are read with DataHub's
  JSON protocol (``protocol="pb"`` for the protobuf one), bodies LZ4-compressed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import requests
from datahub import DataHub
from datahub.exceptions import (
    DatahubException,
    InternalServerException,
    InvalidCursorException,
    LimitExceededException,
    ResourceNotFoundException,
    SeekOutOfRangeException,
    ShardSealedException,
)
from datahub.models import CursorType, RecordType
from datahub.models.compress import CompressFormat

from odl.config.field_formats import parse_datahub_offsets
from odl.inputs.kafka_source import PartitionState, RawBatch
from odl.inputs.partition_assignment import shard_rank

logger = logging.getLogger(__name__)
# pydatahub logs every error answer at ERROR, including the ones this module handles
# (an expired sequence, a sealed shard); what matters is logged here instead
logging.getLogger("datahub.rest").setLevel(logging.CRITICAL)

ENV_ACCESS_KEY_ID = "DATAHUB_ACCESS_KEY_ID"
ENV_ACCESS_KEY_SECRET = "DATAHUB_ACCESS_KEY_SECRET"
_SHARD_REFRESH_SECS = 10.0
_WATERMARK_REFRESH_SECS = 2.0
_IDLE_SLEEP_SECS = 0.02
_MAX_READ = 1000  # DataHub's limit per GetRecords


@dataclass
class DatahubStart:
    """How to position each shard at start (first match wins).

    Attributes:
        checkpoint: next sequence per shard from a checkpoint.
        cursors: explicit cursors per shard (EasyRec's ``{"<shard>": {"cursor": ...}}``).
        sequences: explicit sequences per shard.
        timestamp_s: SYSTEM_TIME cursors at this time.
    """

    checkpoint: Optional[dict[int, int]] = None
    cursors: Optional[dict[int, str]] = None
    sequences: Optional[dict[int, int]] = None
    timestamp_s: Optional[float] = None


def datahub_endpoint(endpoint: str, region: str) -> str:
    """The endpoint URL: ``endpoint``, else ``region`` (a URL, or a region id)."""
    if endpoint:
        return endpoint
    if "://" in region:
        return region
    return f"https://dh-{region}.aliyuncs.com" if region else ""


def parse_datahub_start(offset_info: str, offset_time: str,
                        checkpoint: Optional[dict[int, int]]) -> DatahubStart:
    """Start rules from ``datahub_train_input`` and a checkpoint (the checkpoint wins).

    Raises:
        ValueError: malformed offset_info / offset_time
            (``odl.config.field_formats.parse_datahub_offsets``).
    """
    if checkpoint is not None:
        return DatahubStart(checkpoint=dict(checkpoint))
    doc = parse_datahub_offsets(offset_info, offset_time)
    return DatahubStart(cursors=doc.get("cursors") or None,
                        sequences=doc.get("sequences") or None,
                        timestamp_s=doc.get("timestamp_s"))


@dataclass
class _ShardReader:
    shard_id: str
    cursor: Optional[str] = None
    next_seq: int = 0
    finished: bool = False
    parents: tuple[str, ...] = ()
    closed: bool = False


class DatahubSource:
    """Reads raw record batches from one DataHub topic (contract: module docstring).

    Args:
        endpoint: the DataHub endpoint URL.
        access_id: AccessKey id ("" = ``DATAHUB_ACCESS_KEY_ID``).
        access_key: AccessKey secret ("" = ``DATAHUB_ACCESS_KEY_SECRET``).
        project: project name.
        topic: topic name.
        start: start rules.
        batch_size: records per batch.
        batch_timeout_ms: emit a partial batch after this long.
        shard_num: expected shard count (0 = not checked; a difference is logged).
        protocol: ``"json"`` (the default: in Python its parsing costs half the CPU of the
            protobuf one, ``bench/datahub_input.py``) or ``"pb"``.
        rank: this rank of ``world_size``: only the shards ``shard_rank`` gives it are read.
        world_size: ranks reading the topic together (1: every shard).
    """

    def __init__(self, endpoint: str, access_id: str, access_key: str, project: str,
                 topic: str, start: DatahubStart, batch_size: int,
                 batch_timeout_ms: int = 200, shard_num: int = 0,
                 protocol: str = "json", rank: int = 0, world_size: int = 1) -> None:
        self.endpoint = endpoint
        self.project = project
        self.topic = topic
        self._start = start
        self.batch_size = int(batch_size)
        self.batch_timeout = batch_timeout_ms / 1000.0
        self._shard_num = shard_num
        access_id = access_id or os.environ.get(ENV_ACCESS_KEY_ID, "")
        access_key = access_key or os.environ.get(ENV_ACCESS_KEY_SECRET, "")
        self._client = DataHub(access_id, access_key, endpoint, enable_pb=protocol == "pb",
                               compress_format=CompressFormat.LZ4, user_agent="odl",
                               retry_times=0, conn_timeout=5, read_timeout=30)
        self._schema: Any = None
        self._tuple = False
        self._readers: dict[str, _ShardReader] = {}
        self.rank, self.world_size = int(rank), int(world_size)
        self._others: set[str] = set()  # shards other ranks read
        self._rr = 0
        self._last_shard_refresh = 0.0
        self._last_watermarks = 0.0
        self.partition_state: dict[int, PartitionState] = {}
        self.records_consumed = 0
        self.broker_error: Optional[str] = None
        self._closed = False

    def __repr__(self) -> str:
        return f"DatahubSource({self.endpoint}, {self.project}/{self.topic})"

    @property
    def partitions(self) -> list[int]:
        """Shard ids known so far, as ints."""
        return sorted(int(k) for k in self._readers)

    # ---------------------------------------------------------------- retries
    def _call(self, what: str, fn: Any, stop_event: Optional[threading.Event]) -> Any:
        """Runs ``fn()`` until it succeeds, backing off on transient errors."""
        delay = 0.1
        while True:
            try:
                out = fn()
            except (LimitExceededException, InternalServerException,
                    requests.exceptions.RequestException) as exc:
                self._transient(what, exc)
            except DatahubException as exc:
                if int(getattr(exc, "status_code", 0) or 0) < 500 or isinstance(
                        exc, (ResourceNotFoundException, SeekOutOfRangeException,
                              InvalidCursorException, ShardSealedException)):
                    raise
                self._transient(what, exc)
            else:
                if self.broker_error is not None:
                    logger.info("DataHub %s/%s reachable again", self.project, self.topic)
                self.broker_error = None
                return out
            if stop_event is not None and stop_event.wait(delay):
                raise InterruptedError("stopped while DataHub was unavailable")
            if stop_event is None:
                time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _transient(self, what: str, exc: BaseException) -> None:
        code = getattr(exc, "error_code", "") or type(exc).__name__
        text = f"DataHub {what} failed: {code} {getattr(exc, 'error_msg', '') or ''}".strip()
        if self.broker_error != text:
            logger.warning("%s; retrying", text)
        self.broker_error = text

    # ---------------------------------------------------------------- start
    def open(self, stop_event: Optional[threading.Event] = None) -> dict[int, int]:
        """Reads the topic's schema and shards and positions every shard.

        Returns:
            The start sequence per shard.
        """
        while True:
            try:
                topic = self._call("get_topic",
                                   lambda: self._client.get_topic(self.project, self.topic),
                                   stop_event)
                break
            except ResourceNotFoundException as exc:
                self.broker_error = f"DataHub topic {self.project}/{self.topic}: {exc}"
                logger.warning("%s; waiting for it", self.broker_error)
                if stop_event is not None and stop_event.wait(1.0):
                    raise InterruptedError("stopped while waiting for the topic") from None
        self._tuple = topic.record_type == RecordType.TUPLE
        self._schema = topic.record_schema
        self._refresh_shards(stop_event, initial=True)
        if not self._readers and self.world_size > 1:
            raise ValueError(
                f"rank {self.rank} of {self.world_size} owns none of DataHub topic "
                f"{self.project}/{self.topic}'s shards {sorted(self._others, key=int)} "
                "(shard s goes to rank s % ranks): run fewer ranks")
        if self._shard_num and self._shard_num != len(self._readers) + len(self._others):
            logger.warning("datahub_train_input.shard_num is %d but %s/%s has %d shards; "
                           "reading all of them", self._shard_num, self.project, self.topic,
                           len(self._readers) + len(self._others))
        positions = {int(k): r.next_seq for k, r in self._readers.items()}
        logger.info("DataHub %s/%s: %d shards, start sequences %s", self.project, self.topic,
                    len(self._readers), positions)
        return positions

    def _refresh_shards(self, stop_event: Optional[threading.Event],
                        initial: bool = False) -> None:
        shards = self._call("list_shard",
                            lambda: self._client.list_shard(self.project, self.topic),
                            stop_event).shards
        self._last_shard_refresh = time.monotonic()
        for sh in shards:
            sid = str(sh.shard_id)
            if self.world_size > 1 and shard_rank(sid, self.world_size) != self.rank:
                self._others.add(sid)
                continue
            r = self._readers.get(sid)
            if r is None:
                r = _ShardReader(sid, parents=tuple(str(p) for p in (sh.parent_shard_ids or [])))
                self._readers[sid] = r
                self._position(r, stop_event, from_start=initial)
            r.closed = sh.state.value == "CLOSED"
            self.partition_state.setdefault(int(sid), PartitionState(position=r.next_seq))

    def _position(self, r: _ShardReader, stop_event: Optional[threading.Event],
                  from_start: bool) -> None:
        """Sets a shard's first cursor from the start rules (new shards: their oldest)."""
        s, shard = self._start, int(r.shard_id)
        if s.checkpoint is not None and shard in s.checkpoint:
            self._seek_sequence(r, s.checkpoint[shard], stop_event)
        elif from_start and s.cursors and shard in s.cursors:
            r.cursor = s.cursors[shard]
            r.next_seq = -1  # learned from the first read
        elif from_start and s.sequences and shard in s.sequences:
            self._seek_sequence(r, s.sequences[shard], stop_event)
        elif from_start and s.timestamp_s is not None:
            res = self._call("get_cursor", lambda: self._client.get_cursor(
                self.project, self.topic, r.shard_id, CursorType.SYSTEM_TIME,
                int(s.timestamp_s * 1000)), stop_event)
            r.cursor, r.next_seq = res.cursor, int(res.sequence)
        else:
            self._seek_oldest(r, stop_event)

    def _seek_oldest(self, r: _ShardReader, stop_event: Optional[threading.Event]) -> None:
        res = self._call("get_cursor", lambda: self._client.get_cursor(
            self.project, self.topic, r.shard_id, CursorType.OLDEST), stop_event)
        r.cursor, r.next_seq = res.cursor, int(res.sequence)

    def _seek_sequence(self, r: _ShardReader, seq: int,
                       stop_event: Optional[threading.Event]) -> None:
        try:
            res = self._call("get_cursor", lambda: self._client.get_cursor(
                self.project, self.topic, r.shard_id, CursorType.SEQUENCE, int(seq)),
                stop_event)
            r.cursor, r.next_seq = res.cursor, int(res.sequence)
        except (SeekOutOfRangeException, InvalidCursorException):
            self._seek_oldest(r, stop_event)
            if r.next_seq > seq:
                logger.warning("DataHub %s/%s shard %s: sequence %d has expired; continuing at "
                               "the oldest record %d (%d records lost to retention)",
                               self.project, self.topic, r.shard_id, seq, r.next_seq,
                               r.next_seq - seq)
            else:  # past the end (a checkpoint of records DataHub no longer has)
                logger.warning("DataHub %s/%s shard %s: sequence %d is beyond the shard; "
                               "reading from %d", self.project, self.topic, r.shard_id, seq,
                               r.next_seq)

    # ---------------------------------------------------------------- reading
    def _readable(self) -> list[_ShardReader]:
        out = []
        for r in self._readers.values():
            if r.finished:
                continue
            if any(p in self._readers and not self._readers[p].finished for p in r.parents):
                continue  # children wait until their parents are read to the end
            out.append(r)
        return sorted(out, key=lambda r: int(r.shard_id))

    def read_batch(self, stop_event: Optional[threading.Event] = None) -> Optional[RawBatch]:
        """Reads up to ``batch_size`` records (a partial batch after ``batch_timeout_ms``).

        Returns:
            The batch, or None when stopped before any record arrived.
        """
        values: list[bytes] = []
        parts: list[int] = []
        offs: list[int] = []
        stamps: list[int] = []
        deadline = time.monotonic() + self.batch_timeout
        while len(values) < self.batch_size:
            if stop_event is not None and stop_event.is_set():
                break
            if time.monotonic() - self._last_shard_refresh > _SHARD_REFRESH_SECS:
                self._refresh_shards(stop_event)
            readers = self._readable()
            got = 0
            for i in range(len(readers)):
                r = readers[(self._rr + i) % len(readers)]
                got += self._read_shard(r, self.batch_size - len(values), values, parts, offs,
                                        stamps, stop_event)
                if len(values) >= self.batch_size:
                    break
            self._rr += 1
            if values and time.monotonic() >= deadline:
                break
            if got == 0:
                if values and time.monotonic() >= deadline:
                    break
                if stop_event is not None:
                    if stop_event.wait(_IDLE_SLEEP_SECS):
                        break
                else:
                    time.sleep(_IDLE_SLEEP_SECS)
        self._refresh_watermarks(stop_event)
        if not values:
            return None
        self.records_consumed += len(values)
        positions = {int(k): r.next_seq for k, r in self._readers.items()}
        return RawBatch(values=values, partitions=np.asarray(parts, dtype=np.int32),
                        offsets=np.asarray(offs, dtype=np.int64),
                        timestamps_ms=np.asarray(stamps, dtype=np.int64),
                        positions=positions)

    def _read_shard(self, r: _ShardReader, limit: int, values: list[bytes], parts: list[int],
                    offs: list[int], stamps: list[int],
                    stop_event: Optional[threading.Event]) -> int:
        limit = min(limit, _MAX_READ)
        try:
            if self._tuple:
                res = self._call("get_tuple_records", lambda: self._client.get_tuple_records(
                    self.project, self.topic, r.shard_id, self._schema, r.cursor, limit),
                    stop_event)
            else:
                res = self._call("get_blob_records", lambda: self._client.get_blob_records(
                    self.project, self.topic, r.shard_id, r.cursor, limit), stop_event)
        except ShardSealedException:
            r.finished = True
            logger.info("DataHub %s/%s shard %s read to its end (closed); its children follow",
                        self.project, self.topic, r.shard_id)
            self._refresh_shards(stop_event)
            return 0
        except (InvalidCursorException, SeekOutOfRangeException):
            self._seek_sequence(r, max(r.next_seq, 0), stop_event)
            return 0
        shard = int(r.shard_id)
        for rec in res.records:
            if self._tuple:
                names = [f.name for f in self._schema.field_list]
                values.append(json.dumps(dict(zip(names, rec.values, strict=False)),
                                         default=str).encode())
            else:
                values.append(bytes(rec.blob_data))
            parts.append(shard)
            offs.append(int(rec.sequence))
            stamps.append(int(rec.system_time))
        if res.records:
            r.next_seq = int(res.records[-1].sequence) + 1
            st = self.partition_state.setdefault(shard, PartitionState())
            st.position = r.next_seq
            st.high_watermark = max(st.high_watermark, r.next_seq)
        r.cursor = res.next_cursor
        return len(res.records)

    def _refresh_watermarks(self, stop_event: Optional[threading.Event]) -> None:
        now = time.monotonic()
        if now - self._last_watermarks < _WATERMARK_REFRESH_SECS:
            return
        self._last_watermarks = now
        for sid, r in self._readers.items():
            st = self.partition_state.setdefault(int(sid), PartitionState())
            st.position = max(r.next_seq, 0)
            try:
                latest = self._client.get_cursor(self.project, self.topic, sid,
                                                 CursorType.LATEST)
                st.high_watermark = max(int(latest.sequence) + 1, st.position) \
                    if latest.record_time >= 0 else st.position
            except (DatahubException, requests.exceptions.RequestException):
                pass  # lag is informational; reads report the outage

    def end_positions(self, stop_event: Optional[threading.Event] = None) -> dict[int, int]:
        """Each known shard's next sequence after its latest record, asked now.

        Returns:
            ``{shard: sequence}`` (a shard without records: its position).
        """
        self._last_watermarks = 0.0
        self._refresh_watermarks(stop_event)
        return {p: st.high_watermark for p, st in self.partition_state.items()
                if st.high_watermark >= 0}

    # ---------------------------------------------------------------- commits
    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Nothing to commit: the checkpoint is the record of what was trained."""

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Nothing to commit (see :meth:`request_commit`)."""

    def close(self) -> None:
        """Releases the HTTP session."""
        self._closed = True
