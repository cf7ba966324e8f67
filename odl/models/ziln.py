"""The zero-inflated lognormal (``ZILN_LOSS``): a value that is often 0 and heavy-tailed when not.

EasyRec's loss for lifetime-value prediction (Wang, Liu, Miao 2019, "A Deep Probabilistic
Model for Customer Lifetime Value Prediction"; ``easy_rec/python/loss/zero_inflated_lognormal.py``).
A single-task model of ``num_class: 3`` has logits ``(p, mu, s)`` per record and a label
``y`` (any number; ``y > 0`` is a positive value):

* ``sigma = clip(softplus(s), sqrt(1e-7), max_sigma)``;
* loss ``= classification_weight * mean(bce(p, y > 0))
  + regression_weight * -(sum over y > 0 of log LogNormal(y; mu, sigma)) / (n_pos + 1e-8)
  + mu_regularization * mean(mu**2) + sigma_regularization * mean(s**2)``, with
  ``log LogNormal(y; mu, sigma) = -log y - log sigma - log(2 pi) / 2
  - (log y - mu)**2 / (2 sigma**2)``;
* outputs: ``sigmoid(p)``, the probability of a positive value (scored by AUC against
  ``y > 0``), and the expected value ``exp(clip(log sigmoid(p) + mu + sigma**2 / 2, -100,
  max_log_clip_value))`` (with ``return_log_pred_value`` its log, unclipped), scored as a
  regression against ``y``.

The model's outputs are named ``<label>`` (the probability) and ``<label>_value``
(``odl.models.ctr_model.CtrModel.set_configured_loss``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from odl.protos import pipeline_pb2

__all__ = ["VALUE_SUFFIX", "ziln_loss", "ziln_predictions"]

# the value output's name is the label's with this suffix
VALUE_SUFFIX = "_value"
# Keras' epsilon: sigma's lower bound is its square root
_KERAS_EPSILON = 1e-7
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _sigma(scale_logit: torch.Tensor, max_sigma: float) -> torch.Tensor:
    return nn.functional.softplus(scale_logit).clamp(math.sqrt(_KERAS_EPSILON), max_sigma)


def ziln_loss(logits: torch.Tensor, labels: torch.Tensor,
              settings: pipeline_pb2.ZILNLoss) -> torch.Tensor:
    """The zero-inflated lognormal loss of ``[B, 3]`` logits (module docstring).

    Args:
        logits: ``[B, 3]``: the positive logit, the log's mean, the log's scale logit.
        labels: ``[B]`` values.
        settings: ``Loss.ziln_loss``.

    Returns:
        Scalar loss.
    """
    y = labels.reshape(-1).to(logits.dtype)
    positive = (y > 0).to(logits.dtype)
    p, mu, s = logits[:, 0], logits[:, 1], logits[:, 2]
    classification = nn.functional.binary_cross_entropy_with_logits(p, positive)
    sigma = _sigma(s, float(settings.max_sigma))
    safe = torch.where(y > 0, y, torch.ones_like(y))
    log_y = safe.log()
    log_prob = -log_y - sigma.log() - _HALF_LOG_2PI - (log_y - mu).square() / (2 * sigma.square())
    regression = -(positive * log_prob).sum() / (positive.sum() + 1e-8)
    penalty = (float(settings.mu_regularization) * mu.square().mean()
               + float(settings.sigma_regularization) * s.square().mean())
    return (float(settings.classification_weight) * classification
            + float(settings.regression_weight) * regression + penalty)


def ziln_predictions(logits: torch.Tensor, settings: pipeline_pb2.ZILNLoss) -> torch.Tensor:
    """``[B, 2]``: the probability of a positive value and the expected value (or its log).

    Args:
        logits: ``[B, 3]`` logits.
        settings: ``Loss.ziln_loss``.

    Returns:
        ``[B, 2]`` in the logits' dtype.
    """
    p, mu, s = logits[:, 0], logits[:, 1], logits[:, 2]
    sigma = _sigma(s, float(settings.max_sigma))
    log_value = nn.functional.logsigmoid(p) + mu + 0.5 * sigma.square()
    if not settings.return_log_pred_value:
        log_value = log_value.clamp(-100.0, float(settings.max_log_clip_value)).exp()
    return torch.stack([torch.sigmoid(p), log_value], dim=1)
