"""EasyRec's variational dropout of a feature group (``model_config.variational_dropout``).

Dropout Feature Ranking (Chang et al. 2017, arXiv:1712.08645) as EasyRec's
``VariationalDropoutLayer`` and TorchEasyRec's ``VariationalDropout`` apply it to a group's
input ``x`` (its features side by side): a learned drop probability ``p = sigmoid(logit_p)``
per feature, or per column with ``embedding_wise_variational_dropout``::

    training:   x * (1 - sigmoid((logit(p) + logit(u)) / 0.1)),   u ~ U(0, 1) per sample
    evaluation: x * (1 - p)                                        (predictions, serving)
    penalty:    regularization_lambda / batch_size * sum(1 - p)    (added to the loss)

The training mask is a concrete (relaxed Bernoulli) sample, so ``p`` learns from the loss;
the penalty pushes the probabilities up, and the features the model does not need end with a
high ``p``: ``sigmoid(logit_p)`` ranks the group's features. ``logit_p`` starts as TF's
``get_variable`` default (Glorot uniform: ``U(-sqrt(3 / n), sqrt(3 / n))`` over ``n``
probabilities) and is a dense parameter: the dense optimizer trains it, checkpoints, the delta
topic and serving carry it as any other (``<group module>.logit_p``).

This module has no ``from __future__ import annotations``: TorchScript reads the class's
annotations as types.
"""

import math
from collections.abc import Sequence

import torch
from torch import nn

from odl.protos import pipeline_pb2

# EasyRec's temperature of the concrete relaxation
TEMPERATURE = 0.1
# EasyRec's guard of the logarithms (numpy's float64 eps: 2**-52)
EPSILON = 2.0 ** -52


class FeatureDropout(nn.Module):
    """A group's variational dropout (module docstring); scriptable.

    Args:
        widths: the width of each feature of the group's input, in column order.
        settings: ``model_config.variational_dropout``.

    Raises:
        ValueError: no feature, or a width below 1.
    """

    __constants__ = ["regularization_lambda", "temperature", "epsilon"]
    columns: list[int]

    def __init__(self, widths: Sequence[int],
                 settings: pipeline_pb2.VariationalDropoutLayer) -> None:
        super().__init__()
        widths = [int(w) for w in widths]
        if not widths or min(widths) < 1:
            raise ValueError(f"variational dropout needs features of width >= 1, got {widths}")
        self.regularization_lambda = float(settings.regularization_lambda)
        self.temperature = TEMPERATURE
        self.epsilon = EPSILON
        per_column = bool(settings.embedding_wise_variational_dropout)
        n = sum(widths) if per_column else len(widths)
        limit = math.sqrt(3.0 / n)  # Glorot uniform of a vector: fan_in = fan_out = n
        self.logit_p = nn.Parameter(torch.empty(n).uniform_(-limit, limit))
        # the probability of each column (a plain list: no state beside logit_p)
        self.columns = list(range(n)) if per_column else [
            j for j, w in enumerate(widths) for _ in range(w)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, columns]`` masked (training) or scaled by ``1 - p`` (evaluation)."""
        p = torch.sigmoid(self.logit_p)
        columns = torch.tensor(self.columns, dtype=torch.long, device=x.device)
        if not self.training:
            return x * (1.0 - p)[columns]
        u = torch.rand(x.shape[0], p.shape[0], dtype=x.dtype, device=x.device)
        eps = self.epsilon
        logit = (torch.log(p + eps) - torch.log(1.0 - p + eps)
                 + torch.log(u + eps) - torch.log(1.0 - u + eps))
        keep = 1.0 - torch.sigmoid(logit / self.temperature)
        return x * keep[:, columns]

    def over_pair(self, first: torch.Tensor,
                  second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` over the columns of ``first`` then ``second``, split back into the two.

        One group's two parts (its lookups and its dense columns) share one mask.
        """
        both = self.forward(torch.cat([first, second], dim=1))
        return both[:, : first.shape[1]], both[:, first.shape[1]:]

    def penalty(self, batch_size: int) -> torch.Tensor:
        """``regularization_lambda / batch_size * sum(1 - p)``: the loss term."""
        keep = 1.0 - torch.sigmoid(self.logit_p)
        return keep.sum() * (self.regularization_lambda / max(int(batch_size), 1))


def variational_dropout_loss(modules: Sequence[nn.Module], batch_size: int) -> torch.Tensor:
    """The penalties of the ``FeatureDropout`` modules among ``modules``, summed.

    EasyRec adds its ``variational_dropout_loss`` collection to the loss the same way.
    """
    terms = [m.penalty(batch_size) for m in modules if isinstance(m, FeatureDropout)]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()
