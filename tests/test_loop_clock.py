"""The training rate ``/status`` and the progress line show (``odl.train.loop_clock``)."""

from __future__ import annotations

from odl.train.loop_clock import LoopClock


def test_the_rate_is_the_rate_so_far_until_the_first_window_closes() -> None:
    """A run shorter than the window (or the line just after a restart) shows the samples/s
    it has had, not 0; after the first window the rate is each full window's."""
    now = [100.0]
    clock = LoopClock(step=0, now=lambda: now[0])
    now[0] += 0.5
    assert clock.count(1000) == clock.rate == 2000.0  # 1,000 samples in 0.5 s
    now[0] += 0.5
    assert clock.count(1000) == 2000.0
    now[0] += 4.0  # the first window (5 s) closes: 6,000 samples in 5 s
    assert clock.count(4000) == clock.rate == 1200.0
    now[0] += 1.0  # inside the next window: the last full window's rate stands
    assert clock.count(500) is None and clock.rate == 1200.0
    now[0] += 4.0
    assert clock.count(500) == 200.0  # 1,000 samples in the 5 s window
