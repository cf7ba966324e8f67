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
last) and then renamed into place (``odl.checkpoint.atomic_directory``), so a crash at any
moment leaves either the complete directory or a temporary one that is ignored and removed at
the next start. A checkpoint
whose DONE marker is missing or whose files do not match the manifest is never loaded: the
loader warns and falls back to the previous one.
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

from odl.checkpoint.atomic_directory import atomic_directory, write_durable
from odl.checkpoint.file_digest import sha256_file

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
    m = _CKPT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def list_checkpoints(model_dir: str) -> list[str]:
    """Checkpoint directories in ``model_dir`` that have a DONE marker, oldest first.

    Args:
        model_dir: the model directory.

    Returns:
        Paths sorted by step.
    """
    if not os.path.isdir(model_dir):
        return []
    found = []
    for name in os.listdir(model_dir):
        m = _CKPT_RE.match(name)
        if m and os.path.exists(os.path.join(model_dir, name, DONE_FILE)):
            found.append((int(m.group(1)), os.path.join(model_dir, name)))
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: str) -> Optional[str]:
    """Checks a checkpoint against its manifest.

    Args:
        path: checkpoint directory.

    Returns:
        None when it is complete and intact, else the reason it is not.
    """
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
    if os.path.exists(os.path.join(path, MANIFEST_FILE)) or checkpoint_step(path) is not None:
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
        path=path,
        global_step=int(manifest["global_step"]),
        state=state,
        positions=positions,
        source=source,
        manifest=manifest,
    )


class CheckpointManager:
    """Writes, lists, prunes and restores checkpoints in one model_dir.

    Args:
        model_dir: the model directory (created if missing).
        keep_max: keep at most this many complete checkpoints (0 = all).
    """

    def __init__(self, model_dir: str, keep_max: int = 10) -> None:
        self.model_dir = model_dir
        self.keep_max = keep_max
        os.makedirs(model_dir, exist_ok=True)
        self.last_saved_path: Optional[str] = None
        self.last_saved_step: Optional[int] = None
        self.last_saved_time: Optional[float] = None
        self.last_error: Optional[str] = None
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        for name in os.listdir(self.model_dir):
            if _TMP_RE.match(name):
                logger.info("removing unfinished checkpoint %s", name)
                shutil.rmtree(os.path.join(self.model_dir, name), ignore_errors=True)

    def save(
        self,
        global_step: int,
        state: dict,
        positions: dict[int, int],
        source: dict,
        config_text: str,
        generation: str = "",
    ) -> str:
        """Writes one checkpoint atomically and prunes old ones.

        Args:
            global_step: the step the state is at.
            state: TrainModule checkpoint state (plain tensors).
            positions: next offset per partition covered by the state.
            source: description of the input (e.g. {"source": "kafka", "topic": ...}).
            config_text: the effective pipeline config, already redacted.
            generation: the trainer run's generation id.

        Returns:
            The checkpoint directory.

        Raises:
            CheckpointError: it could not be written (the previous ones are untouched).
        """
        final = os.path.join(self.model_dir, f"{CKPT_PREFIX}{global_step}")
        if os.path.exists(os.path.join(final, DONE_FILE)):
            logger.info("checkpoint %s exists already", final)
            self._mark_saved(final, global_step)
            return final
        tmp = os.path.join(self.model_dir, f".{CKPT_PREFIX}{global_step}.tmp-{os.getpid()}")
        t0 = time.monotonic()
        try:
            with atomic_directory(final, tmp, replace=True):  # final: an incomplete leftover
                with open(os.path.join(tmp, MODEL_FILE), "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                pos_doc: dict[str, Any] = dict(source)
                pos_doc["positions"] = {str(p): int(o) for p, o in sorted(positions.items())}
                write_durable(os.path.join(tmp, POSITIONS_FILE),
                              json.dumps(pos_doc, indent=1).encode())
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
                write_durable(os.path.join(tmp, MANIFEST_FILE),
                              json.dumps(manifest, indent=1).encode())
                write_durable(os.path.join(tmp, DONE_FILE), b"")
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
        self.last_error = None
        self._mark_saved(final, global_step)
        logger.info(
            "saved checkpoint %s (%.1f MB in %.2fs)",
            final,
            files[MODEL_FILE]["bytes"] / 1e6,
            time.monotonic() - t0,
        )
        self._prune()
        return final

    def _mark_saved(self, path: str, step: int) -> None:
        self.last_saved_path = path
        self.last_saved_step = step
        self.last_saved_time = time.time()

    def _prune(self) -> None:
        if self.keep_max <= 0:
            return
        ckpts = list_checkpoints(self.model_dir)
        for old in ckpts[: max(0, len(ckpts) - self.keep_max)]:
            logger.info("removing old checkpoint %s", old)
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Optional[str]:
        """The newest intact checkpoint, skipping damaged ones with a warning."""
        for candidate in reversed(list_checkpoints(self.model_dir)):
            reason = verify_checkpoint(candidate)
            if reason is None:
                return candidate
            logger.warning("skipping damaged checkpoint %s: %s", candidate, reason)
        return None
