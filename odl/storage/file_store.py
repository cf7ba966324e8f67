"""One API for every file odl reads or writes, on a local disk or on OSS (``oss://``).

Callers pass paths of either kind (``odl.storage.storage_path``) and get the same behaviour:

* ``read_bytes`` / ``write_bytes``: whole files. A local write is atomic (temporary file,
  fsync, rename); an OSS object write is atomic by nature.
* ``exists``, ``list_dir``, ``remove_tree``, ``glob_files``: a directory on OSS is a key
  prefix; it exists when some key is below it.
* ``upload_tree`` / ``download_tree``: a whole directory. OSS has no atomic rename, so a
  directory on OSS is committed by the names in ``last`` (e.g. ``MANIFEST.json``, then
  ``DONE``) written after every other file; readers trust only a directory whose marker is
  there, and a crash mid-upload leaves a directory without it, which cleanup removes.
* ``cache_dir_for``: the local directory that mirrors a remote one (checkpoints are staged and
  verified there). ``$ODL_CACHE_DIR`` (default ``~/.cache/odl``) ``/oss/<bucket>/<key>``.

Errors: a missing file raises ``FileNotFoundError``; OSS failures raise
``odl.storage.oss_store.StorageError`` (after the retries described there); local failures
raise ``OSError``.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
from collections.abc import Sequence

from odl.storage.atomic_directory import write_atomic
from odl.storage.oss_store import oss_store
from odl.storage.storage_path import (
    OSS_SCHEME,
    OssLocation,
    check_supported,
    is_remote,
    parse_oss,
)

logger = logging.getLogger(__name__)

_WILDCARD = re.compile(r"[*?\[]")


def cache_root() -> str:
    """``$ODL_CACHE_DIR`` or ``~/.cache/odl``."""
    return os.environ.get("ODL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "odl")


def cache_dir_for(path: str) -> str:
    """The local directory that mirrors a remote path (the path itself when local)."""
    if not is_remote(path):
        return path
    loc = parse_oss(path)
    return os.path.join(cache_root(), "oss", loc.bucket, *[p for p in loc.key.split("/") if p])


def read_bytes(path: str) -> bytes:
    """A whole file.

    Raises:
        FileNotFoundError: it does not exist.
    """
    check_supported(path)
    if is_remote(path):
        return oss_store().get(parse_oss(path))
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    """A whole UTF-8 text file."""
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file atomically (local parents are created)."""
    check_supported(path)
    if is_remote(path):
        oss_store().put(parse_oss(path), data)
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    write_atomic(path, data)


def upload_file(local_path: str, path: str) -> None:
    """Copies a local file to ``path`` (multipart on OSS for large files)."""
    check_supported(path)
    if is_remote(path):
        oss_store().put_file(parse_oss(path), local_path)
        return
    with open(local_path, "rb") as f:
        write_bytes(path, f.read())


def exists(path: str) -> bool:
    """Whether a file, or a directory with something in it, is at ``path``."""
    check_supported(path)
    if not is_remote(path):
        return os.path.exists(path)
    loc = parse_oss(path)
    store = oss_store()
    if loc.key and store.exists(loc):
        return True
    dirs, files = store.list(loc)
    return bool(dirs or files)


def is_file(path: str) -> bool:
    """Whether a file (an object) is at ``path``."""
    check_supported(path)
    if not is_remote(path):
        return os.path.isfile(path)
    loc = parse_oss(path)
    return bool(loc.key) and oss_store().exists(loc)


def list_dir(path: str) -> tuple[list[str], list[str]]:
    """``(sub_directory_names, file_names)`` directly inside a directory (empty when absent)."""
    check_supported(path)
    if is_remote(path):
        dirs, files = oss_store().list(parse_oss(path))
        return sorted(dirs), sorted(files)
    if not os.path.isdir(path):
        return [], []
    dirs, files = [], []
    for name in sorted(os.listdir(path)):
        (dirs if os.path.isdir(os.path.join(path, name)) else files).append(name)
    return dirs, files


def remove(path: str) -> None:
    """Removes one file (missing is fine)."""
    check_supported(path)
    if is_remote(path):
        loc = parse_oss(path)
        oss_store().delete(loc.bucket, [loc.key])
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_tree(path: str) -> None:
    """Removes a directory and everything in it (missing is fine)."""
    check_supported(path)
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    loc = parse_oss(path)
    store = oss_store()
    keys = list(store.iter_keys(loc))
    if keys:
        store.delete(loc.bucket, keys)


def upload_tree(local_dir: str, path: str, last: Sequence[str] = ()) -> int:
    """Copies a local directory to ``path``, the names in ``last`` after all others, in order.

    Args:
        local_dir: the directory to copy.
        path: the destination directory (local or ``oss://``).
        last: relative names written last, in this order (the commit markers).

    Returns:
        Bytes copied.
    """
    rels = []
    for root, _dirs, names in os.walk(local_dir):
        for n in names:
            rels.append(os.path.relpath(os.path.join(root, n), local_dir))
    tail = [r for r in last if r in rels]
    ordered = sorted(r for r in rels if r not in tail) + tail
    total = 0
    for rel in ordered:
        src = os.path.join(local_dir, rel)
        dst = (path.rstrip("/") + "/" + rel.replace(os.sep, "/") if is_remote(path)
               else os.path.join(path, rel))
        upload_file(src, dst)
        total += os.path.getsize(src)
    return total


def download_tree(path: str, local_dir: str) -> int:
    """Copies every file below ``path`` into ``local_dir`` (created; files overwritten).

    Returns:
        Bytes copied.
    """
    check_supported(path)
    os.makedirs(local_dir, exist_ok=True)
    if not is_remote(path):
        shutil.copytree(path, local_dir, dirs_exist_ok=True)
        return sum(os.path.getsize(os.path.join(r, n))
                   for r, _d, ns in os.walk(local_dir) for n in ns)
    loc = parse_oss(path)
    store = oss_store()
    total = 0
    _dirs, files = store.list(loc, recursive=True)
    for rel in files:
        dst = os.path.join(local_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        store.get_to_file(OssLocation(loc.bucket, loc.dir_prefix + rel), dst)
        total += os.path.getsize(dst)
    return total


def download_file(path: str, local_path: str) -> None:
    """Copies one remote file to a local path (atomically: temporary name, then rename)."""
    check_supported(path)
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    tmp = f"{local_path}.download.{os.getpid()}"
    if is_remote(path):
        oss_store().get_to_file(parse_oss(path), tmp)
    else:
        shutil.copyfile(path, tmp)
    os.replace(tmp, local_path)


def local_copy(path: str) -> str:
    """A local path holding ``path``'s content.

    ``path`` itself when local, else a fresh download into :func:`cache_dir_for` (a file or a
    whole directory).
    """
    if not is_remote(path):
        return path
    dst = cache_dir_for(path)
    if is_file(path):
        download_file(path, dst)
        return dst
    if not exists(path):
        raise FileNotFoundError(path)
    tmp = f"{dst}.download.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    download_tree(path, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.replace(tmp, dst)
    return dst


def glob_files(pattern: str) -> list[str]:
    """Files matching a glob (``*``, ``?``, ``[..]``; ``**`` not special), sorted.

    On OSS the listing starts at the longest prefix without a wildcard and every key below it
    is matched against the pattern (``*`` may cross ``/`` there, as in ``fnmatch``).
    """
    check_supported(pattern)
    if not is_remote(pattern):
        import glob as _glob

        return sorted(p for p in _glob.glob(pattern) if os.path.isfile(p))
    loc = parse_oss(pattern)
    m = _WILDCARD.search(loc.key)
    if m is None:
        return [pattern] if is_file(pattern) else []
    head = loc.key[: m.start()]
    prefix_dir = head[: head.rfind("/") + 1] if "/" in head else ""
    store = oss_store()
    keys = store.iter_keys(OssLocation(loc.bucket, prefix_dir))
    return sorted(f"{OSS_SCHEME}{loc.bucket}/{k}" for k in keys if fnmatch.fnmatchcase(k, loc.key))
