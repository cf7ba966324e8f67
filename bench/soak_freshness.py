"""Freshness of a running loop, measured from outside its processes (``bench/soak.py``).

Nothing here touches the trainer or serving: the figures come from what a user can read.

* :class:`TopicFollower` follows a topic's partitions in short rounds: ask the broker for the
  log ends, fetch up to them, unassign (a consumer left assigned at the log end of the
  embedded broker, which has no fetch long-polling, refetches tens of thousands of times a
  second). Used for the delta topic and, optionally, the sample topic.
* :class:`DeltaHeaders` keeps, per complete version of the delta topic (all its chunks
  seen), its header only: min / max Kafka produce time of the samples it includes, publish
  time, input positions, and the samples it adds (its positions minus the previous complete
  version's). The rows themselves are dropped as soon as a message is parsed.
* :class:`ServingApplies` polls serving's ``/status`` every ``poll_s`` (0.1 s) and notes
  each ``(generation, version, last_apply_time)`` it has not seen before.
* :class:`SampleTimestamps` (exact mode): produce timestamps of the sample topic, run-length
  encoded per partition (the producer stamps a burst of records with one time), dropped once
  the versions covering them are applied.
* :class:`FreshnessTracker` joins them. Serving applies versions in topic order, so a version
  was applied no later than the first version at or after it (in topic order) that a poll
  saw applied, at that version's ``last_apply_time``: that is the apply time used (exact when
  the poll saw the version itself, an upper bound when two versions were applied between two
  polls). Then, per version, for its samples (the records between the previous version's
  positions and its own):

  - upper bound of each sample's latency: apply time - the version's min produce time;
  - lower bound: apply time - its max produce time;
  - exact mode: apply time - each record's own produce timestamp (1 ms bins).

  The sample-weighted quantiles of the per-version upper bounds bound the per-sample
  quantiles from above (every sample's latency is at most its version's bound), those of the
  lower bounds from below. Figures are kept per minute of apply time; memory is a few numbers
  per version and, in exact mode, one counter per distinct latency in ms per minute.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from odl.kafka.client_settings import consumer_config, delta_consumer_config
from odl.protos import delta_pb2

logger = logging.getLogger("bench.soak")


def weighted_quantile(pairs: Sequence[tuple[float, int]], q: float) -> Optional[float]:
    """The ``q`` quantile (inverted CDF) of values with integer weights.

    Args:
        pairs: ``(value, weight)``; weights <= 0 are ignored.
        q: in [0, 1].

    Returns:
        The smallest value whose cumulative weight reaches ``q`` of the total; None if empty.
    """
    items = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in items)
    if not total:
        return None
    need = q * total
    acc = 0
    for v, w in items:
        acc += w
        if acc >= need:
            return v
    return items[-1][0]


def counter_quantile(counts: Counter, q: float) -> Optional[float]:
    """The ``q`` quantile of a ``{value: count}`` counter (inverted CDF)."""
    return weighted_quantile(list(counts.items()), q)


class _HaltableThread(threading.Thread):
    """A daemon thread whose loop ends once ``stop`` sets ``_halt``."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._halt = threading.Event()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread (after its current round) and waits up to ``timeout`` s."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout)


class TopicFollower(_HaltableThread):
    """Fetches the new messages of a topic every ``interval_s`` and hands them to ``handle``.

    Args:
        bootstrap: the broker.
        topic: the topic (it must exist).
        handle: called with each list of messages (errors left out), in partition order.
        starts: partition -> first offset (default: each partition's log start).
        interval_s: seconds between two rounds.
        delta: read like serving reads a delta topic (``read_uncommitted``).
        name: thread name.

    Attributes:
        next_offsets: partition -> next offset to read.
        resets: times a partition's next offset had been deleted (retention) and reading
            went on from the log start.
        skipped: records so skipped.
        messages: messages handed over.
        error: the last broker error (None once a round succeeds).
    """

    def __init__(self, bootstrap: str, topic: str, handle: Callable[[list[Message]], None],
                 starts: Optional[dict[int, int]] = None, interval_s: float = 0.2,
                 delta: bool = False, name: str = "topic-follower") -> None:
        super().__init__(name)
        make = delta_consumer_config if delta else consumer_config
        self.conf = make(bootstrap, f"odl-bench-soak-{uuid.uuid4().hex[:8]}")
        self.conf["auto.offset.reset"] = "earliest"
        self.topic = topic
        self.handle = handle
        self.interval_s = interval_s
        self.next_offsets: dict[int, int] = dict(starts or {})
        self.resets = 0
        self.skipped = 0
        self.messages = 0
        self.error: Optional[str] = None

    def run(self) -> None:
        consumer = Consumer(self.conf)
        try:
            md = consumer.list_topics(topic=self.topic, timeout=10.0).topics.get(self.topic)
            partitions = sorted(md.partitions) if md is not None else [0]
            while not self._halt.is_set():
                try:
                    self._round(consumer, partitions)
                    self.error = None
                except KafkaException as exc:
                    self.error = str(exc)
                    logger.warning("reading %s: %s", self.topic, exc)
                self._halt.wait(self.interval_s)
        except Exception:  # a bench thread must not die silently
            logger.exception("follower of %s failed", self.topic)
            self.error = "failed (see the log)"
        finally:
            consumer.close()

    def _round(self, consumer: Consumer, partitions: list[int]) -> None:
        todo: dict[int, int] = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                       timeout=5.0, cached=False)
            nxt = self.next_offsets.setdefault(p, low)
            if nxt < low:
                self.resets += 1
                self.skipped += low - nxt
                self.next_offsets[p] = nxt = low
            if high > nxt:
                todo[p] = high
        if not todo:
            return
        consumer.assign([TopicPartition(self.topic, p, self.next_offsets[p]) for p in todo])
        try:
            deadline = time.monotonic() + 10.0
            while (any(self.next_offsets[p] < h for p, h in todo.items())
                   and time.monotonic() < deadline and not self._halt.is_set()):
                msgs = [m for m in consumer.consume(num_messages=5000, timeout=0.05)
                        if m.error() is None]
                for m in msgs:
                    p = m.partition()
                    self.next_offsets[p] = max(self.next_offsets[p], m.offset() + 1)
                if msgs:
                    self.messages += len(msgs)
                    self.handle(msgs)
                # past transaction markers, which take an offset but are never delivered
                for tp in consumer.position([TopicPartition(self.topic, p) for p in todo]):
                    if tp.offset >= 0:
                        self.next_offsets[tp.partition] = max(self.next_offsets[tp.partition],
                                                              tp.offset)
        finally:
            consumer.unassign()


@dataclass
class VersionHeader:
    """What the bench keeps of one delta version.

    Attributes:
        generation: trainer generation.
        version: the version (global step).
        offset: delta topic offset of its last chunk.
        min_produce_ms: min Kafka produce time of its samples (0 = unknown).
        max_produce_ms: max Kafka produce time of its samples (0 = unknown).
        publish_ms: when the trainer snapshotted it.
        positions: partition -> next offset it covers.
        prev_positions: the previous complete version's positions (None for the first).
        samples: records between ``prev_positions`` and ``positions`` (None for the first).
        nbytes: bytes of all its chunks.
    """

    generation: str
    version: int
    offset: int
    min_produce_ms: int
    max_produce_ms: int
    publish_ms: int
    positions: dict[int, int]
    prev_positions: Optional[dict[int, int]] = None
    samples: Optional[int] = None
    nbytes: int = 0


class DeltaHeaders:
    """Assembles delta chunks into version headers (``TopicFollower`` handler).

    Attributes:
        unparsable: messages that did not parse.
        dropped_incomplete: versions given up with chunks missing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partial: dict[tuple[str, int], tuple[VersionHeader, int, set[int]]] = {}
        self._complete: deque[VersionHeader] = deque()
        self._last_positions: Optional[dict[int, int]] = None
        self.unparsable = 0
        self.dropped_incomplete = 0

    def __call__(self, msgs: list[Message]) -> None:
        for m in msgs:
            value = m.value() or b""
            try:
                c = delta_pb2.DeltaChunk.FromString(value)
            except Exception:  # protobuf's DecodeError and friends
                self.unparsable += 1
                continue
            key = (c.generation, int(c.version))
            entry = self._partial.get(key)
            if entry is None:
                h = VersionHeader(
                    generation=c.generation, version=int(c.version), offset=m.offset(),
                    min_produce_ms=int(c.min_produce_time_ms),
                    max_produce_ms=int(c.max_produce_time_ms),
                    publish_ms=int(c.publish_time_ms),
                    positions={int(p.partition): int(p.next_offset) for p in c.positions})
                entry = (h, max(1, int(c.chunk_count)), set())
                self._partial[key] = entry
            h, count, seen = entry
            seen.add(int(c.chunk_index))
            h.nbytes += len(value)
            h.offset = m.offset()
            if len(seen) >= count:
                del self._partial[key]
                self._completed(h)
        if len(self._partial) > 50:  # half-sent versions never complete
            for key in sorted(self._partial, key=lambda k: self._partial[k][0].offset)[:-50]:
                del self._partial[key]
                self.dropped_incomplete += 1

    def _completed(self, h: VersionHeader) -> None:
        prev = self._last_positions
        if prev is not None:
            h.prev_positions = prev
            h.samples = sum(max(0, off - prev.get(p, off)) for p, off in h.positions.items())
        self._last_positions = h.positions
        with self._lock:
            self._complete.append(h)

    def take(self) -> list[VersionHeader]:
        """The versions completed since the last call, in topic order."""
        with self._lock:
            out = list(self._complete)
            self._complete.clear()
        return out


class SampleTimestamps:
    """Produce timestamps of the sample topic, run-length encoded (``TopicFollower`` handler).

    Per partition a deque of ``[first offset, timestamp ms]`` runs; a run ends where the next
    begins, the last one at ``read_to``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, deque[list[int]]] = {}
        self.read_to: dict[int, int] = {}

    def __call__(self, msgs: list[Message]) -> None:
        with self._lock:
            for m in msgs:
                p, off, ts = m.partition(), m.offset(), m.timestamp()[1]
                runs = self._runs.get(p)
                if runs is None:
                    runs = self._runs[p] = deque()
                if not runs or runs[-1][1] != ts or off != self.read_to.get(p, off):
                    runs.append([off, ts])
                self.read_to[p] = off + 1

    @property
    def runs(self) -> int:
        """Runs held (memory)."""
        with self._lock:
            return sum(len(r) for r in self._runs.values())

    def latencies(self, lo: dict[int, int], hi: dict[int, int], apply_ms: int
                  ) -> Optional[Counter]:
        """Per-sample latency (ms) of the records in ``[lo, hi)`` per partition, then drops
        the runs before ``hi``.

        Returns:
            ``{latency ms: records}``, or None while some of them are not read yet.
        """
        with self._lock:
            if any(self.read_to.get(p, -1) < off for p, off in hi.items() if off > lo.get(p, 0)):
                return None
            out: Counter = Counter()
            for p, end in hi.items():
                runs = self._runs.get(p)
                if not runs:
                    continue
                start = lo.get(p, end)
                for i, (first, ts) in enumerate(runs):
                    if first >= end:
                        break
                    last = runs[i + 1][0] if i + 1 < len(runs) else self.read_to[p]
                    n = min(last, end) - max(first, start)
                    if n > 0:
                        out[apply_ms - ts] += n
                self.drop_below(p, end)
            return out

    def drop_below(self, p: int, off: int) -> None:
        """Drops the runs that end at or before ``off`` (caller holds the lock or owns it)."""
        runs = self._runs.get(p)
        while runs and len(runs) > 1 and runs[1][0] <= off:
            runs.popleft()

    def drop_all_below(self, positions: dict[int, int]) -> None:
        """Drops what lies before ``positions`` (nothing there will be asked for)."""
        with self._lock:
            for p, off in positions.items():
                self.drop_below(p, off)


class ServingApplies(_HaltableThread):
    """Polls serving's ``/status``; notes each version seen applied.

    Args:
        url: serving's base URL.
        poll_s: seconds between polls.

    Attributes:
        last: the last ``/status`` document and the time it was read.
        polls: polls answered.
        failures: polls not answered.
    """

    def __init__(self, url: str, poll_s: float = 0.1) -> None:
        super().__init__("serving-applies")
        self.url = url.rstrip("/") + "/status"
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._seen: deque[tuple[str, int, float]] = deque()
        self._last_key: Optional[tuple[str, int]] = None
        self.last: tuple[Optional[dict[str, Any]], float] = (None, 0.0)
        self.polls = 0
        self.failures = 0

    def run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._halt.is_set():
                t = time.monotonic()
                try:
                    doc = client.get(self.url).json()
                except (httpx.HTTPError, ValueError):
                    self.failures += 1
                else:
                    self.polls += 1
                    self._note(doc)
                self._halt.wait(max(0.0, self.poll_s - (time.monotonic() - t)))

    def _note(self, doc: dict[str, Any]) -> None:
        key = (str(doc.get("generation") or ""), int(doc.get("version") or 0))
        applied = doc.get("last_apply_time")
        with self._lock:
            self.last = (doc, time.time())
            if applied is not None and key != self._last_key:
                self._last_key = key
                self._seen.append((key[0], key[1], float(applied)))

    def take(self) -> list[tuple[str, int, float]]:
        """``(generation, version, apply time)`` seen since the last call, in order."""
        with self._lock:
            out = list(self._seen)
            self._seen.clear()
        return out


@dataclass
class MinuteFreshness:
    """The freshness figures of one minute (by apply time).

    Attributes:
        bounds: per version ``(upper bound s, lower bound s, samples)``.
        exact: ``{latency ms: samples}`` (exact mode).
        versions: versions resolved in the minute.
        publish_to_apply: per version, apply time - publish time (s).
    """

    bounds: list[tuple[float, float, int]] = field(default_factory=list)
    exact: Counter = field(default_factory=Counter)
    versions: int = 0
    publish_to_apply: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """p50 / p99 / max of each measure, and counts."""
        ub = [(u, n) for u, _, n in self.bounds]
        lb = [(b, n) for _, b, n in self.bounds]

        def r(x: Optional[float]) -> Optional[float]:
            return None if x is None else round(x, 3)

        out: dict[str, Any] = {
            "versions": self.versions,
            "samples": sum(n for _, _, n in self.bounds),
            "upper_p50": r(weighted_quantile(ub, 0.5)),
            "upper_p99": r(weighted_quantile(ub, 0.99)),
            "upper_max": r(max((u for u, _ in ub), default=None)),
            "lower_p50": r(weighted_quantile(lb, 0.5)),
            "lower_p99": r(weighted_quantile(lb, 0.99)),
            "publish_to_apply_p99": r(weighted_quantile(
                [(x, 1) for x in self.publish_to_apply], 0.99)),
        }
        if self.exact:
            ms = (counter_quantile(self.exact, 0.5), counter_quantile(self.exact, 0.99),
                  max(self.exact))
            out.update({"exact_samples": sum(self.exact.values()),
                        "exact_p50": r(ms[0] / 1000), "exact_p99": r(ms[1] / 1000),
                        "exact_max": r(ms[2] / 1000)})
        return out


class FreshnessTracker:
    """Joins version headers, serving's applies and (optionally) sample timestamps.

    Args:
        minute_of: unix time -> minute index.
        timestamps: the sample topic's timestamps (exact mode), or None.

    Attributes:
        minutes: minute -> its figures.
        versions: per resolved version ``[apply s, version, samples, upper s, lower s,
            publish->apply s]`` (None where unknown).
        unresolved_dropped: versions dropped unmatched (another generation).
    """

    def __init__(self, minute_of: Callable[[float], int],
                 timestamps: Optional[SampleTimestamps] = None) -> None:
        self.minute_of = minute_of
        self.timestamps = timestamps
        self.minutes: dict[int, MinuteFreshness] = {}
        self.versions: list[list[Any]] = []
        self._pending: deque[VersionHeader] = deque()
        self._applied: deque[tuple[str, int, float]] = deque()
        self._exact_wait: deque[tuple[VersionHeader, float]] = deque()
        self.unresolved_dropped = 0
        self.last_applied: Optional[VersionHeader] = None

    @property
    def pending(self) -> int:
        """Versions read but not yet seen applied."""
        return len(self._pending)

    def update(self, headers: Iterable[VersionHeader],
               applied: Iterable[tuple[str, int, float]]) -> None:
        """Adds new headers and observed applies; resolves what can be."""
        self._pending.extend(headers)
        self._applied.extend(applied)
        while self._applied and self._pending:
            g, v, t = self._applied[0]
            head = self._pending[0]
            if head.generation != g:
                if any(h.generation == g for h in self._pending):
                    self._pending.popleft()  # a version of another generation, never applied
                    self.unresolved_dropped += 1
                    continue
                self._applied.popleft()  # an apply of a version this reader never saw
                continue
            k = 0
            while (k < len(self._pending) and self._pending[k].generation == g
                   and self._pending[k].version <= v):
                k += 1
            for _ in range(k):
                self._resolve(self._pending.popleft(), t)
            if self._pending:  # the next version is after (g, v): this apply is used up
                self._applied.popleft()
            else:
                break  # (g, v)'s own header may still come
        self._exact()

    def _resolve(self, h: VersionHeader, t: float) -> None:
        self.last_applied = h
        m = self.minutes.setdefault(self.minute_of(t), MinuteFreshness())
        m.versions += 1
        up = lo = None
        if h.samples and h.min_produce_ms > 0:
            up, lo = t - h.min_produce_ms / 1000, t - h.max_produce_ms / 1000
            m.bounds.append((up, lo, h.samples))
        p2a = t - h.publish_ms / 1000 if h.publish_ms else None
        if p2a is not None:
            m.publish_to_apply.append(p2a)
        self.versions.append([round(t, 3), h.version, h.samples,
                              None if up is None else round(up, 4),
                              None if lo is None else round(lo, 4),
                              None if p2a is None else round(p2a, 4)])
        if self.timestamps is not None:
            self._exact_wait.append((h, t))

    def _exact(self) -> None:
        ts = self.timestamps
        if ts is None:
            return
        while self._exact_wait:
            h, t = self._exact_wait[0]
            if h.prev_positions is None:
                ts.drop_all_below(h.positions)
                self._exact_wait.popleft()
                continue
            lat = ts.latencies(h.prev_positions, h.positions, int(round(t * 1000)))
            if lat is None:
                return  # not read yet
            self.minutes.setdefault(self.minute_of(t), MinuteFreshness()).exact.update(lat)
            self._exact_wait.popleft()

    def figures(self, minute: int) -> dict[str, Any]:
        """The figures of a minute (empty ones when nothing was applied in it)."""
        return self.minutes.get(minute, MinuteFreshness()).figures()

    def overall(self, minutes: Iterable[int]) -> dict[str, Any]:
        """The figures of several minutes together."""
        total = MinuteFreshness()
        for i in minutes:
            m = self.minutes.get(i)
            if m is None:
                continue
            total.bounds += m.bounds
            total.exact.update(m.exact)
            total.versions += m.versions
            total.publish_to_apply += m.publish_to_apply
        return total.figures()
