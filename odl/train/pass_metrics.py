"""Per-pass progressive metrics of a file stream (``file_stream_input``, PaddleRec's passes).

A pass is ``split_per_pass`` consecutive splits of one day; pass ids count from 1 at 0000
(PaddleRec's numbering): ``pass = minute_of_day // (split_interval * split_per_pass) + 1``.
Each trained batch counts in the pass of the split its last record came from (the input's
position after the batch), so a batch that straddles two passes counts in the later one.

For the pass in progress the tracker keeps the predictions made before each step's update
(predict-then-train, as the windowed progressive metrics) and the labels; when the first
batch of the next pass arrives, before it is trained, the pass is closed (and the trainer
checkpoints every ``checkpoint_per_pass`` passes): its AUC, logloss, samples and positive
rate go to the log, to ``/status`` (``"passes"``, the last ``keep`` of them, and
``"current_pass"``) and to ``/metrics`` (``odl_pass_auc``, ``odl_pass_logloss``,
``odl_pass_samples`` of the last closed pass). The AUC of a pass after training on it
(PaddleRec's train AUC) is not computed.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections import deque
from typing import Any, Optional

import numpy as np

from odl.auc import roc_auc

logger = logging.getLogger(__name__)

_EPS = 1e-7


def pass_of(split_minute: int, split_interval: int, split_per_pass: int) -> tuple[str, int]:
    """``(YYYYMMDD, pass id)`` of the split starting at ``split_minute`` (unix minutes, UTC)."""
    t = dt.datetime.fromtimestamp(split_minute * 60, tz=dt.timezone.utc)
    minute_of_day = t.hour * 60 + t.minute
    return t.strftime("%Y%m%d"), minute_of_day // (split_interval * split_per_pass) + 1


class PassMetrics:
    """Progressive metrics per pass (module docstring).

    Args:
        split_interval: minutes between splits.
        split_per_pass: splits per pass.
        keep: closed passes kept for ``/status``.
    """

    def __init__(self, split_interval: int, split_per_pass: int, keep: int = 48) -> None:
        self.interval = max(1, int(split_interval))
        self.per_pass = max(1, int(split_per_pass))
        self.closed: deque[dict[str, Any]] = deque(maxlen=keep)
        self.passes_closed = 0  # passes closed by this process
        self._current: Optional[tuple[str, int]] = None
        self._probs: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._lock = threading.Lock()

    def begin(self, split_minute: int) -> bool:
        """Closes the pass in progress when the next batch belongs to another one.

        Called before the batch is trained; returns whether a pass was closed.
        """
        key = pass_of(split_minute, self.interval, self.per_pass)
        with self._lock:
            closed = self._current is not None and key != self._current and bool(self._probs)
            if closed:
                self._close()
            self._current = key
            return closed

    def update(self, split_minute: int, probs: np.ndarray, labels: np.ndarray) -> None:
        """Adds a trained batch's predictions (to the pass ``begin`` opened)."""
        if self._current is None:
            self.begin(split_minute)
        with self._lock:
            self._probs.append(np.asarray(probs, dtype=np.float64))
            self._labels.append(np.asarray(labels, dtype=np.float64))

    def _close(self) -> None:
        assert self._current is not None
        p = np.concatenate(self._probs) if self._probs else np.zeros(0)
        y = np.concatenate(self._labels) if self._labels else np.zeros(0)
        summary = _summary(self._current, p, y)
        self.closed.append(summary)
        self.passes_closed += 1
        self._probs, self._labels = [], []
        logger.info("pass %s/%d: %d samples, progressive auc %s logloss %s, positive rate %s",
                    summary["day"], summary["pass"], summary["samples"], summary["auc"],
                    summary["logloss"], summary["positive_rate"])

    def close_current(self) -> bool:
        """Closes the pass in progress (the stream ended with it); returns whether one was."""
        with self._lock:
            closed = self._current is not None and bool(self._probs)
            if closed:
                self._close()
            self._current = None
            return closed

    def status(self) -> dict[str, Any]:
        """``{"current_pass": {...} or None, "passes": [closed passes, oldest first]}``."""
        with self._lock:
            current = None
            if self._current is not None:
                n = sum(len(a) for a in self._probs)
                current = {"day": self._current[0], "pass": self._current[1], "samples": n}
            return {"current_pass": current, "passes": list(self.closed)}

    def last_closed(self) -> Optional[dict[str, Any]]:
        """The most recently closed pass, or None."""
        with self._lock:
            return self.closed[-1] if self.closed else None


def _summary(key: tuple[str, int], p: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    n = int(p.shape[0])
    auc = None
    if n and 0 < y.sum() < n:
        auc = round(float(roc_auc(y, p)), 6)
    logloss = None
    if n:
        q = np.clip(p, _EPS, 1 - _EPS)
        logloss = round(float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))), 6)
    return {"day": key[0], "pass": key[1], "samples": n, "auc": auc, "logloss": logloss,
            "positive_rate": round(float(y.mean()), 6) if n else None}
