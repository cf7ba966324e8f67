"""The model contract: one forward shared by training, export and serving.

Every model is a ``CtrModel`` made of two parts:

* ``model.ebc`` - the sparse part: a TorchRec ``EmbeddingBagCollection`` (built on the
  ``meta`` device; ``TrainModule`` shards it and fuses the table optimizer into its
  backward). Its parameters are ``ebc.embedding_bags.<table>.weight`` in checkpoints.
* ``model.dense`` - the dense part: an ``nn.Module`` holding every other parameter and
  buffer (checkpoint and ``DENSE_UPDATE_VARIABLES`` names ``dense.<name>``) and all the
  computation after the embedding lookup. Its ``forward`` takes one float tensor per group of
  ``model.pooled_layout``, in that order, then the raw dense features (``Batch.dense``,
  ``[B, num_dense]`` in ``FeatureBuilder.dense_feature_names`` order), and returns the logits:
  ``[B]`` for a model with one output, ``[B, len(output_names)]`` for several (columns in
  ``model.output_names`` order; output ``i`` predicts label column ``model.output_labels[i]``
  of ``Batch.labels``; a two-class task's pair and a ``ZILN_LOSS`` model's three logits
  make one and two outputs, see Predictions). It must compile with ``torch.jit.script``
  and keep no state between calls. Its parameter names and registration order are part of
  the checkpoint format (the dense optimizer's state is stored by parameter position): keep
  them when changing a model.

``model.pooled_layout`` declares the dense part's embedding inputs: group ``g`` is a
``[B, g.width]`` tensor holding, lookup after lookup, the ids of ``feature`` pooled in
``table`` (sum or mean, as the table's pooling says), the first ``g.dims[i]`` columns of the
table for lookup ``i`` (a table may be stored wider, see ``odl.models.embedding_tables``).
Usually every lookup of a group has the same width, ``g.dim``; a group of mixed widths
(e.g. a WideAndDeep deep group of 16- and 32-wide features, which EasyRec concatenates) has
``g.dim == 0`` and its widths in ``g.lookup_dims``.

Predictions: ``predictions(logits, regression, softmax)`` turns the logits into what
training reports and serving answers, ``sigmoid(logit)`` per output, or the logit itself for
a regression output (``odl.config.loss_settings.regression_outputs``: every loss term of the
output is ``L2_LOSS``), or for a ``num_class`` C model (C outputs ``<label>_<k>``, one per
class) the softmax over them; a ``ZILN_LOSS`` model's three logits predict a positive
value's probability and the expected value (``odl.models.ziln``).

``CtrModel.forward(batch)`` is the lookup (``lookup``: the EBC, then the columns rearranged
into the declared layout) followed by ``model.dense``; it returns a ``ModelOutput`` with the
logits and the pooled groups. ``model.loss(output, batch)`` computes the model's loss from
its arguments only; ``model.training_loss`` adds the distillation losses of
``model_config.kd`` (``odl.models.distillation``), whatever the class. The same
``model.dense`` class is what the exporter scripts into ``dense_model.pt``
(``odl.export.dense_export``) and what ``odl-serve`` runs after its own lookups of the same
layout, so a model's math exists once; nothing else in training, publishing, export or
serving is model specific.

Adding a model: one module of this package that subclasses ``CtrModel`` (in ``__init__``
build ``self.ebc`` with ``set_tables`` from a layout of ``odl.models.embedding_tables``,
``self.dense`` (a scriptable module following the rules above) and ``self.pooled_layout``,
set ``self.output_names``; call ``set_configured_loss`` and set ``kernel_l2``, or implement
``loss``) and registers its class
(``odl.models.model_registry``), plus its settings message in ``protos/pipeline.proto``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from odl.features.batch import Batch
from odl.models.ctr_losses import (
    add_loss_weights,
    ctr_loss,
    embedding_l2,
    learned_weight_terms,
    linear_kernel_l2,
    log_loss_weights,
    loss_terms,
    random_loss_weights,
    sample_weight_tensor,
    session_tensor,
)
from odl.models.ziln import VALUE_SUFFIX, ziln_predictions
from odl.protos import pipeline_pb2

if TYPE_CHECKING:
    import numpy as np

    from odl.models.embedding_tables import EmbeddingLayout

logger = logging.getLogger(__name__)


def predictions(logits: torch.Tensor, regression: Sequence[bool] = (),
                softmax: bool = False, task_classes: Sequence[int] = (),
                ziln: pipeline_pb2.ZILNLoss | None = None) -> np.ndarray:
    """The predictions of logits: ``sigmoid``, or the logit for a regression output.

    Args:
        logits: ``[B]`` (one output) or ``[B, n]`` logits.
        regression: per output, whether it is a regression (empty: none is).
        softmax: the ``n`` outputs are a ``num_class`` model's classes: their softmax.
        task_classes: per output of a multi-task model, its logits
            (``odl.config.loss_settings.task_classes``): an output of two is
            ``softmax(pair)[1]``, the probability of class 1 (empty: one logit each).
        ziln: a ``ZILN_LOSS`` model's settings (``odl.config.loss_settings.ziln_settings``):
            its ``[B, 3]`` logits predict ``[B, 2]``, the probability of a positive value and
            the expected value (``odl.models.ziln``).

    Returns:
        float64 ``[B]`` or ``[B, n]`` predictions, on the CPU.
    """
    if ziln is not None:
        return ziln_predictions(logits, ziln).to(torch.float64).cpu().numpy()
    if softmax:
        return torch.softmax(logits, dim=1).to(torch.float64).cpu().numpy()
    if any(c > 1 for c in task_classes):  # a task of two logits: its class-1 probability
        columns: list[torch.Tensor] = []
        start = 0
        for t, c in enumerate(task_classes):
            if c == 2:
                columns.append(torch.softmax(logits[:, start : start + 2], dim=1)[:, 1])
            elif t < len(regression) and regression[t]:
                columns.append(logits[:, start])
            else:
                columns.append(torch.sigmoid(logits[:, start]))
            start += c
        out = torch.stack(columns, dim=1)
        return (out.squeeze(1) if out.shape[1] == 1 else out).to(torch.float64).cpu().numpy()
    out = torch.sigmoid(logits)
    if any(regression):
        if logits.dim() == 1:
            out = logits
        else:
            mask = torch.tensor(list(regression), dtype=torch.bool, device=logits.device)
            out = torch.where(mask.unsqueeze(0), logits, out)
    return out.to(torch.float64).cpu().numpy()


def class_outputs(name: str, num_class: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A single-task model's ``(output_names, output_labels)``.

    One output ``name`` on label column 0, or for ``num_class`` C > 1 the C outputs
    ``<name>_<k>``, output k on column k of the one-hot labels.
    """
    if num_class <= 1:
        return (name,), (0,)
    return tuple(f"{name}_{k}" for k in range(num_class)), tuple(range(num_class))


@dataclass(frozen=True)
class PooledGroup:
    """One embedding input of a model's dense part.

    Attributes:
        name: the group's name (the dense ``forward`` argument it feeds, e.g. ``"deep"``).
        lookups: ``(feature, table)`` per lookup, in column order.
        dim: columns each lookup contributes (the first ``dim`` columns of its table); 0
            when the lookups differ (``lookup_dims``).
        lookup_dims: per lookup, its columns, when they differ (empty: ``dim`` each).
    """

    name: str
    lookups: tuple[tuple[str, str], ...]
    dim: int
    lookup_dims: tuple[int, ...] = ()

    @property
    def dims(self) -> tuple[int, ...]:
        """Columns each lookup contributes, in lookup order."""
        return self.lookup_dims if self.lookup_dims else (self.dim,) * len(self.lookups)

    @property
    def width(self) -> int:
        """Columns of the group's tensor."""
        return sum(self.dims)

    @classmethod
    def of(cls, name: str, lookups: tuple[tuple[str, str], ...],
           dims: tuple[int, ...] | list[int]) -> PooledGroup:
        """A group from per-lookup widths: ``dim`` set when they are all equal, else 0.

        Args:
            name: the group's name.
            lookups: ``(feature, table)`` per lookup.
            dims: columns per lookup.

        Returns:
            The group.
        """
        dims = tuple(int(d) for d in dims)
        if len(set(dims)) <= 1:
            return cls(name, tuple(lookups), dims[0] if dims else 0)
        return cls(name, tuple(lookups), 0, dims)


@dataclass
class ModelOutput:
    """What a model's forward returns.

    Attributes:
        logits: ``[B]`` (one output) or ``[B, n_outputs]``.
        pooled: the dense part's embedding inputs, one tensor per ``pooled_layout`` group
            (the loss reads them for embedding regularization).
        aux_loss: a loss term the forward computed beside the logits (a backbone's
            ``AuxiliaryLoss`` blocks), or None.
    """

    logits: torch.Tensor
    pooled: tuple[torch.Tensor, ...]
    aux_loss: torch.Tensor | None = None

    def rows(self, n: int) -> ModelOutput:
        """The output of the first ``n`` records (a padded batch's own rows).

        The auxiliary loss stays the whole batch's.
        """
        return dataclasses.replace(self, logits=self.logits[:n],
                                   pooled=tuple(p[:n] for p in self.pooled))


@dataclass(frozen=True)
class _ColumnGather:
    """How one pooled group is cut out of the EBC's pooled output ``[B, total]``.

    Lookups at evenly spaced columns (the common case) are a slice (a view when the spacing
    is ``dim``, else one strided copy); other orders use an index.

    Attributes:
        start: first column of the first lookup.
        count: lookups in the group.
        stride: columns from one lookup's first column to the next's.
        dim: columns taken per lookup.
        index: explicit columns when the lookups are not evenly spaced.
    """

    start: int
    count: int
    stride: int
    dim: int
    index: torch.Tensor | None = None

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """The group's ``[B, count * dim]`` tensor."""
        if self.index is not None:
            return values.index_select(1, self.index)
        if self.stride == self.dim:
            return values[:, self.start : self.start + self.count * self.dim]
        block = values[:, self.start : self.start + self.count * self.stride]
        return block.unflatten(1, (self.count, self.stride))[:, :, : self.dim].reshape(
            values.shape[0], self.count * self.dim)


class CtrModel(nn.Module):
    """Base of every model (the contract is in the module docstring).

    Subclasses set ``ebc``, ``dense``, ``pooled_layout`` and ``output_names`` in
    ``__init__`` and implement ``loss``.
    """

    ebc: EmbeddingBagCollection
    dense: nn.Module
    pooled_layout: tuple[PooledGroup, ...]
    output_names: tuple[str, ...]
    # per output, its column of Batch.labels (a [B] label tensor is column 0)
    output_labels: tuple[int, ...] = (0,)
    # model_config.kd's losses (odl.models.distillation; build_model sets it), or None
    distillation: Any = None
    # ``loss`` reads the logits only through ``ctr_loss`` of ``loss_terms`` (its other terms,
    # regularization, do not depend on them): ``log_loss_weights`` may then describe it
    LOGITS_ONLY_IN_CTR_LOSS = False
    # dense parameters added to the model after its checkpoints were first written, each
    # registered after the others: a checkpoint without them restores (they keep their
    # initial values, the dense optimizer starts fresh; ``odl.train.module_state``)
    ADDED_PARAMETERS: tuple[str, ...] = ()
    # the default ``loss``'s weight of the squared dense Linear kernels (l2_regularization)
    kernel_l2: float = 0.0

    def __init__(self) -> None:
        super().__init__()
        self._gathers: dict[tuple, list[_ColumnGather]] = {}

    def set_tables(self, layout: EmbeddingLayout, device: torch.device | str = "meta") -> None:
        """Sets ``self.layout`` and builds ``self.ebc``, its tables, on ``device``.

        Args:
            layout: the model's table layout (``odl.models.embedding_tables``).
            device: where the tables are built (``meta``: materialized by DMP).
        """
        self.layout = layout
        self.ebc = EmbeddingBagCollection(tables=layout.configs, device=torch.device(device),
                                          is_weighted=layout.weighted)

    @property
    def outputs(self) -> list[tuple[str, int]]:
        """``(output name, label column)`` per output, in output order."""
        return list(zip(self.output_names, self.output_labels, strict=True))

    def metric_outputs(self, regression: Sequence[bool]
                       ) -> tuple[list[tuple[str, int]], list[bool]]:
        """What the progressive metrics and the eval topic score, and which are regressions.

        By default every output (:attr:`outputs`, ``regression`` as given, one flag per
        output); a model whose outputs are per domain scores one prediction per task.

        Args:
            regression: per output, whether it is a regression
                (``odl.config.loss_settings.regression_outputs``).

        Returns:
            ``(name, label column)`` per scored output, and its regression flag.
        """
        return self.outputs, list(regression)

    def metric_predictions(self, probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The predictions :meth:`metric_outputs` scores, from the model's.

        Args:
            probs: the model's predictions, ``[B]`` or ``[B, outputs]``.
            labels: the records' labels, ``[B]`` or ``[B, label columns]``.

        Returns:
            ``probs`` by default.
        """
        return probs

    def lookup(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The sparse part: the batch's ids pooled in the tables, in ``pooled_layout``.

        Args:
            batch: the batch (its ``sparse`` KJT).

        Returns:
            One ``[B, group.width]`` tensor per group.
        """
        kt = self.ebc(batch.sparse)
        values = kt.values()
        key = (tuple(kt.keys()), values.device)
        gathers = self._gathers.get(key)
        if gathers is None:
            gathers = self._plan_gathers(kt.keys(), kt.length_per_key(), values.device)
            self._gathers[key] = gathers
        return tuple(g(values) for g in gathers)

    def _plan_gathers(self, keys: Sequence[str], lengths: Sequence[int],
                      device: torch.device) -> list[_ColumnGather]:
        """Per group, where its columns lie in the pooled output.

        TorchRec names a pooled key ``feature`` or ``feature@table`` and groups keys by
        pooling type, so its column order can differ from the layout's; the columns are
        looked up by name once per key order.
        """
        ranges: dict[tuple[str, str | None], int] = {}
        total = 0
        for k, length in zip(keys, lengths, strict=True):
            f, _, t = k.partition("@")
            ranges[(f, t or None)] = total
            total += int(length)
        gathers: list[_ColumnGather] = []
        for group in self.pooled_layout:
            starts: list[int] = []
            for f, t in group.lookups:
                first = ranges.get((f, t), ranges.get((f, None)))
                if first is None:
                    raise RuntimeError(f"pooled embeddings {list(keys)} lack {f}@{t}")
                starts.append(first)
            if group.lookup_dims:  # mixed widths: one slice when contiguous, else an index
                dims = group.dims
                first = starts[0] if starts else 0
                if all(starts[i + 1] == starts[i] + dims[i] for i in range(len(starts) - 1)):
                    gathers.append(_ColumnGather(first, 1, group.width, group.width))
                else:
                    cols = [c for s0, d in zip(starts, dims, strict=True)
                            for c in range(s0, s0 + d)]
                    index = torch.tensor(cols, dtype=torch.long, device=device)
                    gathers.append(_ColumnGather(first, len(starts), 0, 0, index))
                continue
            n, dim = len(starts), group.dim
            first = starts[0] if starts else 0
            stride = starts[1] - starts[0] if n > 1 else dim
            if (stride >= max(dim, 1) and first + n * stride <= total
                    and starts == list(range(first, first + n * stride, stride))):
                gathers.append(_ColumnGather(first, n, stride, dim))
            else:
                cols = [c for s0 in starts for c in range(s0, s0 + dim)]
                index = torch.tensor(cols, dtype=torch.long, device=device)
                gathers.append(_ColumnGather(first, n, stride, dim, index))
        return gathers

    def forward(self, batch: Batch) -> ModelOutput:
        """Lookup, then the dense part.

        Args:
            batch: the batch.

        Returns:
            The logits and the pooled embedding inputs; with a dense part that has
            auxiliary losses (a backbone's ``AuxiliaryLoss`` blocks), their sum beside.
        """
        pooled = self.lookup(batch)
        if getattr(self.dense, "has_aux_loss", False):
            logits, aux = self.dense.logits_and_aux_loss(*pooled, batch.dense)
            return ModelOutput(logits, pooled, aux)
        return ModelOutput(self.dense(*pooled, batch.dense), pooled)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The training loss (scalar) of ``output``, the forward's result on ``batch``.

        By default :meth:`configured_loss` with ``kernel_l2`` (a model that called
        :meth:`set_configured_loss`); a model with other terms overrides it.

        Args:
            output: what ``forward(batch)`` returned.
            batch: the batch (labels).

        Returns:
            Scalar loss.
        """
        return self.configured_loss(output, batch, self.kernel_l2)

    def training_loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """What a training step minimizes: :meth:`loss` plus the distillation losses.

        ``model_config.kd``'s terms (``odl.models.distillation``; ``build_model`` sets
        ``distillation``) join every model class's own loss here.

        Args:
            output: what ``forward(batch)`` returned.
            batch: the batch (labels, soft labels).

        Returns:
            Scalar loss.
        """
        loss = self.loss(output, batch)
        if self.distillation is not None:
            loss = loss + self.distillation(output.logits, batch)
        return loss

    def log_loss_weights(self, batch: Batch) -> np.ndarray | None:
        """Each record's weight ``c_i`` in the loss's cross entropy, where that form holds.

        The form: the loss is ``sum_i c_i * bce(logit_i, label_i)`` plus terms that do not
        depend on the logits (``odl.models.ctr_losses.log_loss_weights``). In-batch learning
        reads the records' loss slopes from it in closed form (``odl.train.in_batch.log_loss``).
        None for a model without one output whose loss is so built
        (``LOGITS_ONLY_IN_CTR_LOSS``), or with other loss terms.

        Args:
            batch: the batch (its records and ``sample_weight`` values).

        Returns:
            ``[B]`` float64, or None.
        """
        if not self.LOGITS_ONLY_IN_CTR_LOSS or len(self.output_names) != 1:
            return None
        if getattr(self.dense, "num_class", 1) > 1:
            return None
        return log_loss_weights(self.model_config, self.loss_terms, self.learned, batch.size,
                                batch.sample_weights)

    def set_configured_loss(self, model_config: pipeline_pb2.EasyRecModel,
                            output_name: str) -> None:
        """What :meth:`configured_loss` reads, from the model's config (``self.dense`` built).

        Sets ``output_names`` / ``output_labels`` (one output, or ``num_class`` columns named
        after ``output_name``, or a ``ZILN_LOSS`` model's ``output_name`` and
        ``<output_name>_value``), ``embedding_regularization``, ``model_config``,
        ``loss_terms`` and ``learned`` (the terms with a learned weight, whose weights join
        ``self.dense``).

        Args:
            model_config: the ``EasyRecModel``.
            output_name: the name of the model's output (the label it predicts).
        """
        self.loss_terms = loss_terms(model_config)
        if any(t.loss_type == pipeline_pb2.ZILN_LOSS for t in self.loss_terms):
            # a positive value's probability and the expected value, of the one label
            self.output_names = (output_name, output_name + VALUE_SUFFIX)
            self.output_labels = (0, 0)
        else:
            self.output_names, self.output_labels = class_outputs(output_name,
                                                                  model_config.num_class)
        self.embedding_regularization = float(model_config.embedding_regularization)
        self.model_config = model_config
        self.learned = learned_weight_terms(model_config, self.loss_terms)
        add_loss_weights(self.dense, sum(self.learned))

    def configured_loss(self, output: ModelOutput, batch: Batch,
                        kernel_l2: float = 0.0) -> torch.Tensor:
        """The loss of a model with one output column set (or ``num_class`` columns).

        The configured prediction loss (``odl.models.ctr_losses.ctr_loss`` with the model's
        ``loss_terms``, learned and random term weights, sessions and sample weights) +
        ``kernel_l2`` * the squared dense Linear kernels + ``embedding_regularization`` *
        each pooled group's mean squared lookup. A subclass calling it sets
        ``model_config``, ``loss_terms``, ``learned`` and ``embedding_regularization``.

        Args:
            output: what ``forward(batch)`` returned.
            batch: the batch (labels).
            kernel_l2: the weight of the squared dense Linear kernels.

        Returns:
            Scalar loss.
        """
        return self.add_regularization(self.prediction_loss(output.logits, batch), output,
                                       kernel_l2)

    def prediction_loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The configured prediction loss of ``logits`` (``configured_loss``'s first term)."""
        return ctr_loss(logits, batch.labels, self.loss_terms, learned=self.learned,
                        uncertainty=getattr(self.dense, "loss_uncertainty", None),
                        term_weights=random_loss_weights(self.model_config,
                                                         len(self.loss_terms), logits),
                        softmax=self.dense.num_class > 1, sessions=session_tensor(batch),
                        data_weights=sample_weight_tensor(batch))

    def add_regularization(self, loss: torch.Tensor, output: ModelOutput,
                           kernel_l2: float) -> torch.Tensor:
        """``loss`` plus the terms every model shares.

        The forward's auxiliary loss (``output.aux_loss``, when given) + ``kernel_l2`` *
        the squared dense Linear kernels + ``embedding_regularization`` * each pooled
        group's mean squared lookup.

        Args:
            loss: the prediction loss.
            output: what ``forward(batch)`` returned (its pooled groups).
            kernel_l2: the weight of the squared dense Linear kernels.

        Returns:
            Scalar loss.
        """
        if output.aux_loss is not None:
            loss = loss + output.aux_loss
        if kernel_l2:
            loss = loss + kernel_l2 * linear_kernel_l2(self.dense)
        if self.embedding_regularization:
            for pooled, group in zip(output.pooled, self.pooled_layout, strict=True):
                if group.lookups:
                    loss = loss + self.embedding_regularization * embedding_l2(
                        pooled, len(group.lookups))
        return loss
