"""A PaddleRec-style stream of files: time splits of part files, read in time order.

Layout read (``file_stream_input``, local or ``oss://``)::

    <train_data_dir>/
      YYYYMMDD/                 one directory per day (UTC)
        HHMM/                   one split every split_interval minutes, from 0000
          part-00000            data files (file_pattern), CSV lines or .parquet rows
          part-00001
          <data_donefile>       written last by the producer: the split is complete

A split is read once it is complete: its ``data_donefile`` exists, or, without a donefile,
once a later split's directory exists. Until then the source waits, looking again every
``data_sleep_second``. A split that is still not complete while a later split is
complete is *missing*: after ``missing_split_wait_secs`` it is skipped, logged with a
warning and counted (``skipped_splits``), never silently. Past ``end_day`` the stream ends
(``read_batch`` raises ``StopIteration`` once everything before it was handed out); with no
``end_day`` it runs on, waiting for new days.

Positions, the source-interface form every online source hands out (partition -> next
offset), are three numbers::

    {0: split (unix minutes of the split's start, UTC),
     1: file (index in the split's sorted file list),
     2: record (index in that file of the next record to read)}

A checkpoint stores them with the model, so a restart (or kill -9 followed by crash recovery)
reopens that split, that file and skips to that record: every record is trained exactly
once, as with Kafka offsets. The split's file list must not change once the split is
complete. Each record's ``partitions`` / ``offsets`` in a batch are its file index and
record index (for reject reports). A batch never spans two splits: the last batch of a split
may be short, and its positions (``file`` = the split's file count) still name its split, so
the trainer counts it in its split's pass and day.

With several ranks (``rank`` of ``world_size``) every rank reads the whole stream in groups
of ``world_size`` batches (``batch_size`` x ``world_size`` records, cut as one process with
that batch size would cut them) and keeps the group's ``rank``-th batch of ``batch_size``
records, which may be empty when the group ends its split early (the rank then takes part
in the step with nothing). The ranks' reads are identical, so their positions after a group
are equal: a checkpoint's positions name the next record of the whole stream and restore
into any number of ranks. The trainer steps the ranks through the same group together
(``odl.train.training_loop``), so the ranks train as one process with the group as its batch.
"""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np

from odl.inputs.file_source import file_records
from odl.inputs.kafka_source import PartitionState, RawBatch
from odl.storage import file_store
from odl.storage.oss_store import StorageError
from odl.storage.storage_path import join

logger = logging.getLogger(__name__)

__all__ = ["FileStreamSource", "FileStreamStart", "split_dir", "split_minute"]

SPLIT_KEY, FILE_KEY, RECORD_KEY = 0, 1, 2
_DAY_RE = re.compile(r"^\d{8}$")
_SPLIT_RE = re.compile(r"^\d{4}$")
_WAIT_STEP_SECS = 0.05


def split_minute(day: str, hhmm: str = "0000") -> int:
    """Unix minutes (UTC) of a split's start, from ``YYYYMMDD`` and ``HHMM``."""
    d = dt.datetime.strptime(day + hhmm, "%Y%m%d%H%M").replace(tzinfo=dt.timezone.utc)
    return int(d.timestamp()) // 60


def split_dir(root: str, minute: int) -> str:
    """``root/YYYYMMDD/HHMM`` of the split starting at ``minute`` (unix minutes, UTC)."""
    t = dt.datetime.fromtimestamp(minute * 60, tz=dt.timezone.utc)
    return join(root, t.strftime("%Y%m%d"), t.strftime("%H%M"))


@dataclass(frozen=True)
class FileStreamStart:
    """Where the stream starts: checkpoint positions, else ``start_day`` at 0000.

    Attributes:
        checkpoint: restored positions (keys ``SPLIT_KEY``, ``FILE_KEY``, ``RECORD_KEY``).
        start_day: ``YYYYMMDD``.
    """

    checkpoint: Optional[dict[int, int]]
    start_day: str


class FileStreamSource:
    """Reads raw record batches from a time-split file stream (module docstring).

    Args:
        train_data_dir: root of the day directories.
        start: where to begin.
        batch_size: records per batch (each rank's, with several ranks).
        split_interval: minutes between splits.
        end_day: last day read (``YYYYMMDD``), "" to run on.
        data_donefile: the completion marker's name, "" for none.
        data_sleep_second: seconds between two looks at a split that is not complete.
        missing_split_wait_secs: how long a missing split is waited for once a later one is
            complete.
        file_pattern: glob of the data files in a split.
        batch_timeout_ms: hand out a partial batch after this long without filling it.
        rank: this rank of ``world_size`` (module docstring).
        world_size: ranks training the model together.
    """

    def __init__(self, train_data_dir: str, start: FileStreamStart, batch_size: int,
                 split_interval: int = 5, end_day: str = "", data_donefile: str = "",
                 data_sleep_second: float = 10.0, missing_split_wait_secs: float = 600.0,
                 file_pattern: str = "part-*", batch_timeout_ms: int = 200,
                 rank: int = 0, world_size: int = 1) -> None:
        self.root = train_data_dir.rstrip("/")
        self._start = start
        self.rank = int(rank)
        self.world_size = max(1, int(world_size))
        self.share = int(batch_size)  # this rank's records of a group
        self.batch_size = self.share * self.world_size  # records read at a time
        self.interval = int(split_interval)
        self.end_minute = (split_minute(end_day) + 24 * 60) if end_day else None
        self.donefile = data_donefile
        self.sleep = float(data_sleep_second)
        self.missing_wait = float(missing_split_wait_secs)
        self.pattern = file_pattern
        self.batch_timeout = batch_timeout_ms / 1000.0
        self.split = 0
        self.file = 0
        self.record = 0
        self._files: Optional[list[str]] = None  # the current split's files, once complete
        self._records: Optional[Iterator[bytes]] = None
        self._missing_since: Optional[float] = None
        self._next_look = 0.0
        self.skipped_splits = 0
        self.splits_read = 0
        self.looks = 0  # times a split's completeness was checked
        self.records_consumed = 0
        self.broker_error: Optional[str] = None
        self.partition_state: dict[int, PartitionState] = {}

    def __repr__(self) -> str:
        return f"FileStreamSource({self.root})"

    @property
    def partitions(self) -> list[int]:
        """The three position keys."""
        return [SPLIT_KEY, FILE_KEY, RECORD_KEY]

    @property
    def ended(self) -> bool:
        """Past ``end_day``: nothing more will be read."""
        return self.end_minute is not None and self.split >= self.end_minute

    @property
    def positions(self) -> dict[int, int]:
        """The next record to read, as positions (module docstring)."""
        return {SPLIT_KEY: self.split, FILE_KEY: self.file, RECORD_KEY: self.record}

    def status_report(self) -> dict[str, object]:
        """For ``/status``: the split being read or waited for, splits read and skipped."""
        return {"split": split_dir("", self.split).lstrip("/"), "file": self.file,
                "record": self.record, "splits_read": self.splits_read,
                "skipped_splits": self.skipped_splits,
                "waiting": self._files is None}

    def open(self, stop_event: Optional[threading.Event] = None) -> dict[int, int]:
        """Sets the start position; returns it."""
        cp = self._start.checkpoint
        if cp and SPLIT_KEY in cp:
            self.split = int(cp[SPLIT_KEY])
            self.file = int(cp.get(FILE_KEY, 0))
            self.record = int(cp.get(RECORD_KEY, 0))
        else:
            self.split = split_minute(self._start.start_day)
            self.file = self.record = 0
        if self.split % self.interval:
            raise ValueError(f"split {self.split} is not on the {self.interval}-minute grid")
        logger.info("file stream %s: starting at %s, file %d, record %d", self.root,
                    split_dir(self.root, self.split), self.file, self.record)
        return self.positions

    # ---------------------------------------------------------------- splits
    def _complete(self, minute: int) -> bool:
        d = split_dir(self.root, minute)
        if self.donefile:
            return file_store.is_file(join(d, self.donefile))
        return bool(file_store.list_dir(d)[1]) and self._later_split(minute) is not None

    def _later_split(self, minute: int) -> Optional[int]:
        """The earliest split after ``minute`` whose directory exists (this day or later)."""
        day = dt.datetime.fromtimestamp(minute * 60, tz=dt.timezone.utc).strftime("%Y%m%d")
        days = sorted(d for d in file_store.list_dir(self.root)[0]
                      if _DAY_RE.match(d) and d >= day)
        for d in days:
            for hhmm in sorted(s for s in file_store.list_dir(join(self.root, d))[0]
                               if _SPLIT_RE.match(s)):
                m = split_minute(d, hhmm)
                if m > minute and m % self.interval == 0:
                    return m
        return None

    def _later_complete(self, minute: int) -> Optional[int]:
        m = self._later_split(minute)
        while m is not None:
            if not self.donefile or file_store.is_file(join(split_dir(self.root, m),
                                                            self.donefile)):
                return m
            m = self._later_split(m)
        return None

    def _open_split(self) -> bool:
        """Lists the current split's files once it is complete; False while waiting."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + self.sleep
        self.looks += 1
        try:
            if self._complete(self.split):
                self._missing_since = None
                d = split_dir(self.root, self.split)
                self._files = sorted(file_store.glob_files(join(d, self.pattern)))
                self._next_look = 0.0
                self.broker_error = None
                return True
            later = self._later_complete(self.split)
        except (StorageError, OSError) as exc:
            self.broker_error = f"cannot list {self.root}: {exc}"
            return False
        self.broker_error = None
        if later is None:
            return False
        if self._missing_since is None:
            self._missing_since = now
            logger.warning("file stream: split %s is not complete but %s is; skipping it in "
                           "%.0fs unless it completes", split_dir(self.root, self.split),
                           split_dir(self.root, later), self.missing_wait)
        if now - self._missing_since < self.missing_wait:
            self._next_look = min(self._next_look, self._missing_since + self.missing_wait)
            return False
        skipped = (later - self.split) // self.interval
        logger.warning("file stream: skipping %d missing split(s) from %s to %s", skipped,
                       split_dir(self.root, self.split), split_dir(self.root, later))
        self.skipped_splits += skipped
        self.split, self.file, self.record = later, 0, 0
        self._missing_since = None
        self._next_look = 0.0
        return False

    def _advance_split(self) -> None:
        self.splits_read += 1
        self.split += self.interval
        self.file = self.record = 0
        self._files = None
        self._records = None

    # ---------------------------------------------------------------- reading
    def read_batch(self, stop_event: Optional[threading.Event] = None) -> Optional[RawBatch]:
        """Reads up to ``batch_size`` records (a partial batch after ``batch_timeout_ms``).

        With several ranks it reads a group of ``world_size`` batches and returns this
        rank's (module docstring), possibly with no records.

        Returns:
            The batch, or None when stopped before any record arrived.

        Raises:
            StopIteration: past ``end_day``, with every record before it handed out.
        """
        values: list[bytes] = []
        files: list[int] = []
        recs: list[int] = []
        deadline = time.monotonic() + self.batch_timeout
        while len(values) < self.batch_size:
            if stop_event is not None and stop_event.is_set():
                break
            if self.ended:
                break
            if self._files is None and not self._open_split():
                if values and time.monotonic() >= deadline:
                    break
                if stop_event is not None:
                    if stop_event.wait(_WAIT_STEP_SECS):
                        break
                else:
                    time.sleep(_WAIT_STEP_SECS)
                continue
            assert self._files is not None
            if self.file >= len(self._files):
                if values:  # a batch never spans two splits: it ends with its split
                    break
                self._advance_split()
                continue
            if self._records is None:
                self._records = itertools.islice(
                    file_records(self._files[self.file], self.batch_size), self.record, None)
            for rec in self._records:
                values.append(rec)
                files.append(self.file)
                recs.append(self.record)
                self.record += 1
                if len(values) >= self.batch_size:
                    break
            else:
                self._records = None
                self.file += 1
                self.record = 0
        if not values:
            if self.ended:
                logger.info("file stream: end_day reached after %d splits (%d skipped)",
                            self.splits_read, self.skipped_splits)
                raise StopIteration
            return None
        if self.world_size > 1:  # this rank's batch of the group
            mine = slice(self.rank * self.share, (self.rank + 1) * self.share)
            values, files, recs = values[mine], files[mine], recs[mine]
        self.records_consumed += len(values)
        return RawBatch(values=values, partitions=np.asarray(files, dtype=np.int32),
                        offsets=np.asarray(recs, dtype=np.int64),
                        timestamps_ms=np.zeros(len(values), dtype=np.int64),
                        positions=self.positions)

    # ---------------------------------------------------------------- commits
    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Nothing to commit: the checkpoint is the record of what was trained."""

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Nothing to commit (see :meth:`request_commit`)."""

    def close(self) -> None:
        """Drops the open file."""
        self._records = None
