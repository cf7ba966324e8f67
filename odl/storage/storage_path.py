"""Paths of both kinds: local (``/data/x``, ``rel/x``) and OSS (``oss://bucket/key``).

OSS keys use ``/`` whatever the host; a "directory" is a key prefix ending in ``/``. Any other
``scheme://`` (``hdfs://``, ``s3://``) is refused by :func:`check_supported` with the scheme
named.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

OSS_SCHEME = "oss://"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class UnsupportedPathError(ValueError):
    """A path with a scheme odl does not read or write."""


@dataclass(frozen=True)
class OssLocation:
    """An ``oss://bucket/key`` path split into its parts.

    Attributes:
        bucket: the bucket name.
        key: the object key or prefix, without a leading ``/`` ("" for the bucket root).
    """

    bucket: str
    key: str

    @property
    def dir_prefix(self) -> str:
        """The key as a directory prefix: ``""`` or ending in ``/``."""
        return self.key if not self.key or self.key.endswith("/") else self.key + "/"


def is_remote(path: str) -> bool:
    """True for an ``oss://`` path."""
    return path.startswith(OSS_SCHEME)


def scheme_of(path: str) -> str | None:
    """The lower-case scheme of ``scheme://...``, None for a local path."""
    m = _SCHEME.match(path or "")
    return m.group(1).lower() if m else None


def check_supported(path: str) -> None:
    """Raises for a path whose scheme odl cannot use (anything but local and ``oss://``).

    Args:
        path: the path.

    Raises:
        UnsupportedPathError: naming the scheme.
    """
    scheme = scheme_of(path)
    if scheme not in (None, "oss"):
        raise UnsupportedPathError(
            f"{scheme}:// paths are not supported; give a local path or oss://bucket/key")
    if scheme == "oss":
        parse_oss(path)


def parse_oss(path: str) -> OssLocation:
    """Splits ``oss://bucket/key``.

    Args:
        path: the path.

    Returns:
        Its bucket and key.

    Raises:
        UnsupportedPathError: not an ``oss://`` path or no bucket.
    """
    if not is_remote(path):
        raise UnsupportedPathError(f"not an oss:// path: {path}")
    rest = path[len(OSS_SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UnsupportedPathError(f"{path}: no bucket (expected oss://bucket/key)")
    key = posixpath.normpath(key) if key.strip("/") else ""
    if key in (".", "/"):
        key = ""
    return OssLocation(bucket, key.lstrip("/"))


def join(path: str, *parts: str) -> str:
    """``os.path.join`` for local paths, ``/``-joining for ``oss://`` paths."""
    if not is_remote(path):
        return os.path.join(path, *parts)
    out = path.rstrip("/")
    for p in parts:
        out = out + "/" + p.strip("/")
    return out


def basename(path: str) -> str:
    """The last component (a trailing ``/`` ignored)."""
    if is_remote(path):
        return posixpath.basename(path.rstrip("/"))
    return os.path.basename(os.path.normpath(path))


def dirname(path: str) -> str:
    """The parent path (a trailing ``/`` ignored)."""
    if is_remote(path):
        loc = parse_oss(path)
        parent = posixpath.dirname(loc.key.rstrip("/"))
        return f"{OSS_SCHEME}{loc.bucket}/{parent}" if parent else f"{OSS_SCHEME}{loc.bucket}"
    return os.path.dirname(os.path.normpath(path))
