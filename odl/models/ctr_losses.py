"""The prediction losses of a one-output CTR model (``model_config.losses`` / ``loss_type``).

``ctr_loss`` is the weighted sum of the configured terms (EasyRec's ``losses { loss_type
weight }``; with no ``losses``, the single ``loss_type``), each a mean over the batch, for
logits ``s`` and 0/1 labels ``y``:

* ``CLASSIFICATION``, ``CROSS_ENTROPY_LOSS``: binary cross entropy with logits;
* ``SIGMOID_L2_LOSS``: ``(sigmoid(s) - y)**2``;
* ``BINARY_FOCAL_LOSS``: ``-alpha_t * (1 - p_t)**gamma * log(p_t)`` with ``p_t`` the
  probability of the true class and ``alpha_t = alpha`` for positives, ``1 - alpha`` for
  negatives (no class weight without ``alpha``);
* ``PAIR_WISE_LOSS``: over every (positive, negative) pair of the batch,
  ``softplus(-(s_pos - s_neg - margin))``;
* ``PAIRWISE_LOGISTIC_LOSS``: over every (positive, negative) pair,
  ``softplus(-(s_pos - s_neg) / temperature)``.

A pairwise term of a batch without both classes is 0. The model's regularization terms are
added by the model (``odl.models.deepfm``, ``odl.models.tower_models``). The predictions
reported and served are ``sigmoid(s)`` for every loss.
"""

from __future__ import annotations

import torch
from torch import nn

from odl.protos import pipeline_pb2

_L = pipeline_pb2


def loss_terms(model_config: pipeline_pb2.EasyRecModel) -> list[pipeline_pb2.Loss]:
    """The configured terms: ``losses``, or one term of ``loss_type`` with weight 1."""
    if model_config.losses:
        return list(model_config.losses)
    term = pipeline_pb2.Loss()
    term.loss_type = model_config.loss_type
    return [term]


def ctr_loss(logits: torch.Tensor, labels: torch.Tensor,
             terms: list[pipeline_pb2.Loss]) -> torch.Tensor:
    """The weighted sum of the loss terms (module docstring).

    Args:
        logits: ``[B]`` logits.
        labels: ``[B]`` float 0/1 labels.
        terms: from :func:`loss_terms`.

    Returns:
        Scalar loss.
    """
    total = logits.new_zeros(())
    for term in terms:
        total = total + float(term.weight) * _term(logits, labels, term)
    return total


def _term(s: torch.Tensor, y: torch.Tensor, term: pipeline_pb2.Loss) -> torch.Tensor:
    kind = term.loss_type
    if kind in (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS):
        return nn.functional.binary_cross_entropy_with_logits(s, y)
    if kind == _L.SIGMOID_L2_LOSS:
        return (torch.sigmoid(s) - y).square().mean()
    if kind == _L.BINARY_FOCAL_LOSS:
        cfg = term.binary_focal_loss
        ce = nn.functional.binary_cross_entropy_with_logits(s, y, reduction="none")
        p = torch.sigmoid(s)
        p_t = p * y + (1 - p) * (1 - y)
        loss = (1 - p_t).pow(float(cfg.gamma)) * ce
        if cfg.HasField("alpha"):
            a = float(cfg.alpha)
            loss = (a * y + (1 - a) * (1 - y)) * loss
        return loss.mean()
    if kind in (_L.PAIR_WISE_LOSS, _L.PAIRWISE_LOGISTIC_LOSS):
        pos, neg = s[y > 0.5], s[y <= 0.5]
        if pos.numel() == 0 or neg.numel() == 0:
            return s.sum() * 0.0
        diff = pos.unsqueeze(1) - neg.unsqueeze(0)
        if kind == _L.PAIR_WISE_LOSS:
            diff = diff - float(term.pairwise_loss.margin)
        else:
            diff = diff / float(term.pairwise_logistic_loss.temperature)
        return nn.functional.softplus(-diff).mean()
    raise ValueError(f"loss type {pipeline_pb2.LossType.Name(kind)} is not implemented")


def linear_kernel_l2(module: nn.Module) -> torch.Tensor:
    """Sum of the squared weights of every ``nn.Linear`` in ``module`` (biases left out)."""
    return sum(m.weight.square().sum() for m in module.modules() if isinstance(m, nn.Linear))

