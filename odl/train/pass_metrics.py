"""Per-pass progressive metrics of a file stream (``file_stream_input``, PaddleRec's passes).

A pass is ``split_per_pass`` consecutive splits of one day; pass ids count from 1 at 0000
(PaddleRec's numbering): ``pass = minute_of_day // (split_interval * split_per_pass) + 1``.
Each trained batch counts in the pass of its split (the input's position after the batch; the
file stream never puts two splits in one batch).

For the pass in progress the tracker keeps the predictions made before each step's update
(predict-then-train, as the windowed progressive metrics) and the labels; when the first
batch of the next pass arrives, before it is trained, the pass is closed (and the trainer
checkpoints every ``checkpoint_per_pass`` passes): its AUC, logloss, samples and positive
rate go to the log, to ``/status`` (``"passes"``, the last ``keep`` of them, and
``"current_pass"``) and to ``/metrics`` (``odl_pass_auc``, ``odl_pass_logloss``,
``odl_pass_samples`` of the last closed pass).

Train AUC (PaddleRec's AUC of a pass after training on it): the tracker keeps a uniform
sample of the pass's batches (reservoir sampling over batches, seeded, about
``train_auc_samples`` records); when the pass closes, the trainer scores them again with the
model that trained on the whole pass (``TrainModule.predict``, no update) and hands the
predictions to ``set_train_auc``: ``"train_auc"`` / ``"train_logloss"`` in the pass's entry,
``odl_pass_train_auc`` in ``/metrics``. The gap between train and progressive AUC is how much
the model fits what it has seen beyond what it predicts.
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
        train_auc_samples: records of each pass kept to compute its train AUC (0: none).
    """

    def __init__(self, split_interval: int, split_per_pass: int, keep: int = 48,
                 train_auc_samples: int = 65536) -> None:
        self.interval = max(1, int(split_interval))
        self.per_pass = max(1, int(split_per_pass))
        self.closed: deque[dict[str, Any]] = deque(maxlen=keep)
        self.passes_closed = 0  # passes closed by this process
        self._current: Optional[tuple[str, int]] = None
        self._probs: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.train_auc_samples = int(train_auc_samples)
        self._kept: list[Any] = []  # sampled batches of the pass in progress
        self._seen_batches = 0
        self._rng = np.random.default_rng(0)
        self._to_rescore: list[Any] = []  # the closed pass's sample, until taken

    @property
    def current_day(self) -> Optional[str]:
        """``YYYYMMDD`` of the pass in progress, None before the first batch."""
        current = self._current
        return current[0] if current is not None else None

    @property
    def open_pass(self) -> Optional[tuple[str, int]]:
        """``(day, pass)`` of the pass in progress (a checkpoint keeps it), None before one."""
        return self._current

    def resume(self, day: str, pass_id: int) -> None:
        """Opens a restored checkpoint's pass in progress (no samples of it in this process).

        The next batch of another pass then closes it, so the pass still ends (its delta,
        checkpoint, the day's end) after a restart at its last record.
        """
        with self._lock:
            self._current = (str(day), int(pass_id))

    def begin(self, split_minute: int) -> bool:
        """Closes the pass in progress when the next batch belongs to another one.

        Called before the batch is trained (with several ranks, on every rank for every
        group, whatever its batch holds); returns whether a pass was closed. A pass closes
        even when this process trained none of its records (a resumed pass, a rank whose
        batches of the pass were empty).
        """
        key = pass_of(split_minute, self.interval, self.per_pass)
        with self._lock:
            closed = self._current is not None and key != self._current
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

    def keep_batch(self, batch: Any) -> None:
        """Offers a trained batch to the pass's train-AUC sample (reservoir over batches)."""
        if self.train_auc_samples <= 0 or batch is None or not batch.size:
            return
        slots = max(1, -(-self.train_auc_samples // int(batch.size)))
        with self._lock:
            self._seen_batches += 1
            if len(self._kept) < slots:
                self._kept.append(batch)
                return
            j = int(self._rng.integers(self._seen_batches))
            if j < slots:
                self._kept[j] = batch

    def take_rescore(self) -> list[Any]:
        """The sampled batches of the pass closed last, once: score them for ``set_train_auc``."""
        with self._lock:
            out, self._to_rescore = self._to_rescore, []
            return out

    def set_train_auc(self, probs: np.ndarray, labels: np.ndarray) -> Optional[float]:
        """Records the train AUC of the pass closed last from its rescored sample."""
        p = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.float64)
        summary = _summary(("", 0), p, y)
        with self._lock:
            if not self.closed:
                return None
            last = self.closed[-1]
            last["train_auc"] = summary["auc"]
            last["train_logloss"] = summary["logloss"]
            last["train_auc_samples"] = summary["samples"]
        logger.info("pass %s/%d: train auc %s logloss %s (%d samples rescored after the pass)",
                    last["day"], last["pass"], summary["auc"], summary["logloss"],
                    summary["samples"])
        return summary["auc"]

    def _close(self) -> None:
        assert self._current is not None
        p = np.concatenate(self._probs) if self._probs else np.zeros(0)
        y = np.concatenate(self._labels) if self._labels else np.zeros(0)
        summary = _summary(self._current, p, y)
        self.closed.append(summary)
        self.passes_closed += 1
        self._probs, self._labels = [], []
        self._to_rescore, self._kept, self._seen_batches = self._kept, [], 0
        logger.info("pass %s/%d: %d samples, progressive auc %s logloss %s, positive rate %s",
                    summary["day"], summary["pass"], summary["samples"], summary["auc"],
                    summary["logloss"], summary["positive_rate"])

    def close_current(self) -> bool:
        """Closes the pass in progress (the stream ended with it); returns whether one was."""
        with self._lock:
            closed = self._current is not None
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
    y = (y > 0).astype(np.float64)  # a ZILN model's values: positive or not
    auc = None
    if n and 0 < y.sum() < n:
        auc = round(float(roc_auc(y, p)), 6)
    logloss = None
    if n:
        q = np.clip(p, _EPS, 1 - _EPS)
        logloss = round(float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))), 6)
    return {"day": key[0], "pass": key[1], "samples": n, "auc": auc, "logloss": logloss,
            "positive_rate": round(float(y.mean()), 6) if n else None,
            "train_auc": None, "train_logloss": None, "train_auc_samples": 0}
