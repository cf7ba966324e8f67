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

That is a **full** checkpoint. With ``full_every`` above 1 the checkpoints between two full
ones are **increments**: the same files but the tables, whose changed rows each rank writes
into ``rows.rank-<r>-of-<N>.pt``, and a manifest (``"format": 2``) naming the parent and base
it continues. Their contract (what they hold, when a checkpoint must be full, how a chain
is verified and read, retention) is ``odl.checkpoint.checkpoint_chain``'s docstring; finding
and reading checkpoints, full or not, is ``odl.checkpoint.checkpoint_reader``'s.
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
loader warns and falls back to the previous one (for an increment: the previous one whose
whole chain is usable).

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

from odl.checkpoint import checkpoint_chain, table_parts
from odl.checkpoint.checkpoint_chain import TABLE_ROWS_KEY, ChainLink
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
from odl.checkpoint.checkpoint_reader import (
    LoadedCheckpoint,
    assemble_table_parts,
    newest_usable,
    read_checkpoint,
    resolve_checkpoint_path,
)
from odl.checkpoint.file_digest import sha256_file
from odl.storage import file_store
from odl.storage.atomic_directory import commit_directory, write_durable
from odl.storage.oss_store import StorageError, oss_store
from odl.storage.storage_path import dirname, is_remote, join, parse_oss

logger = logging.getLogger(__name__)

__all__ = [
    "CKPT_PREFIX", "DONE_FILE", "MANIFEST_FILE", "MODEL_FILE", "POSITIONS_FILE",
    "CheckpointError", "CheckpointManager", "LoadedCheckpoint", "PendingSave",
    "assemble_table_parts", "checkpoint_step", "list_checkpoints", "local_checkpoint_copy",
    "read_checkpoint", "resolve_checkpoint_path", "verify_checkpoint", "write_full_copy",
]


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
        parent: the checkpoint it is an increment of (``odl.checkpoint.checkpoint_chain``);
            None for a full checkpoint.
    """

    global_step: int
    final: str
    tmp: str
    target: str
    exists: bool = False
    parent: Optional[ChainLink] = None


def write_full_copy(path: str, target: str) -> str:
    """Writes checkpoint ``path`` as a full checkpoint at ``target`` (a self-contained copy).

    An increment is read through its chain (``read_checkpoint``, whole tables) and written
    with the layout of a full checkpoint, committed as every checkpoint is (a temporary
    directory renamed into place, or uploaded with MANIFEST.json and DONE last).

    Args:
        path: a verified checkpoint.
        target: the directory to write (replaced when it exists).

    Returns:
        ``target``.

    Raises:
        CheckpointError: it could not be read or written.
    """
    ckpt = read_checkpoint(path)
    local = local_checkpoint_copy(path)
    with open(os.path.join(local, CONFIG_FILE)) as f:
        config_text = f.read()
    tmp = (f"{file_store.cache_dir_for(target)}.tmp-{os.getpid()}" if is_remote(target)
           else os.path.join(os.path.dirname(target.rstrip("/")),
                             f".{os.path.basename(target.rstrip('/'))}.tmp-{os.getpid()}"))
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        CheckpointManager._write_local(tmp, ckpt.global_step, ckpt.state, ckpt.positions,
                                       ckpt.source, config_text,
                                       str(ckpt.manifest.get("generation", "")))
        if is_remote(target):
            file_store.remove_tree(target)
            file_store.upload_tree(tmp, target, last=(MANIFEST_FILE, DONE_FILE))
        else:
            commit_directory(tmp, target, replace=True)
    except (OSError, RuntimeError, StorageError) as exc:
        raise CheckpointError(f"writing a full copy of {path} at {target} failed: "
                              f"{exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class CheckpointManager:
    """Writes, lists, prunes and restores checkpoints in one model_dir.

    Args:
        model_dir: the model directory, local (created if missing) or ``oss://``.
        keep_max: keep at most this many complete checkpoints (0 = all), and the links
            their chains need.
        full_every: every this many-th checkpoint is full, the others increments
            (``odl.checkpoint.checkpoint_chain``); 1: all full.

    Attributes:
        chain: the last checkpoint written or restored, as the parent of the next
            increment; None when the next must be full.
    """

    def __init__(self, model_dir: str, keep_max: int = 10, full_every: int = 1) -> None:
        self.model_dir = model_dir
        self.full_every = max(1, int(full_every))
        self.chain: Optional[ChainLink] = None
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
        rows: Optional[dict[str, Any]] = None,
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
            rows: write an increment of ``chain`` instead: ``state`` without the tables
                and this process's changed rows (``checkpoint_chain.rows_document``).

        Returns:
            The checkpoint directory (an ``oss://`` path for a remote model_dir).

        Raises:
            CheckpointError: it could not be written (the previous ones are untouched).
        """
        pending = self.begin_save(global_step, overwrite, increment=rows is not None)
        if pending.exists:
            return pending.target
        if rows is None:
            return self.commit_save(pending, state, positions, source, config_text,
                                    generation)
        try:
            entry = self.write_table_part(pending, rows, 0, 1)
        except CheckpointError:
            self.abort_save(pending)
            raise
        return self.commit_save(pending, state, positions, source, config_text, generation,
                                [entry])

    def increment_allowed(self, overwrite: bool = False) -> bool:
        """Whether the next checkpoint may be an increment of ``chain``.

        Not with ``full_every`` 1, without a parent, when the chain would reach
        ``full_every`` links, or for a checkpoint replacing one of its step.
        """
        return (self.full_every > 1 and self.chain is not None and not overwrite
                and self.chain.depth + 1 < self.full_every)

    def begin_save(self, global_step: int, overwrite: bool = False,
                   increment: bool = False) -> PendingSave:
        """Starts a checkpoint: its temporary directory, or the finding that it exists.

        Args:
            global_step: the step.
            overwrite: see ``save``.
            increment: an increment of ``chain`` (``increment_allowed`` must be True).

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
                self.chain = None  # not this state's rows: the next checkpoint is full
                return PendingSave(global_step, final, "", target, exists=True)
        except StorageError as exc:
            self.last_error = str(exc)
            raise CheckpointError(f"checkpoint at step {global_step}: {exc}") from exc
        if increment and not self.increment_allowed(overwrite):
            raise CheckpointError(f"checkpoint at step {global_step}: no parent for an "
                                  "increment (it must be full)")
        tmp = os.path.join(self.local_dir, f".{name}.tmp-{os.getpid()}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"writing checkpoint at step {global_step} failed: "
                                  f"{exc}") from exc
        return PendingSave(global_step, final, tmp, target,
                           parent=self.chain if increment else None)

    def write_table_part(self, pending: PendingSave, document: dict, rank: int,
                         world_size: int) -> dict[str, Any]:
        """Writes one rank's table part (``odl.checkpoint.table_parts``) of a checkpoint.

        Of an increment, the rank's changed rows (``checkpoint_chain.rows_document``).

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
        name = (checkpoint_chain.rows_file_name(rank, world_size)
                if checkpoint_chain.is_rows_document(document)
                else table_parts.part_file_name(rank, world_size))
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
        increment = None
        if pending.parent is not None:
            increment = checkpoint_chain.increment_fields(pending.parent)
            state = dict(state, **{TABLE_ROWS_KEY: [p["name"] for p in parts]})
        elif parts:
            state = dict(state, table_parts=[p["name"] for p in parts])
        try:
            files = self._write_local(tmp, global_step, state, positions, source,
                                      config_text, generation, parts, increment)
            with open(os.path.join(tmp, MANIFEST_FILE), "rb") as f:
                link = checkpoint_chain.link_from_manifest(os.path.basename(final), f.read())
            commit_directory(tmp, final, replace=True)  # final: an incomplete leftover
        except (OSError, RuntimeError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            # a full disk is the OSError (ENOSPC) of table_parts.save_durable
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
        self.chain = link
        logger.info(
            "saved %s %s (%.1f MB in %.2fs)",
            "checkpoint" if increment is None else
            f"increment {increment['depth']} of {increment['base']}",
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
                     parts: Sequence[dict[str, Any]] = (),
                     increment: Optional[dict[str, Any]] = None) -> dict:
        """Fills the temporary checkpoint directory; returns the manifest's file table.

        The table parts (or an increment's row files) the ranks wrote there are listed
        from ``parts``; an increment's manifest names its parent (``increment``).
        """
        table_parts.save_durable(os.path.join(tmp, MODEL_FILE), state)
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
        manifest: dict[str, Any] = {
            "format": 1 if increment is None else checkpoint_chain.INCREMENT_FORMAT,
            "global_step": int(global_step),
            "created": time.time(),
            "generation": generation,
            "files": files,
        }
        if increment is not None:
            manifest["increment"] = increment
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
            needed = self._chain_links(ckpts[-self.keep_max:])
            for old in ckpts[: max(0, len(ckpts) - self.keep_max)]:
                if old in needed:
                    continue
                logger.info("removing old checkpoint %s", old)
                if self.remote:
                    # DONE first: a reader never trusts a half-removed checkpoint
                    file_store.remove(join(old, DONE_FILE))
                file_store.remove_tree(old)
        except StorageError as exc:
            logger.warning("pruning old checkpoints failed (%s); the next checkpoint retries",
                           exc)

    @staticmethod
    def _chain_links(kept: Sequence[str]) -> set[str]:
        """The checkpoints that the chains of ``kept`` checkpoints read from.

        Parents are named by the manifests (one read per link); an unreadable manifest
        ends its chain.
        """
        needed: set[str] = set()
        for path in reversed(kept):
            while path not in needed:
                needed.add(path)
                try:
                    manifest, _raw = checkpoint_chain.manifest_of(path)
                except CheckpointError as exc:
                    logger.warning("%s; pruning keeps what it can", exc)
                    break
                parent = (manifest.get("increment") or {}).get("parent")
                if not parent:
                    break
                path = join(dirname(path), str(parent))
        return needed

    def latest(self) -> Optional[str]:
        """The newest usable checkpoint, skipping damaged ones with a warning.

        An increment is usable with its whole chain.

        Raises:
            odl.storage.oss_store.StorageError: OSS could not be listed (a restore must not
                start from nothing because OSS was down).
        """
        return newest_usable(self.model_dir)
