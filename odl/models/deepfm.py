"""EasyRec's DeepFM on a TorchRec ``EmbeddingBagCollection``.

    wide  = sum over wide features of their first ``wide_output_dim`` weights  [B, W]
            (+ a linear term over dense raw features in a wide group) + bias
    fm    = 0.5 * ((sum_i v_i)**2 - sum_i v_i**2)  over the deep group's embeddings  [B, D]
    deep  = DNN(concat(deep embeddings, deep dense raw features))  [B, H]
    logit = sum(wide) + sum(fm) + Linear(deep -> 1)              (no final_dnn)
    logit = Linear(final_dnn(concat(wide, fm, deep)) -> 1)       (with final_dnn)

Loss: mean binary cross entropy with logits
    + l2_regularization * sum of squared dense Linear weights (kernels, not biases)
    + embedding_regularization * mean over (sample, deep feature) of ||pooled embedding||**2
    + wide_regularization (or embedding_regularization when 0) * same over wide lookups.
The embedding terms use the pooled vectors of the step (cheap), which equals the looked-up
rows for single-valued features.

Parameter names: the tables are ``ebc.embedding_bags.<table>.weight``; every dense parameter
lives under ``dense.`` (``dense.dnn.*``, ``dense.deep_out.*``, ``dense.final_dnn.*``,
``dense.final_out.*``, ``dense.wide_bias``, ``dense.wide_dense.*``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

from odl.features.batch import Batch
from odl.models.embedding_tables import EmbeddingLayout
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


def build_mlp(in_dim: int, dnn: pipeline_pb2.DNN) -> tuple[nn.Sequential, int]:
    """EasyRec's DNN: per hidden layer Linear, [BatchNorm], ReLU, [Dropout].

    Args:
        in_dim: input width.
        dnn: the layer settings.

    Returns:
        ``(module, output width)``.

    Raises:
        ValueError: unsupported activation.
    """
    if dnn.activation not in ("relu", "tf.nn.relu"):
        raise ValueError(f"DNN activation {dnn.activation!r} is not supported (use relu)")
    layers: list[nn.Module] = []
    width = in_dim
    for i, units in enumerate(dnn.hidden_units):
        layers.append(nn.Linear(width, int(units)))
        if dnn.use_bn:
            layers.append(nn.BatchNorm1d(int(units)))
        layers.append(nn.ReLU())
        if i < len(dnn.dropout_ratio) and dnn.dropout_ratio[i] > 0:
            layers.append(nn.Dropout(float(dnn.dropout_ratio[i])))
        width = int(units)
    return nn.Sequential(*layers), width


class DeepFMDense(nn.Module):
    """The dense (non-embedding) parameters of DeepFM."""

    def __init__(
        self,
        deep_in: int,
        fm_dim: int,
        num_wide_dense: int,
        cfg: pipeline_pb2.DeepFM,
    ) -> None:
        super().__init__()
        self.wide_output_dim = int(cfg.wide_output_dim)
        self.dnn, deep_width = build_mlp(deep_in, cfg.dnn)
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.wide_dense = (
            nn.Linear(num_wide_dense, self.wide_output_dim, bias=False)
            if num_wide_dense else None
        )
        self.has_final = cfg.HasField("final_dnn")
        if self.has_final:
            final_in = self.wide_output_dim + fm_dim + deep_width
            self.final_dnn, final_width = build_mlp(final_in, cfg.final_dnn)
            self.final_out = nn.Linear(final_width, 1)
        else:
            self.deep_out = nn.Linear(deep_width, 1)


class DeepFM(nn.Module):
    """DeepFM over an ``EmbeddingBagCollection`` built on the ``meta`` device.

    Args:
        layout: table layout (deep and wide lookups).
        dense_features: names of ``Batch.dense`` columns, in order.
        deep_dense: dense features in the deep group.
        wide_dense: dense features in a wide group.
        model_config: the ``EasyRecModel`` (DeepFM settings and regularization).
        ebc_device: device of the tables (``meta``: materialized by DMP).
    """

    def __init__(
        self,
        layout: EmbeddingLayout,
        dense_features: Sequence[str],
        deep_dense: Sequence[str],
        wide_dense: Sequence[str],
        model_config: pipeline_pb2.EasyRecModel,
        ebc_device: torch.device | str = "meta",
    ) -> None:
        super().__init__()
        cfg = model_config.deepfm
        self.layout = layout
        self.ebc = EmbeddingBagCollection(tables=layout.configs, device=torch.device(ebc_device))
        col = {n: i for i, n in enumerate(dense_features)}
        self._deep_dense_idx = [col[n] for n in deep_dense]
        self._wide_dense_idx = [col[n] for n in wide_dense]
        self._all_deep_dense = self._deep_dense_idx == list(range(len(dense_features)))
        self._num_deep = len(layout.deep_keys)
        self._dim = layout.deep_dim
        deep_in = self._num_deep * self._dim + len(deep_dense)
        if deep_in == 0:
            raise ValueError("DeepFM needs at least one feature in a deep group")
        self.dense = DeepFMDense(deep_in, self._dim if self._num_deep else 0,
                                 len(wide_dense), cfg)
        self.l2_regularization = float(cfg.l2_regularization or cfg.dense_regularization)
        self.embedding_regularization = float(model_config.embedding_regularization)
        self.wide_regularization = float(cfg.wide_regularization or
                                         model_config.embedding_regularization)
        self._resolved = False
        self._column_order: torch.Tensor | None = None
        self._deep_width = 0
        self._last_deep: torch.Tensor | None = None
        self._last_wide: torch.Tensor | None = None

    def _resolve(self, kt: KeyedTensor) -> torch.Tensor | None:
        """Columns of the pooled output in layout order (deep keys, then wide keys).

        TorchRec groups pooled outputs by pooling type, so with mixed combiners its column
        order differs from the layout's; the permutation is computed once. Returns None when
        the output is already in layout order (the common case, no copy needed).
        """
        if not self._resolved:
            ranges: dict[tuple[str, str | None], tuple[int, int]] = {}
            start = 0
            for key, length in zip(kt.keys(), kt.length_per_key(), strict=True):
                f, _, t = key.partition("@")
                ranges[(f, t or None)] = (start, start + length)
                start += length
            cols: list[int] = []
            for f, t in self.layout.deep_keys + self.layout.wide_keys:
                r = ranges.get((f, t)) or ranges.get((f, None))
                if r is None:
                    raise RuntimeError(f"pooled embeddings {kt.keys()} lack {f}@{t}")
                cols.extend(range(*r))
            self._column_order = (
                None if cols == list(range(start)) else torch.tensor(cols, dtype=torch.long)
            )
            self._deep_width = self._num_deep * self._dim
            self._resolved = True
        return self._column_order

    def forward(self, batch: Batch) -> torch.Tensor:
        """Returns logits ``[B]``."""
        kt = self.ebc(batch.sparse)
        pooled = kt.values()
        order = self._resolve(kt)
        if order is not None:
            pooled = pooled.index_select(1, order.to(pooled.device))
        deep_sl, wide_sl = slice(0, self._deep_width), slice(self._deep_width, pooled.shape[1])
        b = pooled.shape[0]
        d = self.dense
        parts = []
        # Wide.
        wide = d.wide_bias.expand(b, d.wide_output_dim)
        n_wide = len(self.layout.wide_keys)
        if n_wide:
            w = pooled[:, wide_sl].reshape(b, n_wide, -1)[:, :, : d.wide_output_dim]
            self._last_wide = w
            wide = wide + w.sum(dim=1)
        if d.wide_dense is not None:
            wide = wide + d.wide_dense(batch.dense[:, self._wide_dense_idx])
        # FM and deep.
        deep_in = []
        fm = None
        if self._num_deep:
            emb = pooled[:, deep_sl]
            self._last_deep = emb.reshape(b, self._num_deep, self._dim)
            v = self._last_deep
            fm = 0.5 * (v.sum(dim=1).square() - v.square().sum(dim=1))
            deep_in.append(emb)
        if self._deep_dense_idx:
            dense = batch.dense if self._all_deep_dense else batch.dense[:, self._deep_dense_idx]
            deep_in.append(dense)
        x = deep_in[0] if len(deep_in) == 1 else torch.cat(deep_in, dim=1)
        deep = d.dnn(x)
        if d.has_final:
            parts = [wide] + ([fm] if fm is not None else []) + [deep]
            out = d.final_out(d.final_dnn(torch.cat(parts, dim=1)))
            return out.squeeze(1)
        logit = d.deep_out(deep).squeeze(1) + wide.sum(dim=1)
        if fm is not None:
            logit = logit + fm.sum(dim=1)
        return logit

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean BCE with logits plus the configured regularization (see module docstring).

        Args:
            logits: output of ``forward`` on ``batch`` (same step: uses its pooled vectors).
            batch: the batch (labels).

        Returns:
            Scalar loss.
        """
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        if self.l2_regularization:
            sq = sum(m.weight.square().sum() for m in self.dense.modules()
                     if isinstance(m, nn.Linear))
            loss = loss + self.l2_regularization * sq
        if self.embedding_regularization and self._last_deep is not None:
            loss = loss + self.embedding_regularization * (
                self._last_deep.square().sum(dim=-1).mean())
        if self.wide_regularization and self._last_wide is not None:
            loss = loss + self.wide_regularization * self._last_wide.square().sum(dim=-1).mean()
        return loss
