"""Writes delta versions to files (a ``publisher.delta_sink.DeltaSink``).

Directory layout (``incr_save_dir``)::

    <version:020d>-<generation>.delta       the version's chunks, each as
                                            [uint32 little-endian length][serialized DeltaChunk]
    <version:020d>-<generation>.delta.done  empty marker, written last

Both files are written under a temporary name, fsynced and renamed into place, the marker
after the data: a reader takes only versions whose ``.done`` marker exists, in file name
order within a generation. On OSS (``incr_save_dir = oss://bucket/prefix``) each file is one
object, written whole (objects are atomic), the marker after the data. A version number may
repeat in a new generation (after a restart from an older checkpoint).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from odl.storage import file_store
from odl.storage.storage_path import is_remote, join
from publisher.delta_sink import NO_OFFSETS, SentOffsets

logger = logging.getLogger(__name__)

DELTA_SUFFIX = ".delta"
DONE_SUFFIX = ".delta.done"
_LEN = struct.Struct("<I")


def version_file_name(version: int, generation: str) -> str:
    """File name of a version's chunks."""
    return f"{int(version):020d}-{generation}{DELTA_SUFFIX}"


class FsSink:
    """Writes one file per version.

    Args:
        directory: the target directory (created when missing).

    Attributes:
        directory: the target directory.
        description: ``fs <directory>``.
        topic: None (versions go to files, not to a topic).
        servers: ``""``.
        broker_error: None (no broker).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        if not is_remote(directory):
            os.makedirs(directory, exist_ok=True)
        self.description = f"fs {directory}"
        self.topic: Optional[str] = None
        self.servers = ""
        self.broker_error: Optional[str] = None

    def claim(self, timeout: float = 30.0) -> None:
        """Nothing to claim: a directory has no fencing (the generation rule still holds)."""

    def send(self, version: int, generation: str, chunks: Sequence[bytes],
             timeout: float = 30.0) -> SentOffsets:
        """Writes the version's file and then its ``.done`` marker.

        Args:
            version: the version.
            generation: the trainer generation.
            chunks: serialized chunks in order.
            timeout: unused (same signature as the Kafka sink).

        Returns:
            ``NO_OFFSETS`` (files have no offsets).
        """
        name = version_file_name(version, generation)
        if is_remote(self.directory):
            data = b"".join(_LEN.pack(len(c)) + bytes(c) for c in chunks)
            file_store.write_bytes(join(self.directory, name), data)
            file_store.write_bytes(join(self.directory, name[: -len(DELTA_SUFFIX)] + DONE_SUFFIX),
                                   b"")
            return NO_OFFSETS
        path = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".{name}.tmp")
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(_LEN.pack(len(chunk)))
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        done_tmp = os.path.join(self.directory, f".{name}.done.tmp")
        with open(done_tmp, "wb") as f:
            os.fsync(f.fileno())
        os.replace(done_tmp, path[: -len(DELTA_SUFFIX)] + DONE_SUFFIX)
        return NO_OFFSETS

    def status(self) -> dict[str, Any]:
        """No sink-specific status."""
        return {}

    def close(self, timeout: float = 5.0) -> None:
        """Nothing to release."""


def read_chunks(path: str, max_chunk_bytes: int = 64 << 20) -> list[bytes]:
    """Reads the chunks of one ``.delta`` file.

    Args:
        path: the file.
        max_chunk_bytes: largest chunk accepted.

    Returns:
        The chunks in order.

    Raises:
        ValueError: truncated file or a chunk larger than ``max_chunk_bytes``.
    """
    out = []
    blob = file_store.read_bytes(path)
    pos = 0
    while pos < len(blob):
        if len(blob) - pos < _LEN.size:
            raise ValueError(f"{path}: truncated length prefix")
        (n,) = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        if n > max_chunk_bytes:
            raise ValueError(f"{path}: chunk of {n} bytes > {max_chunk_bytes}")
        if len(blob) - pos < n:
            raise ValueError(f"{path}: truncated chunk")
        out.append(blob[pos:pos + n])
        pos += n
    return out


def list_versions(directory: str) -> Iterator[str]:
    """Paths of the complete (``.done``) version files, sorted by name.

    Args:
        directory: an ``incr_save_dir`` (local or ``oss://``).

    Yields:
        ``.delta`` file paths whose marker exists.
    """
    names = set(file_store.list_dir(directory)[1])
    for name in sorted(names):
        if name.endswith(DELTA_SUFFIX) and not name.startswith("."):
            if name[: -len(DELTA_SUFFIX)] + DONE_SUFFIX in names:
                yield join(directory, name)
