"""In-batch learning decided by the stream, for a config that does not write it.

In-batch learning pays where a batch's earlier records teach its later ones what the next
batch would have learned from them: one user's events in a burst, a new item's first
clicks. Where records share rows only through popular ids it buys nothing and costs a step
about twice as long, and its larger wide rate (``odl.train.in_batch.wide_rate``) loses AUC
(measured figures in ``docs/training.md``). Which stream is which is not in the config, so
where ``train_config.in_batch_learning`` is unwritten (``odl.config.in_batch_settings``)
the trainer decides it from the shift's measured gain (``ShiftGain``).

Contract (``InBatchChoice``):

* **Phases.** ``measuring``: every step runs the shift and per-record Adagrad; the wide
  tables learn at their rate without in-batch learning (the written multiplier, else the
  table rate) stated in the logit's space as in-batch learning states it, not adapted
  (``WideRate.at_level``: where the wide part adds to the logit, the rate as written;
  through a ``final_dnn``, that rate over the logit's sensitivity to the wide part).
  ``on``: in-batch learning as written ``true`` does it, its wide rate included
  (``WideRate``, from its start level, adapted). ``off``: as ``in_batch_learning: false``,
  except that one step in ``PROBE_EVERY`` runs the shift (without per-record Adagrad, at
  the wide rate without in-batch learning, in the rows' space) so the gain is still
  measured. A config that writes ``true`` is ``on`` from the start and never changes.
* **Windows.** A window closes once its steps that ran the shift hold ``WINDOW_RECORDS``
  records (every rank's) and number ``WINDOW_MIN_STEPS``; its gain is the mean of the gains
  measured meanwhile (a step's gain is measured when the next shifting step runs). At a
  window's end: ``OFF_WINDOWS`` windows in a row with a mean under ``OFF_BELOW`` turn
  in-batch learning off; a mean of at least ``ON_ABOVE`` turns it on; otherwise the phase
  stays. The run's first window decides nothing at its end: a fresh model learns from
  anything, so every stream's gain starts high there. One window's mean is noisy where the
  gain is small (on the bursty stream one window of ten falls near zero while the stream's
  gain is 0.004), hence two in a row to turn it off.
* **Early on.** A window, the first included, turns it on before its end (and closes
  there) once at least ``EARLY_MIN_GAINS`` of its gains measured after the run's first
  ``WARM_RECORDS`` records have a mean at least ``EARLY_Z`` standard errors above
  ``ON_ABOVE``. Where nearly every step gains (MovieLens: every step of the first
  thousands of records) that is a few thousand records in, not two windows; a fresh
  model's high first gains are not counted, and a gain as noisy as the bursty stream's or
  as small as the Criteo-like stream's waits for the window's end.
* **Why the phases.** A wide rate three times the table's for the first hundred steps of a
  stream where in-batch learning pays nothing leaves a lasting loss (Adagrad's first steps
  are its largest), while the shift alone at the written rate costs nothing there; so the
  larger, adapted wide rate waits for a decision that the shift pays. Measuring states the
  written rate in the logit's space because through a final DNN the rows' rate moves the
  logit by a fifth to a tenth of what it does where the wide part adds to the logit: the
  first records' wide rows would learn almost nothing until the decision.
* Every rank sees every record's gain (the step's exchange), so all ranks take the same
  decisions at the same steps without a collective of their own. The phase, the open
  window and the counts are part of the checkpoint (``state_dict``): a restored run closes
  its windows at the steps the run that wrote it would have; the gain of the step before
  the restart, measured with the next step, is not carried, so that window's mean lacks
  one step's gain.
"""

from __future__ import annotations

import math

from odl.train.in_batch.in_batch_learning import ShiftGain

# A window closes once its shifting steps hold this many records (every rank's) and number
# at least WINDOW_MIN_STEPS.
WINDOW_RECORDS = 16384
WINDOW_MIN_STEPS = 32
# OFF_WINDOWS windows in a row with a mean gain under OFF_BELOW turn in-batch learning off,
# a window's mean of at least ON_ABOVE turns it on.
OFF_BELOW = 0.001
OFF_WINDOWS = 2
ON_ABOVE = 0.003
# While off, one step in this many runs the shift to keep measuring the gain.
PROBE_EVERY = 32
# A window turns it on before its end once at least EARLY_MIN_GAINS gains measured after the
# run's first WARM_RECORDS records (every rank's) have a mean EARLY_Z standard errors above
# ON_ABOVE.
WARM_RECORDS = 4096
EARLY_MIN_GAINS = 16
EARLY_Z = 3.0

MEASURING, ON, OFF = "measuring", "on", "off"


class InBatchChoice:
    """Whether and how far in-batch learning runs at each step (module docstring).

    Args:
        auto: decided by the stream; False: on at every step (written ``true``).
    """

    def __init__(self, auto: bool) -> None:
        self.auto = bool(auto)
        self.phase = MEASURING if self.auto else ON
        self.windows = 0  # windows closed
        self.switches = 0  # phase changes
        self.window_gain: float | None = None  # the last closed window's mean gain
        self._below = 0  # windows in a row under OFF_BELOW
        self._sum = 0.0  # the open window's measured gains: their sum and count
        self._measured = 0
        self._steps = 0  # its steps that shifted and their records
        self._records = 0
        self._seen = 0  # ShiftGain.steps when last read
        self._total = 0  # records seen
        # the open window's gains measured after WARM_RECORDS: sum, sum of squares, count
        self._early = [0.0, 0.0, 0]

    def shifting(self, step: int) -> bool:
        """Whether step ``step`` (counted from 0) runs the shift."""
        return self.phase != OFF or step % PROBE_EVERY == 0

    @property
    def active(self) -> bool:
        """Whether in-batch learning runs at every step (measuring or on)."""
        return self.phase != OFF

    @property
    def measuring(self) -> bool:
        """Whether the stream's decision is still open (nothing decided yet)."""
        return self.phase == MEASURING

    @property
    def per_record(self) -> bool:
        """Whether the steps that shift also run per-record Adagrad."""
        return self.phase != OFF

    @property
    def wide_engaged(self) -> bool:
        """Whether the wide tables learn at in-batch learning's wide rate."""
        return self.phase == ON

    def end_step(self, gain: ShiftGain, records: int, shifted: bool) -> None:
        """Takes a step's measured gain and records; closes a window and decides.

        Args:
            gain: in-batch learning's gain (its newest step's value, if measured since the
                last call).
            records: the step's records (every rank's).
            shifted: whether the step ran the shift.
        """
        if not self.auto:
            return
        if gain.steps > self._seen and gain.last is not None:
            self._sum += gain.last
            self._measured += 1
            if self._total >= WARM_RECORDS:
                self._early[0] += gain.last
                self._early[1] += gain.last * gain.last
                self._early[2] += 1
        self._seen = gain.steps
        self._total += records
        if shifted:
            self._records += records
            self._steps += 1
        early = self.phase != ON and self._clear_gain()
        if not early and (self._records < WINDOW_RECORDS or self._steps < WINDOW_MIN_STEPS
                          or not self._measured):
            return
        mean = self._sum / self._measured
        self._close(mean)
        if early:
            self._below, phase = 0, ON
        elif self.windows == 1:
            return
        else:
            self._below = self._below + 1 if mean < OFF_BELOW else 0
            phase = self.phase
            if self._below >= OFF_WINDOWS:
                phase = OFF
            elif mean >= ON_ABOVE:
                phase = ON
        if phase != self.phase:
            self.phase = phase
            self.switches += 1

    def _clear_gain(self) -> bool:
        """Whether the open window's gains after WARM_RECORDS clear ON_ABOVE (early on)."""
        total, squares, n = self._early
        if n < EARLY_MIN_GAINS:
            return False
        mean = total / n
        sem = math.sqrt(max(squares / n - mean * mean, 0.0) / (n - 1))
        return mean - EARLY_Z * sem >= ON_ABOVE

    def _close(self, mean: float) -> None:
        """Closes the open window with its mean gain."""
        self.windows += 1
        self.window_gain = mean
        self._sum, self._measured, self._steps, self._records = 0.0, 0, 0, 0
        self._early = [0.0, 0.0, 0]

    def status(self) -> dict:
        """The decision's figures for ``/status``'s ``in_batch``."""
        return {"mode": "auto" if self.auto else "on", "phase": self.phase,
                "window_gain": (round(self.window_gain, 6) if self.window_gain is not None
                                else None),
                "windows": self.windows, "switches": self.switches}

    def state_dict(self) -> dict:
        """The phase, the open window and the counts (a checkpoint's ``in_batch_choice``)."""
        return {"phase": self.phase, "windows": self.windows, "switches": self.switches,
                "window_gain": self.window_gain, "below": self._below, "sum": self._sum,
                "measured": self._measured, "steps": self._steps, "records": self._records,
                "total": self._total, "early": list(self._early)}

    def load_state_dict(self, state: dict, gain: ShiftGain) -> None:
        """Restores :meth:`state_dict`'s values (auto only: written ``true`` stays on)."""
        if not self.auto:
            return
        self.phase = str(state["phase"])
        self.windows, self.switches = int(state["windows"]), int(state["switches"])
        wg = state.get("window_gain")
        self.window_gain = None if wg is None else float(wg)
        self._below = int(state["below"])
        self._sum, self._measured = float(state["sum"]), int(state["measured"])
        self._steps = int(state["steps"])
        self._records = int(state["records"])
        self._total = int(state.get("total", 0))
        early = state.get("early", (0.0, 0.0, 0))
        self._early = [float(early[0]), float(early[1]), int(early[2])]
        self._seen = gain.steps
