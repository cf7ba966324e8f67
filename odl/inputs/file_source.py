"""Offline sample source: CSV or Parquet files matched by a glob.

CSV files hold one record per line in the same layout as the Kafka stream (header-less,
``data_config.separator``); Parquet rows are handed on as JSON objects (column name → value),
which the record parser reads like JSON stream records. Files are read in sorted name order,
``num_epochs`` times. Batches carry no positions: offline training does not resume mid-file.

Files on OSS (``oss://bucket/prefix/*.csv``) are matched by listing the prefix before the
first wildcard (``odl.storage.file_store.glob_files``); each is downloaded into the local
cache when its turn comes, read, and removed again.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import numpy as np

from odl.inputs.kafka_source import RawBatch
from odl.storage import file_store
from odl.storage.storage_path import is_remote

logger = logging.getLogger(__name__)


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "isoformat"):
        return value.isoformat()  # type: ignore[no-any-return]
    return str(value)


def file_records(path: str, parquet_batch: int = 1024) -> Iterator[bytes]:
    """The records of one file, in order.

    CSV / text lines (empty ones skipped) or Parquet rows as JSON objects. A remote
    (``oss://``) file is downloaded into the local cache while it is read and removed
    afterwards.

    Args:
        path: the file, local or ``oss://``.
        parquet_batch: Parquet rows decoded at a time.
    """
    local = path
    if is_remote(path):
        cached = file_store.cache_dir_for(path)  # keeps the name's extension
        local = os.path.join(os.path.dirname(cached),
                             f".read-{os.getpid()}-{os.path.basename(cached)}")
        file_store.download_file(path, local)
    try:
        logger.debug("reading %s (%.1f MB)", path, os.path.getsize(local) / 1e6)
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            for rb in pq.ParquetFile(local).iter_batches(batch_size=parquet_batch):
                for row in rb.to_pylist():
                    yield json.dumps(row, default=_json_default).encode()
            return
        with open(local, "rb") as f:
            for line in f:
                line = line.rstrip(b"\r\n")
                if line:
                    yield line
    finally:
        if local != path:
            os.remove(local)


class FileSource:
    """Reads raw record batches from files.

    The records of all files and epochs, in order, are cut into batches of ``batch_size``;
    with several ranks, rank ``r`` of ``N`` takes batches ``r, r + N, r + 2N, ...`` (it
    reads every file and skips the others' records). A step of the ranks together therefore
    trains records ``[k * N * batch_size, (k + 1) * N * batch_size)``, what one process with
    a batch ``N`` times as large trains at its step ``k``; at the end some ranks hold one
    batch fewer (they take part in the last step with an empty one).

    Args:
        pattern: glob (comma separated globs allowed) of ``.csv``/``.txt`` or ``.parquet`` files,
            local or ``oss://``.
        batch_size: records per batch.
        num_epochs: passes over the files.
        rank: this rank of ``world_size``.
        world_size: ranks training the model together.
    """

    def __init__(self, pattern: str, batch_size: int, num_epochs: int = 1, rank: int = 0,
                 world_size: int = 1) -> None:
        files: list[str] = []
        for part in pattern.split(","):
            files.extend(file_store.glob_files(part.strip()))
        if not files:
            raise FileNotFoundError(f"train_input_path {pattern!r} matches no files")
        self.files = files
        self.batch_size = int(batch_size)
        self.num_epochs = max(1, int(num_epochs))
        self.rank = int(rank)
        self.world_size = max(1, int(world_size))
        self.records_consumed = 0

    def batches(self) -> Iterator[RawBatch]:
        """Yields this rank's batches over all files and epochs."""
        values: list[bytes] = []
        index = 0  # of the batch being cut, among every rank's
        filled = 0  # its records so far
        for epoch in range(self.num_epochs):
            for path in self.files:
                logger.info("epoch %d: reading %s", epoch, path)
                for rec in file_records(path, self.batch_size):
                    mine = index % self.world_size == self.rank
                    if mine:
                        values.append(rec)
                    filled += 1
                    if filled == self.batch_size:
                        if mine:
                            yield self._make(values)
                            values = []
                        index, filled = index + 1, 0
        if values:
            yield self._make(values)

    def _make(self, values: list[bytes]) -> RawBatch:
        n = len(values)
        self.records_consumed += n
        return RawBatch(
            values=values,
            partitions=np.zeros(n, dtype=np.int32),
            offsets=np.zeros(n, dtype=np.int64),
            timestamps_ms=np.zeros(n, dtype=np.int64),
            positions={},
        )
