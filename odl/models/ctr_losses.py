"""The prediction losses of a one-output CTR model (``model_config.losses`` / ``loss_type``).

``ctr_loss`` is the weighted sum of the configured terms (EasyRec's ``losses { loss_type
weight }``; with no ``losses``, the single ``loss_type``), each a mean over the batch, for
logits ``s`` and 0/1 labels ``y``, as EasyRec computes them (``easy_rec/python/loss``):

* ``CLASSIFICATION``, ``CROSS_ENTROPY_LOSS``: binary cross entropy with logits;
* ``L2_LOSS``: ``(s - y)**2`` (EasyRec's regression loss, on the logit itself);
* ``SIGMOID_L2_LOSS``: ``(sigmoid(s) - y)**2``;
* ``BINARY_FOCAL_LOSS``: ``-alpha_t * (1 - p_t)**gamma * log(p_t)`` with ``p_t`` the
  probability of the true class and ``alpha_t = alpha`` for positives, ``1 - alpha`` for
  negatives (no class weight without ``alpha``);
* ``F1_REWEIGHTED_LOSS``: binary cross entropy (labels smoothed to ``y * (1 - ls) + ls / 2``
  with ``label_smoothing`` ls) where positives weigh 1 and negatives
  ``sum(p) / (f1_beta_square * n_pos + n_neg - (B - sum(p)) + 1e-8)`` with ``p = sigmoid(s)``
  over the batch of B samples (gradients flow through the weight, as in EasyRec); the mean
  over the samples of nonzero weight;
* ``PAIR_WISE_LOSS``: over every (positive, negative) pair of the batch,
  ``softplus(-(s_pos - s_neg - margin))``;
* ``PAIRWISE_LOGISTIC_LOSS``: over every (positive, negative) pair,
  ``softplus(-(s_pos - s_neg) / temperature)``;
* ``PAIRWISE_FOCAL_LOSS``: over every pair ``(i, j)`` with ``y_i > y_j`` (and, when
  ``hinge_margin`` is written, ``d < hinge_margin``), with ``d = (s_i - s_j) / temperature``
  and ``q = clip(sigmoid(d), 1e-7, 1 - 1e-7)``: ``w * softplus(-d)`` with
  ``w = (1 - q)**gamma`` (times ``alpha`` when set); the mean over the pairs of nonzero
  ``w``, or with ``ohem_ratio < 1`` the mean of the positive values among the largest
  ``round(ohem_ratio * pairs)``.

Term weights: each term's ``weight`` (times a multi-task tower's ``weight``), or with
``loss_weight_strategy: Uncertainty`` a learned weight for the ``learn_loss_weight`` terms,
or with ``Random`` (EasyRec's) a fresh draw at every step of ``softmax(N(0, 1))`` over the
model's terms (:func:`random_loss_weights`; one term alone weighs 1), replacing the configured
weights.

A ``num_class`` C model (C > 1; ``odl.config.loss_settings.num_classes``) has ``[B, C]``
logits and one-hot labels; its terms (CLASSIFICATION / CROSS_ENTROPY_LOSS) are the softmax
cross entropy ``-sum_k y_k log softmax(s)_k``, and its predictions the softmax. A two-class
model's ``JRC_LOSS`` term is :func:`jrc_loss` over the batch's sessions. A ``num_class: 3``
model's ``ZILN_LOSS`` term (its only one) is the zero-inflated lognormal loss of its three
logits and real-valued labels (``odl.models.ziln``).

A pairwise term of a batch without a pair is 0. The model's regularization terms are added
by the model (``odl.models.deepfm``, ``odl.models.tower_models``). The predictions reported
and served are ``sigmoid(s)``, except for an output whose every term is ``L2_LOSS`` (a
regression, ``odl.config.loss_settings.regression_outputs``), which predicts ``s`` itself
as EasyRec does, from real-valued labels.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from odl.features.batch import Batch
from odl.models.ziln import ziln_loss
from odl.protos import pipeline_pb2

_L = pipeline_pb2


def loss_terms(model_config: pipeline_pb2.EasyRecModel) -> list[pipeline_pb2.Loss]:
    """The configured terms: ``losses``, or one term of ``loss_type`` with weight 1.

    A task's ``ORDER_CALIBRATE_LOSS`` terms are left out: they compare tasks
    (``odl.models.task_losses``), they are not a loss of the task's own logit.
    """
    if model_config.losses:
        return [t for t in model_config.losses if t.loss_type != _L.ORDER_CALIBRATE_LOSS]
    term = pipeline_pb2.Loss()
    term.loss_type = model_config.loss_type
    return [term]


def learned_weight_terms(model_config: pipeline_pb2.EasyRecModel,
                         terms: list[pipeline_pb2.Loss]) -> list[bool]:
    """Per term, whether its weight is learned (Uncertainty strategy and learn_loss_weight)."""
    uncertainty = model_config.loss_weight_strategy == pipeline_pb2.EasyRecModel.Uncertainty
    return [uncertainty and bool(t.learn_loss_weight) for t in terms]


def random_loss_weights(model_config: pipeline_pb2.EasyRecModel, count: int,
                        like: torch.Tensor) -> torch.Tensor | None:
    """This step's term weights under EasyRec's ``Random`` strategy, else None.

    Args:
        model_config: the model config (its ``loss_weight_strategy``).
        count: the model's loss terms (every task's, for a multi-task model).
        like: a tensor of the device and dtype wanted.

    Returns:
        ``softmax`` of ``count`` standard normal draws (``[1.0]`` for one term), or None.
    """
    if model_config.loss_weight_strategy != pipeline_pb2.EasyRecModel.Random:
        return None
    if count <= 1:
        return like.new_ones(max(count, 1))
    return torch.softmax(torch.randn(count, device=like.device, dtype=like.dtype), dim=0)


def log_loss_weights(model_config: pipeline_pb2.EasyRecModel, terms: list[pipeline_pb2.Loss],
                     learned: list[bool], records: int,
                     data_weights: np.ndarray | None) -> np.ndarray | None:
    """Per record ``c_i`` with ``ctr_loss`` equal to ``sum_i c_i * bce(s_i, y_i)`` (one output).

    That form holds where every term is cross entropy on the logit (CLASSIFICATION,
    CROSS_ENTROPY_LOSS) with a weight that is not learned and not a ``Random`` draw among
    several terms: a term's mean puts ``weight / B`` on each record, or with
    ``data_config.sample_weight`` values ``w`` ``weight * w_i / count(w != 0)``.

    Args:
        model_config: the model config (its ``loss_weight_strategy``).
        terms: from :func:`loss_terms`.
        learned: from :func:`learned_weight_terms`.
        records: the batch's records ``B``.
        data_weights: ``[B]`` the batch's ``sample_weight`` values, or None.

    Returns:
        ``[B]`` float64, or None where the loss has another form.
    """
    logistic = (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS)
    if any(learned) or any(t.loss_type not in logistic for t in terms):
        return None
    if model_config.loss_weight_strategy == _L.EasyRecModel.Random:
        if len(terms) > 1:
            return None
        total = 1.0  # one term's draw is 1, in place of its weight
    else:
        total = sum(float(t.weight) for t in terms)
    if data_weights is None:
        return np.full(records, total / max(records, 1))
    w = np.asarray(data_weights, dtype=np.float64).reshape(-1)
    nonzero = int(np.count_nonzero(w))
    return total * w / nonzero if nonzero else np.zeros_like(w)


def sample_weight_tensor(batch: Batch) -> torch.Tensor | None:
    """The batch's ``data_config.sample_weight`` values as a tensor (None without one)."""
    w = batch.sample_weights
    return None if w is None else torch.from_numpy(np.asarray(w, dtype=np.float32))


def session_tensor(batch: Batch) -> torch.Tensor | None:
    """The batch's JRC session keys as a tensor (None without a session column)."""
    keys = batch.session_keys
    return None if keys is None else torch.from_numpy(np.asarray(keys, dtype=np.int64))


def add_loss_weights(dense: nn.Module, count: int) -> None:
    """Registers ``count`` learned loss weights as ``dense.loss_uncertainty`` (from 0).

    Registered after every other parameter of the dense part, so a model without them keeps
    its checkpoint layout; they are trained by the dense optimizer and published with the
    other dense variables (serving does not read them).
    """
    if count:
        dense.register_parameter("loss_uncertainty", nn.Parameter(torch.zeros(int(count))))


def ctr_loss(logits: torch.Tensor, labels: torch.Tensor, terms: list[pipeline_pb2.Loss],
             sample_weights: torch.Tensor | None = None, scale: float = 1.0,
             learned: list[bool] | None = None,
             uncertainty: torch.Tensor | None = None,
             term_weights: torch.Tensor | None = None,
             softmax: bool = False,
             sessions: torch.Tensor | None = None,
             data_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum of the loss terms (module docstring).

    Args:
        logits: ``[B]`` logits.
        labels: ``[B]`` float 0/1 labels.
        terms: from :func:`loss_terms`.
        sample_weights: ``[B]`` per-sample weights (a multi-task tower's task space), or
            None; each term is then ``sum(w * loss) / sum(w)`` (TorchEasyRec's weighting);
            only ``odl.config.loss_settings.POINTWISE_LOSS_TYPES`` take weights.
        scale: a factor on every term (a multi-task tower's ``weight``).
        learned: per term, whether its weight is learned (:func:`learned_weight_terms`).
        uncertainty: the learned terms' ``u``, one per learned term in order: the term
            becomes ``exp(-u) * v + u / 2`` (``0.5 * exp(-u) * v + u / 2`` for L2 losses).
        term_weights: per term, its weight in place of ``scale * weight`` (the ``Random``
            strategy's draw, :func:`random_loss_weights`), or None.
        softmax: a ``num_class`` C model: ``[B, C]`` logits and one-hot labels, each term
            (CLASSIFICATION / CROSS_ENTROPY_LOSS) the softmax cross entropy, a JRC_LOSS term
            :func:`jrc_loss`.
        sessions: ``[B]`` int64 session keys (``Batch.session_keys``) for JRC_LOSS.
        data_weights: ``[B]`` EasyRec's ``data_config.sample_weight`` values
            (:func:`sample_weight_tensor`), or None: each term is then ``sum(w * loss) /
            count(w != 0)`` (TF's ``SUM_BY_NONZERO_WEIGHTS``), or, with ``sample_weights``,
            weighted by both (``sum(w * s * loss) / sum(w * s)``). Pointwise terms and the
            softmax cross entropy only (validation refuses the others).

    Returns:
        Scalar loss.

    Raises:
        ValueError: weights for a loss that is not pointwise.
    """
    total = logits.new_zeros(())
    if data_weights is not None:
        data_weights = data_weights.to(device=logits.device, dtype=logits.dtype)
        if sample_weights is not None:
            sample_weights = sample_weights * data_weights
            data_weights = None
    k = 0
    for i, term in enumerate(terms):
        if term.loss_type == _L.ZILN_LOSS:  # [B, 3] logits, real labels
            value = ziln_loss(logits, labels, term.ziln_loss)
        elif softmax and term.loss_type == _L.JRC_LOSS:
            if sessions is None:
                raise ValueError("JRC_LOSS needs the batch's session keys")
            value = jrc_loss(logits, labels, sessions, term.jrc_loss)
        elif softmax:
            per_sample = -(labels * torch.log_softmax(logits, dim=1)).sum(dim=1)
            value = (per_sample.mean() if data_weights is None
                     else _mean_over_nonzero_weights(per_sample * data_weights, data_weights))
        elif data_weights is not None:
            value = _mean_over_nonzero_weights(
                _pointwise(logits, labels, term) * data_weights, data_weights)
        elif sample_weights is None:
            value = _term(logits, labels, term)
        else:
            value = (_pointwise(logits, labels, term) * sample_weights).sum() / (
                sample_weights.sum().clamp_min(1e-12))
        if term_weights is not None:
            value = term_weights[i] * value
        else:
            value = float(scale) * float(term.weight) * value
        if learned is not None and learned[i] and uncertainty is not None:
            u = uncertainty[k]
            k += 1
            half = 0.5 if term.loss_type in (_L.L2_LOSS, _L.SIGMOID_L2_LOSS) else 1.0
            value = half * torch.exp(-u) * value + 0.5 * u
        total = total + value
    return total


def jrc_loss(logits: torch.Tensor, labels: torch.Tensor, sessions: torch.Tensor,
             settings: pipeline_pb2.JRCLoss) -> torch.Tensor:
    """EasyRec's JRC loss of a two-class model (joint ranking and calibration).

    ``ce`` is the softmax cross entropy; the list-wise part ``ge``: for each sample j and
    class c, ``-sum_i y_ic log softmax_i(s_ic)`` over the samples i of j's session (with
    ``same_label_loss`` false, only i = j counts, against the other samples of the session
    of the other label), divided by the session's size and averaged over j. The loss is
    ``w * ce + (1 - w) * ge`` with ``w`` = ``alpha`` (``fixed``), a uniform draw
    (``random_uniform``), or the first of a softmax of two normal draws (``random_normal``,
    the second weighing ``ge``), or of two Bernoulli(0.5) draws that are used when exactly
    one is 1 (else 0.5 each, ``random_bernoulli``).

    Args:
        logits: ``[B, 2]``.
        labels: ``[B, 2]`` one-hot.
        sessions: ``[B]`` session keys.
        settings: the term's ``jrc_loss``.

    Returns:
        Scalar loss.
    """
    ce = -(labels * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()
    b = logits.shape[0]
    sessions = sessions.to(logits.device)
    mask = (sessions.unsqueeze(1) == sessions.unsqueeze(0)).to(logits.dtype)  # [i, j]
    y_neg = labels[:, 0:1] * mask  # [i, j]: sample i's label, where i is in j's session
    y_pos = labels[:, 1:2] * mask
    off = (1 - mask) * -1e9
    l_neg = logits[:, 0:1] + off  # [i, j]: sample i's logit of class 0 (masked)
    l_pos = logits[:, 1:2] + off
    if settings.same_label_loss:
        loss_pos = -(y_pos * torch.log_softmax(l_pos, dim=0)).sum(dim=0)
        loss_neg = -(y_neg * torch.log_softmax(l_neg, dim=0)).sum(dim=0)
        ge = ((loss_pos + loss_neg) / mask.sum(dim=0)).mean()
    else:
        diag = torch.eye(b, dtype=logits.dtype, device=logits.device)
        l_pos = l_pos + (1 - diag) * y_pos * -1e9
        l_neg = l_neg + (1 - diag) * y_neg * -1e9
        loss_pos = -torch.diagonal(y_pos * torch.log_softmax(l_pos, dim=0))
        loss_neg = -torch.diagonal(y_neg * torch.log_softmax(l_neg, dim=0))
        ge = (loss_pos + loss_neg).mean()
    strategy = settings.loss_weight_strategy
    if strategy == "random_uniform":
        w = torch.rand((), dtype=logits.dtype, device=logits.device)
        return w * ce + (1 - w) * ge
    if strategy == "random_normal":
        ws = torch.softmax(torch.randn(2, dtype=logits.dtype, device=logits.device), dim=0)
        return ws[0] * ce + ws[1] * ge
    if strategy == "random_bernoulli":
        ws = torch.bernoulli(torch.full((2,), 0.5, dtype=logits.dtype, device=logits.device))
        if float(ws.sum()) != 1.0:
            ws = torch.full((2,), 0.5, dtype=logits.dtype, device=logits.device)
        return ws[0] * ce + ws[1] * ge
    alpha = float(settings.alpha)
    return alpha * ce + (1 - alpha) * ge


def _pointwise(s: torch.Tensor, y: torch.Tensor, term: pipeline_pb2.Loss) -> torch.Tensor:
    """The per-sample loss ``[B]`` of a pointwise term."""
    kind = term.loss_type
    if kind in (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS):
        return nn.functional.binary_cross_entropy_with_logits(s, y, reduction="none")
    if kind == _L.L2_LOSS:
        return (s - y).square()
    if kind == _L.SIGMOID_L2_LOSS:
        return (torch.sigmoid(s) - y).square()
    if kind == _L.BINARY_FOCAL_LOSS:
        return _binary_focal(s, y, term.binary_focal_loss)
    raise ValueError(f"loss type {pipeline_pb2.LossType.Name(kind)} takes no sample weights")


def _term(s: torch.Tensor, y: torch.Tensor, term: pipeline_pb2.Loss) -> torch.Tensor:
    kind = term.loss_type
    if kind in (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS):
        return nn.functional.binary_cross_entropy_with_logits(s, y)
    if kind == _L.L2_LOSS:
        return l2_loss(s, y)
    if kind == _L.SIGMOID_L2_LOSS:
        return (torch.sigmoid(s) - y).square().mean()
    if kind == _L.BINARY_FOCAL_LOSS:
        return binary_focal_loss(s, y, term.binary_focal_loss)
    if kind == _L.F1_REWEIGHTED_LOSS:
        return f1_reweighted_loss(s, y, term.f1_reweighted_loss)
    if kind in (_L.PAIR_WISE_LOSS, _L.PAIRWISE_LOGISTIC_LOSS):
        return pairwise_loss(s, y, term)
    if kind == _L.PAIRWISE_FOCAL_LOSS:
        return pairwise_focal_loss(s, y, term.pairwise_focal_loss)
    raise ValueError(f"loss type {pipeline_pb2.LossType.Name(kind)} is not implemented")


def l2_loss(s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``L2_LOSS``: the mean of ``(s - y)**2`` (the logit itself as the prediction)."""
    return (s - y).square().mean()


def binary_focal_loss(s: torch.Tensor, y: torch.Tensor,
                      cfg: pipeline_pb2.BinaryFocalLoss) -> torch.Tensor:
    """``BINARY_FOCAL_LOSS`` (module docstring)."""
    return _binary_focal(s, y, cfg).mean()


def _binary_focal(s: torch.Tensor, y: torch.Tensor,
                  cfg: pipeline_pb2.BinaryFocalLoss) -> torch.Tensor:
    ce = nn.functional.binary_cross_entropy_with_logits(s, y, reduction="none")
    p = torch.sigmoid(s)
    p_t = p * y + (1 - p) * (1 - y)
    loss = (1 - p_t).pow(float(cfg.gamma)) * ce
    if cfg.HasField("alpha"):
        a = float(cfg.alpha)
        loss = (a * y + (1 - a) * (1 - y)) * loss
    return loss


def f1_reweighted_loss(s: torch.Tensor, y: torch.Tensor,
                       cfg: pipeline_pb2.F1ReweighedLoss) -> torch.Tensor:
    """``F1_REWEIGHTED_LOSS`` (module docstring; EasyRec's f1_reweight_sigmoid_cross_entropy)."""
    p = torch.sigmoid(s)
    n = float(s.shape[0])
    num_pos = y.sum()
    num_neg = n - num_pos
    tp = p.sum()
    tn = n - tp
    neg_weight = tp / (float(cfg.f1_beta_square) * num_pos + num_neg - tn + 1e-8)
    weights = torch.where(y == 1.0, torch.ones_like(s), neg_weight.expand_as(s))
    ls = float(cfg.label_smoothing)
    target = y * (1 - ls) + 0.5 * ls if ls > 0 else y
    ce = nn.functional.binary_cross_entropy_with_logits(s, target, reduction="none")
    return _mean_over_nonzero_weights(weights * ce, weights)


def pairwise_loss(s: torch.Tensor, y: torch.Tensor, term: pipeline_pb2.Loss) -> torch.Tensor:
    """``PAIR_WISE_LOSS`` and ``PAIRWISE_LOGISTIC_LOSS`` (module docstring)."""
    pos, neg = s[y > 0.5], s[y <= 0.5]
    if pos.numel() == 0 or neg.numel() == 0:
        return s.sum() * 0.0
    diff = pos.unsqueeze(1) - neg.unsqueeze(0)
    if term.loss_type == _L.PAIR_WISE_LOSS:
        diff = diff - float(term.pairwise_loss.margin)
    else:
        diff = diff / float(term.pairwise_logistic_loss.temperature)
    return nn.functional.softplus(-diff).mean()


# EasyRec's focal loss clips probabilities to [eps, 1 - eps].
_FOCAL_EPS = 1e-7


def pairwise_focal_loss(s: torch.Tensor, y: torch.Tensor,
                        cfg: pipeline_pb2.PairwiseFocalLoss) -> torch.Tensor:
    """``PAIRWISE_FOCAL_LOSS`` (module docstring; EasyRec's ``pairwise_focal_loss``)."""
    if float(cfg.temperature) != 1.0:
        s = s / float(cfg.temperature)
    d = s.unsqueeze(1) - s.unsqueeze(0)
    mask = y.unsqueeze(1) > y.unsqueeze(0)
    if cfg.HasField("hinge_margin"):
        mask = mask & (d < float(cfg.hinge_margin))
    d = d[mask]
    if d.numel() == 0:
        return s.sum() * 0.0
    q = torch.sigmoid(d).clamp(_FOCAL_EPS, 1 - _FOCAL_EPS)
    weights = (1 - q).pow(float(cfg.gamma))
    if cfg.HasField("alpha"):
        weights = weights * float(cfg.alpha)
    losses = weights * nn.functional.softplus(-d)
    ratio = float(cfg.ohem_ratio)
    if ratio >= 1.0:
        return _mean_over_nonzero_weights(losses, weights)
    k = int(round(d.numel() * ratio))  # round half to even, as tf.math.rint
    top = torch.topk(losses, k).values
    top = top[top > 0]
    return top.mean() if top.numel() else s.sum() * 0.0


def _mean_over_nonzero_weights(losses: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TensorFlow's ``SUM_BY_NONZERO_WEIGHTS``: sum / count of nonzero weights (0 if none)."""
    count = (weights != 0).sum()
    if int(count) == 0:
        return losses.sum() * 0.0
    return losses.sum() / count


def linear_kernel_l2(module: nn.Module) -> torch.Tensor:
    """Sum of the squared weights of every ``nn.Linear`` in ``module`` (biases left out)."""
    return sum(m.weight.square().sum() for m in module.modules() if isinstance(m, nn.Linear))


def embedding_l2(pooled: torch.Tensor, lookups: int) -> torch.Tensor:
    """Mean over (sample, lookup) of the squared pooled embeddings.

    Args:
        pooled: ``[B, ...]`` the step's pooled lookups of one group, concatenated.
        lookups: how many lookups ``pooled`` holds per sample (> 0).

    Returns:
        Scalar ``sum(pooled**2) / (B * lookups)``.
    """
    return pooled.square().sum() / (pooled.shape[0] * lookups)

