"""EasyRec's knowledge distillation (``model_config.kd``): losses toward a teacher's soft labels.

Each ``kd`` entry adds ``loss_weight`` times a loss between one of the model's predictions and
a soft label (``data_config.vector_labels``, ``odl.config.vector_labels``) to the training
loss, with EasyRec's formulas (``easy_rec/python/builders/loss_builder.py``,
``build_kd_loss``; ``EPSILON`` is Keras's):

* predictions: ``logits`` / ``probs`` of a model with one output (``[B]``; probs = sigmoid) or
  of a ``num_class`` C model (``[B, C]``; probs = softmax), ``logits_<output>`` /
  ``probs_<output>`` of a multi-task model's binary output;
* ``CROSS_ENTROPY_LOSS``: probabilities turned into logits (``log(x + eps)``) where the
  label or the prediction is not logits, both divided by ``temperature`` (> 0), turned into
  distributions (softmax over C classes, sigmoid for one), then TF's ``log_loss`` of the
  label's against the prediction's, averaged over every element;
* ``BINARY_CROSS_ENTROPY_LOSS``: both in logits (``logit(clip(p))``), divided by the
  temperature, the sigmoid cross entropy of the prediction's logits against the sigmoid of
  the label's, averaged;
* ``KL_DIVERGENCE_LOSS``: both in logits (``logit(clip(p))`` for one output, ``log(p + eps)``
  less the tensor's maximum for classes), divided by the temperature, turned into
  distributions (a single output's into ``[1 - p, p]``), Keras's ``KLD`` (each clipped to
  ``[eps, 1]``) averaged over the records;
* ``L2_LOSS``: the mean squared difference of the prediction and the label as they are.

The soft label has as many numbers as the prediction (1 or C). The terms join the step's
loss (``CtrModel.add_regularization``) and train the tables and the dense part as the
model's own loss does; prediction and serving do not read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from odl.config.config_error import ConfigError
from odl.config.loss_settings import (
    num_classes,
    regression_outputs,
    task_classes,
    ziln_settings,
)
from odl.features.batch import Batch
from odl.protos import pipeline_pb2

__all__ = ["EPSILON", "Distillation", "build_distillation"]

EPSILON = 1e-7  # tf.keras.backend.epsilon(), EasyRec's
_L = pipeline_pb2.LossType


@dataclass
class _Term:
    """One ``kd`` entry, resolved against the model."""

    kd: pipeline_pb2.KD
    prediction: Callable[[torch.Tensor], torch.Tensor]  # logits -> the named prediction
    width: int  # numbers per record of the prediction (1 or C)


class Distillation:
    """The ``kd`` losses of a model (module docstring); call with the logits and the batch."""

    def __init__(self, terms: list[_Term]) -> None:
        self._terms = terms

    def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The sum of the weighted ``kd`` losses of the batch (a scalar)."""
        total = logits.new_zeros(())
        vectors = batch.label_vectors or {}
        for term in self._terms:
            pred = term.prediction(logits)
            label = torch.as_tensor(vectors[term.kd.soft_label_name], device=logits.device,
                                    dtype=pred.dtype)
            label = label.reshape(pred.shape)
            total = total + kd_loss(term.kd, pred, label, term.width)
        return total


def kd_loss(kd: pipeline_pb2.KD, pred: torch.Tensor, label: torch.Tensor,
            width: int) -> torch.Tensor:
    """One ``kd`` entry's weighted loss (module docstring).

    Args:
        kd: the entry.
        pred: the prediction, ``[B]`` (width 1) or ``[B, C]``.
        label: the soft label, shaped as ``pred``.
        width: 1 or C.

    Returns:
        A scalar.
    """
    w, t, eps = float(kd.loss_weight), float(kd.temperature), EPSILON
    if kd.loss_type == _L.L2_LOSS:
        return ((pred - label) ** 2).mean() * w if w else pred.new_zeros(())
    if kd.loss_type == _L.BINARY_CROSS_ENTROPY_LOSS:
        if not kd.label_is_logits:
            label = torch.logit(label.clamp(eps, 1 - eps))
        if not kd.pred_is_logits:
            pred = torch.logit(pred.clamp(eps, 1 - eps))
        if t > 0:
            label, pred = label / t, pred / t
        return F.binary_cross_entropy_with_logits(pred, torch.sigmoid(label)) * w
    if kd.loss_type == _L.KL_DIVERGENCE_LOSS:
        label, pred = _distributions(_as_logits(label, kd.label_is_logits, width),
                                     _as_logits(pred, kd.pred_is_logits, width), t, width)
        if width == 1:
            label = torch.stack([1 - label, label], -1)
            pred = torch.stack([1 - pred, pred], -1)
        label, pred = label.clamp(eps, 1), pred.clamp(eps, 1)
        return (label * torch.log(label / pred)).sum(-1).mean() * w
    # CROSS_ENTROPY_LOSS
    label, pred = _distributions(label if kd.label_is_logits else torch.log(label + eps),
                                 pred if kd.pred_is_logits else torch.log(pred + eps), t, width)
    losses = -label * torch.log(pred + eps) - (1 - label) * torch.log(1 - pred + eps)
    return losses.mean() * w if w else pred.new_zeros(())


def _distributions(label: torch.Tensor, pred: torch.Tensor, t: float,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides' logits over the temperature, made distributions (softmax, or sigmoid)."""
    if t > 0:
        label, pred = label / t, pred / t
    if width > 1:
        return torch.softmax(label, -1), torch.softmax(pred, -1)
    return torch.sigmoid(label), torch.sigmoid(pred)


def _as_logits(x: torch.Tensor, is_logits: bool, width: int) -> torch.Tensor:
    """KL's side in logits (EasyRec's: a class distribution's log, less its maximum)."""
    if is_logits:
        return x
    if width == 1:
        return torch.logit(x.clamp(EPSILON, 1 - EPSILON))
    x = torch.log(x + EPSILON)
    return x - x.max()


def build_distillation(config: pipeline_pb2.EasyRecConfig,
                       output_names: tuple[str, ...] | list[str]) -> Distillation | None:
    """The model's ``kd`` losses, or None without ``kd`` entries.

    Args:
        config: the pipeline config (validated: ``odl.config.vector_labels``).
        output_names: the built model's ``output_names``.

    Raises:
        ConfigError: a ``pred_name`` the model does not have, or a soft label of another
            width than its prediction.
    """
    kds = list(config.model_config.kd)
    if not kds:
        return None
    predictions = _predictions(config, list(output_names))
    dims = {v.input_name: int(v.dim) for v in config.data_config.vector_labels}
    terms = []
    for i, kd in enumerate(kds):
        where = f"model_config.kd[{i}]"
        if kd.pred_name not in predictions:
            raise ConfigError(f"{where}.pred_name", (
                f"{kd.pred_name!r} is not a prediction of this model; it has "
                f"{', '.join(predictions) or 'none a distillation reads'}"))
        prediction, width = predictions[kd.pred_name]
        if dims[kd.soft_label_name] != width:
            raise ConfigError(f"{where}.soft_label_name", (
                f"{kd.soft_label_name!r} holds {dims[kd.soft_label_name]} numbers per record; "
                f"{kd.pred_name!r} has {width}"))
        terms.append(_Term(kd, prediction, width))
    return Distillation(terms)


def _predictions(config: pipeline_pb2.EasyRecConfig, names: list[str]
                 ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """Prediction name -> (logits -> it, its width), as EasyRec names a model's predictions."""
    classes = num_classes(config)
    regression = regression_outputs(config)
    if ziln_settings(config) is not None:  # (three logits of one output: not read here)
        return {}
    if classes > 1:
        return {"logits": (lambda x: x, classes),
                "probs": (lambda x: torch.softmax(x, -1), classes)}
    if len(names) == 1:
        out = {"logits": (lambda x: x.reshape(-1), 1)}
        if not regression[0]:
            out["probs"] = (lambda x: torch.sigmoid(x.reshape(-1)), 1)
        return out
    if any(c > 1 for c in task_classes(config)) or len(regression) != len(names):
        return {}  # (outputs of several columns each: not read by a distillation here)
    out = {}
    for k, name in enumerate(names):
        out[f"logits_{name}"] = (lambda x, k=k: x[:, k], 1)
        if not regression[k]:
            out[f"probs_{name}"] = (lambda x, k=k: torch.sigmoid(x[:, k]), 1)
    return out
