"""Atomic, verifiable checkpoints with the input positions they cover.

On-disk layout (one directory per checkpoint inside ``model_dir``)::

    model_dir/
      model.ckpt-<global_step>/
        model.pt          torch.save of {"model": {name: tensor}, "optimizer": {...},
                          "global_step": int} as produced by TrainModule
        positions.json    {"source": "kafka", "topic": str,
                           "positions": {"<partition>": <next offset to read>}}
        pipeline.config   the effective pipeline config, secrets redacted
        MANIFEST.json     {"format": 1, "global_step": int, "created": unix_s,
                           "generation": str, "files": {name: {"bytes": int, "sha256": hex}}}
        DONE              completion marker, written last

A checkpoint is first written to ``.model.ckpt-<step>.tmp-<pid>`` (every file fsynced, DONE
last) and then renamed into place (``odl.storage.atomic_directory``), so a crash at any
moment leaves either the complete directory or a temporary one that is ignored and removed at
the next start. A checkpoint
whose DONE marker is missing or whose files do not match the manifest is never loaded: the
loader warns and falls back to the previous one.

On OSS (``model_dir = oss://bucket/prefix``) the same layout is kept under the prefix. A
checkpoint is written to the local mirror of ``model_dir``
(``odl.storage.file_store.cache_dir_for``) exactly as above, then uploaded file by file with
``MANIFEST.json`` and then ``DONE`` last: the DONE object commits it. Readers (restore,
``fine_tune_checkpoint`` lookup, export, ``keep_checkpoint_max`` pruning) list only
checkpoints with DONE and verify every file against the manifest after downloading it into
the local mirror. A crash or an OSS failure mid-upload leaves objects without DONE; they are
removed at the next start and after the next successful checkpoint (with any multipart
upload left open under ``model_dir``). A failed upload is a failed checkpoint
(``CheckpointError``): the trainer goes on training and the next checkpoint retries.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from odl.checkpoint.file_digest import sha256_file
from odl.storage import file_store
from odl.storage.atomic_directory import atomic_directory, write_durable
from odl.storage.oss_store import StorageError, oss_store
from odl.storage.storage_path import basename, is_remote, join, parse_oss

logger = logging.getLogger(__name__)

CKPT_PREFIX = "model.ckpt-"
_CKPT_RE = re.compile(r"^model\.ckpt-(\d+)$")
_TMP_RE = re.compile(r"^\.model\.ckpt-\d+\.tmp-\d+$")
MODEL_FILE = "model.pt"
POSITIONS_FILE = "positions.json"
CONFIG_FILE = "pipeline.config"
MANIFEST_FILE = "MANIFEST.json"
DONE_FILE = "DONE"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


@dataclass
class LoadedCheckpoint:
    """What a checkpoint holds.

    Attributes:
        path: the checkpoint directory.
        global_step: training step it was taken at.
        state: the TrainModule state (model, optimizer, step).
        positions: next offset per partition (empty for offline checkpoints).
        source: the positions' source description (topic etc.).
        manifest: the parsed manifest.
    """

    path: str
    global_step: int
    state: dict
    positions: dict[int, int]
    source: dict
    manifest: dict


def checkpoint_step(path: str) -> Optional[int]:
    """Returns the step of a ``model.ckpt-<step>`` path, or None."""
    m = _CKPT_RE.match(basename(path))
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
            m = _CKPT_RE.match(name)
            if m and file_store.is_file(join(model_dir, name, DONE_FILE)):
                found.append((int(m.group(1)), join(model_dir, name)))
        return [p for _, p in sorted(found)]
    if not os.path.isdir(model_dir):
        return []
    for name in os.listdir(model_dir):
        m = _CKPT_RE.match(name)
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
                if f.read() == remote_manifest:
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


def resolve_checkpoint_path(path: str) -> str:
    """A checkpoint directory, or a model_dir whose newest intact checkpoint is returned.

    Args:
        path: ``model.ckpt-N`` directory or a model_dir.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: nothing usable is there.
    """
    if checkpoint_step(path) is not None or file_store.is_file(join(path, MANIFEST_FILE)):
        reason = verify_checkpoint(path)
        if reason:
            raise CheckpointError(f"checkpoint {path} is not usable: {reason}")
        return path
    for candidate in reversed(list_checkpoints(path)):
        reason = verify_checkpoint(candidate)
        if reason is None:
            return candidate
        logger.warning("skipping damaged checkpoint %s: %s", candidate, reason)
    raise CheckpointError(f"no complete checkpoint in {path}")


def read_checkpoint(path: str, map_location: str = "cpu") -> LoadedCheckpoint:
    """Loads a verified checkpoint directory.

    Args:
        path: checkpoint directory (verified by the caller or via resolve_checkpoint_path).
        map_location: device for the tensors.

    Returns:
        The loaded checkpoint.
    """
    remote_path = path
    path = local_checkpoint_copy(path)
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    state = torch.load(os.path.join(path, MODEL_FILE), map_location=map_location, weights_only=True)
    positions: dict[int, int] = {}
    source: dict = {}
    pos_path = os.path.join(path, POSITIONS_FILE)
    if os.path.exists(pos_path):
        with open(pos_path) as f:
            source = json.load(f)
        positions = {int(k): int(v) for k, v in source.get("positions", {}).items()}
    return LoadedCheckpoint(
        path=remote_path,
        global_step=int(manifest["global_step"]),
        state=state,
        positions=positions,
        source=source,
        manifest=manifest,
    )


class CheckpointManager:
    """Writes, lists, prunes and restores checkpoints in one model_dir.

    Args:
        model_dir: the model directory, local (created if missing) or ``oss://``.
        keep_max: keep at most this many complete checkpoints (0 = all).
    """

    def __init__(self, model_dir: str, keep_max: int = 10) -> None:
        self.model_dir = model_dir
        self.remote = is_remote(model_dir)
        # where checkpoints are written first: model_dir itself, or its local mirror
        self.local_dir = file_store.cache_dir_for(model_dir)
        self.keep_max = keep_max
        os.makedirs(self.local_dir, exist_ok=True)
        self.last_saved_path: Optional[str] = None
        self.last_saved_step: Optional[int] = None
        self.last_saved_time: Optional[float] = None
        self.last_error: Optional[str] = None
        self.last_upload_seconds: Optional[float] = None
        self._remove_stale_temporaries()
        if self.remote:
            self._remove_remote_orphans(below_step=None, uploads_older_than=3600.0)

    def _remove_stale_temporaries(self) -> None:
        for name in os.listdir(self.local_dir):
            if _TMP_RE.match(name):
                logger.info("removing unfinished checkpoint %s", name)
                shutil.rmtree(os.path.join(self.local_dir, name), ignore_errors=True)

    def _remove_remote_orphans(self, below_step: Optional[int],
                               uploads_older_than: float) -> None:
        """Removes checkpoint prefixes without DONE (all, or those below ``below_step``)."""
        try:
            dirs, _files = file_store.list_dir(self.model_dir)
            for name in dirs:
                m = _CKPT_RE.match(name)
                if not m or (below_step is not None and int(m.group(1)) >= below_step):
                    continue
                path = join(self.model_dir, name)
                if not file_store.is_file(join(path, DONE_FILE)):
                    logger.info("removing uncommitted checkpoint objects %s", path)
                    file_store.remove_tree(path)
            aborted = oss_store().abort_uploads(parse_oss(self.model_dir), uploads_older_than)
            if aborted:
                logger.info("aborted %d unfinished multipart uploads under %s", aborted,
                            self.model_dir)
        except StorageError as exc:
            logger.warning("cleaning up %s failed (%s); a later checkpoint retries",
                           self.model_dir, exc)

    def save(
        self,
        global_step: int,
        state: dict,
        positions: dict[int, int],
        source: dict,
        config_text: str,
        generation: str = "",
        overwrite: bool = False,
    ) -> str:
        """Writes one checkpoint atomically and prunes old ones.

        Args:
            global_step: the step the state is at.
            state: TrainModule checkpoint state (plain tensors).
            positions: next offset per partition covered by the state.
            source: description of the input (e.g. {"source": "kafka", "topic": ...}).
            config_text: the effective pipeline config, already redacted.
            generation: the trainer run's generation id.
            overwrite: replace a complete checkpoint of the same step (the state changed
                without a step, e.g. a day's shrink of the dynamic tables); otherwise it is
                kept and returned.

        Returns:
            The checkpoint directory (an ``oss://`` path for a remote model_dir).

        Raises:
            CheckpointError: it could not be written (the previous ones are untouched).
        """
        name = f"{CKPT_PREFIX}{global_step}"
        final = os.path.join(self.local_dir, name)
        target = join(self.model_dir, name)
        try:
            if not overwrite and file_store.is_file(join(target, DONE_FILE)):
                logger.info("checkpoint %s exists already", target)
                self._mark_saved(target, global_step)
                return target
        except StorageError as exc:
            self.last_error = str(exc)
            raise CheckpointError(f"checkpoint at step {global_step}: {exc}") from exc
        tmp = os.path.join(self.local_dir, f".{name}.tmp-{os.getpid()}")
        t0 = time.monotonic()
        try:
            with atomic_directory(final, tmp, replace=True):  # final: an incomplete leftover
                files = self._write_local(tmp, global_step, state, positions, source,
                                          config_text, generation)
        except (OSError, RuntimeError) as exc:
            # torch.save reports a full disk as a RuntimeError of its zip writer whose
            # context is the OSError (ENOSPC): name the OSError, it is what an operator needs
            cause = exc
            while not isinstance(cause, OSError) and cause.__context__ is not None:
                cause = cause.__context__
            exc = cause if isinstance(cause, OSError) else exc
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(
                f"writing checkpoint at step {global_step} failed: {exc}"
            ) from exc
        if self.remote:
            t_up = time.monotonic()
            try:
                file_store.upload_tree(final, target, last=(MANIFEST_FILE, DONE_FILE))
            except (StorageError, OSError) as exc:
                self.last_error = f"uploading to {target}: {exc}"
                raise CheckpointError(
                    f"uploading checkpoint at step {global_step} to {target} failed: {exc}"
                ) from exc
            self.last_upload_seconds = time.monotonic() - t_up
        self.last_error = None
        self._mark_saved(target, global_step)
        logger.info(
            "saved checkpoint %s (%.1f MB in %.2fs)",
            target,
            files[MODEL_FILE]["bytes"] / 1e6,
            time.monotonic() - t0,
        )
        self._prune(global_step)
        return target

    @staticmethod
    def _write_local(tmp: str, global_step: int, state: dict, positions: dict[int, int],
                     source: dict, config_text: str, generation: str) -> dict:
        """Fills the temporary checkpoint directory; returns the manifest's file table."""
        with open(os.path.join(tmp, MODEL_FILE), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        pos_doc: dict[str, Any] = dict(source)
        pos_doc["positions"] = {str(p): int(o) for p, o in sorted(positions.items())}
        write_durable(os.path.join(tmp, POSITIONS_FILE), json.dumps(pos_doc, indent=1).encode())
        write_durable(os.path.join(tmp, CONFIG_FILE), config_text.encode())
        files = {}
        for name in (MODEL_FILE, POSITIONS_FILE, CONFIG_FILE):
            fp = os.path.join(tmp, name)
            files[name] = {"bytes": os.path.getsize(fp), "sha256": sha256_file(fp)}
        manifest = {
            "format": 1,
            "global_step": int(global_step),
            "created": time.time(),
            "generation": generation,
            "files": files,
        }
        write_durable(os.path.join(tmp, MANIFEST_FILE), json.dumps(manifest, indent=1).encode())
        write_durable(os.path.join(tmp, DONE_FILE), b"")
        return files

    def _mark_saved(self, path: str, step: int) -> None:
        self.last_saved_path = path
        self.last_saved_step = step
        self.last_saved_time = time.time()

    def _prune(self, saved_step: int) -> None:
        if self.remote:
            # the local mirror keeps only the newest checkpoint (the upload source)
            for name in os.listdir(self.local_dir):
                m = _CKPT_RE.match(name)
                if m and int(m.group(1)) != saved_step:
                    shutil.rmtree(os.path.join(self.local_dir, name), ignore_errors=True)
            self._remove_remote_orphans(below_step=saved_step, uploads_older_than=3600.0)
        if self.keep_max <= 0:
            return
        try:
            ckpts = list_checkpoints(self.model_dir)
            for old in ckpts[: max(0, len(ckpts) - self.keep_max)]:
                logger.info("removing old checkpoint %s", old)
                if self.remote:
                    # DONE first: a reader never trusts a half-removed checkpoint
                    file_store.remove(join(old, DONE_FILE))
                file_store.remove_tree(old)
        except StorageError as exc:
            logger.warning("pruning old checkpoints failed (%s); the next checkpoint retries",
                           exc)

    def latest(self) -> Optional[str]:
        """The newest intact checkpoint, skipping damaged ones with a warning.

        Raises:
            odl.storage.oss_store.StorageError: OSS could not be listed (a restore must not
                start from nothing because OSS was down).
        """
        for candidate in reversed(list_checkpoints(self.model_dir)):
            reason = verify_checkpoint(candidate)
            if reason is None:
                return candidate
            logger.warning("skipping damaged checkpoint %s: %s", candidate, reason)
        return None
