"""EasyRec's MultiTower and DCN, TorchEasyRec's DCNV2: ``CtrModel``s of towers.

The contract is ``odl.models.ctr_model``. All are towers over named feature groups whose
outputs are concatenated into ``final_dnn`` and one logit::

    tower_i = DNN_i(x_i)                  MultiTower: one per multi_tower.towers[i]
    tower_i = Cross(x_i)                  DCN: deep_tower (a DNN) and cross_tower (Cross)
    tower_i = CrossV2(backbone(x))        DCNV2: over the first group, then its deep DNN
    tower_i = DIN(key, sequence)          MultiTowerDIN: its towers, then one per din_towers[i]
    logit   = Linear(final_dnn(concat(tower_0, tower_1, ...)) -> 1)

``x_i`` is the tower's feature group: the pooled embeddings of its embedded features, then
its dense (raw) features. The cross network is DCN v1's,
``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l`` for ``cross_num`` layers (``w_l``, ``b_l`` of
the input's width); DCN v2's is ``CrossNetV2`` of ``odl.models.building_blocks`` (low-rank
weights); a DIN tower is ``TargetAttention`` over a sequence attention group
(``model_config.seq_att_groups``: its keys' lookups, then its SequenceFeatures' positions,
and the first sequence's length as the tower's dense input). The sparse part has one pooled
group, ``towers``: every tower's lookups, tower after tower (a feature read by two towers is
looked up twice, which is also how embedding regularization counts it), each as wide as its
table (features of different ``embedding_dim`` are concatenated, as in EasyRec).

Loss: the configured prediction loss (``odl.models.ctr_losses``; binary cross entropy by
default) + ``l2_regularization`` * the sum of squared
dense Linear kernels and cross weights + ``embedding_regularization`` * mean over (sample,
lookup) of the squared pooled embedding.

Parameter names: ``dense.towers.<i>.*`` (a DNN: ``Sequential`` layers; a cross network:
``weights``, ``biases``; DCNV2's: ``0.*`` the backbone, ``1.layers.<l>.*`` the cross
layers; a DIN tower's: ``mlp.*``), ``dense.final_dnn.*``, ``dense.final_out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging
from collections.abc import Sequence

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from odl.config.model_classes import sequence_attention_features, tower_settings
from odl.features.batch import Batch
from odl.models.building_blocks import (
    CrossNet,
    CrossNetV2,
    GroupSequences,
    SequenceBlock,
    TargetAttention,
    build_mlp,
    build_optional_mlp,
)
from odl.models.ctr_losses import (
    add_loss_weights,
    ctr_loss,
    embedding_l2,
    learned_weight_terms,
    linear_kernel_l2,
    loss_terms,
    random_loss_weights,
    session_tensor,
)
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup, class_outputs
from odl.models.embedding_tables import EmbeddingLayout
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class TowerDense(nn.Module):
    """The towers, ``final_dnn`` and the logit (module docstring); scriptable.

    Args:
        towers: per tower ``(kind, width, dense columns, settings)``: kind ``"dnn"``
            (settings: a ``DNN``), ``"cross"`` (settings: ``cross_num``), ``"cross_v2"``
            (settings: ``(CrossV2, backbone DNN or None)``) or ``"din"`` (settings: ``(DNN,
            key width, seq_len, TorchEasyRec's encoder form, dense key columns, dense
            columns per item)``; its input: keys, positions, [dense key, dense positions,]
            length), the columns of its
            lookups in the ``towers`` group, its columns of the raw dense features.
        final_dnn: the ``final_dnn`` settings.
        sequences: per tower, the ``GroupSequences`` combining its group's sequences (their
            positions end its lookups, their lengths end its dense columns), or None.
        num_class: logits per sample (``[B]`` for 1, ``[B, C]`` for C > 1).

    Raises:
        ValueError: a tower with no input, or an unsupported DNN setting.
    """

    tower_cols: list[int]
    tower_dense: list[list[int]]

    __constants__ = ["num_class"]

    def __init__(self, towers: Sequence[tuple[str, int, Sequence[int], object]],
                 final_dnn: pipeline_pb2.DNN,
                 sequences: "Sequence[GroupSequences | None] | None" = None,
                 num_class: int = 1) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.tower_cols = [0]
        self.tower_dense = []
        self.towers = nn.ModuleList()
        width = 0
        for i, (kind, lookup_width, dense_cols, settings) in enumerate(towers):
            in_width = int(lookup_width) + len(dense_cols)
            if in_width == 0:
                raise ValueError(f"tower {i} reads no feature")
            self.tower_cols.append(self.tower_cols[-1] + int(lookup_width))
            self.tower_dense.append([int(c) for c in dense_cols])
            seqs = sequences[i] if sequences else None
            if seqs is not None:  # the group's sequences, each combined into one vector
                in_width = seqs.out_width
            start = len(self.towers)
            if kind == "cross":
                self.towers.append(CrossNet(in_width, int(settings)))
                width += in_width
            elif kind == "din":
                dnn, key_width, seq_len, encoder, dense_key, dense_item = settings
                attention = TargetAttention(key_width, seq_len, dnn, encoder, dense_key,
                                            dense_item)
                self.towers.append(attention)
                width += attention.out_width
            elif kind == "cross_v2":
                cross, backbone = settings
                mlp, out = build_optional_mlp(in_width, backbone)
                self.towers.append(nn.Sequential(
                    mlp, CrossNetV2(out, int(cross.cross_num), int(cross.low_rank))))
                width += out
            else:
                mlp, out = build_mlp(in_width, settings)
                self.towers.append(mlp)
                width += out
            if seqs is not None:
                self.towers[start] = nn.Sequential(seqs, self.towers[start])
        self.final_dnn, final_width = build_mlp(width, final_dnn)
        self.final_out = nn.Linear(final_width, self.num_class)

    def forward(self, towers: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]``.

        Args:
            towers: ``[B, total lookups * dim]``, every tower's pooled lookups in order.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        outs: list[torch.Tensor] = []
        for i, tower in enumerate(self.towers):
            parts: list[torch.Tensor] = []
            start = self.tower_cols[i]
            end = self.tower_cols[i + 1]
            if end > start:
                parts.append(towers[:, start:end])
            cols = self.tower_dense[i]
            if len(cols) > 0:
                parts.append(dense[:, cols])
            x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            outs.append(tower(x))
        h = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        out = self.final_out(self.final_dnn(h))
        return out.squeeze(1) if self.num_class == 1 else out


class TowerModel(CtrModel):
    """MultiTower or DCN over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        layout: table layout (every embedded feature of the towers' groups, as deep lookups).
        dense_features: names of ``Batch.dense`` columns, in order.
        groups: feature group name -> ``(embedded features, dense features)``.
        model_config: the ``EasyRecModel`` (``multi_tower`` or ``dcn``).
        output_name: the name of the model's one output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).
        sequences: feature group -> its sequence blocks, whose lookups end the group's
            embedded features and whose length columns end its dense features.
        din_dense: a DIN tower's group -> ``(dense key columns, dense columns per item)``:
            its dense features are the key's dense columns, then each position's dense item
            columns, then the length (absent: no dense part).

    Raises:
        ValueError: a tower names an unknown group or reads nothing.
    """

    def __init__(
        self,
        layout: EmbeddingLayout,
        dense_features: Sequence[str],
        groups: dict[str, tuple[list[str], list[str]]],
        model_config: pipeline_pb2.EasyRecModel,
        output_name: str = "label",
        ebc_device: "torch.device | str" = "meta",
        sequences: "dict[str, list[SequenceBlock]] | None" = None,
        din_dense: "dict[str, tuple[int, int]] | None" = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.ebc = EmbeddingBagCollection(tables=layout.configs, device=torch.device(ebc_device),
                                          is_weighted=layout.weighted)
        table_of = dict(layout.deep_keys)
        dim_of = {f: d for (f, _t), d in zip(layout.deep_keys, layout.deep_dims, strict=True)}
        col = {n: i for i, n in enumerate(dense_features)}
        _field, settings, towers = tower_settings(model_config)
        lookups: list[tuple[str, str]] = []
        dims: list[int] = []
        specs = []
        seq_mods: list[GroupSequences | None] = []
        for kind, group, tower in towers:
            if group not in groups:
                raise ValueError(f"a tower reads feature group {group!r}, which does not exist")
            sparse, dense = groups[group]
            lookups += [(f, table_of[f]) for f in sparse]
            dims += [dim_of[f] for f in sparse]
            width = sum(dim_of[f] for f in sparse)
            if kind == "din":  # keys, then seq_len positions as wide as the keys
                keys, _hists = sequence_attention_features(model_config, group)
                dense_key, dense_item = (din_dense or {}).get(group, (0, 0))
                key_emb = sum(dim_of[k] for k in keys if k in dim_of)
                key_width = key_emb + dense_key
                item_emb = key_width - dense_item
                if item_emb > 0:
                    seq_len, rest = divmod(width - key_emb, item_emb)
                else:
                    seq_len, rest = divmod(len(dense) - 1 - dense_key, max(dense_item, 1))
                if (key_width == 0 or rest or item_emb < 0
                        or len(dense) - 1 - dense_key != seq_len * dense_item):
                    raise ValueError(f"DIN group {group!r}: the sequences' items must be as "
                                     f"wide as the keys ({key_width})")
                encoder = tower.HasField("attn_mlp")  # TorchEasyRec's DIN encoder
                tower = (tower.attn_mlp if encoder else tower.dnn, key_width, seq_len, encoder,
                         dense_key, dense_item)
            specs.append((kind, width, [col[n] for n in dense], tower))
            blocks = (sequences or {}).get(group, []) if kind != "din" else []
            if blocks:  # the blocks' lookups end the group's, their lengths its dense columns
                seq_mods.append(GroupSequences.of_blocks(blocks, dim_of, width, len(dense)))
            else:
                seq_mods.append(None)
        self.dense = TowerDense(specs, settings.final_dnn, seq_mods,
                                int(model_config.num_class))
        self.pooled_layout = (PooledGroup.of("towers", tuple(lookups), dims),)
        self.output_names, self.output_labels = class_outputs(output_name,
                                                              model_config.num_class)
        self.l2 = float(settings.l2_regularization)
        self.embedding_regularization = float(model_config.embedding_regularization)
        self.loss_terms = loss_terms(model_config)
        self.learned = learned_weight_terms(model_config, self.loss_terms)
        self.model_config = model_config
        add_loss_weights(self.dense, sum(self.learned))

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The prediction loss plus the regularization terms (module docstring).

        Args:
            output: ``forward(batch)``'s result.
            batch: the batch (labels).

        Returns:
            Scalar loss.
        """
        loss = ctr_loss(output.logits, batch.labels, self.loss_terms, learned=self.learned,
                        uncertainty=getattr(self.dense, "loss_uncertainty", None),
                        term_weights=random_loss_weights(self.model_config,
                                                         len(self.loss_terms), output.logits),
                        softmax=self.dense.num_class > 1, sessions=session_tensor(batch))
        if self.l2:
            sq = linear_kernel_l2(self.dense) + sum(
                m.weights.square().sum() for m in self.dense.modules() if isinstance(m, CrossNet))
            loss = loss + self.l2 * sq
        (pooled,) = output.pooled
        lookups = len(self.pooled_layout[0].lookups)
        if self.embedding_regularization and lookups:
            loss = loss + self.embedding_regularization * embedding_l2(pooled, lookups)
        return loss
