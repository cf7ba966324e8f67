"""Crash recovery from the trainer's own delta topic: the state of the last complete version.

After a SIGKILL the newest checkpoint is older than what serving may already have applied:
versions published after the checkpoint reflect records the checkpoint's positions would
make the trainer read again. The trainer therefore restores the checkpoint and then replays
its own delta topic the way serving does, from the checkpoint's ``delta_topic_offset`` to
the topic's end:

* every message is decoded (``decode_chunk``); corrupt ones are counted and skipped, and so
  are chunks of a generation superseded by a newer one (``publisher.generation_fence``);
* chunks are assembled into versions (``VersionAssembler``, all-or-nothing); a version that
  never completed (half-sent when the trainer died) is dropped and logged;
* the complete versions' values are merged in topic order (later versions win; a version
  carries full values, never differences), ready to be copied onto the live tensors;
* the last complete version's header gives the global step and the input positions the
  state covers, i.e. the recovery point;
* a version naming a full republish (``RepublishMark``, ``publisher.delta_sender``) that
  lies before the start offset and that the checkpoint does not hold means the topic lost
  versions after the checkpoint was written and was refilled past its offset: the read
  starts over at the full version's first chunk (``RecoveredState.rewound_to``), as serving
  does, so the trainer recovers what serving converges to. Each full version is sought once.

``RecoveryMerger`` merges message by message and needs no broker; decoding, fencing,
assembling and the full-republish rule are serving's own path (``publisher.delta_stream``);
``read_published_state`` feeds it the topic.

Every checkpoint the trainer writes equals a fully published version (it publishes and
waits for the acknowledgement first), so checkpoint + these versions is exactly the model
serving converges to. Depends on the delta codec, numpy, torch and confluent_kafka only.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np
import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from odl.kafka.client_settings import delta_consumer_config
from odl.models.dynamic.dynamic_table import DynamicTable
from publisher.delta_format import DeltaFormatError, DeltaVersion, VersionHeader
from publisher.delta_stream import DeltaStreamReader
from publisher.full_republish import FullRepublishes
from publisher.id_maps import IdMaps

logger = logging.getLogger(__name__)

_CONSUME_BATCH = 500
_NO_PROGRESS_SECS = 30.0


class DeltaRecoveryError(RuntimeError):
    """The delta topic could not be read to its end (broker unreachable, timeout)."""


@dataclass
class RecoveredState:
    """What the complete versions after a start offset add up to.

    Attributes:
        topic: the delta topic.
        start_offset: first offset read.
        end_offset: the offset after the last message read (the topic's end when read).
        low_watermark: the topic's first available offset when read.
        versions: complete versions merged.
        skipped_versions: complete versions ignored because they are not newer than
            ``min_version`` (already in the checkpoint).
        dropped_versions: incomplete versions dropped (half-sent when a trainer died).
        rejected: reason -> messages / versions rejected as corrupt.
        last_header: header of the last complete version merged (None: none).
        dense: variable id -> float32 array, the newest value of each variable.
        sparse: table id -> ``(ids int64 [n], values float32 [n, dim])``, newest row values.
        deletes: table id -> raw ids of a dynamic table whose last event was a delete.
        generations: generations of the merged versions, in topic order.
        rewound_to: the full republish's offset the read started over at, or None.
        seconds: time spent reading and merging.
    """

    topic: str
    start_offset: int
    end_offset: int
    low_watermark: int = 0
    versions: int = 0
    skipped_versions: int = 0
    dropped_versions: int = 0
    rejected: Counter = field(default_factory=Counter)
    last_header: Optional[VersionHeader] = None
    dense: dict[int, np.ndarray] = field(default_factory=dict)
    sparse: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    deletes: dict[int, np.ndarray] = field(default_factory=dict)
    generations: list[str] = field(default_factory=list)
    rewound_to: Optional[int] = None
    seconds: float = 0.0

    @property
    def version(self) -> Optional[int]:
        """The recovered version (global step), or None when no complete version was found."""
        return None if self.last_header is None else int(self.last_header.version)

    @property
    def rows(self) -> int:
        """Distinct embedding rows recovered."""
        return sum(len(ids) for ids, _ in self.sparse.values())

    def positions_for(self, topic: str) -> dict[int, int]:
        """The last version's next offset per partition of input ``topic``."""
        if self.last_header is None:
            return {}
        return {int(p): int(o) for t, p, o in self.last_header.positions if t == topic}


class RecoveryMerger:
    """Folds delta-topic messages, in topic order, into a ``RecoveredState``.

    Each message goes through what serving does with it (``publisher.delta_stream``: decode,
    generation fence, all-or-nothing assembly, the full-republish rule); every complete
    version newer than ``min_version`` is merged,
    the newest value of each row / variable winning. ``read_published_state`` feeds it the
    topic's messages; it needs no broker.

    Args:
        state: the state to fill.
        min_version: complete versions at or below this step are skipped; None = keep all.
        owner: the generation that owns the topic at the first message (None: unknown).
        max_message_bytes: largest delta message accepted by the decoder.
        republishes: the full republishes the read holds (``publisher.full_republish``:
            the checkpoint's, those at or after the first offset fed; shared by the mergers
            of one read); one it does not hold sets ``rewind_to``. None: not checked.

    """

    def __init__(self, state: RecoveredState, min_version: Optional[int] = None,
                 owner: Optional[str] = None, max_message_bytes: int = 64 << 20,
                 republishes: Optional[FullRepublishes] = None) -> None:
        self.state = state
        self._min_version = min_version
        # every version of the read may be pending at once: nothing is dropped for room
        self._reader = DeltaStreamReader(owner, republishes, max_message_bytes,
                                         max_pending_versions=1 << 20,
                                         max_pending_bytes=1 << 62, what="delta recovery")
        self._dense: dict[int, np.ndarray] = {}
        self._parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        # table id -> (ids, order key) of every delete and row event, key 2*seq (delete) or
        # 2*seq + 1 (row) so a version's deletes come before its rows
        self._events: dict[int, list[tuple[np.ndarray, int]]] = {}
        self._seq = 0

    def add(self, data: bytes, offset: int) -> None:
        """Handles the message at ``offset``: rejected, fenced, pending, skipped or merged.

        Args:
            data: the message value.
            offset: its offset in the delta topic (for the logs).
        """
        state = self.state
        try:
            version = self._reader.read(data, offset)
        except DeltaFormatError as exc:
            state.rejected[exc.reason] += 1
            logger.warning("delta recovery: rejected message at offset %d: %s", offset, exc)
            return
        if version is None:
            return
        h = version.header
        if self._min_version is not None and h.version <= self._min_version:
            state.skipped_versions += 1
            logger.info("delta recovery: version %d (%s) is not newer than the checkpoint (%d): "
                        "skipped", h.version, h.generation, self._min_version)
            return
        self._merge(version)
        state.versions += 1
        state.last_header = h
        if not state.generations or state.generations[-1] != h.generation:
            state.generations.append(h.generation)

    @property
    def rewind_to(self) -> Optional[int]:
        """The offset to read again from, with a fresh merger; None: read on."""
        return self._reader.rewind_to

    def _merge(self, version: DeltaVersion) -> None:
        self._dense.update(version.dense)
        self._seq += 1
        for tid, gone in version.deletes.items():
            self._events.setdefault(int(tid), []).append((gone, 2 * self._seq))
        for tid, part in version.sparse.items():
            self._parts.setdefault(int(tid), []).append(part)
            self._events.setdefault(int(tid), []).append((part[0], 2 * self._seq + 1))

    def finish(self) -> RecoveredState:
        """Drops the versions still incomplete and fills in the merged values.

        Returns:
            The state.
        """
        state = self.state
        assembler = self._reader.assembler
        pending = assembler.pending_versions
        state.dropped_versions = assembler.dropped_versions + pending
        if pending:
            logger.warning("delta recovery: %d incomplete version(s) at the end of %s (half-sent "
                           "when the trainer stopped) ignored", pending, state.topic)
        state.dense = self._dense
        sparse = {}
        for tid, parts in self._parts.items():
            ids = np.concatenate([p[0] for p in reversed(parts)])
            values = np.concatenate([p[1] for p in reversed(parts)])
            uniq, first = np.unique(ids, return_index=True)  # first = from the newest version
            sparse[tid] = (uniq, values[first])
        deletes = {}
        for tid, events in self._events.items():
            if not any(key % 2 == 0 for _, key in events):
                continue
            ids = np.concatenate([e[0] for e in events])
            keys = np.concatenate([np.full(len(e[0]), e[1], dtype=np.int64) for e in events])
            order = np.lexsort((keys, ids))  # by id, then by event order
            last = np.ones(order.shape[0], dtype=bool)
            last[:-1] = ids[order][1:] != ids[order][:-1]
            final_ids, final_keys = ids[order][last], keys[order][last]
            gone = final_ids[final_keys % 2 == 0]
            if gone.shape[0]:
                deletes[tid] = gone
            if tid in sparse and gone.shape[0]:
                keep = ~np.isin(sparse[tid][0], gone)
                sparse[tid] = (sparse[tid][0][keep], sparse[tid][1][keep])
        state.sparse = sparse
        state.deletes = deletes
        return state


def delta_topic_end(server: str, topic: str, kafka_config: Optional[Mapping[str, str]] = None,
                    timeout: float = 10.0) -> int:
    """The delta topic's end offset (0 when the topic does not exist yet).

    Raises:
        DeltaRecoveryError: the broker did not answer.
    """
    consumer = Consumer(delta_consumer_config(server, f"odl-recovery-{uuid.uuid4().hex[:8]}",
                                              kafka_config))
    try:
        if not _topic_exists(consumer, topic, timeout):
            return 0
        _low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout,
                                                    cached=False)
        return int(high)
    except KafkaException as exc:
        raise DeltaRecoveryError(f"delta topic {topic} @ {server}: {exc}") from exc
    finally:
        consumer.close()


def _topic_exists(consumer: Consumer, topic: str, timeout: float) -> bool:
    # Lists all topics: asking for one by name can auto-create it with default settings.
    md = consumer.list_topics(timeout=timeout)
    tmd = md.topics.get(topic)
    return tmd is not None and tmd.error is None and bool(tmd.partitions)


def read_published_state(
    server: str,
    topic: str,
    start_offset: int,
    kafka_config: Optional[Mapping[str, str]] = None,
    min_version: Optional[int] = None,
    stop: Optional[threading.Event] = None,
    timeout: float = _NO_PROGRESS_SECS,
    max_message_bytes: int = 64 << 20,
    owner: Optional[str] = None,
) -> RecoveredState:
    """Reads the delta topic from ``start_offset`` to its end and merges the complete versions.

    Args:
        server: bootstrap servers of the delta topic.
        topic: the delta topic (one partition).
        start_offset: where to start (a checkpoint's ``delta_topic_offset``).
        kafka_config: extra librdkafka settings (SASL/SSL).
        min_version: complete versions at or below this step are ignored (the checkpoint
            already holds newer values); None = keep all.
        stop: set to abandon the read (raises ``DeltaRecoveryError``).
        timeout: seconds without progress before giving up.
        max_message_bytes: largest delta message accepted by the decoder.
        owner: the generation that owned the topic at ``start_offset`` (the checkpoint's);
            chunks of generations it superseded are ignored (``publisher.generation_fence``),
            as serving ignores them.

    Returns:
        The merged state of the complete versions (empty when there are none).

    Raises:
        DeltaRecoveryError: the broker is unreachable or the read made no progress.
    """
    t0 = time.monotonic()
    consumer = Consumer(delta_consumer_config(server, f"odl-recovery-{uuid.uuid4().hex[:8]}",
                                              kafka_config))
    state = RecoveredState(topic=topic, start_offset=int(start_offset),
                           end_offset=int(start_offset))
    try:
        try:
            if not _topic_exists(consumer, topic, timeout):
                logger.info("delta topic %s does not exist yet: nothing to recover", topic)
                state.seconds = time.monotonic() - t0
                return state
            tp = TopicPartition(topic, 0)
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout, cached=False)
        except KafkaException as exc:
            raise DeltaRecoveryError(f"delta topic {topic} @ {server}: {exc}") from exc
        state.low_watermark = int(low)
        if start_offset < low:
            logger.error("delta topic %s starts at offset %d but recovery needs %d (retention "
                         "removed versions): the versions in between cannot be recovered",
                         topic, low, start_offset)
        begin = max(int(start_offset), int(low))
        if high <= begin:
            if high < start_offset:
                logger.warning("delta topic %s ends at %d, before the checkpoint's offset %d "
                               "(topic recreated?): nothing to recover", topic, high,
                               start_offset)
            state.end_offset = max(int(start_offset), int(high))
            state.seconds = time.monotonic() - t0
            return state
        republishes = FullRepublishes(owner, min_version, read_from=begin)
        while True:
            merger = RecoveryMerger(state, min_version, owner, max_message_bytes, republishes)
            _consume(consumer, topic, begin, int(high), merger, stop, timeout)
            if merger.rewind_to is None:
                break
            begin = republishes.read_from = max(merger.rewind_to, int(low))
            state = RecoveredState(topic=topic, start_offset=int(start_offset),
                                   end_offset=int(start_offset), low_watermark=int(low),
                                   rewound_to=begin)
            # a fresh consumer: right after an assign, position() may still be the old one
            consumer.close()
            consumer = Consumer(delta_consumer_config(
                server, f"odl-recovery-{uuid.uuid4().hex[:8]}", kafka_config))
    finally:
        consumer.close()
    state.seconds = time.monotonic() - t0
    return state


def _consume(consumer: Consumer, topic: str, begin: int, high: int, merger: RecoveryMerger,
             stop: Optional[threading.Event], timeout: float) -> None:
    tp = TopicPartition(topic, 0, begin)
    consumer.assign([tp])
    next_offset = begin
    last_progress = time.monotonic()
    while next_offset < high:
        if stop is not None and stop.is_set():
            raise DeltaRecoveryError("stopped while reading the delta topic")
        try:
            msgs = consumer.consume(num_messages=_CONSUME_BATCH, timeout=0.2)
        except KafkaException as exc:
            raise DeltaRecoveryError(f"reading delta topic {topic}: {exc}") from exc
        if not msgs:
            # transaction markers take offsets but are never delivered: the consumer's
            # position moves past them
            pos = consumer.position([TopicPartition(topic, 0)])[0].offset
            if pos > next_offset:
                next_offset = min(int(pos), high)
                last_progress = time.monotonic()
                continue
            if time.monotonic() - last_progress > timeout:
                raise DeltaRecoveryError(f"no progress reading delta topic {topic} at offset "
                                         f"{next_offset} (end {high}) for {timeout:.0f}s")
            continue
        last_progress = time.monotonic()
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    logger.warning("delta recovery: consumer error %s", err.str())
                continue
            offset = int(msg.offset())
            if offset >= high:
                continue
            next_offset = max(next_offset, offset + 1)
            merger.add(msg.value() or b"", offset)
            if merger.rewind_to is not None:
                return
    merger.state.end_offset = next_offset
    merger.finish()


class DynamicRowOwner(Protocol):
    """What crash recovery needs of a trainer with dynamic tables (``TrainModule``)."""

    def dynamic_table(self, table: str) -> Optional[DynamicTable]:
        """The dynamic table behind a table name, None for a fixed table."""

    def reset_dynamic_rows(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """Re-initializes rows evicted from dynamic tables (table name -> rows)."""


@torch.no_grad()
def apply_recovered_state(tables: Mapping[str, torch.Tensor],
                          dense: Mapping[str, torch.Tensor], id_maps: IdMaps,
                          state: RecoveredState,
                          dynamic: Optional[DynamicRowOwner] = None) -> int:
    """Copies the recovered rows and variables onto live tensors (checks everything first).

    Dynamic tables: the recovered deletes are forgotten (their rows freed and reset) and the
    recovered raw ids are given rows (``DynamicTable.upsert``, evicting by the table's
    policy when full) before their values are copied, so the trainer holds what serving
    holds. Their counters restart from the recovery (sightings 1, last seen now). A recovered
    id on a table's disk tier takes its values in its slot (its counters and optimizer state
    kept); the rows moved to disk to make room are written there first.

    Args:
        tables: table name -> live weight tensor (``TrainModule.embedding_tables()``).
        dense: dense variable name -> live tensor (``TrainModule.dense_parameters()``).
        id_maps: the ids the versions use (as the publisher assigns them).
        state: what ``read_published_state`` returned.
        dynamic: the owner of the dynamic tables (the train module), when it has any.

    Returns:
        Embedding rows copied.

    Raises:
        ValueError: a version does not fit the model (unknown id, shape, row out of range);
            nothing was modified.
    """
    table_names = id_maps.table_names()
    dense_names = id_maps.dense_names()
    plan: list[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = []
    for vid, arr in state.dense.items():
        name = dense_names.get(int(vid))
        if name is None or name not in dense:
            raise ValueError(f"recovered dense variable id {vid} is not in the model")
        t = dense[name]
        if tuple(arr.shape) != tuple(t.shape):
            raise ValueError(f"recovered {name} has shape {tuple(arr.shape)}, model "
                             f"{tuple(t.shape)}")
        plan.append((t, None, torch.from_numpy(np.ascontiguousarray(arr))))
    step = int(state.version or 0)
    now = time.time()
    dyn_rows: list[tuple[str, DynamicTable, np.ndarray, np.ndarray]] = []
    for tid in set(state.sparse) | set(state.deletes):
        name = table_names.get(int(tid))
        dyn = dynamic.dynamic_table(name) if dynamic is not None and name else None
        if dyn is None and int(tid) in state.deletes:
            raise ValueError(f"recovered deletes for table id {tid}, which is not dynamic")
        if dyn is not None:
            ids, values = state.sparse.get(tid, (np.empty(0, np.int64),
                                                 np.empty((0, 1), np.float32)))
            if len(ids) and int(values.shape[1]) > tables[name].shape[1]:
                raise ValueError(f"recovered rows of table {name} are wider than the table")
            dyn_rows.append((name, dyn, ids, values))
    dynamic_names = {name for name, *_ in dyn_rows}
    for tid, (ids, values) in state.sparse.items():
        name = table_names.get(int(tid))
        if name is None or name not in tables:
            raise ValueError(f"recovered table id {tid} is not in the model")
        if name in dynamic_names:
            continue
        w = tables[name]
        dim = int(values.shape[1])
        if dim > w.shape[1] or (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0])):
            raise ValueError(f"recovered rows of table {name} do not fit its shape "
                             f"{tuple(w.shape)}")
        plan.append((w[:, :dim] if dim < w.shape[1] else w,
                     torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
                     torch.from_numpy(np.ascontiguousarray(values))))
    rows = 0
    for t, ids, values in plan:
        values = values.to(device=t.device, dtype=t.dtype)
        if ids is None:
            t.copy_(values)
        else:
            t[ids.to(t.device)] = values
            rows += int(ids.shape[0])
    for tid, gone in state.deletes.items():
        dyn = dynamic.dynamic_table(table_names[int(tid)]) if dynamic is not None else None
        if dyn is not None and len(gone):
            freed = dyn.forget(gone)
            if freed.shape[0]:
                dynamic.reset_dynamic_rows({dyn.name: freed}, step)
    for name, dyn, ids, values in dyn_rows:
        ids = np.asarray(ids, dtype=np.int64)
        disk = getattr(dyn, "disk", None)
        if disk is not None and len(ids):  # ids on a disk tier take their values there
            on = disk.slots(ids)
            if (on >= 0).any():
                record = disk.read(on[on >= 0])
                first = disk.columns[name]
                record[:, first:first + int(values.shape[1])] = values[on >= 0]
                disk.write(on[on >= 0], record)
                rows += int((on >= 0).sum())
                ids, values = ids[on < 0], values[on < 0]
        if not len(ids):
            continue
        slots, evicted = dyn.upsert(ids, step, now)
        if evicted.shape[0]:
            dynamic.reset_dynamic_rows({dyn.name: evicted}, step)
        ok = slots >= 0
        w = tables[name]
        dim = int(values.shape[1])
        target = w[:, :dim] if dim < w.shape[1] else w
        target[torch.from_numpy(slots[ok]).to(w.device)] = torch.from_numpy(
            np.ascontiguousarray(values[ok])).to(device=w.device, dtype=w.dtype)
        rows += int(ok.sum())
    return rows
