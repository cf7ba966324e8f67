"""The prediction loss of a multi-task model: each task's terms on its logits and its label.

Shared by the multi-task models (``odl.models.multi_task_models``,
``odl.models.multi_task_backbone``): per task ``t`` (its ``TaskTower``), ``weight_t`` * the
task's configured loss (``losses`` / ``loss_type``, ``odl.models.ctr_losses``) on its logit
column (two columns and the softmax over the 0/1 label one-hot for a task of
``num_class: 2``) against its label column; a task with a ``task_space_indicator_label``
weighs each sample's loss by ``in_task_space_weight`` when that label is > 0, else
``out_task_space_weight``, normalized (TorchEasyRec's weighting). Learned (uncertainty) and
random term weights follow ``model_config.loss_weight_strategy``. A task's
``ORDER_CALIBRATE_LOSS`` adds, per task of its ``relation_tower_names``, ``weight *
mean(relu(sigmoid(logit_task) - sigmoid(logit_named)))`` (EasyRec's order calibration).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from odl.features.batch import Batch
from odl.models.ctr_losses import (
    add_loss_weights,
    ctr_loss,
    learned_weight_terms,
    loss_terms,
    random_loss_weights,
    sample_weight_tensor,
    session_tensor,
)
from odl.protos import pipeline_pb2


class TaskLoss:
    """The tasks' weighted prediction losses (module docstring).

    Args:
        model_config: the ``EasyRecModel`` (its ``loss_weight_strategy``).
        tasks: the ``TaskTower`` per task, in output order.
        label_columns: per task, its column of ``Batch.labels``.
        space_columns: per task, the ``Batch.labels`` column of its
            ``task_space_indicator_label``, or None.
        dense: the model's dense part: the learned loss weights join it
            (``dense.loss_uncertainty``).
    """

    def __init__(self, model_config: pipeline_pb2.EasyRecModel,
                 tasks: Sequence[pipeline_pb2.TaskTower], label_columns: Sequence[int],
                 space_columns: Sequence[int | None] | None, dense: nn.Module) -> None:
        self.model_config = model_config
        self.labels = [int(c) for c in label_columns]
        self.weights = [float(t.weight) for t in tasks]
        # each task's logit columns: one, or two (a two-class task: softmax over the pair)
        self.classes = [max(int(t.num_class), 1) for t in tasks]
        self.columns = [sum(self.classes[:t]) for t in range(len(self.classes))]
        self.terms = [loss_terms(t) for t in tasks]
        self.learned = [learned_weight_terms(model_config, terms) for terms in self.terms]
        # each task's learned weights: a slice of dense.loss_uncertainty
        self.learned_start = [sum(sum(x) for x in self.learned[:t])
                              for t in range(len(self.learned))]
        add_loss_weights(dense, sum(sum(x) for x in self.learned))
        # ORDER_CALIBRATE_LOSS: (task, earlier task it must not exceed, weight)
        names = [t.tower_name for t in tasks]
        self.calibrations = [(i, names.index(r), float(term.weight))
                             for i, t in enumerate(tasks) for term in t.losses
                             if term.loss_type == pipeline_pb2.LossType.ORDER_CALIBRATE_LOSS
                             for r in t.relation_tower_names if r in names]
        spaces = list(space_columns or [None] * len(tasks))
        self.spaces = [None if c is None else
                       (int(c), float(t.in_task_space_weight), float(t.out_task_space_weight))
                       for c, t in zip(spaces, tasks, strict=True)]

    def __call__(self, logits: torch.Tensor, batch: Batch, dense: nn.Module) -> torch.Tensor:
        """The sum over tasks of their weighted losses.

        Args:
            logits: ``[B]`` or ``[B, logit columns]``.
            batch: the batch (labels ``[B]`` or ``[B, label columns]``).
            dense: the model's dense part (its learned loss weights).

        Returns:
            Scalar loss.
        """
        logits = logits if logits.dim() == 2 else logits.unsqueeze(1)
        labels = batch.labels if batch.labels.dim() == 2 else batch.labels.unsqueeze(1)
        loss = logits.new_zeros(())
        drawn = random_loss_weights(self.model_config, sum(len(x) for x in self.terms),
                                    logits)
        data_weights = sample_weight_tensor(batch)
        first = 0
        for t, (w, terms) in enumerate(zip(self.weights, self.terms, strict=True)):
            term_weights = None if drawn is None else drawn[first : first + len(terms)]
            first += len(terms)
            weights = None
            space = self.spaces[t]
            if space is not None:
                col, w_in, w_out = space
                inside = (labels[:, col] > 0).to(logits.dtype)
                weights = w_in * inside + w_out * (1 - inside)
            uncertainty = getattr(dense, "loss_uncertainty", None)
            if uncertainty is not None:
                uncertainty = uncertainty[self.learned_start[t]:]
            column = self.columns[t]
            y = labels[:, self.labels[t]]
            if self.classes[t] == 2:  # softmax over the pair, the 0/1 label one-hot
                loss = loss + ctr_loss(logits[:, column : column + 2],
                                       torch.stack([1 - y, y], dim=1), terms, weights,
                                       scale=w, learned=self.learned[t],
                                       uncertainty=uncertainty, term_weights=term_weights,
                                       softmax=True, sessions=session_tensor(batch),
                                       data_weights=data_weights)
                continue
            loss = loss + ctr_loss(logits[:, column], y, terms,
                                   weights, scale=w, learned=self.learned[t],
                                   uncertainty=uncertainty, term_weights=term_weights,
                                   data_weights=data_weights)
        for t, r, weight in self.calibrations:  # a task's probability not above r's
            p_t = torch.sigmoid(logits[:, self.columns[t]])
            p_r = torch.sigmoid(logits[:, self.columns[r]])
            loss = loss + weight * torch.relu(p_t - p_r).mean()
        return loss
