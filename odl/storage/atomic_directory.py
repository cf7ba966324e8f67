"""Crash-safe writes on a local file system: whole directories and single files.

Contract: a reader of ``final`` sees either nothing (or the previous file) or the complete new
content, never a part of it, across a crash or power loss at any moment.

* ``atomic_directory(final, tmp)``: the caller fills ``tmp``; on a clean exit every file in it
  is on disk (each written with ``write_durable`` / ``copy_durable`` or fsynced by the caller),
  ``tmp`` is fsynced, renamed to ``final`` and the parent fsynced. On an exception ``tmp`` is
  removed and ``final`` is untouched. Callers name ``tmp`` inside the same parent with a prefix
  their readers ignore, and remove stale ones at start.
* ``write_atomic(path, data)``: writes ``<path>.tmp.<pid>``, fsyncs it, renames it over
  ``path`` and fsyncs the directory.
* ``write_durable(path, data)`` / ``copy_durable(src, dst)``: one file written and fsynced
  in place (for files inside a directory that ``atomic_directory`` commits).

Object storage has no atomic rename; this module is for local paths only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def fsync_directory(path: str) -> None:
    """Flushes a directory's entries (new, renamed or removed names) to disk.

    Args:
        path: the directory.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs the file (not atomic on its own).

    Args:
        path: the file (created or truncated).
        data: its content.
    """
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_durable(path: str, obj: object) -> None:
    """``write_durable`` of ``obj`` as JSON (one-space indent, trailing newline).

    Args:
        path: the file.
        obj: a JSON-serializable value.
    """
    write_durable(path, (json.dumps(obj, indent=1) + "\n").encode())


def copy_durable(src: str, dst: str) -> None:
    """Copies a file's bytes and fsyncs the copy.

    Args:
        src: the source file.
        dst: the destination file (created or truncated).
    """
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def write_atomic(path: str, data: bytes) -> None:
    """Replaces ``path`` by ``data`` atomically (a reader sees the old file or the new one).

    Args:
        path: the file.
        data: its new content.

    Raises:
        OSError: the write failed (``path`` is unchanged, the temporary file removed).
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))


@contextmanager
def atomic_directory(final: str, tmp: str, replace: bool = False) -> Iterator[str]:
    """Builds a directory under ``tmp`` and commits it as ``final`` (module docstring).

    Args:
        final: the committed directory's path.
        tmp: where it is built (same parent as ``final``; removed first if it exists).
        replace: remove an existing ``final`` before the rename (only for leftovers the
            caller has judged incomplete); otherwise an existing ``final`` raises.

    Yields:
        ``tmp``, created and empty.

    Raises:
        FileExistsError: ``final`` exists and ``replace`` is false.
    """
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_directory(tmp, final, replace)


def commit_directory(tmp: str, final: str, replace: bool = False) -> None:
    """Commits the directory built under ``tmp`` as ``final``.

    ``atomic_directory``'s end, for a directory that several writers filled.

    Args:
        tmp: the filled directory (removed when the commit fails).
        final: the committed directory's path (same parent as ``tmp``).
        replace: remove an existing ``final`` first (see ``atomic_directory``).

    Raises:
        FileExistsError: ``final`` exists and ``replace`` is false.
        OSError: the rename failed.
    """
    try:
        fsync_directory(tmp)
        if os.path.exists(final):
            if not replace:
                raise FileExistsError(f"{final} exists already")
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_directory(os.path.dirname(os.path.abspath(final)))
