"""A bounded in-memory history of a daemon's figures, for its dashboard page (``GET /``).

A :class:`HistorySampler` thread calls a function every ``interval_s`` seconds that returns a
flat ``{name: number}`` of the daemon's current figures (``auc``, ``samples_per_sec``,
``lag.3``, ``rejects.bad_label`` ...) and adds it to a :class:`MetricHistory`:

* the last ``fine_span_s`` seconds (1 h by default) are kept point by point;
* older points are folded into ``coarse_step_s`` buckets (60 s), each the mean of its points
  per figure, kept for ``coarse_span_s`` (24 h); older buckets are dropped.

Memory is therefore bounded by ``fine_span_s / interval_s + coarse_span_s / coarse_step_s``
points (1,800 + 1,440 with the defaults), whatever the uptime. A figure missing from a point
(a partition not assigned yet, a metric without samples) is ``None`` there.

``to_json(since)`` is what the ``/history`` endpoint returns::

    {"interval_s": 2.0, "now": <unix s>,
     "t": [<unix s>, ...],                       ascending, coarse buckets first
     "series": {"<name>": [<number or null>, ...], ...}}    one value per ``t``

With ``since`` only the points after that time are returned (the page asks for what is new).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Optional

logger = logging.getLogger(__name__)

Point = dict[str, float]


class MetricHistory:
    """Recent figures point by point, older ones as per-minute means (module docstring).

    Args:
        interval_s: the sampling interval (reported to the page).
        fine_span_s: seconds kept point by point.
        coarse_step_s: bucket width of older points.
        coarse_span_s: seconds of buckets kept.
    """

    def __init__(self, interval_s: float = 2.0, fine_span_s: float = 3600.0,
                 coarse_step_s: float = 60.0, coarse_span_s: float = 86400.0) -> None:
        self.interval_s = float(interval_s)
        self.fine_span_s = float(fine_span_s)
        self.coarse_step_s = float(coarse_step_s)
        self.coarse_span_s = float(coarse_span_s)
        self._fine: deque[tuple[float, Point]] = deque()
        self._coarse: deque[tuple[float, Point]] = deque()
        # the bucket being filled: (start, sums, counts)
        self._bucket: Optional[tuple[float, dict[str, float], dict[str, int]]] = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._fine) + len(self._coarse) + (self._bucket is not None)

    def record(self, values: Mapping[str, Optional[float]], t: Optional[float] = None) -> None:
        """Adds one point.

        Args:
            values: figure name -> number (None and non-finite numbers are left out).
            t: its unix time (default: now); points must come in time order.
        """
        t = time.time() if t is None else float(t)
        point = {k: float(v) for k, v in values.items()
                 if v is not None and math.isfinite(float(v))}
        with self._lock:
            self._fine.append((t, point))
            while self._fine and self._fine[0][0] < t - self.fine_span_s:
                self._fold(*self._fine.popleft())
            while self._coarse and self._coarse[0][0] < t - self.coarse_span_s:
                self._coarse.popleft()

    def _fold(self, t: float, point: Point) -> None:
        """Adds an aged point to its coarse bucket (closing the previous one)."""
        start = t - t % self.coarse_step_s
        if self._bucket is not None and self._bucket[0] != start:
            self._close_bucket()
        if self._bucket is None:
            self._bucket = (start, {}, {})
        _, sums, counts = self._bucket
        for k, v in point.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1

    def _close_bucket(self) -> None:
        assert self._bucket is not None
        start, sums, counts = self._bucket
        self._coarse.append((start + self.coarse_step_s / 2,
                             {k: sums[k] / counts[k] for k in sums}))
        self._bucket = None

    def points(self, since: Optional[float] = None) -> list[tuple[float, Point]]:
        """``(unix time, figures)`` in time order, those after ``since`` only when given."""
        with self._lock:
            out = list(self._coarse)
            if self._bucket is not None:
                start, sums, counts = self._bucket
                out.append((start + self.coarse_step_s / 2,
                            {k: sums[k] / counts[k] for k in sums}))
            out += list(self._fine)
        if since is not None:
            out = [(t, p) for t, p in out if t > since]
        return out

    def to_json(self, since: Optional[float] = None) -> dict:
        """The ``/history`` document (module docstring)."""
        pts = self.points(since)
        names = sorted({k for _, p in pts for k in p})
        return {
            "interval_s": self.interval_s,
            "now": time.time(),
            "t": [round(t, 3) for t, _ in pts],
            "series": {k: [p.get(k) for _, p in pts] for k in names},
        }


class HistorySampler:
    """Adds ``sample()`` to a history every ``history.interval_s`` seconds, in a daemon thread.

    A failing ``sample`` is logged once per distinct error and skipped; the thread goes on.

    Args:
        history: where the points go.
        sample: returns the current figures.
        name: the thread's name.
    """

    def __init__(self, history: MetricHistory, sample: Callable[[], Mapping[str, Optional[float]]],
                 name: str = "history-sampler") -> None:
        self.history = history
        self._sample = sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._last_error: Optional[str] = None

    def start(self) -> HistorySampler:
        """Starts sampling (the first point at once); returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops sampling and joins the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def sample_now(self) -> None:
        """Takes one point now (the thread does this every interval)."""
        try:
            values = self._sample()
        except Exception as exc:  # noqa: BLE001 - a dashboard must not take the daemon down
            text = f"{type(exc).__name__}: {exc}"
            if text != self._last_error:
                logger.warning("dashboard history: sampling failed: %s", text)
                self._last_error = text
            return
        self.history.record(values)

    def _run(self) -> None:
        while True:
            self.sample_now()
            if self._stop.wait(self.history.interval_s):
                return
