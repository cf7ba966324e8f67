"""What the training loop keeps between steps (``odl.train.training_loop``)."""

from __future__ import annotations

import time

# seconds of the samples/s window
_RATE_WINDOW_SECS = 5.0


class LoopClock:
    """What a training loop keeps between steps.

    The last checkpoint's step and time, and the window of the samples/s rate ``/status``
    shows.

    Args:
        step: the global step the loop starts at.
    """

    def __init__(self, step: int) -> None:
        self.last_ckpt_step = step
        self.last_ckpt_time = time.monotonic()
        self._window_start = time.monotonic()
        self._window_samples = 0
        self.rate = 0.0

    def secs_since_checkpoint(self) -> float:
        """Seconds since the loop started or last checkpointed."""
        return time.monotonic() - self.last_ckpt_time

    def time_due(self, every_secs: float) -> bool:
        """Whether ``save_checkpoints_secs`` (0: never) has passed since the last one."""
        return bool(every_secs and self.secs_since_checkpoint() >= every_secs)

    def checkpointed(self, step: int) -> None:
        """Records a checkpoint at ``step``, now."""
        self.last_ckpt_step, self.last_ckpt_time = step, time.monotonic()

    def count(self, trained: int) -> float | None:
        """Adds a step's samples; the window's samples/s once it is over (else None)."""
        self._window_samples += trained
        elapsed = time.monotonic() - self._window_start
        if elapsed < _RATE_WINDOW_SECS:
            return None
        self.rate = self._window_samples / elapsed
        self._window_start, self._window_samples = time.monotonic(), 0
        return self.rate
