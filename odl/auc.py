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


def grouped_auc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray,
                reduction: str = "mean") -> float:
    """GAUC: the AUC within each group (e.g. each user), averaged over the groups.

    Groups with only one class are left out (as EasyRec's ``gauc`` and TorchEasyRec's
    ``grouped_auc`` do); ties within a group count one half.

    Args:
        labels: 0/1 (or bool) array, shape ``(n,)``.
        scores: real-valued scores, shape ``(n,)``.
        groups: integer group keys, shape ``(n,)``.
        reduction: ``"mean"`` (every group alike, TorchEasyRec's and EasyRec's default),
            ``"mean_by_sample_num"`` (weighted by group size) or ``"mean_by_positive_num"``
            (weighted by positives).

    Returns:
        The GAUC in ``[0, 1]``, or ``nan`` when no group has both classes.
    """
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    g = np.asarray(groups).astype(np.int64).ravel()
    n = y.shape[0]
    if n == 0:
        return float("nan")
    order = np.lexsort((s, g))  # by group, then score
    y, s, g = y[order], s[order], g[order]
    new_group = np.r_[True, g[1:] != g[:-1]]
    group_id = np.cumsum(new_group) - 1
    group_start = np.flatnonzero(new_group)
    rank = np.arange(n) - group_start[group_id] + 1.0  # 1-based rank within the group
    new_run = new_group | np.r_[True, s[1:] != s[:-1]]  # runs of tied scores in a group
    run_id = np.cumsum(new_run) - 1
    rank = (np.bincount(run_id, weights=rank) / np.bincount(run_id))[run_id]
    size = np.bincount(group_id).astype(np.float64)
    pos = np.bincount(group_id, weights=y.astype(np.float64))
    neg = size - pos
    both = (pos > 0) & (neg > 0)
    if not both.any():
        return float("nan")
    pos_ranks = np.bincount(group_id, weights=rank * y)
    auc = (pos_ranks[both] - pos[both] * (pos[both] + 1) / 2) / (pos[both] * neg[both])
    if reduction == "mean":
        return float(auc.mean())
    weight = {"mean_by_sample_num": size, "mean_by_positive_num": pos}.get(reduction)
    if weight is None:
        raise ValueError(f"unknown GAUC reduction {reduction!r}")
    return float((auc * weight[both]).sum() / weight[both].sum())


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
