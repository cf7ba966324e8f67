"""Content digests of files (checkpoint and export manifests)."""

from __future__ import annotations

import hashlib


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 4 MiB pieces.

    Args:
        path: the file.

    Returns:
        The lowercase hex digest.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
