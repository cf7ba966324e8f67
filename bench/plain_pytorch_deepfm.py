"""Baseline for bench/train_throughput.py: the same DeepFM on plain PyTorch.

``PlainDeepFM`` has the math of ``odl.models.deepfm.DeepFM`` (same tables, same dense tower
``DeepFMDense``, same loss) but looks ids up with one ``nn.EmbeddingBag(sparse=True)`` per
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
from odl.models.deepfm import DeepFMDense
from odl.models.embedding_tables import WIDE_SUFFIX, build_embedding_layout
from odl.models.model_factory import model_groups
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
        self.deep_dense_idx = [col[n] for n in groups["deep_dense"]]
        self.wide_dense_idx = [col[n] for n in groups["wide_dense"]]
        deep_in = len(self.deep_keys) * self.dim + len(self.deep_dense_idx)
        self.dense = DeepFMDense(deep_in, self.dim if self.deep_keys else 0,
                                 len(self.wide_dense_idx), cfg)
        self.l2 = float(cfg.l2_regularization or cfg.dense_regularization)
        self.emb_reg = float(mc.embedding_regularization)
        self.wide_reg = float(cfg.wide_regularization or mc.embedding_regularization)
        self.device = torch.device(device)
        self.to(self.device)
        self.sparse_opt = torch.optim.Adagrad(list(self.tables.parameters()), lr=sparse_lr)
        self.dense_opt = torch.optim.Adam(list(self.dense.parameters()), lr=dense_lr)

    def _lookup(self, jt: dict, keys: list[tuple[str, str]]) -> list[torch.Tensor]:
        return [self.tables[t](jt[f].values(), jt[f].offsets()) for f, t in keys]

    def forward(self, batch: Batch) -> torch.Tensor:
        """Returns logits ``[B]`` (stores the pooled vectors for the loss)."""
        jt = batch.sparse.to_dict()
        d = self.dense
        b = batch.labels.shape[0]
        wide = d.wide_bias.expand(b, d.wide_output_dim)
        self._wide = None
        if self.wide_keys:
            self._wide = torch.stack(self._lookup(jt, self.wide_keys), dim=1)
            wide = wide + self._wide.sum(dim=1)
        if d.wide_dense is not None:
            wide = wide + d.wide_dense(batch.dense[:, self.wide_dense_idx])
        deep_in = []
        fm = None
        self._deep = None
        if self.deep_keys:
            emb = self._lookup(jt, self.deep_keys)
            self._deep = torch.stack(emb, dim=1)
            fm = 0.5 * (self._deep.sum(dim=1).square() - self._deep.square().sum(dim=1))
            deep_in.append(torch.cat(emb, dim=1))
        if self.deep_dense_idx:
            deep_in.append(batch.dense[:, self.deep_dense_idx])
        deep = d.dnn(torch.cat(deep_in, dim=1))
        if d.has_final:
            parts = [wide] + ([fm] if fm is not None else []) + [deep]
            return d.final_out(d.final_dnn(torch.cat(parts, dim=1))).squeeze(1)
        logit = d.deep_out(deep).squeeze(1) + wide.sum(dim=1)
        return logit + fm.sum(dim=1) if fm is not None else logit

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Same loss as ``DeepFM.loss``."""
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        if self.l2:
            loss = loss + self.l2 * sum(
                m.weight.square().sum() for m in self.dense.modules() if isinstance(m, nn.Linear))
        if self.emb_reg and self._deep is not None:
            loss = loss + self.emb_reg * self._deep.square().sum(dim=-1).mean()
        if self.wide_reg and self._wide is not None:
            loss = loss + self.wide_reg * self._wide.square().sum(dim=-1).mean()
        return loss

    def step(self, batch: Batch) -> float:
        """One training step; returns the loss."""
        batch = batch.to(self.device)
        self.train()
        self.sparse_opt.zero_grad(set_to_none=True)
        self.dense_opt.zero_grad(set_to_none=True)
        logits = self(batch)
        loss = self.loss(logits, batch)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Eval-mode predictions (float64)."""
        self.eval()
        out = torch.sigmoid(self(batch.to(self.device))).double().cpu().numpy()
        self.train()
        return out
