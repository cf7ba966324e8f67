"""What the trainer does at a file stream's pass and day boundaries.

A PaddleRec-style file stream (``file_stream_input``) trains time splits grouped into passes
and days (:mod:`odl.train.pass_metrics`). When a batch of a new pass arrives, the closed
pass's gauges and train AUC are set; with ``model_save_path`` its delta is written
(``<day>/delta_<pass>``), every ``checkpoint_per_pass`` passes a checkpoint is copied to
``<day>/<pass>``, and at a day's end the dynamic tables shrink and the checkpoint after it
becomes the day's base (:mod:`odl.train.pass_saves`). A start without a base writes the
starting model as the base of the day before the first split.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from odl.checkpoint.checkpoint_manager import CheckpointError, CheckpointManager
from odl.inputs.batch_prefetcher import PreparedBatch
from odl.inputs.file_stream_source import SPLIT_KEY
from odl.protos import pipeline_pb2
from odl.storage.oss_store import StorageError
from odl.train.crash_recovery import RestoredState
from odl.train.distributed import agree
from odl.train.pass_metrics import PassMetrics, pass_of
from odl.train.pass_saves import PassSaves, day_before
from odl.train.progressive_metrics import output_column
from odl.train.train_module import TrainModule
from odl.train.trainer_metrics import TrainerMetrics

logger = logging.getLogger(__name__)


class PassBoundaries:
    """The trainer's side of a file stream's passes (module docstring).

    Args:
        config: the pipeline config (``file_stream_input``).
        module: the model being trained.
        passes: the stream's passes and their metrics.
        saves: the day / pass saves (``model_save_path``), or None.
        metrics: the trainer's Prometheus metrics.
        checkpoints: the model_dir's checkpoints.
        checkpoint: takes a checkpoint now (``overwrite``: of the same step); False when
            skipped or failed.
        positions: the input positions of the steps trained so far.
        label_column: the label column the first output is scored on.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, module: TrainModule,
                 passes: PassMetrics, saves: PassSaves | None, metrics: TrainerMetrics,
                 checkpoints: CheckpointManager, checkpoint: Callable[..., bool],
                 positions: Callable[[], dict[int, int]], label_column: int) -> None:
        self._config = config
        self._module = module
        self._passes = passes
        self._saves = saves
        self._metrics = metrics
        self._checkpoints = checkpoints
        self._checkpoint_now = checkpoint
        self._positions = positions
        self._label_column = label_column

    def resume(self, restored: RestoredState) -> None:
        """Opens the pass the restored state was inside (``PassMetrics.resume``).

        The checkpoint's pass in progress; after crash recovery moved the model past the
        checkpoint, the pass of the last record trained (the recovered positions' split).
        """
        open_pass = restored.open_pass
        if restored.recovered_version is not None:
            split = (restored.positions or {}).get(SPLIT_KEY)
            fs = self._config.file_stream_input
            open_pass = (pass_of(int(split), fs.split_interval, fs.split_per_pass)
                         if split is not None else None)
        if open_pass is not None:
            self._passes.resume(*open_pass)

    def begin(self, item: PreparedBatch) -> None:
        """Before ``item`` is trained: a new pass closes the previous one first."""
        if SPLIT_KEY not in item.positions:
            return
        prev = self._passes.current_day
        if self._passes.begin(item.positions[SPLIT_KEY]):
            self.ended(day_ended=self._passes.current_day != prev)

    def trained(self, item: PreparedBatch, probs: np.ndarray, labels: np.ndarray) -> None:
        """After ``item`` is trained: its predictions join its pass's metrics."""
        if SPLIT_KEY in item.positions and item.batch is not None:
            self._passes.update(item.positions[SPLIT_KEY], probs, labels)
            self._passes.keep_batch(item.batch)

    def stream_ended(self) -> None:
        """The stream ended: its last pass closes (on every rank alike)."""
        if self._passes.close_current():
            self.ended(day_ended=True)

    def ended(self, day_ended: bool) -> None:
        """Handles a closed file-stream pass, before any record of the next pass is trained.

        Gauges and the pass's train AUC; with ``model_save_path``, the day's end shrink and
        ``<day>/delta_<pass>``; a checkpoint every ``checkpoint_per_pass`` passes (copied to
        ``<day>/<pass>``); at a day's end the checkpoint after the shrink and ``<day>/base``.

        Args:
            day_ended: the next batch belongs to another day, or the stream ended.
        """
        last = self._passes.last_closed()
        if last is None:
            return
        self._metrics.pass_samples.set(last["samples"])
        if last["auc"] is not None:
            self._metrics.pass_auc.set(last["auc"])
        if last["logloss"] is not None:
            self._metrics.pass_logloss.set(last["logloss"])
        self._train_auc()
        day, pass_id = last["day"], int(last["pass"])
        step = self._module.global_step
        saves = self._saves
        shrunk = False
        if day_ended and self._module.dynamic:
            evicted = self._module.shrink_dynamic()
            shrunk = bool(evicted)
            logger.info("day %s ended: shrink evicted %s", day, evicted or "nothing")
        if saves is not None:
            try:
                saves.write_delta(day, pass_id, step, self._positions())
                self._metrics.pass_deltas.inc()
            except (OSError, StorageError) as exc:
                logger.error("pass %s/%d: delta not written: %s", day, pass_id, exc)
        every = int(self._config.file_stream_input.checkpoint_per_pass)
        due = bool(every and self._passes.passes_closed % every == 0)
        base_due = day_ended and saves is not None and saves.export_base is not None
        if not (due or base_due) or not step:
            return
        logger.info("pass %s/%d ended: checkpoint%s", day, pass_id,
                    " and day base" if base_due else "")
        if step != self._checkpoints.last_saved_step or shrunk:
            if not self._checkpoint_now(overwrite=shrunk):
                logger.warning("pass %s/%d: no checkpoint, so no pass copy or base", day,
                               pass_id)
                return
        path = self._checkpoints.last_saved_path
        if saves is None or path is None:
            return
        try:
            if due:
                saves.copy_checkpoint(path, day, pass_id)
            if base_due:
                saves.write_base(day, path)
                self._metrics.day_bases.inc()
        except (OSError, StorageError, CheckpointError) as exc:
            logger.error("pass %s/%d: day/pass save failed: %s", day, pass_id, exc)
        except Exception as exc:  # noqa: BLE001 - the exporter's errors must not stop training
            logger.exception("day %s: base export failed: %s", day, exc)

    def _train_auc(self) -> None:
        """Scores the closed pass's sampled batches with the model after the pass."""
        batches = self._passes.take_rescore()
        if self._module.world_size > 1:  # predict is a collective: as many calls on every rank
            most = max(n for (n,) in agree([len(batches)]))
            for _ in range(most - len(batches)):
                self._module.predict(self._module.empty_batch())
        if not batches:
            return
        probs = [output_column(self._module.predict(b), 0) for b in batches]
        labels = [output_column(b.labels.detach().cpu().numpy(), self._label_column)
                  for b in batches]
        auc = self._passes.set_train_auc(np.concatenate(probs), np.concatenate(labels))
        if auc is not None:
            self._metrics.pass_train_auc.set(auc)

    def first_base(self) -> None:
        """Writes the starting model as a base when ``model_save_path`` holds none yet.

        It is the base of the day before the first split to train, so that day's deltas
        apply to it.
        """
        saves = self._saves
        if saves is None or saves.export_base is None or saves.has_base():
            return
        fs = self._config.file_stream_input
        first = self._positions().get(SPLIT_KEY)
        day = (pass_of(int(first), fs.split_interval, fs.split_per_pass)[0] if first
               else fs.start_day)
        step = self._module.global_step
        if step != self._checkpoints.last_saved_step and not self._checkpoint_now():
            logger.warning("no starting base: the checkpoint failed")
            return
        path = self._checkpoints.last_saved_path
        if path is not None:
            saves.write_base(day_before(day), path)
            self._metrics.day_bases.inc()
