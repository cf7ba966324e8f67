"""What a checkpoint directory is on disk, and whether one is complete and intact.

The layout is ``odl.checkpoint.checkpoint_manager``'s (its module docstring): a
``model.ckpt-<step>`` directory with ``model.pt``, ``positions.json``, ``pipeline.config``,
``MANIFEST.json`` (every file's size and SHA-256) and ``DONE`` written last. A checkpoint
counts only with DONE and with every file matching the manifest; a remote one is verified
in its local mirror after downloading.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Optional

from odl.checkpoint.file_digest import sha256_file
from odl.storage import file_store
from odl.storage.storage_path import basename, is_remote, join

logger = logging.getLogger(__name__)

CKPT_PREFIX = "model.ckpt-"
CKPT_RE = re.compile(r"^model\.ckpt-(\d+)$")
TMP_RE = re.compile(r"^\.model\.ckpt-\d+\.(tmp|part)-\d+$")
MODEL_FILE = "model.pt"
POSITIONS_FILE = "positions.json"
CONFIG_FILE = "pipeline.config"
MANIFEST_FILE = "MANIFEST.json"
DONE_FILE = "DONE"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


def checkpoint_step(path: str) -> Optional[int]:
    """Returns the step of a ``model.ckpt-<step>`` path, or None."""
    m = CKPT_RE.match(basename(path))
    return int(m.group(1)) if m else None


def list_checkpoints(model_dir: str) -> list[str]:
    """Checkpoint directories in ``model_dir`` that have a DONE marker, oldest first.

    Args:
        model_dir: the model directory (local or ``oss://``).

    Returns:
        Paths sorted by step.

    Raises:
        odl.storage.oss_store.StorageError: OSS could not be listed.
    """
    found = []
    if is_remote(model_dir):
        dirs, _files = file_store.list_dir(model_dir)
        for name in dirs:
            m = CKPT_RE.match(name)
            if m and file_store.is_file(join(model_dir, name, DONE_FILE)):
                found.append((int(m.group(1)), join(model_dir, name)))
        return [p for _, p in sorted(found)]
    if not os.path.isdir(model_dir):
        return []
    for name in os.listdir(model_dir):
        m = CKPT_RE.match(name)
        if m and os.path.exists(os.path.join(model_dir, name, DONE_FILE)):
            found.append((int(m.group(1)), os.path.join(model_dir, name)))
    return [p for _, p in sorted(found)]


def local_checkpoint_copy(path: str) -> str:
    """A local directory holding checkpoint ``path``: itself when local, else its mirror.

    A remote checkpoint is downloaded into its mirror unless the mirror already holds the
    same manifest and DONE (the files are verified by the caller either way).

    Args:
        path: the checkpoint directory.

    Returns:
        The local directory.

    Raises:
        CheckpointError: it has no DONE marker or a file is missing.
        odl.storage.oss_store.StorageError: OSS failed (never taken as a damaged checkpoint:
            a restore must not fall back to an older one, or to none, because OSS was down).
    """
    if not is_remote(path):
        return path
    local = file_store.cache_dir_for(path)
    try:
        if not file_store.is_file(join(path, DONE_FILE)):
            raise CheckpointError(f"checkpoint {path} is not usable: no DONE marker "
                                  "(incomplete)")
        remote_manifest = file_store.read_bytes(join(path, MANIFEST_FILE))
        local_manifest = os.path.join(local, MANIFEST_FILE)
        if os.path.exists(os.path.join(local, DONE_FILE)) and os.path.exists(local_manifest):
            with open(local_manifest, "rb") as f:
                same = f.read() == remote_manifest
            # a mirror that lacks a file (another host's table part) is downloaded whole
            if same and all(os.path.exists(os.path.join(local, name))
                            for name in json.loads(remote_manifest).get("files", {})):
                return local
        t0 = time.monotonic()
        tmp = f"{local}.download.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        nbytes = file_store.download_tree(path, tmp)
        shutil.rmtree(local, ignore_errors=True)
        os.replace(tmp, local)
        logger.info("downloaded %s (%.1f MB in %.2fs)", path, nbytes / 1e6,
                    time.monotonic() - t0)
        return local
    except OSError as exc:  # a file pruned while reading, a full local disk
        raise CheckpointError(f"checkpoint {path} could not be read: {exc}") from exc


def verify_checkpoint(path: str) -> Optional[str]:
    """Checks a checkpoint against its manifest.

    Args:
        path: checkpoint directory.

    Returns:
        None when it is complete and intact, else the reason it is not.
    """
    if is_remote(path):
        try:
            path = local_checkpoint_copy(path)
        except CheckpointError as exc:
            return str(exc)
    if not os.path.exists(os.path.join(path, DONE_FILE)):
        return "no DONE marker (incomplete)"
    try:
        with open(os.path.join(path, MANIFEST_FILE)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    for name, info in manifest.get("files", {}).items():
        fp = os.path.join(path, name)
        if not os.path.exists(fp):
            return f"{name} is missing"
        if os.path.getsize(fp) != info["bytes"]:
            return f"{name} has {os.path.getsize(fp)} bytes, manifest says {info['bytes']}"
        if sha256_file(fp) != info["sha256"]:
            return f"{name} does not match its checksum"
    return None
