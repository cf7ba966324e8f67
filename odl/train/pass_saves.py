"""Day and pass saves of a file stream (PaddleRec's ``model_save_path`` layout).

With ``file_stream_input.model_save_path`` set, the trainer writes, beside its own
checkpoints in ``model_dir``::

    <model_save_path>/                  local or oss://
      YYYYMMDD/                         the day the passes belong to (UTC)
        <pass_id>/                      a checkpoint at the end of the pass, every
                                        checkpoint_per_pass passes: a copy (hard links when
                                        local) of model_dir's model.ckpt-<step>, same files
                                        (odl.checkpoint.checkpoint_manager), DONE last; usable
                                        as fine_tune_checkpoint or by odl-export; an
                                        increment is written full (its chain read), so
                                        the copy stands alone
        delta_<pass_id>/                what the pass changed: one delta version in the layout
                                        of publisher.fs_sink (<step:020d>-<generation>.delta
                                        and its .delta.done), version = the global step at the
                                        pass's end; every dense variable, the rows touched
                                        since the previous delta or base (dynamic tables: those
                                        above delta_threshold and seen within delta_keep_days)
                                        and the ids evicted since then (deletes)
        base/<unix-seconds>/            at the end of the day, after the dynamic tables'
                                        shrink (decay, delete_threshold, unseen days): an
                                        export of the model (odl.export.exporter layout;
                                        dynamic tables: rows above base_threshold)

A base is the model at the end of its day; the deltas of the following days apply to it in
(day, pass) order (``odl-serve --export_dir <root>/<day>/base --delta_dir <root>``). At the
first start, when ``model_save_path`` holds no base yet, the starting model (fresh or warm
started) is written as the base of the day before the first split's day, so the first day's
deltas have a base too.

Each ``delta_<pass_id>`` and ``<pass_id>`` directory is written under a temporary name and
renamed into place (on OSS: the marker objects last), so a reader never sees a partial one. A
directory left by a run that crashed and retrained the pass is replaced. The rows touched
since the last delta and the ids evicted since then are part of every checkpoint
(``state_dict``), so a restart inside a pass still writes the pass's whole delta; after crash
recovery brought the model past its checkpoint with published Kafka versions, the next delta
carries every row (what recovery changed is not tracked row by row).

With several ranks (a file stream's ranks close every pass together, ``odl.train.training_loop``)
every rank tracks the rows its own batches touch, and writing a pass delta is a collective:
each rank hands its rows to the model's collective read and rank 0 writes the delta with
their union and the dynamic tables' evictions of every rank (as ``odl.train.rank_publishing``
does for a Kafka version). Rank 0 alone copies pass checkpoints and exports bases, and tells
the other ranks whether a base was written (what it covers is then no longer pending
anywhere). A checkpoint holds the union of every rank's pending rows; restored, rank 0 takes
them into its next delta.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

from odl.checkpoint.checkpoint_manager import (
    DONE_FILE,
    MANIFEST_FILE,
    local_checkpoint_copy,
    write_full_copy,
)
from odl.inputs.source_factory import online_input_name
from odl.storage import file_store
from odl.storage.atomic_directory import atomic_directory
from odl.storage.storage_path import basename, is_remote, join
from odl.train.distributed import from_rank0, gather_to_rank0
from publisher.delta_encoder import encode_version
from publisher.delta_tracker import DeltaTracker
from publisher.fs_sink import FsSink
from publisher.id_maps import build_id_maps
from publisher.publisher_factory import dense_variable_shapes, published_table_dims
from publisher.version_snapshot import ParameterSnapshotter

logger = logging.getLogger(__name__)

PASS_DELETES = "pass_delta"  # the dynamic tables' delete consumer of the delta files
BASE_DIR = "base"
DELTA_PREFIX = "delta_"

# ``export_base(config, checkpoint_path, export_dir)``: writes one export of a checkpoint
# (``odl.export.exporter.export_checkpoint``, handed in by the CLI: odl.export sits above
# odl.train)
BaseExporter = Callable[[Any, str, str], Any]


def delta_dir_name(pass_id: int) -> str:
    """``delta_<pass_id>``."""
    return f"{DELTA_PREFIX}{int(pass_id)}"


class PassSaves:
    """Writes the day/pass layout (module docstring) for one trainer.

    Args:
        config: the pipeline config (``file_stream_input.model_save_path`` set).
        module: the ``TrainModule``.
        generation: the trainer generation id (written into the delta versions).
        export_base: writes an export of a checkpoint; None: no bases are written.
    """

    def __init__(self, config: Any, module: Any, generation: str,
                 export_base: Optional[BaseExporter]) -> None:
        self.config = config
        self.root = config.file_stream_input.model_save_path
        self.module = module
        self.generation = generation
        self.export_base = export_base
        isc = config.train_config.incr_save_config
        self.value_type = "fp16" if isc.value_type == isc.FP16 else "fp32"
        self.max_chunk_bytes = int(isc.max_chunk_bytes) if isc.max_chunk_bytes else 900_000
        self.model_name = isc.model_name or basename(config.model_dir)
        self.id_maps = build_id_maps(dense_variable_shapes(module), published_table_dims(module))
        self._table_rows = {name: rows for name, (rows, _) in module.table_shapes().items()}
        self.tracker = DeltaTracker(module.feature_tables(changing=True), self._table_rows)
        module.add_touched_rows_hook(self.tracker.record)
        module.add_table_growth_hook(self._tables_grew)
        self.snapshots = ParameterSnapshotter(module, self.id_maps, self.tracker,
                                              online_input_name(config),
                                              delete_consumer=PASS_DELETES)
        self.rank, self.world_size = int(module.rank), int(module.world_size)
        self.last_delta: Optional[str] = None
        self.last_base: Optional[str] = None
        self.last_pass_checkpoint: Optional[str] = None
        self.deltas_written = 0
        self.bases_written = 0
        if self.rank == 0:
            self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Removes directories a killed trainer left half written (local roots)."""
        if is_remote(self.root) or not os.path.isdir(self.root):
            return
        for day in os.listdir(self.root):
            day_dir = os.path.join(self.root, day)
            if not os.path.isdir(day_dir):
                continue
            for name in os.listdir(day_dir):
                if name.startswith(".") and ".tmp-" in name:
                    shutil.rmtree(os.path.join(day_dir, name), ignore_errors=True)
                    logger.info("removed %s (left half written)", os.path.join(day_dir, name))

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """The rows touched since the last delta (per table), for the checkpoint.

        With several ranks a collective: every rank's rows, united on rank 0 (the other ranks
        get an empty dict). The dynamic tables keep their own pending deletes in their state.
        """
        touched = self.tracker.take()
        self.tracker.put_back(touched)
        mine = {name: ids.cpu().clone() for name, ids in touched.items()}  # written later
        if self.world_size == 1:
            return {"touched": mine}
        everyone = gather_to_rank0(mine)
        if everyone is None:
            return {}
        names = sorted({name for part in everyone for name in part})
        return {"touched": {name: torch.unique(torch.cat([part[name] for part in everyone
                                                         if name in part]))
                            for name in names}}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restores ``state_dict`` (None: a checkpoint without it; nothing is pending).

        With several ranks rank 0 takes the rows (every rank's, as saved) into its next delta.
        """
        if not state or self.rank != 0:
            return
        touched = {name: torch.as_tensor(ids, dtype=torch.int64)
                   for name, ids in state.get("touched", {}).items() if name in self._table_rows}
        self.tracker.put_back(touched)

    def _tables_grew(self, shapes: dict[str, tuple[int, int]]) -> None:
        """Growing dynamic tables grew (``odl.train.table_growth``): the tracker follows."""
        self._table_rows = {name: rows for name, (rows, _) in shapes.items()}
        self.tracker.grow(self._table_rows, self.module.growth.moves)

    def mark_all_rows(self) -> None:
        """Puts every row into the next delta (state changed by crash recovery)."""
        touched = {}
        for name, rows in self._table_rows.items():
            dyn = self.module.dynamic_table(name)
            ids = (torch.from_numpy(dyn.live_rows()) if dyn is not None
                   else torch.arange(rows, dtype=torch.int64))
            touched[name] = ids
        self.tracker.put_back(touched)
        logger.info("the next pass delta carries every row (crash recovery changed the model "
                    "past its checkpoint)")

    # ------------------------------------------------------------------ writes
    def has_base(self) -> bool:
        """Whether ``model_save_path`` holds any day's base (rank 0's answer on every rank)."""
        found = None
        if self.rank == 0:
            days, _ = file_store.list_dir(self.root)
            found = any(file_store.exists(join(self.root, d, BASE_DIR)) for d in days
                        if len(d) == 8 and d.isdigit())
        return bool(from_rank0(found) if self.world_size > 1 else found)

    def write_delta(self, day: str, pass_id: int, step: int,
                    positions: Mapping[int, int]) -> Optional[str]:
        """Writes ``<day>/delta_<pass_id>``: what changed since the previous delta or base.

        With several ranks a collective; rank 0 writes (module docstring).

        Args:
            day: ``YYYYMMDD``.
            pass_id: the pass.
            step: the global step (the version).
            positions: the input positions after the pass.

        Returns:
            The directory written (None on ranks other than 0).
        """
        t0 = time.monotonic()
        if self.rank != 0:  # this rank's rows into the collective read
            self.snapshots.take(step, {}, dense=False, sparse=True)
            return None
        snap = self.snapshots.take(step, positions, dense=True, sparse=True)
        chunks = encode_version(snap.header(self.model_name, self.generation), snap.dense,
                                snap.sparse, self.value_type, self.max_chunk_bytes,
                                snap.deletes)
        final = join(self.root, day, delta_dir_name(pass_id))
        if is_remote(final):
            file_store.remove_tree(final)
            FsSink(final).send(step, self.generation, chunks)
        else:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = join(self.root, day, f".{delta_dir_name(pass_id)}.tmp-{os.getpid()}")
            with atomic_directory(final, tmp, replace=True):
                FsSink(tmp).send(step, self.generation, chunks)
        rows = sum(len(ids) for ids, _ in snap.sparse.values())
        deletes = sum(len(ids) for ids in snap.deletes.values())
        self.last_delta = final
        self.deltas_written += 1
        logger.info("pass %s/%d: wrote %s (version %d, %d rows, %d deletes, %.1f MB) in %.2fs",
                    day, pass_id, final, step, rows, deletes,
                    sum(len(c) for c in chunks) / 1e6, time.monotonic() - t0)
        return final

    def copy_checkpoint(self, checkpoint: str, day: str, pass_id: int) -> Optional[str]:
        """Copies a checkpoint to ``<day>/<pass_id>`` (hard links when both are local).

        An increment is written as a full checkpoint instead (``write_full_copy``): its
        parents are not copied.

        Args:
            checkpoint: the checkpoint directory (model_dir's ``model.ckpt-<step>``).
            day: ``YYYYMMDD``.
            pass_id: the pass.

        Returns:
            The directory written (None on ranks other than 0, which copy nothing).
        """
        if self.rank != 0:
            return None
        src = local_checkpoint_copy(checkpoint)
        final = join(self.root, day, str(int(pass_id)))
        with open(os.path.join(src, MANIFEST_FILE)) as f:
            increment = bool(json.load(f).get("increment"))
        if increment:  # its parents stay in model_dir: the copy is written full
            write_full_copy(checkpoint, final)
        elif is_remote(final):
            file_store.remove_tree(final)
            file_store.upload_tree(src, final, last=(MANIFEST_FILE, DONE_FILE))
        else:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = join(self.root, day, f".{int(pass_id)}.tmp-{os.getpid()}")
            with atomic_directory(final, tmp, replace=True):
                for name in sorted(os.listdir(src), key=lambda n: n == DONE_FILE):
                    _link_or_copy(os.path.join(src, name), os.path.join(tmp, name))
        self.last_pass_checkpoint = final
        logger.info("pass %s/%d: checkpoint %s", day, pass_id, final)
        return final

    def write_base(self, day: str, checkpoint: str) -> Optional[str]:
        """Writes ``<day>/base`` from a checkpoint of the model at the day's end.

        The next delta then holds only what changes after it. With several ranks a
        collective: rank 0 exports and every rank learns whether it did.

        Args:
            day: ``YYYYMMDD``.
            checkpoint: the checkpoint taken after the shrink.

        Returns:
            The base directory, or None without an exporter (and on ranks other than 0).

        Raises:
            Exception: rank 0's export failed (the exporter's error; other ranks return None).
        """
        if self.export_base is None:
            logger.warning("no exporter: %s/%s not written", day, BASE_DIR)
            return None
        t0 = time.monotonic()
        target = join(self.root, day, BASE_DIR)
        result, error = None, None
        if self.rank == 0:
            try:
                result = self.export_base(self.config, checkpoint, target)
            except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
                error = exc
        ok = bool(from_rank0(error is None)) if self.world_size > 1 else error is None
        if error is not None:
            raise error
        if not ok:  # rank 0's export failed: what is pending stays pending here too
            return None
        # what was pending is in the base now: the next delta starts from it (kept when the
        # export failed, so the deltas still cover it)
        self.tracker.take()
        if self.module.dynamic:
            self.module.dynamic.take_deleted(PASS_DELETES)
        if self.rank != 0:
            return None
        path = getattr(result, "path", target)
        self.last_base = str(path)
        self.bases_written += 1
        logger.info("day %s: base %s written in %.1fs", day, path, time.monotonic() - t0)
        return str(path)

    def status(self) -> dict[str, Any]:
        """``/status`` ``"pass_saves"``: where and what was written last."""
        return {"model_save_path": self.root, "last_delta": self.last_delta,
                "last_base": self.last_base, "last_pass_checkpoint": self.last_pass_checkpoint,
                "deltas_written": self.deltas_written, "bases_written": self.bases_written}


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def day_before(day: str) -> str:
    """``YYYYMMDD`` of the day before ``day``."""
    d = dt.datetime.strptime(day, "%Y%m%d") - dt.timedelta(days=1)
    return d.strftime("%Y%m%d")
