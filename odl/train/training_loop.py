"""The trainer's loop: one turn per step, the same on one rank and on N.

Each turn every rank says what it holds (``odl.train.distributed.RankTurn``): whether it
stops, holds a batch (and its size, so the step need not ask again), has finished its input
or failed, and (rank 0's, for all) whether a checkpoint is due by time or a failed one is to
be retried and which parts of a delta version are due. Then, on every rank alike:

* all stop when one stops (after a failure on any rank no rank runs the collectives of a
  clean stop) or when every input has ended;
* all publish together before the step (``odl.train.rank_publishing``);
* all train when one holds a batch (the others with an empty one), and all checkpoint on the
  same steps;
* on a file stream and on offline files the ranks train a group of batches only when every
  rank holds its batch of it, or has none left (``odl.inputs.file_stream_source``,
  ``odl.inputs.file_source``: rank ``r``'s ``k``-th batch is the group's ``r``-th), so a
  step trains what one process with the ranks' batches together would, however fast each
  rank reads, and passes end at the same step everywhere; ranks holding different groups
  of a file stream stop on a failure.

With one rank the exchange is the rank's own turn (no collective). What a step trains and
records is the trainer's (``Trainer.train_on``); this module decides when.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from odl.inputs.batch_prefetcher import PreparedBatch
from odl.inputs.file_stream_source import FILE_KEY, RECORD_KEY, SPLIT_KEY
from odl.inputs.source_factory import online_input_kind
from odl.train.distributed import RankTurn, exchange_turn
from odl.train.loop_clock import LoopClock

if TYPE_CHECKING:
    from odl.train.trainer import Trainer

# seconds after a failed checkpoint before an idle loop retries it
CHECKPOINT_RETRY_SECS = 5.0


class TrainingLoop:
    """Runs a trainer's turns until a stop (module docstring).

    Args:
        trainer: the trainer whose input, module, publisher and checkpoints it drives.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._t = trainer

    def run(self) -> None:
        """Turns until a rank stops or every input has ended; then every rank stops."""
        t = self._t
        clock = LoopClock(t.module.global_step)
        pipeline = t.input_pipeline
        assert pipeline is not None
        publishing = t.rank_publishing
        # a file stream or offline files: every rank reads the same groups of batches and
        # trains its batch of a group only when every rank holds its own (or has no input
        # left), so they step through the groups (and the passes) together; a rank holding
        # a group's batch keeps it until then
        lockstep = not t.options.online or online_input_kind(t.config) == "file_stream"
        held: Optional[PreparedBatch] = None
        while True:
            if t.publisher is not None and t.publisher.fatal_error is not None:
                # fenced: another trainer owns the delta topic (3, not restarted by systemd);
                # else a publisher bug (1: a restart resumes from the last checkpoint)
                t.fail(t.publisher.fatal_error, 3 if t.publisher.fenced else 1)
            stop = t.stops.requested or t.stops.check(t.module.global_step)
            item = None if stop else (held if held is not None else pipeline.get(timeout=0.1))
            held = None
            t.update_input_state()
            turn = exchange_turn(self._turn(clock, stop, item, lockstep))
            t.last_exchange_at = time.monotonic()
            if (lockstep and all(r.has_batch for r in turn)
                    and len({r.file_position for r in turn}) > 1):
                t.fail("the ranks read different records of the file stream (a split "
                       "completed while they were deciding to skip it?): "
                       f"{[r.file_position for r in turn]}; restart from the last "
                       "checkpoint", 1)
                continue  # every rank saw it: they stop together on the next turn
            if any(r.stop for r in turn) or all(r.finished for r in turn):
                self._ends(turn)
                break
            any_batch = any(r.has_batch for r in turn)
            if lockstep:  # every rank with input left holds its batch of the group
                any_batch = any_batch and all(r.has_batch or r.finished for r in turn)
            if lockstep and item is not None and not any_batch:
                held = item  # the others have not read this group yet
            if publishing is not None:  # rank 0's schedule for all, before the step
                publishing.after_turn(t.module.global_step, turn[0].publish_flags,
                                      any_batch, t.positions_snapshot())
            if not any_batch:
                self._idle(clock, bool(turn[0].retry_checkpoint))
                continue
            sizes = [r.size for r in turn]  # what each rank trains this step
            self._stepped(clock, t.train_on(item, sizes) if item is not None
                          else t.train_empty(sizes))
            self._checkpoint_if_due(clock, bool(turn[0].checkpoint_due))  # rank 0's clock

    def _turn(self, clock: LoopClock, stop: bool, item: Optional[PreparedBatch],
              lockstep: bool) -> RankTurn:
        """What this rank tells the others this turn."""
        t = self._t
        pipeline = t.input_pipeline
        assert pipeline is not None
        step = t.module.global_step
        where = ([item.positions.get(k, -1) for k in (SPLIT_KEY, FILE_KEY, RECORD_KEY)]
                 if lockstep and item is not None else [-1, -1, -1])
        publishing = t.rank_publishing
        retry = (item is None and t.last_checkpoint_error is not None
                 and step != t.checkpoints.last_saved_step
                 and clock.secs_since_checkpoint() >= CHECKPOINT_RETRY_SECS)
        return RankTurn(
            stop=int(stop), has_batch=int(item is not None),
            finished=int(item is None and pipeline.finished),
            checkpoint_due=int(clock.time_due(t.config.train_config.save_checkpoints_secs)),
            retry_checkpoint=int(retry), failed=int(t.failure is not None),
            publish_flags=publishing.turn_flags(step) if publishing is not None else 0,
            split=where[0], file=where[1], record=where[2],
            size=int(item.batch.size if item is not None and item.batch is not None else 0))

    def _ends(self, turn: list[RankTurn]) -> None:
        """A turn where a rank stops or every input has ended: the stop, on every rank."""
        t = self._t
        failed = [r for r, rank_turn in enumerate(turn) if rank_turn.failed]
        if failed and t.failure is None:  # no last version or checkpoint then
            t.fail(f"rank {failed[0]} stopped on a failure", 1)
        ended = all(r.finished for r in turn) and not any(r.stop for r in turn)
        if ended and not failed and t.pass_boundaries is not None:
            t.pass_boundaries.stream_ended()  # on every rank: passes go together
        if not t.stops.requested:
            t.stops.request("end of input" if all(r.finished for r in turn)
                            else "another rank stopped")
        t.ranks_stopped_together = not failed

    def _idle(self, clock: LoopClock, retry_checkpoint: bool) -> None:
        """A turn without a batch on any rank.

        A finished background checkpoint is taken in (``/status`` shows it while idle); one
        process's publisher publishes the last steps now; after a failed checkpoint
        (rank 0's turn says) every rank retries without waiting for the next due step, so
        health recovers once the cause is gone.
        """
        t = self._t
        t.checkpointing.writer.collect()
        if t.publisher is not None and t.rank_publishing is None:
            t.publisher.publish_if_behind(t.module.global_step, t.positions_snapshot())
        if retry_checkpoint:
            t.checkpointing.take()
            clock.checkpointed(t.module.global_step)

    def _stepped(self, clock: LoopClock, trained: int) -> None:
        """After a step: the samples/s window of ``/status`` and the progress log line."""
        t = self._t
        if clock.count(trained) is not None:  # the rate /status shows, every few s
            t.samples_per_sec = clock.rate
        log_every = max(1, t.config.train_config.log_step_count_steps)
        if trained and t.module.global_step % log_every == 0:
            t.log_progress()

    def _checkpoint_if_due(self, clock: LoopClock, time_due: bool) -> None:
        """A checkpoint when ``save_checkpoints_steps`` or ``time_due`` says so.

        One process writes it in the background (its outcome is taken in here, after a
        later step); several ranks write theirs together, on the loop's thread.
        """
        t = self._t
        t.checkpointing.writer.collect()
        step = t.module.global_step
        every_steps = t.config.train_config.save_checkpoints_steps
        due = (every_steps and step - clock.last_ckpt_step >= every_steps) or time_due
        if due and step != clock.last_ckpt_step and step != t.checkpoints.last_saved_step:
            t.checkpointing.take(background=True)
            clock.checkpointed(step)
