"""The wide tables' rate under in-batch learning: stated in the logit's space, set by the stream.

A table optimizer's step is stated in the rows' own space: Adagrad moves a row's columns by
about ``lr`` each, whatever its gradient's scale. How far that moves a record's prediction
depends on how the model reads the row: a first-order (wide) weight of width 1 added to the
logit moves it by ``lr``; the same wide part read through a ``final_dnn``, or wider, moves
it by ``lr`` times the logit's sensitivity to the wide output, often a tenth of that. A wide
rate tuned on one model shape is then wrong for the next.

Contract (``WideRate``), for a model with wide tables trained with in-batch learning:

* **Sensitivity** ``s``: per step, the mean over the step's records (every rank's) and over
  the wide lookups of the logit's sensitivity to the lookup's pooled vector ``J =
  dlogit/d wide``, measured as far as a row's first step from a fresh accumulator moves the
  logit: ``sum |J|`` (Adagrad), ``sqrt(stored columns) * |J|`` (row-wise Adagrad), ``|J|^2``
  (SGD, per unit error). A wide weight of width 1 added to the logit has ``s = 1``. ``s`` is
  smoothed over steps (``SMOOTHING``; the first step's value as it is).
* **Level** ``a``: the wide rate in the logit's space, as a multiple of the table rate:
  ``train_config.wide_learning_rate_multiplier`` at the start (``DEFAULT_LEVEL`` when the
  config does not write it).
* A step's wide tables learn at ``multiplier = a * min(1 / s, BOOST_MAX)`` times the table
  rate (at most ``limits.MAX_WIDE_LR_MULTIPLIER``; ``1 / s`` rounded to ``1 / QUANTUM`` of
  an octave), with ``a`` and ``s`` as the step before left them: the fused kernel takes its
  rate at the forward, before the step's Jacobian exists (the first step uses ``a``). The
  in-batch shift and per-record Adagrad use the same multiplier. Where ``s = 1`` (a wide
  part of width 1 added to the logit) it is the level itself: the multiplier as written. A
  zero Jacobian (``s = 0``) leaves the level as the multiplier. ``BOOST_MAX`` bounds the
  loop between the two: a model whose dense part reads its growing wide weights ever more
  weakly would otherwise raise their rate without end.
* **Adaptation** (``train_config.wide_rate_adaptation``, default on): every
  ``PROBE_EVERY``-th step the in-batch pass runs twice more, with the wide rows' rates times
  ``PROBE_FACTOR`` and divided by it; the step's loss at the records' shifted logits of each
  decides: ``log a`` moves toward the better one by ``LEVEL_STEP`` per ``LEVEL_RECORDS``
  records since the last probe (every rank's; at most ``LEVEL_STEP_MAX``: the level moves as
  fast per record whatever the batch size), kept within ``[a0, LEVEL_RANGE * a0]`` (``a0``
  the start). The shifts of a step predict each record after the step's earlier records were
  learned at that rate, so the comparison is progressive validation of the rate on the
  step's own records, as a per-sample learner would be judged. The probes change no state:
  the step trains on the shifts at the current rate, and the new level applies from the next
  step.
* Why the range: the probes see one batch, to first order. They do not see what a rate
  does to the steps after it (on the bursty stream they point below the rate that is best
  over the whole stream: 0.001-0.002 AUC lost where the level may fall below its start),
  nor, through a ``final_dnn``, what steps too large for the first order do. The ceiling
  bounds the loop between the level and the sensitivity; within four times the start the
  measured gain stays (``docs/benchmarks.md``, online learning quality: without a ceiling
  the same on MovieLens).

Every rank sees every record's ``J`` and loss (the step's exchange), so all ranks hold the
same sensitivity, level and multiplier. The level, the smoothed sensitivity and the probe
schedule are part of the checkpoint (``state_dict``); a run restored from one continues as
the run that wrote it would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from odl.config import limits
from odl.protos import pipeline_pb2
from odl.train.in_batch.batch_row_pairs import RowPairIndex

# An unwritten wide_learning_rate_multiplier under in-batch learning starts the level here
# (the bursty stream's best, measured with a wide part of width 1 added to the logit).
DEFAULT_LEVEL = 3.0
# Weight of the step's sensitivity in the smoothed one.
SMOOTHING = 0.1
# Probes run every this many steps, at the wide rates times and divided by PROBE_FACTOR.
PROBE_EVERY = 4
PROBE_FACTOR = math.exp(0.5)
# The level's move per LEVEL_RECORDS records, in natural log units (about 5 %), at most
# LEVEL_STEP_MAX a probe, and how far above its start it may go.
LEVEL_STEP = 0.05
LEVEL_RECORDS = 1024
LEVEL_STEP_MAX = 0.25
LEVEL_RANGE = 4.0
# The most the sensitivity multiplies the level by (1 / s at most this).
BOOST_MAX = 16.0
# The level's divisor 1 / s is rounded to 1 / QUANTUM of an octave (about 2 %).
QUANTUM = 32


def start_level(train_config: pipeline_pb2.TrainConfig, in_batch: bool) -> float:
    """The wide tables' multiplier at the start.

    ``wide_learning_rate_multiplier`` as written; unwritten, ``DEFAULT_LEVEL`` (a level) for
    in-batch learning's wide rate (``in_batch``) and 1 (the table rate) otherwise.
    """
    if train_config.HasField("wide_learning_rate_multiplier"):
        return float(train_config.wide_learning_rate_multiplier)
    return DEFAULT_LEVEL if in_batch else 1.0


@dataclass(frozen=True)
class WideLookups:
    """Where the wide lookups' pooled vectors sit in the step's Jacobian.

    Attributes:
        columns: ``[W, width]`` each wide lookup's columns of ``dlogit/d pooled`` (the
            groups side by side), padded with the Jacobian's column count (a zero column
            appended there).
        norm: ``"l1"`` (Adagrad), ``"rowwise"`` (row-wise Adagrad) or ``"l2sq"`` (SGD).
        stored: ``[W]`` each lookup's table's stored columns (row-wise Adagrad's divisor).
    """

    columns: np.ndarray
    norm: str
    stored: np.ndarray


NORMS = {"adagrad": "l1", "rowwise_adagrad": "rowwise", "sgd": "l2sq"}


def wide_lookups(index: RowPairIndex, wide: np.ndarray, kind: str) -> WideLookups:
    """The ``WideLookups`` of the lookups of ``index`` where ``wide`` (``[L]`` bool) is true.

    Args:
        index: the model's row-pair index.
        wide: which lookups read a wide table.
        kind: the table kernel (a key of ``NORMS``).
    """
    return WideLookups(columns=index.lookup_columns[wide], norm=NORMS[kind],
                       stored=index.lookup_stored[wide].astype(np.float64))


class WideRate:
    """The wide tables' rate of one model (module docstring).

    Args:
        lookups: the wide lookups' columns.
        level: the starting level.
        adapt: move the level by the probes.
    """

    def __init__(self, lookups: WideLookups, level: float, adapt: bool) -> None:
        self._lookups = lookups
        self.level = float(level)
        self.start = float(level)  # the level stays within [start, start * LEVEL_RANGE]
        self.adapt = bool(adapt)
        self.sensitivity: float | None = None
        self.steps = 0  # steps observed since the start
        self._since = 0  # records since the last probe
        self._probed = False  # the step being taken ran the probes
        self.probes = 0
        self._member: np.ndarray | None = None  # the sensitivity's column map (built once)
        self.multiplier = self._multiplier()

    def probe_due(self) -> bool:
        """The step being taken (not observed yet) runs the probes."""
        return self.adapt and self.steps % PROBE_EVERY == PROBE_EVERY - 1

    def judge(self, loss_faster: float, loss_slower: float, records: int) -> None:
        """Moves the level toward the probe with the lower loss (equal: no move).

        Args:
            loss_faster: the step's loss at the larger wide rate.
            loss_slower: at the smaller one.
            records: the step's records (every rank's).
        """
        self.probes += 1
        self._probed = True
        if not (math.isfinite(loss_faster) and math.isfinite(loss_slower)):
            return
        if loss_faster == loss_slower:
            return
        size = min(LEVEL_STEP * (self._since + records) / LEVEL_RECORDS, LEVEL_STEP_MAX)
        step = size if loss_faster < loss_slower else -size
        self.level = float(min(max(self.level * math.exp(step), self.start),
                               self.start * LEVEL_RANGE))

    def observe(self, jac: np.ndarray) -> None:
        """Ends a step: the sensitivity and the next step's multiplier.

        Args:
            jac: ``[records, columns]`` the step's ``dlogit/d pooled`` (every rank's records).
        """
        self.steps += 1
        self._since = 0 if self._probed else self._since + len(jac)
        self._probed = False
        if len(jac):
            s = self._step_sensitivity(jac)
            self.sensitivity = (s if self.sensitivity is None
                                else (1 - SMOOTHING) * self.sensitivity + SMOOTHING * s)
        self.multiplier = self._multiplier()

    def status(self) -> dict:
        """The figures of ``/status``'s ``wide_rate``."""
        return {"level": round(self.level, 4), "multiplier": round(self.multiplier, 4),
                "sensitivity": (round(self.sensitivity, 6) if self.sensitivity is not None
                                else None),
                "adapting": self.adapt, "probes": self.probes}

    def state_dict(self) -> dict:
        """The level, smoothed sensitivity and probe schedule (a checkpoint's ``wide_rate``)."""
        return {"level": self.level, "sensitivity": self.sensitivity, "steps": self.steps,
                "since": self._since}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`'s values.

        The level only where it adapts: otherwise the config's multiplier stays the level.
        """
        if self.adapt:  # (within this config's range, should its multiplier have changed)
            self.level = float(min(max(float(state["level"]), self.start),
                                   self.start * LEVEL_RANGE))
        s = state.get("sensitivity")
        self.sensitivity = None if s is None else float(s)
        self.steps, self._since = int(state.get("steps", 0)), int(state.get("since", 0))
        self.multiplier = self._multiplier()

    def at_level(self, level: float) -> float:
        """The table rate's multiplier that puts the wide rate at ``level`` in the logit's space.

        By the sensitivity as the last step left it; for a level not adapted (the stream's
        measuring phase, ``odl.train.in_batch.in_batch_choice``).
        """
        s = self.sensitivity
        if s is None or s <= 0:
            return min(level, limits.MAX_WIDE_LR_MULTIPLIER)
        octaves = min(round(-math.log2(s) * QUANTUM) / QUANTUM, math.log2(BOOST_MAX))
        return float(min(level * 2.0 ** octaves, limits.MAX_WIDE_LR_MULTIPLIER))

    def _multiplier(self) -> float:
        return self.at_level(self.level)

    def _step_sensitivity(self, jac: np.ndarray) -> float:
        lk = self._lookups
        columns = jac.shape[1]
        if self._member is None or len(self._member) != columns:
            # [columns, W]: 1 where a column is one of the wide lookup's (the padding's
            # column, ``columns``, falls off the end)
            member = np.zeros((columns + 1, len(lk.columns)))
            for w, cols in enumerate(lk.columns):
                member[cols, w] = 1.0
            self._member = member[:columns]
        j = jac.astype(np.float64)
        if lk.norm == "l1":
            per = np.abs(j) @ self._member  # [records, W]
        elif lk.norm == "rowwise":
            per = np.sqrt((j * j) @ self._member) * np.sqrt(lk.stored)[None, :]
        else:
            per = (j * j) @ self._member
        return float(per.mean())
