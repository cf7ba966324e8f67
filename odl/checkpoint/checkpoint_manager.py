"""Atomic, verifiable checkpoints with the input positions they cover.

On-disk layout (one directory per checkpoint inside ``model_dir``)::

    model_dir/
      model.ckpt-<global_step>/
        model.pt          torch.save of {"model": {name: tensor}, "optimizer": {...},
                          "global_step": int} as produced by TrainModule
        positions.json    {"source": "kafka", "topic": str,
                           "positions": {"<partition>": <next offset to read>},
                           ...the trainer's extras: "eval_positions", "delta_topic_offset",
                           "open_pass": [day, pass] of a file stream's pass in progress}
        pipeline.config   the effective pipeline config, secrets redacted
        MANIFEST.json     {"format": 1, "global_step": int, "created": unix_s,
                           "generation": str, "files": {name: {"bytes": int, "sha256": hex}}}
        DONE              completion marker, written last

The file names, the listing of complete checkpoints and their verification are
``odl.checkpoint.checkpoint_layout``'s. A checkpoint of several ranks adds one file per
rank, ``tables.rank-<r>-of-<N>.pt``, the rows that rank holds
(``odl.checkpoint.table_parts``); its ``model.pt`` holds everything but the tables plus
``"table_parts": [file names]``, and the manifest lists every part.
``read_checkpoint`` puts the tables back together, so every reader sees one process's state.
The ranks write it together (``begin_save``, each rank ``write_table_part``, rank 0
``commit_save`` once every rank has written, or ``abort_save``): the parts go into rank 0's
temporary directory, which the ranks share (one host, or a model_dir on a shared file
system); on OSS a rank on another host uploads its part itself, before rank 0's upload ends
with MANIFEST.json and DONE. Nothing is committed unless every part is in.

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
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from odl.checkpoint import table_parts
from odl.checkpoint.checkpoint_layout import (
    CKPT_PREFIX,
    CKPT_RE,
    CONFIG_FILE,
    DONE_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    POSITIONS_FILE,
    TMP_RE,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    local_checkpoint_copy,
    verify_checkpoint,
)
from odl.checkpoint.file_digest import sha256_file
from odl.storage import file_store
from odl.storage.atomic_directory import commit_directory, write_durable
from odl.storage.oss_store import StorageError, oss_store
from odl.storage.storage_path import is_remote, join, parse_oss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingSave:
    """A checkpoint being written (``CheckpointManager.begin_save``).

    Picklable, so rank 0 can hand it to the other ranks.

    Attributes:
        global_step: its step.
        final: the committed local directory.
        tmp: the temporary directory it is built in (empty when ``exists``).
        target: the committed path (``oss://`` for a remote model_dir).
        exists: a complete checkpoint of this step is there already: nothing to write.
    """

    global_step: int
    final: str
    tmp: str
    target: str
    exists: bool = False


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


def read_checkpoint(path: str, map_location: str = "cpu",
                    whole_tables: bool = True) -> LoadedCheckpoint:
    """Loads a verified checkpoint directory.

    Args:
        path: checkpoint directory (verified by the caller or via resolve_checkpoint_path).
        map_location: device for the tensors.
        whole_tables: put the table parts of a checkpoint of several ranks back together;
            False leaves them on disk and ``state["table_parts"]`` names their local paths
            (``TrainModule.load_checkpoint_state`` of several ranks reads only the blocks
            of its own rows; ``assemble_table_parts`` makes them whole later), and maps the
            state file of a checkpoint of one process instead of reading it (a rank copying
            its own rows out of the whole tables reads only those pages; writes stay in
            this process).

    Returns:
        The loaded checkpoint.

    Raises:
        CheckpointError: the table parts do not make whole tables.
    """
    remote_path = path
    path = local_checkpoint_copy(path)
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    state = torch.load(os.path.join(path, MODEL_FILE), map_location=map_location,
                       weights_only=True, mmap=not whole_tables)
    if state.get("table_parts"):  # written by several ranks
        state["table_parts"] = [os.path.join(path, name) for name in state["table_parts"]]
        try:  # dynamic tables split by id: each rank's partition is in its part (mapped)
            table_parts.merge_dynamic_parts(
                state, (table_parts.read_part(p, map_location, mmap=True)
                        for p in state["table_parts"]))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {remote_path}: its table parts do not hold "
                                  f"the dynamic tables' partitions: {exc}") from exc
        if whole_tables:
            assemble_table_parts(state, remote_path, map_location)
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


def assemble_table_parts(state: dict, path: str = "", map_location: str = "cpu") -> None:
    """Puts the table parts a state names back together.

    The parts (``read_checkpoint(whole_tables=False)``) become the state's ``"model"`` tables
    and ``"sparse_optimizer"``; a state without parts is left as it is.

    Args:
        state: the checkpoint state; changed in place.
        path: the checkpoint, for the error message.
        map_location: device for the tensors.

    Raises:
        CheckpointError: a part is unreadable, or the parts do not make whole tables.
    """
    if not state.get("table_parts"):
        return
    try:
        tables, sparse = table_parts.assemble(
            table_parts.read_part(p, map_location) for p in state["table_parts"])
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: its table parts do not make whole "
                              f"tables: {exc}") from exc
    del state["table_parts"]
    state["model"].update(tables)
    state["sparse_optimizer"] = sparse


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
            if TMP_RE.match(name):
                logger.info("removing unfinished checkpoint %s", name)
                shutil.rmtree(os.path.join(self.local_dir, name), ignore_errors=True)

    def _remove_remote_orphans(self, below_step: Optional[int],
                               uploads_older_than: float) -> None:
        """Removes checkpoint prefixes without DONE (all, or those below ``below_step``)."""
        try:
            dirs, _files = file_store.list_dir(self.model_dir)
            for name in dirs:
                m = CKPT_RE.match(name)
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
        pending = self.begin_save(global_step, overwrite)
        if pending.exists:
            return pending.target
        return self.commit_save(pending, state, positions, source, config_text, generation)

    def begin_save(self, global_step: int, overwrite: bool = False) -> PendingSave:
        """Starts a checkpoint: its temporary directory, or the finding that it exists.

        Args:
            global_step: the step.
            overwrite: see ``save``.

        Returns:
            What ``write_table_part`` / ``commit_save`` / ``abort_save`` take.

        Raises:
            CheckpointError: the model_dir could not be checked or the directory made.
        """
        name = f"{CKPT_PREFIX}{global_step}"
        final = os.path.join(self.local_dir, name)
        target = join(self.model_dir, name)
        try:
            if not overwrite and file_store.is_file(join(target, DONE_FILE)):
                logger.info("checkpoint %s exists already", target)
                self._mark_saved(target, global_step)
                return PendingSave(global_step, final, "", target, exists=True)
        except StorageError as exc:
            self.last_error = str(exc)
            raise CheckpointError(f"checkpoint at step {global_step}: {exc}") from exc
        tmp = os.path.join(self.local_dir, f".{name}.tmp-{os.getpid()}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"writing checkpoint at step {global_step} failed: "
                                  f"{exc}") from exc
        return PendingSave(global_step, final, tmp, target)

    def write_table_part(self, pending: PendingSave, document: dict, rank: int,
                         world_size: int) -> dict[str, Any]:
        """Writes one rank's table part (``odl.checkpoint.table_parts``) of a checkpoint.

        Into ``pending.tmp`` when this host sees it; on OSS, from a rank on another host,
        into this host's mirror and straight to the checkpoint's prefix.

        Args:
            pending: rank 0's ``begin_save``.
            document: ``TrainModule.table_part()``.
            rank: the writing rank.
            world_size: the number of ranks.

        Returns:
            The part's manifest entry: ``{"name", "bytes", "sha256"}``.

        Raises:
            CheckpointError: it could not be written or uploaded, or a local model_dir is
                not shared with rank 0.
        """
        name = table_parts.part_file_name(rank, world_size)
        here = os.path.isdir(pending.tmp)
        if not here and not self.remote:
            raise CheckpointError(
                f"rank {rank} cannot see rank 0's checkpoint directory {pending.tmp}: with "
                "several hosts, model_dir must be on a file system they share (or oss://)")
        folder = pending.tmp if here else os.path.join(
            self.local_dir, f".{CKPT_PREFIX}{pending.global_step}.part-{os.getpid()}")
        path = os.path.join(folder, name)
        try:
            os.makedirs(folder, exist_ok=True)
            table_parts.write_part(path, document)
            entry = {"name": name, "bytes": os.path.getsize(path), "sha256": sha256_file(path)}
            if not here:
                file_store.upload_file(path, join(pending.target, name))
        except (OSError, RuntimeError, StorageError) as exc:
            raise CheckpointError(f"rank {rank}: writing its table part of checkpoint "
                                  f"{pending.global_step} failed: {exc}") from exc
        finally:
            if not here:
                shutil.rmtree(folder, ignore_errors=True)
        return entry

    def commit_save(self, pending: PendingSave, state: dict, positions: dict[int, int],
                    source: dict, config_text: str, generation: str = "",
                    parts: Sequence[dict[str, Any]] = ()) -> str:
        """Writes the rest of a started checkpoint and commits it (DONE last), then prunes.

        Args:
            pending: ``begin_save``'s result (not ``exists``).
            state: the state to write as ``model.pt`` (with ``parts``: without the tables).
            positions: next offset per partition covered by the state.
            source: description of the input.
            config_text: the effective pipeline config, already redacted.
            generation: the trainer run's generation id.
            parts: every rank's ``write_table_part`` entry, rank order (none: one process).

        Returns:
            The checkpoint directory (an ``oss://`` path for a remote model_dir).

        Raises:
            CheckpointError: it could not be written (the previous ones are untouched).
        """
        global_step, final, tmp, target = (pending.global_step, pending.final, pending.tmp,
                                           pending.target)
        t0 = time.monotonic()
        if parts:
            state = dict(state, table_parts=[p["name"] for p in parts])
        try:
            files = self._write_local(tmp, global_step, state, positions, source,
                                      config_text, generation, parts)
            commit_directory(tmp, final, replace=True)  # final: an incomplete leftover
        except (OSError, RuntimeError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
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
            sum(f["bytes"] for f in files.values()) / 1e6,
            time.monotonic() - t0,
        )
        self._prune(global_step)
        return target

    def abort_save(self, pending: PendingSave) -> None:
        """Drops a started checkpoint (a rank could not write its part).

        Nothing is committed; objects a rank uploaded are removed with the next start's or
        checkpoint's clean-up of uncommitted prefixes.
        """
        if pending.tmp:
            shutil.rmtree(pending.tmp, ignore_errors=True)

    @staticmethod
    def _write_local(tmp: str, global_step: int, state: dict, positions: dict[int, int],
                     source: dict, config_text: str, generation: str,
                     parts: Sequence[dict[str, Any]] = ()) -> dict:
        """Fills the temporary checkpoint directory; returns the manifest's file table.

        The table parts the ranks wrote there are listed from ``parts``.
        """
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
        for part in parts:
            files[part["name"]] = {"bytes": part["bytes"], "sha256": part["sha256"]}
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
                m = CKPT_RE.match(name)
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
