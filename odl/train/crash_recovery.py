"""The trainer's state at start: the newest checkpoint brought forward to the last version.

Order of a start (:meth:`CrashRecovery.restore`):

1. The newest intact checkpoint of ``model_dir`` (model, optimizer, step, input positions,
   generation and ``delta_topic_offset``), unless ``continue_train`` is off; positions saved
   for another topic than the config's are not used. Without a checkpoint, parameters are
   warm-started from ``train_config.fine_tune_checkpoint`` (renamed by
   ``fine_tune_ckpt_var_map``, one ``new_name<TAB>old_name`` per line) and the config's start
   positions apply.
2. Online with a Kafka delta topic, the trainer's own published versions
   (:mod:`publisher.delta_recovery`). A fencing sink claims the topic first, so nothing
   lands after what is read. After a checkpoint, the versions published after it (by a
   trainer then killed) are already in serving: the last COMPLETE one becomes the recovery
   point. Its values are copied onto the live tensors and its step and input positions
   replace the checkpoint's, so serving never sees a record trained twice and none is
   skipped. A version half-sent when the trainer died is ignored, as serving ignores it.
   Optimizer state (Adagrad / Adam accumulators) stays the checkpoint's. On a fresh start the
   topic's current end is where this lineage's versions begin; the trainer writes
   ``model.ckpt-0`` with it (:attr:`RestoredState.needs_base_checkpoint`) so a kill before the
   first periodic checkpoint has a recovery base.

Several ranks (``torchrun``): every rank reads the checkpoint; rank 0, which holds the delta
sink, alone claims and reads the delta topic and sends the result to the others. Each rank
loads only the blocks of the checkpoint's table parts that hold its own rows, then writes the
recovered rows its shards hold (a checkpoint of one process: the recovered rows are copied
onto its whole tables first), and takes its own partitions' positions from the recovered
version's.

While the delta topic is read the trainer's state is ``"recovering"``. Broker outages are
waited out (backoff up to ``_RECOVERY_RETRY_MAX_SECS``); a stop request abandons recovery, and
then no checkpoint may be written (:attr:`RestoredState.incomplete`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, TypeVar

import numpy as np

from odl.checkpoint.checkpoint_manager import (
    CheckpointManager,
    LoadedCheckpoint,
    read_checkpoint,
    resolve_checkpoint_path,
)
from odl.inputs.source_factory import online_input_name
from odl.models.dynamic.resplit import saved_partitions
from odl.protos import pipeline_pb2
from odl.train.distributed import from_rank0
from odl.train.table_growth import grow_to_hold
from odl.train.train_module import TrainModule
from odl.train.trainer_metrics import TrainerMetrics
from publisher.delta_recovery import (
    DeltaRecoveryError,
    RecoveredState,
    apply_recovered_state,
    delta_topic_end,
    read_published_state,
)
from publisher.delta_sink import DeltaSink, DeltaSinkError, DeltaSinkUnsupported
from publisher.id_maps import IdMaps, build_id_maps
from publisher.publisher_factory import dense_variable_shapes, published_table_dims

logger = logging.getLogger(__name__)

__all__ = ["CrashRecovery", "RestoredState", "read_var_map"]

_RECOVERY_RETRY_MAX_SECS = 30.0
# how long a fresh start waits for the delta broker before it starts without a recovery base
_FRESH_START_DELTA_WAIT_SECS = 10.0

_T = TypeVar("_T")


@dataclass
class RestoredState:
    """Where the trainer starts from.

    Attributes:
        positions: input positions to start from (None: the config's start positions).
        step: the restored checkpoint's step (None: a fresh start).
        generation: the generation that wrote that checkpoint.
        delta_offset: the delta topic offset from which serving replays to continue this
            state (None: unknown).
        replays_delta_topic: the trainer publishes to a Kafka delta topic it recovers from.
        incomplete: recovery was abandoned (stop requested): no checkpoint may be written.
        report: the ``/status`` ``recovery`` object, None when the delta topic was not read.
        pass_saves_state: the restored checkpoint's ``"pass_saves"`` entry (rows pending for
            the next pass delta), None when it has none.
        recovered_version: the published version crash recovery brought the model to, None
            when it stayed at the checkpoint.
        eval_positions: the eval topic's next offsets saved by the restored checkpoint
            (``odl.train.stream_evaluation``), None when it has none.
        open_pass: ``(day, pass)`` of a file stream's pass in progress at the restored
            checkpoint, None when none was.
    """

    positions: Optional[dict[int, int]] = None
    step: Optional[int] = None
    generation: Optional[str] = None
    delta_offset: Optional[int] = None
    replays_delta_topic: bool = False
    incomplete: bool = False
    report: Optional[dict] = None
    pass_saves_state: Optional[dict] = None
    eval_positions: Optional[dict[int, int]] = None
    recovered_version: Optional[int] = None
    open_pass: Optional[tuple[str, int]] = None

    @property
    def needs_base_checkpoint(self) -> bool:
        """A fresh start that knows where its versions begin: ``model.ckpt-0`` records it."""
        return self.replays_delta_topic and self.step is None and self.delta_offset is not None


class CrashRecovery:
    """Restores the trainer's state at start (see the module docstring).

    Args:
        config: the pipeline config.
        online: Kafka input (delta topic recovery is online only).
        continue_train: restore from ``model_dir``'s newest checkpoint when there is one.
        module: the trainer's model and optimizers.
        checkpoints: the trainer's checkpoint manager.
        metrics: the trainer's metrics.
        stop_event: ends waiting for the delta broker.
        delta_sink: the delta sink, when the config publishes.
        set_state: sets the trainer's state and returns the previous one.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, online: bool, continue_train: bool,
                 module: TrainModule, checkpoints: CheckpointManager, metrics: TrainerMetrics,
                 stop_event: threading.Event, delta_sink: Optional[DeltaSink],
                 set_state: Callable[[str], str]) -> None:
        self._config = config
        self._online = online
        self._continue_train = continue_train
        self._module = module
        self._checkpoints = checkpoints
        self._metrics = metrics
        self._stop = stop_event
        self._sink = delta_sink
        self._set_state = set_state

    def restore(self) -> RestoredState:
        """Restores the newest intact checkpoint, then brings it forward to the last version.

        Returns:
            Where to start from.

        Raises:
            DeltaSinkUnsupported: the broker refuses the fencing producer.
        """
        if self._module.world_size > 1:
            return self._restore_ranks()
        latest = self._latest_checkpoint()
        if latest is not None:
            self._module.load_checkpoint_state(latest[1].state)
            restored = self._restored_from(*latest)
        else:
            restored = self._warm_start()
        recovered = self._read_delta_topic(restored)
        if recovered is not None and self._note_recovered(restored, recovered):
            module = self._module
            self._grow_to_hold(recovered)
            apply_recovered_state(module.embedding_tables(), module.dense_parameters(),
                                  self._id_maps(), recovered, module if module.dynamic else None)
            _recovered_dense_ema(module)
            module.global_step = int(recovered.version)
            self._checkpoints.chain = None  # rows changed beyond the checkpoint: next is full
        return restored

    def _restore_ranks(self) -> RestoredState:
        """``restore`` of one of several ranks (a collective).

        Every rank reads the checkpoint; rank 0 alone claims and reads the delta topic and
        sends what it found to the others. Each rank loads its own rows (only the blocks of
        the table parts that hold them, or its rows of a one-process checkpoint's mapped
        state file), then writes the recovered rows its shards hold; dynamic tables take the
        recovered ids on every rank, as their index is whole on each.
        """
        latest = self._latest_checkpoint(whole_tables=False)
        restored = self._restored_from(*latest) if latest is not None else RestoredState()
        recovered = None
        if self._delta_topic() is not None:
            if self._module.rank == 0:
                recovered = self._read_delta_topic(restored)
            restored, recovered = from_rank0((restored, recovered))  # type: ignore[misc]
        if latest is None:
            self._warm_start()
            return restored
        state = latest[1].state
        module = self._module
        if recovered is not None and self._note_recovered(restored, recovered):
            # own rows first, then the recovered rows this rank's shards hold (and, with
            # dynamic tables, the recovered ids in the index every rank holds)
            state["global_step"] = int(recovered.version)
            module.load_checkpoint_state(state)
            self._grow_to_hold(recovered)  # the same ids on every rank
            apply_recovered_state(module.table_rows(), module.dense_parameters(),
                                  self._id_maps(), recovered,
                                  module if module.dynamic else None)
            _recovered_dense_ema(module)
            self._checkpoints.chain = None  # rows changed beyond the checkpoint: next is full
            return restored
        module.load_checkpoint_state(state)
        return restored

    def _grow_to_hold(self, recovered: RecoveredState) -> None:
        """Growing dynamic tables grow to hold the recovered ids (``grow_to_hold``)."""
        module = self._module
        if not module.dynamic:
            return
        names = self._id_maps().table_names()
        replayed: dict[str, np.ndarray] = {}
        for tid, (ids, _values) in recovered.sparse.items():
            dyn = module.dynamic_table(names.get(int(tid), ""))
            if dyn is not None:  # a deep table and its wide twin: one index
                replayed[dyn.name] = np.union1d(replayed.get(dyn.name, ids), ids)
        grow_to_hold(module, replayed)

    def _id_maps(self) -> IdMaps:
        """The ids the publisher gives the module's variables and tables."""
        return build_id_maps(dense_variable_shapes(self._module),
                             published_table_dims(self._module))

    def _read_delta_topic(self, restored: RestoredState) -> Optional[RecoveredState]:
        """The published versions after the restored checkpoint (None: nothing to apply).

        Sets ``restored``'s delta topic fields; the trainer's state is ``"recovering"``
        meanwhile.
        """
        delta = self._delta_topic()
        if delta is None:
            return None
        restored.replays_delta_topic = True
        prev_state = self._set_state("recovering")
        try:
            return self._recover_published(restored, *delta)
        finally:
            self._set_state(prev_state)

    def _delta_topic(self) -> Optional[tuple[str, str, dict[str, str]]]:
        """``(server, topic, kafka_config)`` of the Kafka delta topic when online + publishing."""
        tc = self._config.train_config
        if not self._online or not tc.HasField("incr_save_config"):
            return None
        isc = tc.incr_save_config
        if isc.WhichOneof("incr_update") != "kafka":
            return None
        return isc.kafka.server, isc.kafka.topic, dict(isc.kafka.kafka_config)

    def _latest_checkpoint(self, whole_tables: bool = True
                           ) -> Optional[tuple[str, LoadedCheckpoint]]:
        """``(path, checkpoint)`` of the newest intact one, None when there is none to use.

        ``whole_tables=False`` leaves a checkpoint's table parts on disk
        (``read_checkpoint``).
        """
        if not self._continue_train:
            return None
        latest = self._checkpoints.latest()
        return ((latest, read_checkpoint(latest, whole_tables=whole_tables))
                if latest is not None else None)

    def _restored_from(self, path: str, ckpt: LoadedCheckpoint) -> RestoredState:
        """Where a start from checkpoint ``ckpt`` (already loaded, or about to be) begins."""
        restored = RestoredState(
            step=ckpt.global_step,
            generation=ckpt.manifest.get("generation") or None,
            delta_offset=(int(ckpt.source["delta_topic_offset"])
                          if "delta_topic_offset" in ckpt.source else None),
            pass_saves_state=ckpt.state.get("pass_saves"),
            eval_positions=({int(p): int(o) for p, o in ckpt.source["eval_positions"].items()}
                            if "eval_positions" in ckpt.source else None),
            open_pass=((str(ckpt.source["open_pass"][0]), int(ckpt.source["open_pass"][1]))
                       if ckpt.source.get("open_pass") else None))
        logger.info("restored %s: step %d, positions %s", path, ckpt.global_step, ckpt.positions)
        self._checkpoints.last_saved_path = path
        self._checkpoints.last_saved_step = ckpt.global_step
        # the next increment's parent, unless the tables' rows moved (dynamic tables
        # re-split into another number of partitions): then the next checkpoint is full
        dynamic = ckpt.state.get("dynamic_tables")
        self._checkpoints.chain = (
            ckpt.link if not self._module.dynamic or dynamic is None
            or saved_partitions(dynamic) == self._module.dynamic.partitions else None)
        self._metrics.checkpoint_step.set(ckpt.global_step)
        if self._online:
            topic = ckpt.source.get("topic")
            if topic and topic != online_input_name(self._config):
                logger.warning(
                    "checkpoint positions are for topic %s, config reads %s: starting from "
                    "the config's start positions", topic, online_input_name(self._config))
            else:
                restored.positions = ckpt.positions
        return restored

    def _warm_start(self) -> RestoredState:
        """A start without a checkpoint: parameters from ``fine_tune_checkpoint``, if set."""
        tc = self._config.train_config
        if tc.fine_tune_checkpoint:
            path = resolve_checkpoint_path(tc.fine_tune_checkpoint)
            ckpt = read_checkpoint(path)
            var_map = (
                read_var_map(tc.fine_tune_ckpt_var_map) if tc.fine_tune_ckpt_var_map else None
            )
            report = self._module.load_parameters(ckpt.state["model"], var_map,
                                                  ckpt.state.get("dynamic_tables"),
                                                  ckpt.global_step)
            logger.info("warm-started parameters from %s: %s", path, report)
        return RestoredState()

    def _recover_published(self, restored: RestoredState, server: str, topic: str,
                           extra: dict[str, str]) -> Optional[RecoveredState]:
        """Reads this trainer's own delta topic from the restored checkpoint's offset.

        Returns:
            What the versions after the checkpoint add up to; None after a fresh start, an
            abandoned read (``restored.incomplete``) or without a replay offset.
        """
        sink = self._sink
        if sink is not None:
            # fence any other writer first, so nothing lands after the read below (a no-op
            # for a sink that does not fence)
            self._retry(lambda: sink.claim(5.0),
                        give_up_secs=(_FRESH_START_DELTA_WAIT_SECS if restored.step is None
                                      else None))
            if self._stop.is_set():
                return None
        if restored.step is None:
            # Fresh start: versions after the topic's current end are this lineage's.
            end = self._retry(lambda: delta_topic_end(server, topic, extra, 5.0),
                              give_up_secs=_FRESH_START_DELTA_WAIT_SECS)
            if end is None:
                if not self._stop.is_set():
                    logger.warning(
                        "delta topic %s unreachable at a fresh start: no model.ckpt-0 "
                        "recovery base; until the first checkpoint, a kill -9 may let "
                        "serving see records twice", topic)
                return None
            restored.delta_offset = end
            restored.report = {"from_checkpoint": None, "delta_topic": topic,
                               "start_offset": end, "versions": 0}
            return None
        start = restored.delta_offset
        if start is None:
            logger.warning("the restored checkpoint has no delta_topic_offset: versions "
                           "published after it cannot be recovered")
            return None
        state = self._retry(lambda: read_published_state(
            server, topic, start, extra, min_version=restored.step, stop=self._stop,
            owner=restored.generation))
        if state is None:
            restored.incomplete = True
        return state

    def _retry(self, fn: Callable[[], _T], give_up_secs: Optional[float] = None) -> Optional[_T]:
        """Calls ``fn`` until it succeeds (broker down: retry with backoff).

        Returns None when a stop is requested or ``give_up_secs`` passed.
        """
        delay = 1.0
        deadline = None if give_up_secs is None else time.monotonic() + give_up_secs
        while not self._stop.is_set():
            try:
                return fn()
            except DeltaSinkUnsupported:
                raise
            except (DeltaRecoveryError, DeltaSinkError) as exc:
                if self._stop.is_set():
                    break
                if deadline is not None and time.monotonic() + delay > deadline:
                    logger.warning("crash recovery: %s; giving up", exc)
                    return None
                logger.warning("crash recovery: %s; retrying in %.0fs", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, _RECOVERY_RETRY_MAX_SECS)
        logger.warning("crash recovery abandoned (stop requested): no checkpoint will be written")
        return None

    def _note_recovered(self, restored: RestoredState, state: RecoveredState) -> bool:
        """Takes the last complete version's step and positions into ``restored``.

        Returns:
            True when a version is to be copied onto the model (the caller copies it).
        """
        restored.delta_offset = state.end_offset
        restored.report = {
            "from_checkpoint": restored.step,
            "delta_topic": state.topic,
            "start_offset": state.start_offset,
            "rewound_to": state.rewound_to,
            "end_offset": state.end_offset,
            "versions": state.versions,
            "skipped_versions": state.skipped_versions,
            "dropped_incomplete_versions": state.dropped_versions,
            "rejected": dict(state.rejected),
            "version": state.version,
            "rows": state.rows,
            "dense_variables": len(state.dense),
            "seconds": round(state.seconds, 3),
        }
        if state.version is None:
            logger.info("crash recovery: no complete version after checkpoint step %d "
                        "(delta offsets %d..%d, %d incomplete dropped): the checkpoint is the "
                        "recovery point", restored.step, state.start_offset,
                        state.end_offset, state.dropped_versions)
            return False
        restored.recovered_version = int(state.version)
        input_topic = online_input_name(self._config)
        recovered = state.positions_for(input_topic)
        if recovered:
            restored.positions = recovered
        else:
            logger.warning("crash recovery: version %d has no positions for input topic %s; "
                           "keeping the checkpoint's", state.version, input_topic)
        logger.info(
            "crash recovery: checkpoint step %d + %d published versions -> version %d "
            "(generations %s): %d rows, %d dense variables; %d incomplete versions dropped; "
            "positions %s; delta offsets %d..%d in %.2fs",
            restored.step, state.versions, state.version, state.generations, state.rows,
            len(state.dense), state.dropped_versions, restored.positions, state.start_offset,
            state.end_offset, state.seconds)
        return True


def read_var_map(path: str) -> dict[str, str]:
    """Reads ``fine_tune_ckpt_var_map``: one ``new_name<TAB>old_name`` per line.

    Blank lines and lines starting with ``#`` are skipped.

    Args:
        path: the map file.

    Returns:
        Old parameter name by new name.

    Raises:
        ValueError: a line is not two tab-separated names.
    """
    out = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'new_name<TAB>old_name', got {line!r}")
            out[parts[0].strip()] = parts[1].strip()
    return out


def _recovered_dense_ema(module: TrainModule) -> None:
    """A served dense EMA after a recovery from the delta topic.

    The published dense variables were the average: the parameters now hold it, and the
    average goes on from there (the live parameters it had averaged are not published).
    """
    if module.serves_dense_ema:
        module.dense_ema.restart_from_parameters(keep_averaging=True)
