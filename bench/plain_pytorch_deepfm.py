"""Baseline for bench/train_throughput.py: the same DeepFM on plain PyTorch.

``PlainDeepFM`` runs ``odl.models.deepfm.DeepFM``'s dense part (``DeepFMDense``) and loss
(``deepfm_loss``) on the same tables, but looks ids up with one ``nn.EmbeddingBag(sparse=True)`` per
table and trains with ``torch.optim.Adagrad`` (sparse gradients, element-wise) for the tables
and ``torch.optim.Adam`` for the dense parameters, i.e. what a user would write without
TorchRec / fbgemm. Wide tables are stored with exactly ``wide_output_dim`` columns here.

    from bench.plain_pytorch_deepfm import PlainDeepFM
    model = PlainDeepFM(config, feature_builder)
    loss = model.step(batch)
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_losses import loss_terms
from odl.models.deepfm import DeepFMDense, DeepFMRegularization, deepfm_loss
from odl.models.embedding_tables import WIDE_SUFFIX, build_embedding_layout
from odl.models.group_inputs import model_groups
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class PlainDeepFM(nn.Module):
    """DeepFM on ``nn.EmbeddingBag`` with torch.optim optimizers.

    Args:
        config: the pipeline config (model_config.deepfm, groups, regularization).
        feature_builder: the feature builder of the same config.
        sparse_lr: Adagrad learning rate of the tables.
        dense_lr: Adam learning rate of the dense parameters.
        device: torch device.
        seed: init seed.
    """

    def __init__(
        self,
        config: pipeline_pb2.EasyRecConfig,
        feature_builder: FeatureBuilder,
        sparse_lr: float = 0.05,
        dense_lr: float = 1e-3,
        device: str = "cpu",
        seed: int = 2026,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        mc = config.model_config
        cfg = mc.deepfm
        groups = model_groups(mc, feature_builder)
        self.wide_output_dim = int(cfg.wide_output_dim) or 1
        layout = build_embedding_layout(
            feature_builder.table_specs, groups["deep_sparse"], groups["wide_sparse"],
            self.wide_output_dim)
        self.deep_keys = layout.deep_keys
        self.wide_keys = layout.wide_keys
        self.dim = layout.deep_dim
        tables = {}
        for c in layout.configs:
            wide = c.name.endswith(WIDE_SUFFIX)
            dim = self.wide_output_dim if wide else c.embedding_dim
            mode = "mean" if c.pooling.name == "MEAN" else "sum"
            bag = nn.EmbeddingBag(c.num_embeddings, dim, mode=mode, sparse=True,
                                  include_last_offset=True)
            with torch.no_grad():
                if wide:
                    bag.weight.zero_()
                else:
                    bag.weight.normal_(0.0, 0.05)
            tables[c.name] = bag
        self.tables = nn.ModuleDict(tables)
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        self.dense = DeepFMDense(
            cfg, num_deep=len(self.deep_keys), dim=self.dim, num_wide=len(self.wide_keys),
            wide_output_dim=self.wide_output_dim,
            deep_dense_idx=[col[n] for n in groups["deep_dense"]],
            wide_dense_idx=[col[n] for n in groups["wide_dense"]],
            num_dense=len(feature_builder.dense_feature_names))
        self.regularization = DeepFMRegularization.from_config(mc)
        self.loss_terms = loss_terms(mc)
        self.device = torch.device(device)
        self.to(self.device)
        self.sparse_opt = torch.optim.Adagrad(list(self.tables.parameters()), lr=sparse_lr)
        self.dense_opt = torch.optim.Adam(list(self.dense.parameters()), lr=dense_lr)

    def _pooled(self, jt: dict, keys: list[tuple[str, str]], b: int) -> torch.Tensor:
        """``[B, len(keys) * dim]``: the lookups' pooled vectors side by side."""
        if not keys:
            return torch.zeros((b, 0), device=self.device)
        return torch.cat([self.tables[t](jt[f].values(), jt[f].offsets()) for f, t in keys],
                         dim=1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [B], pooled deep, pooled wide)``."""
        jt = batch.sparse.to_dict()
        b = batch.labels.shape[0]
        deep = self._pooled(jt, self.deep_keys, b)
        wide = self._pooled(jt, self.wide_keys, b)
        return self.dense(deep, wide, batch.dense), deep, wide

    def step(self, batch: Batch) -> float:
        """One training step; returns the loss."""
        batch = batch.to(self.device)
        self.train()
        self.sparse_opt.zero_grad(set_to_none=True)
        self.dense_opt.zero_grad(set_to_none=True)
        logits, deep, wide = self(batch)
        loss = deepfm_loss(logits, batch.labels, deep, wide, self.dense, self.regularization,
                           self.loss_terms)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Eval-mode predictions (float64)."""
        self.eval()
        out = torch.sigmoid(self(batch.to(self.device))[0]).double().cpu().numpy()
        self.train()
        return out
