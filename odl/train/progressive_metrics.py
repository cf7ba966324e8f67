"""Progressive validation metrics: every batch is scored before the model trains on it.

Two views are kept:

* a sliding window of the last ``window`` (prediction, label) pairs, for AUC and logloss of the
  model as it is now (exact, rank-based AUC with ties averaged), and, when a grouping column
  is configured (``grouped_auc``), GAUC over the window (``odl.auc.grouped_auc``);
* running totals over everything seen since start (AUC from a 10,000-bin histogram of the
  predicted probability per label, accurate to about 1e-4, plus exact mean logloss).

A regression output (``odl.config.loss_settings.regression_outputs``) is scored by the mean
squared error of its predicted values instead (``mse``: the window's, ``mse_total``: since
start); its AUC and logloss are not defined (``None``), and ``positive_rate`` is the window's
mean label. A probability output is scored against ``label > 0`` (0/1 labels as they are; a
``ZILN_LOSS`` model's values as positive or not).
"""

from __future__ import annotations

import numpy as np

from odl.auc import HistogramAuc, grouped_auc, roc_auc

_EPS = 1e-7
_HISTOGRAM_BINS = 10000


def log_loss(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross entropy of probabilities.

    Args:
        probs: predicted probabilities.
        labels: 0/1 labels.

    Returns:
        The mean logloss (NaN for no samples).
    """
    if len(probs) == 0:
        return float("nan")
    p = np.clip(np.asarray(probs, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


class ProgressiveMetrics:
    """Windowed and cumulative AUC / logloss of predictions made before training.

    Args:
        window: number of most recent samples in the window.
        grouped: keep the samples' group keys for GAUC.
        gauc_reduction: how GAUC averages the groups (``odl.auc.grouped_auc``).
        regression: score predicted values by squared error (module docstring).
    """

    def __init__(self, window: int = 100000, grouped: bool = False,
                 gauc_reduction: str = "mean", regression: bool = False) -> None:
        self.window = max(1, int(window))
        self.regression = bool(regression)
        self.grouping = bool(grouped)  # asked for; a regression has no GAUC
        self.grouped = self.grouping and not self.regression
        self.gauc_reduction = gauc_reduction
        # the window's group keys (GAUC), when a grouping column is configured
        self._groups = np.zeros(self.window if grouped else 0, dtype=np.int64)
        self._probs = np.zeros(self.window, dtype=np.float64)
        self._labels = np.zeros(self.window, dtype=np.float64)
        # per-sample logloss (squared error for a regression)
        self._losses = np.zeros(self.window, dtype=np.float64)
        self._filled = 0
        self._cursor = 0
        self._total_auc = HistogramAuc(_HISTOGRAM_BINS)
        self._total_logloss = 0.0
        self.samples = 0

    def update(self, probs: np.ndarray, labels: np.ndarray,
               groups: np.ndarray | None = None) -> None:
        """Adds a scored batch.

        Args:
            probs: probabilities predicted before the update.
            labels: the batch's labels.
            groups: the samples' group keys (with ``grouped``).
        """
        probs = np.asarray(probs, dtype=np.float64)
        labels = np.asarray(labels, dtype=np.float64)
        n = probs.size
        if n == 0:
            return
        self.samples += n
        if self.regression:
            losses = np.square(probs - labels)
        else:  # scored against label > 0: a ZILN model's values as positive or not
            labels = (labels > 0).astype(np.float64)
            p = np.clip(probs, _EPS, 1 - _EPS)
            losses = -(labels * np.log(p) + (1 - labels) * np.log(1 - p))
            self._total_auc.add(labels > 0.5, probs)
        self._total_logloss += float(losses.sum())
        self._ring(self._probs, probs)
        self._ring(self._labels, labels)
        self._ring(self._losses, losses)
        if self.grouped:
            self._ring(self._groups, np.asarray(groups, dtype=np.int64))
        self._cursor = (self._cursor + n) % self.window if n < self.window else 0
        self._filled = min(self.window, self._filled + n)

    def _ring(self, buf: np.ndarray, values: np.ndarray) -> None:
        """Writes ``values`` into ring buffer ``buf`` at the cursor (before it moves)."""
        n = values.size
        if n >= self.window:
            buf[:] = values[-self.window :]
            return
        end = self._cursor + n
        if end <= self.window:
            buf[self._cursor : end] = values
        else:
            first = self.window - self._cursor
            buf[self._cursor :] = values[:first]
            buf[: n - first] = values[first:]

    def window_gauc(self) -> float:
        """GAUC over the window (NaN without groups or a group with both classes)."""
        if not self.grouped:
            return float("nan")
        f = self._filled
        return grouped_auc(self._labels[:f], self._probs[:f], self._groups[:f],
                           self.gauc_reduction)

    def window_auc(self) -> float:
        """AUC over the window (NaN until both classes were seen, and for a regression)."""
        if self.regression:
            return float("nan")
        return roc_auc(self._labels[: self._filled], self._probs[: self._filled])

    def _window_loss(self) -> float:
        if self._filled == 0:
            return float("nan")
        return float(self._losses[: self._filled].mean())

    def window_logloss(self) -> float:
        """Logloss over the window (per-sample losses kept at update: no log() here)."""
        return float("nan") if self.regression else self._window_loss()

    def window_mse(self) -> float:
        """Mean squared error over the window (a regression; NaN otherwise)."""
        return self._window_loss() if self.regression else float("nan")

    def total_auc(self) -> float:
        """AUC over every sample since start, from the histogram."""
        return float("nan") if self.regression else self._total_auc.auc()

    def _total_loss(self) -> float:
        return self._total_logloss / self.samples if self.samples else float("nan")

    def total_logloss(self) -> float:
        """Mean logloss over every sample since start."""
        return float("nan") if self.regression else self._total_loss()

    def total_mse(self) -> float:
        """Mean squared error over every sample since start (a regression; else NaN)."""
        return self._total_loss() if self.regression else float("nan")

    def summary(self) -> dict:
        """The four figures and the window's positive-label rate (NaN replaced by None)."""

        def clean(v: float):
            return None if v != v else round(v, 6)

        return {
            "auc": clean(self.window_auc()),
            "logloss": clean(self.window_logloss()),
            "auc_total": clean(self.total_auc()),
            "logloss_total": clean(self.total_logloss()),
            **({"gauc": clean(self.window_gauc())} if self.grouped else {}),
            **({"mse": clean(self.window_mse()), "mse_total": clean(self.total_mse())}
               if self.regression else {}),
            "positive_rate": clean(float(self._labels[: self._filled].mean())
                                   if self._filled else float("nan")),
            "window_samples": int(self._filled),
            "samples": int(self.samples),
        }


def output_column(values: np.ndarray, column: int) -> np.ndarray:
    """Column ``column`` of ``[B, n]`` values; ``[B]`` values are their own only column."""
    return values if values.ndim == 1 else values[:, column]


class TaskMetrics:
    """Progressive metrics per output of a model with several (a multi-task model).

    The first output's metrics are the trainer's main ``ProgressiveMetrics`` (passed in, so
    they are kept once); the others get their own.

    Args:
        outputs: ``(output name, label column)`` per output, in output order.
        first: the main metrics (the first output's).
        window: window of the other outputs' metrics.
        regression: per output, whether it is a regression (default: none is).
    """

    def __init__(self, outputs: list[tuple[str, int]], first: ProgressiveMetrics,
                 window: int, regression: list[bool] | None = None) -> None:
        self.outputs = list(outputs)
        flags = list(regression or [False] * len(self.outputs))
        self.metrics = {name: first if i == 0 else ProgressiveMetrics(
                            window, first.grouping, first.gauc_reduction, regression=flags[i])
                        for i, (name, _col) in enumerate(self.outputs)}

    def update(self, probs: np.ndarray, labels: np.ndarray,
               groups: np.ndarray | None = None) -> None:
        """Adds a scored batch to every output but the first (the caller updates that one).

        Args:
            probs: ``[B, outputs]`` probabilities predicted before the update.
            labels: ``[B]`` or ``[B, label columns]`` labels.
            groups: the samples' group keys (GAUC), or None.
        """
        for i, (name, col) in enumerate(self.outputs[1:], start=1):
            self.metrics[name].update(probs[:, i], output_column(labels, col), groups)

    def summary(self) -> dict[str, dict]:
        """Output name -> ``ProgressiveMetrics.summary()``."""
        return {name: m.summary() for name, m in self.metrics.items()}
