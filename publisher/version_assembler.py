"""Assembles decoded chunks into complete delta versions (all-or-nothing).

Contract: a version is returned only when every chunk ``0 .. chunk_count - 1`` of its
``(generation, version)`` has arrived and its dense slices tile each variable exactly;
nothing of an incomplete version is ever returned. Chunks are fed in topic order (the delta
topic has one partition). Memory for incomplete versions is bounded by a count and a byte
limit. Used by serving (``serving_plugin.delta_replayer``), crash recovery
(``publisher.delta_recovery``) and the tests' audits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from publisher.delta_format import DecodedChunk, DeltaFormatError, DeltaVersion, DenseSlice

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A version still arriving: its chunks so far, in arrival order ``seq``."""

    seq: int
    chunk_count: int
    chunks: dict[int, DecodedChunk]
    nbytes: int = 0


class VersionAssembler:
    """Collects chunks into complete versions (all-or-nothing).

    Feed chunks in topic order with ``add``; it returns a ``DeltaVersion`` when the last
    missing chunk of a ``(generation, version)`` arrives. A duplicate chunk is ignored.
    When a version completes, every pending version that started arriving before it is
    dropped (it can never complete: the topic has one partition and one writer). Memory is
    bounded: beyond ``max_pending_versions`` or ``max_pending_bytes`` the oldest pending
    versions are dropped (counted in ``dropped_versions``).

    Args:
        max_pending_versions: most incomplete versions kept.
        max_pending_bytes: most serialized bytes of incomplete versions kept.
    """

    def __init__(self, max_pending_versions: int = 8, max_pending_bytes: int = 1 << 30) -> None:
        self.max_pending_versions = max_pending_versions
        self.max_pending_bytes = max_pending_bytes
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._seq = 0
        self.dropped_versions = 0
        self.duplicate_chunks = 0

    @property
    def pending_versions(self) -> int:
        """Incomplete versions held."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """Serialized bytes of the incomplete versions held."""
        return sum(p.nbytes for p in self._pending.values())

    def add(self, chunk: DecodedChunk) -> DeltaVersion | None:
        """Adds one chunk; returns the version it completes, else None.

        Args:
            chunk: a decoded chunk.

        Returns:
            The complete version or None.

        Raises:
            DeltaFormatError: the completed version's dense slices do not cover their
                variables exactly (the version is dropped).
        """
        key = (chunk.header.generation, chunk.header.version)
        pending = self._pending.get(key)
        if pending is not None and pending.chunk_count != chunk.chunk_count:
            logger.warning("version %s: chunk_count changed from %d to %d; restarting it",
                           key, pending.chunk_count, chunk.chunk_count)
            del self._pending[key]
            self.dropped_versions += 1
            pending = None
        if pending is None:
            self._seq += 1
            pending = _Pending(self._seq, chunk.chunk_count, {})
            self._pending[key] = pending
        if chunk.chunk_index in pending.chunks:
            self.duplicate_chunks += 1
            return None
        pending.chunks[chunk.chunk_index] = chunk
        pending.nbytes += chunk.nbytes
        if len(pending.chunks) == pending.chunk_count:
            del self._pending[key]
            for other_key in [k for k, p in self._pending.items() if p.seq < pending.seq]:
                logger.warning("dropping incomplete version %s (a later version completed)",
                               other_key)
                del self._pending[other_key]
                self.dropped_versions += 1
            return _merge_chunks([pending.chunks[i] for i in range(pending.chunk_count)])
        self._enforce_bounds(key)
        return None

    def _enforce_bounds(self, current: tuple[str, int]) -> None:
        while self._pending and (len(self._pending) > self.max_pending_versions
                                 or self.pending_bytes > self.max_pending_bytes):
            oldest = min(self._pending, key=lambda k: self._pending[k].seq)
            logger.warning("dropping incomplete version %s: pending limit reached (%d versions, "
                           "%d bytes)", oldest, len(self._pending), self.pending_bytes)
            del self._pending[oldest]
            self.dropped_versions += 1
            if oldest == current:
                break


def _merge_chunks(chunks: Sequence[DecodedChunk]) -> DeltaVersion:
    first = chunks[0]
    dense: dict[int, np.ndarray] = {}
    slices: dict[int, list[DenseSlice]] = {}
    sparse_parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    delete_parts: dict[int, list[np.ndarray]] = {}
    for c in chunks:
        for tid, gone in c.deletes.items():
            delete_parts.setdefault(tid, []).append(gone)
        dense.update(c.dense)
        for s in c.dense_slices:
            slices.setdefault(s.id, []).append(s)
        for tid, part in c.sparse.items():
            sparse_parts.setdefault(tid, []).append(part)
    for vid, parts in slices.items():
        parts.sort(key=lambda s: s.offset)
        shape = parts[0].shape
        total = math.prod(shape)
        pos = 0
        for s in parts:
            if s.shape != shape or s.offset != pos:
                raise DeltaFormatError("dense_slices", f"dense {vid}: slices do not tile it")
            pos += s.values.size
        if pos != total:
            raise DeltaFormatError("dense_slices", f"dense {vid}: slices cover {pos} of {total}")
        dense[vid] = np.concatenate([s.values for s in parts]).reshape(shape)
    sparse: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for tid, parts in sparse_parts.items():
        dims = {v.shape[1] for _, v in parts}
        if len(dims) != 1:
            raise DeltaFormatError("dim", f"table {tid}: several dims in one version")
        if len(parts) == 1:
            sparse[tid] = parts[0]
        else:
            sparse[tid] = (np.concatenate([i for i, _ in parts]),
                           np.concatenate([v for _, v in parts]))
    deletes = {tid: np.unique(np.concatenate(parts)) for tid, parts in delete_parts.items()}
    return DeltaVersion(first.header, first.value_type, dense, sparse, len(chunks),
                        sum(c.nbytes for c in chunks), deletes)
