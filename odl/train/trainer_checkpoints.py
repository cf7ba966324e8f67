"""The trainer's checkpoints: when one may be taken, what it holds, how it is written.

A checkpoint holds the model state of the current step, the input positions of exactly the
batches trained, the delta topic offset serving replays from to continue it (its replay
point), a file stream's open pass and the eval stream's positions. With a publisher it must
equal a fully published version (the crash-recovery point): the version at its step is
acknowledged first (a sync), else it is skipped and retried. One process copies the state
and writes it in the background (:mod:`odl.train.checkpoint_writer`; outcomes are taken in
on the loop's thread, in step order); several ranks write theirs together
(:mod:`odl.train.rank_checkpoint`). An evaluation on the eval stream runs at every
checkpoint. A written checkpoint's positions are committed to the consumer group.

With ``train_config.full_checkpoint_every`` above 1, a checkpoint is an increment of the
previous one (``odl.checkpoint.checkpoint_chain``) whenever the checkpoint manager allows
it: the state but the tables, and the rows changed since (:mod:`odl.train.checkpoint_rows`,
counted from the restored state on). A failed checkpoint puts its rows back.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Optional

import numpy as np

from odl.checkpoint.checkpoint_manager import CheckpointError
from odl.inputs.source_factory import online_input_kind, online_input_name
from odl.train.checkpoint_rows import CheckpointRows
from odl.train.checkpoint_writer import CheckpointWriter
from odl.train.module_state import changed_rows_part
from odl.train.rank_checkpoint import save_across_ranks
from odl.train.stream_evaluation import evaluate_at_checkpoint

if TYPE_CHECKING:
    from odl.train.trainer import Trainer

logger = logging.getLogger(__name__)

# seconds a checkpoint waits for its version to be acknowledged by the delta broker
_CHECKPOINT_SYNC_SECS = 10.0


class TrainerCheckpoints:
    """Takes the checkpoints of a trainer (module docstring).

    Args:
        trainer: the trainer whose state, positions and publisher it reads.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._t = trainer
        # the periodic checkpoints of one process are written beside the loop
        self.writer = CheckpointWriter()
        # rows changed since the last checkpoint (None: every checkpoint is full)
        self.rows: Optional[CheckpointRows] = None

    def restored(self) -> None:
        """Starts counting changed rows from the restored (or initial) state.

        Called once the trainer's state is restored; with ``full_checkpoint_every`` 1
        nothing is counted and every checkpoint is full.
        """
        if self._t.checkpoints.full_every <= 1:
            return
        if self.rows is None:
            self.rows = CheckpointRows(self._t.module)
            self._t.module.add_table_growth_hook(self._tables_grew)
        else:
            self.rows.restart()

    def _tables_grew(self, _shapes: dict[str, tuple[int, int]]) -> None:
        """Growing dynamic tables grew: the next checkpoint is full.

        An increment holds rows of tables of its parent's shapes (``odl.train.table_growth``).
        A write in flight is waited for first: it would make itself the next parent.
        """
        self.writer.wait()
        self._t.checkpoints.chain = None

    def take(self, overwrite: bool = False, background: bool = False) -> bool:
        """Takes a checkpoint of the current step: the state, positions and replay point.

        Args:
            overwrite: replace a checkpoint of the same step (a day's shrink).
            background: one process only: copy the state here and write it in the
                background; the outcome is recorded when the write ends. Otherwise the
                write is done before returning.

        Returns:
            False when the checkpoint was skipped or failed (recorded in the trainer's
            ``last_checkpoint_error``); True when written or, in the background, started.
        """
        t = self._t
        module = t.module
        self.writer.wait()  # checkpoints complete in step order
        if not overwrite and module.global_step == t.checkpoints.last_saved_step:
            return True  # the write just waited for was of this step
        if t.restored.incomplete:
            logger.warning("not checkpointing: crash recovery did not finish")
            return False
        if t.publisher is not None or t.rank_publishing is not None:
            # A checkpoint must equal a fully published version (the crash-recovery point).
            positions = t.positions_snapshot()
            # no use stalling the train loop for a delta broker known to be down
            sync_secs = 0.0 if t.delta_broker_error() else _CHECKPOINT_SYNC_SECS
            if t.rank_publishing is not None:  # with every rank's rows and positions
                synced = t.rank_publishing.sync(module.global_step, positions, sync_secs)
            else:
                assert t.publisher is not None
                synced = t.publisher.sync(module.global_step, positions, timeout=sync_secs)
            if not synced:
                t.metrics.checkpoint_failures.inc()
                t.last_checkpoint_error = (
                    f"delta version {module.global_step} not published: checkpoint "
                    "skipped (a checkpoint must equal a published version)")
                logger.warning("%s; the next checkpoint will retry", t.last_checkpoint_error)
                return False
        prev_state = t.state
        t.state = "checkpointing"
        positions = t.positions_snapshot()
        try:
            source = (
                {"source": online_input_kind(t.config), "topic": online_input_name(t.config)}
                if t.options.online
                else {"source": "files", "path": t.config.train_input_path}
            )
            source.update(self.replay_point())
            if t.passes is not None and t.passes.open_pass is not None:
                source["open_pass"] = list(t.passes.open_pass)  # resumed at a restart
            if t.evaluates and module.global_step:
                try:
                    evaluate_at_checkpoint(t.evaluator, module, t.metrics)
                except Exception:  # noqa: BLE001 - an evaluation must not stop checkpoints
                    logger.exception("evaluation at step %d failed", module.global_step)
            if t.evaluator is not None:
                source["eval_positions"] = {str(p): o for p, o in
                                            t.evaluator.positions().items()}
            step = module.global_step
            changed = self.rows.take() if self.rows is not None else None
            if module.world_size > 1:
                self._save_across_ranks(positions, source, overwrite, changed)
            else:
                rows = None
                if changed is not None and t.checkpoints.increment_allowed(overwrite):
                    state = module.state_without_tables(  # copies: training goes on
                        dynamic_state=self.rows.dynamic_changes if self.rows else None)
                    rows = changed_rows_part(module, changed)
                else:
                    state = module.state_dict_for_checkpoint()
                if t.pass_saves is not None:
                    state["pass_saves"] = t.pass_saves.state_dict()
                save = functools.partial(t.checkpoints.save, step, state, positions, source,
                                         t.config_text, t.generation, overwrite=overwrite,
                                         rows=rows)
                if background:
                    self.writer.start(save, functools.partial(self._written, step, positions,
                                                              changed=changed))
                    return True
                save()
            self._written(step, positions, None)
            return True
        except CheckpointError as exc:
            self._written(module.global_step, positions, exc, changed)
            return False
        finally:
            t.state = prev_state if prev_state != "checkpointing" else "training"

    def _written(self, step: int, positions: dict[int, int],
                 error: Optional[CheckpointError],
                 changed: Optional[dict[str, np.ndarray]] = None) -> None:
        """Records a checkpoint's outcome (on the loop's thread, also for a background one).

        A failed one puts back the rows it took (``changed``), so the next one writes them.
        """
        if error is not None:
            if changed is not None and self.rows is not None:
                self.rows.put_back(changed)
            self._t.metrics.checkpoint_failures.inc()
            self._t.last_checkpoint_error = str(error)
            logger.error("%s; training continues and the next checkpoint will retry", error)
            return
        self._t.metrics.checkpoint_step.set(step)
        self._t.last_checkpoint_error = None
        if self._t.input_pipeline is not None:
            self._t.input_pipeline.request_commit(positions)

    def _save_across_ranks(self, positions: dict[int, int], source: dict,
                           overwrite: bool, changed: Optional[dict[str, np.ndarray]]) -> None:
        """The checkpoint save of one of several ranks (a collective).

        Every rank writes its own table rows, rank 0 the rest with every rank's positions
        and commits once all parts are in (``odl.train.rank_checkpoint``); every rank learns
        the outcome, so all keep checkpointing on the same steps.

        Raises:
            CheckpointError: on every rank, when any rank's part or the commit failed.
        """
        t = self._t
        extra = ({"pass_saves": t.pass_saves.state_dict()}  # a collective: every rank's
                 if t.pass_saves is not None else None)
        save_across_ranks(t.checkpoints, t.module, positions, source, t.config_text,
                          t.generation, overwrite, extra_state=extra, changed=changed,
                          dynamic_changes=(self.rows.dynamic_changes_of
                                           if self.rows is not None else None))

    def replay_point(self) -> dict:
        """Where serving must start replaying the delta topic to continue this checkpoint.

        Every version published so far is at a step <= the checkpoint's, and versions carry
        full values, so replaying from just after the last delivered version is exact.
        """
        if self._t.publisher is None:
            return {}
        sink = self._t.publisher.sink
        out: dict = {}
        if sink.topic is not None:
            out["delta_topic"] = sink.topic
            out["delta_server"] = sink.servers
        last = self._t.publisher.status().get("last_offset")
        if last is not None and last >= 0:
            out["delta_topic_offset"] = int(last) + 1
        elif self._t.restored.delta_offset is not None:
            out["delta_topic_offset"] = self._t.restored.delta_offset
        return out
