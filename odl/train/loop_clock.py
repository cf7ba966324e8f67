"""What the training loop keeps between steps (``odl.train.training_loop``)."""

from __future__ import annotations

import time
from collections.abc import Callable

# seconds of the samples/s window
_RATE_WINDOW_SECS = 5.0


class LoopClock:
    """What a training loop keeps between steps.

    The last checkpoint's step and time, and the window of the samples/s rate ``/status``
    shows: over the last full window of ``_RATE_WINDOW_SECS``, and before the first one is
    over, over the time since the loop started (a short run, or the progress line just
    after a restart, shows the rate it has, not 0).

    Args:
        step: the global step the loop starts at.
        now: the clock (seconds; ``time.monotonic``).
    """

    def __init__(self, step: int, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self.last_ckpt_step = step
        self.last_ckpt_time = now()
        self._window_start = now()
        self._window_samples = 0
        self._first_window = True
        self.rate = 0.0

    def secs_since_checkpoint(self) -> float:
        """Seconds since the loop started or last checkpointed."""
        return self._now() - self.last_ckpt_time

    def time_due(self, every_secs: float) -> bool:
        """Whether ``save_checkpoints_secs`` (0: never) has passed since the last one."""
        return bool(every_secs and self.secs_since_checkpoint() >= every_secs)

    def checkpointed(self, step: int) -> None:
        """Records a checkpoint at ``step``, now."""
        self.last_ckpt_step, self.last_ckpt_time = step, self._now()

    def count(self, trained: int) -> float | None:
        """Adds a step's samples; the new samples/s when it changed (else None).

        A full window's rate once the window is over; during the first window, the rate so
        far at every step.
        """
        self._window_samples += trained
        elapsed = self._now() - self._window_start
        if elapsed < _RATE_WINDOW_SECS:
            if not self._first_window or elapsed <= 0:
                return None
            self.rate = self._window_samples / elapsed
            return self.rate
        self.rate = self._window_samples / elapsed
        self._window_start, self._window_samples = self._now(), 0
        self._first_window = False
        return self.rate
