"""A step's log loss in closed form: each record's slope and curvature without autograd.

In-batch learning reads, at every step, each record's loss slope and its derivative in the
record's own logit (``odl.train.in_batch.in_batch_scan.loss_and_slopes``: a gradient and a
gradient of it through the model's loss). Where the model's loss depends on the logits only
through cross entropy, ``sum_i c_i * bce(l_i, y_i)`` plus terms that do not depend on them
(regularization; the model says so, ``CtrModel.log_loss_weights``), both have a closed form:

* slope ``c_i * (sigmoid(l_i) - y_i)``;
* curvature ``c_i * sigmoid(l_i) * (1 - sigmoid(l_i))``.

``LogLoss.value`` is the cross-entropy part only: what in-batch learning compares between
logits (the wide rate's probes, the shift's loss gain) differs by the same constant terms on
both sides. ``log_loss_matches`` checks the form against autograd once per run, so a model
whose loss does not have it falls back to autograd rather than learning from wrong slopes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

# The largest difference from autograd's slopes and curvatures, relative to the largest of
# them, at which the closed form is taken (float32 rounding stays far below it).
MATCH_TOLERANCE = 1e-4


@dataclass(frozen=True)
class LogLoss:
    """``sum_i weight_i * bce(l_i, label_i)`` over one rank's ``n`` records.

    Attributes:
        labels: ``[n]`` float64, each record's label (0/1, or a soft label in [0, 1]).
        weights: ``[n]`` float64, each record's weight ``c_i`` in the step's loss.
    """

    labels: np.ndarray
    weights: np.ndarray

    def value(self, at: np.ndarray) -> float:
        """The cross-entropy part of the loss at ``[n]`` logits ``at``."""
        z = np.asarray(at, dtype=np.float64)
        per_record = np.maximum(z, 0.0) - z * self.labels + np.log1p(np.exp(-np.abs(z)))
        return float(np.dot(self.weights, per_record))

    def slopes(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each record's loss slope and its derivative in its own logit at ``at`` (float32)."""
        z = np.asarray(at, dtype=np.float64)
        p = 0.5 * (1.0 + np.tanh(0.5 * z))  # the sigmoid, without exp's overflow
        return ((self.weights * (p - self.labels)).astype(np.float32),
                (self.weights * p * (1.0 - p)).astype(np.float32))


def log_loss_matches(log_loss: LogLoss, slope: np.ndarray, curve: np.ndarray,
                     at: np.ndarray) -> bool:
    """Whether ``log_loss``'s slopes at ``at`` are autograd's ``slope`` and ``curve``.

    Logs a warning naming the largest difference where they are not.
    """
    mine_slope, mine_curve = log_loss.slopes(at)
    scale = max(float(np.abs(slope).max(initial=0.0)), float(np.abs(curve).max(initial=0.0)))
    miss = max(float(np.abs(mine_slope - slope).max(initial=0.0)),
               float(np.abs(mine_curve - curve).max(initial=0.0)))
    if miss <= MATCH_TOLERANCE * scale or (scale == 0.0 and miss == 0.0):
        return True
    logger.warning("in-batch learning: the model's loss is not the log loss it declares "
                   "(slopes differ by %.3g, largest %.3g); reading its slopes through "
                   "autograd", miss, scale)
    return False


def record_log_loss(weights: np.ndarray | None, labels: torch.Tensor,
                    share: float) -> LogLoss | None:
    """One rank's ``LogLoss`` of a step (None where ``weights`` is).

    Args:
        weights: ``[n]`` the model's ``log_loss_weights`` of the batch, or None (its loss
            has no such form).
        labels: ``[n]`` the records' labels.
        share: the rank's share of the step's records (1 with one rank).
    """
    if weights is None:
        return None
    return LogLoss(labels.detach().to("cpu", torch.float64).numpy().reshape(-1),
                   np.asarray(weights, dtype=np.float64) * share)
