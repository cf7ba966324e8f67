"""ROC AUC in plain numpy: exact (rank based, tie aware) and streaming (histogram).

``roc_auc`` is the exact Mann-Whitney statistic: tied scores share their average rank,
so a tie between a positive and a negative counts one half. ``HistogramAuc`` accumulates
positives and negatives in fixed score bins over ``[0, 1]``; its AUC is the exact tie-aware
AUC of the scores quantised to the bin width (1e-6 by default), in constant memory, for
streams too long to keep every score.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC of ``scores`` against binary ``labels``.

    Args:
        labels: 0/1 (or bool) array, shape ``(n,)``.
        scores: real-valued scores, shape ``(n,)``; higher means more likely positive.

    Returns:
        The AUC in ``[0, 1]``, or ``nan`` if only one class is present.
    """
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.shape[0]} vs {s.shape[0]}")
    pos = np.sort(s[y])
    neg = np.sort(s[~y])
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    # Mann-Whitney by counting: for each positive, the negatives scored below it, plus half
    # of those tied with it: two sorts and two binary searches, no ranking of all scores.
    below = np.searchsorted(neg, pos, side="left")
    tied = np.searchsorted(neg, pos, side="right") - below
    wins = float(below.sum(dtype=np.int64)) + 0.5 * float(tied.sum(dtype=np.int64))
    return wins / (float(pos.size) * float(neg.size))


class HistogramAuc:
    """Streaming AUC of probabilities in ``[0, 1]`` with constant memory.

    Args:
        bins: number of equal-width score bins; scores in one bin count as ties.
    """

    def __init__(self, bins: int = 1_000_000) -> None:
        self.bins = int(bins)
        self._pos = np.zeros(self.bins, dtype=np.int64)
        self._neg = np.zeros(self.bins, dtype=np.int64)

    @property
    def count(self) -> int:
        """Number of samples added so far."""
        return int(self._pos.sum() + self._neg.sum())

    def add(self, labels: np.ndarray, scores: np.ndarray) -> None:
        """Adds a batch of samples.

        Args:
            labels: 0/1 array, shape ``(n,)``.
            scores: probabilities, shape ``(n,)``; clipped to ``[0, 1]``.
        """
        y = np.asarray(labels).astype(bool).ravel()
        s = np.clip(np.asarray(scores, dtype=np.float64).ravel(), 0.0, 1.0)
        idx = np.minimum((s * self.bins).astype(np.int64), self.bins - 1)
        np.add.at(self._pos, idx[y], 1)
        np.add.at(self._neg, idx[~y], 1)

    def auc(self) -> float:
        """Returns the AUC of everything added, or ``nan`` with a single class."""
        n_pos = int(self._pos.sum())
        n_neg = int(self._neg.sum())
        if n_pos == 0 or n_neg == 0:
            return float("nan")
        neg_below = np.cumsum(self._neg) - self._neg
        wins = (self._pos * neg_below).sum(dtype=np.float64)
        ties = (self._pos * self._neg).sum(dtype=np.float64)
        return float((wins + 0.5 * ties) / (n_pos * n_neg))
