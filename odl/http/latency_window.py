"""Request rate and latency percentiles between two looks (serving's dashboard figures).

``add(seconds)`` is called once per answered request (any thread); ``take()`` returns the
number of requests since the previous ``take`` and the 50th / 99th percentile of their
times, then starts a new window. At most ``max_samples`` times are kept per window (the
newest); the count stays exact beyond that.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

import numpy as np


class LatencyWindow:
    """Request times since the last ``take`` (module docstring).

    Args:
        max_samples: times kept per window.
    """

    def __init__(self, max_samples: int = 65536) -> None:
        self._times: deque[float] = deque(maxlen=int(max_samples))
        self._count = 0
        self._since = time.monotonic()
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        """Records one request's time."""
        with self._lock:
            self._times.append(float(seconds))
            self._count += 1

    def take(self) -> dict[str, Optional[float]]:
        """The window's figures; a new window starts.

        Returns:
            ``{"rate": requests/s, "p50_ms", "p99_ms"}`` (percentiles None without requests).
        """
        now = time.monotonic()
        with self._lock:
            times, count, since = list(self._times), self._count, self._since
            self._times.clear()
            self._count, self._since = 0, now
        out: dict[str, Optional[float]] = {"rate": count / max(now - since, 1e-9),
                                           "p50_ms": None, "p99_ms": None}
        if times:
            p50, p99 = np.percentile(np.asarray(times), [50, 99])
            out["p50_ms"], out["p99_ms"] = float(p50) * 1000, float(p99) * 1000
        return out
