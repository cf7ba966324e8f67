"""EasyRec's MultiTower(DIN, BST) and DCN, TorchEasyRec's DCNV2: ``CtrModel``s of towers.

The contract is ``odl.models.ctr_model``. All are towers over named feature groups whose
outputs are concatenated into ``final_dnn`` and one logit::

    tower_i = DNN_i(x_i)                  MultiTower: one per multi_tower.towers[i]
    tower_i = Cross(x_i)                  DCN: deep_tower (a DNN) and cross_tower (Cross)
    tower_i = CrossV2(backbone(x))        DCNV2: over the first group, then its deep DNN
    tower_i = DIN(key, sequence)          MultiTowerDIN: its towers, then one per din_towers[i]
    tower_i = BST(key, sequence)          MultiTowerBST: its towers, then one per bst_towers[i]
                                          (odl.models.bst_tower; the group read as DIN's)
    logit   = Linear(final_dnn(concat(tower_0, tower_1, ...)) -> 1)   (final_dnn unset: none)

``x_i`` is the tower's feature group: the pooled embeddings of its embedded features, then
its dense (raw) features, then a vector per projected raw feature (EasyRec's RawFeature with
``embedding_dim`` and no ``boundaries``: ``value * p`` with ``p`` learned, one width per
group, ``building_blocks.ProjectedTail``). The cross network is DCN v1's,
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
layers; a DIN tower's: ``mlp.*``; a BST tower's: ``heads.<h>.*``, ``merge.*``, ``norm1.*``,
``feed_forward.*``, ``norm2.*``), ``dense.final_dnn.*``, ``dense.final_out.*``. With
MultiTower's and MultiTowerDIN's ``model_config.variational_dropout`` a DNN tower's input
is first masked by ``odl.models.feature_dropout`` (``dense.towers.<i>.0.logit_p``, its DNN
at ``1.*``), as EasyRec's input layer masks each group it reads; a tower over projected raw
features projects them first (``dense.towers.<i>.0.projection.weight``, the rest at
``1.*``); DIN towers, which EasyRec
reads through its sequence input layer, are not, and towers over sequences refuse it.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.feature_configs import (
    embedded_feature,
    feature_configs,
    projected_group_dim,
    projected_raw,
)
from odl.config.model_classes import sequence_attention_features
from odl.config.model_validation import (
    check_dropout_group,
    validate_dnn,
    validate_sequence_groups,
)
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.bst_tower import BSTTower
from odl.models.building_blocks import (
    CrossNet,
    CrossNetV2,
    ProjectedTail,
    build_mlp,
    build_optional_mlp,
)
from odl.models.ctr_losses import (
    ctr_loss,
    embedding_l2,
    linear_kernel_l2,
    random_loss_weights,
    sample_weight_tensor,
    session_tensor,
)
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.embedding_tables import EmbeddingLayout, build_embedding_layout
from odl.models.feature_dropout import FeatureDropout, variational_dropout_loss
from odl.models.group_inputs import embedded_and_dense, sequence_blocks
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.sequence_layers import (
    AttentionLayout,
    GroupSequences,
    SequenceBlock,
    TargetAttention,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

# the class whose towers are followed by din_towers (EasyRec reads both from multi_tower)
_DIN = "MultiTowerDIN"
# the class whose towers are followed by bst_towers
_BST = "MultiTowerBST"


class TowerDense(nn.Module):
    """The towers, ``final_dnn`` and the logit (module docstring); scriptable.

    Args:
        towers: per tower ``(kind, width, dense columns, settings)``: kind ``"dnn"``
            (settings: a ``DNN``), ``"cross"`` (settings: ``cross_num``), ``"cross_v2"``
            (settings: ``(CrossV2, backbone DNN or None)``), ``"bst"`` (settings:
            ``BSTTower``'s arguments; its input as a DIN tower's) or ``"din"`` (settings: ``(DNN,
            key width, seq_len, TorchEasyRec's encoder form, dense key columns, dense
            columns per item)``; its input: keys, positions, [dense key, dense positions,]
            length), the columns of its
            lookups in the ``towers`` group, its columns of the raw dense features.
        final_dnn: the ``final_dnn`` settings.
        sequences: per tower, the ``GroupSequences`` combining its group's sequences (their
            positions end its lookups, their lengths end its dense columns), or None.
        num_class: logits per sample (``[B]`` for 1, ``[B, C]`` for C > 1).
        dropouts: per tower, the variational dropout of its input (``model_config.
            variational_dropout``), or None.
        projections: per tower, ``(widths, dim)`` of the projected raw features whose
            values end its dense columns (``ProjectedTail``), or None.

    Raises:
        ValueError: a tower with no input, or an unsupported DNN setting.
    """

    tower_cols: list[int]
    tower_dense: list[list[int]]

    __constants__ = ["num_class"]

    def __init__(self, towers: Sequence[tuple[str, int, Sequence[int], object]],
                 final_dnn: pipeline_pb2.DNN,
                 sequences: "Sequence[GroupSequences | None] | None" = None,
                 num_class: int = 1,
                 dropouts: "Sequence[FeatureDropout | None] | None" = None,
                 projections: "Sequence[tuple[list[int], int] | None] | None" = None,
                 ) -> None:
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
            projected = projections[i] if projections else None
            if projected is not None:  # their values become vectors of dim
                in_width += len(projected[0]) * int(projected[1]) - sum(projected[0])
            seqs = sequences[i] if sequences else None
            if seqs is not None:  # the group's sequences, each combined into one vector
                in_width = seqs.out_width
            start = len(self.towers)
            if kind == "cross":
                self.towers.append(CrossNet(in_width, int(settings)))
                width += in_width
            elif kind == "din":
                dnn, key_width, seq_len, encoder, dense_key, dense_item = settings
                attention = TargetAttention(
                    AttentionLayout.plain(key_width, dense_key, dense_item), seq_len, dnn,
                    encoder)
                self.towers.append(attention)
                width += attention.out_width
            elif kind == "bst":
                bst = BSTTower(*settings)
                self.towers.append(bst)
                width += bst.out_width
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
            drop = dropouts[i] if dropouts else None
            if drop is not None:  # (a tower's input, before its network)
                self.towers[start] = nn.Sequential(drop, self.towers[start])
            if projected is not None:  # (first of all: the dropout masks the vectors)
                self.towers[start] = nn.Sequential(ProjectedTail(*projected),
                                                   self.towers[start])
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
        projected: feature group -> ``(columns of each projected raw feature, dim)``: they
            follow the group's dense features (absent: none).

    Raises:
        ValueError: a tower names an unknown group or reads nothing.
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

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
        projected: "dict[str, tuple[list[list[str]], int]] | None" = None,
    ) -> None:
        super().__init__()
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = {f: d for (f, _t), d in zip(layout.deep_keys, layout.deep_dims, strict=True)}
        col = {n: i for i, n in enumerate(dense_features)}
        _field, settings, towers = tower_settings(model_config)
        lookups: list[tuple[str, str]] = []
        dims: list[int] = []
        specs = []
        seq_mods: list[GroupSequences | None] = []
        drops: list[FeatureDropout | None] = []
        projections: list[tuple[list[int], int] | None] = []
        for kind, group, tower in towers:
            if group not in groups:
                raise ValueError(f"a tower reads feature group {group!r}, which does not exist")
            sparse, dense = groups[group]
            lookups += [(f, table_of[f]) for f in sparse]
            dims += [dim_of[f] for f in sparse]
            width = sum(dim_of[f] for f in sparse)
            if kind in ("din", "bst"):  # keys, then seq_len positions as wide as the keys
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
                if kind == "bst":
                    if dense_key or dense_item:
                        raise ValueError(f"BST group {group!r}: a BST tower reads embedded "
                                         "keys and sequences only")
                    tower = (key_width, seq_len, int(tower.seq_len),
                             int(tower.multi_head_size))
                else:
                    encoder = tower.HasField("attn_mlp")  # TorchEasyRec's DIN encoder
                    tower = (tower.attn_mlp if encoder else tower.dnn, key_width, seq_len,
                             encoder, dense_key, dense_item)
            proj_cols, proj_dim = (projected or {}).get(group, ([], 0))
            projections.append(([len(c) for c in proj_cols], proj_dim) if proj_cols else None)
            specs.append((kind, width, [col[n] for n in dense]
                          + [col[n] for cols in proj_cols for n in cols], tower))
            blocks = (sequences or {}).get(group, []) if kind not in ("din", "bst") else []
            if blocks:  # the blocks' lookups end the group's, their lengths its dense columns
                seq_mods.append(GroupSequences.of_blocks(blocks, dim_of, width, len(dense)))
            else:
                seq_mods.append(None)
            # EasyRec's input layer drops a (non-DIN) tower's group; its DIN towers read
            # their sequences through a layer without it
            drops.append(FeatureDropout([dim_of[f] for f in sparse] + [1] * len(dense)
                                        + [proj_dim] * len(proj_cols),
                                        model_config.variational_dropout)
                         if model_config.HasField("variational_dropout") and kind == "dnn"
                         and not blocks else None)
        self.dense = TowerDense(specs, settings.final_dnn, seq_mods,
                                int(model_config.num_class), drops, projections)
        self.variational_dropout = any(d is not None for d in drops)
        self.pooled_layout = (PooledGroup.of("towers", tuple(lookups), dims),)
        self.set_configured_loss(model_config, output_name)
        self.l2 = float(settings.l2_regularization)

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
                        softmax=self.dense.num_class > 1, sessions=session_tensor(batch),
                        data_weights=sample_weight_tensor(batch))
        if self.l2:
            sq = linear_kernel_l2(self.dense) + sum(
                m.weights.square().sum() for m in self.dense.modules() if isinstance(m, CrossNet))
            loss = loss + self.l2 * sq
        if self.variational_dropout:
            loss = loss + variational_dropout_loss(list(self.dense.modules()),
                                                   output.logits.shape[0])
        (pooled,) = output.pooled
        lookups = len(self.pooled_layout[0].lookups)
        if self.embedding_regularization and lookups:
            loss = loss + self.embedding_regularization * embedding_l2(pooled, lookups)
        return loss


# (kind, group name, settings): ("dnn", group, DNN), ("cross", group, cross_num),
# ("cross_v2", group, (CrossV2, backbone DNN or None)), ("bst", sequence attention group,
# BSTTower) or ("din", sequence attention group,
# DINTower)
TowerSpec = tuple[str, str, Any]


def tower_settings(model_config: pipeline_pb2.EasyRecModel) -> tuple[str, Any, list[TowerSpec]]:
    """``(field name, message, towers)`` of a tower-family model.

    Args:
        model_config: the model config (MultiTower, DCN or DCNV2).

    Returns:
        The settings message (its ``final_dnn`` joins the towers) and its towers in order,
        each ``(kind, group name, settings)``: ``("dnn", group, DNN)``, ``("cross", group,
        cross_num)``, ``("cross_v2", group, (CrossV2, backbone DNN or None))`` or
        ``("din", sequence attention group, DINTower)`` (MultiTowerDIN, after its towers) or
        ``("bst", sequence attention group, BSTTower)`` (MultiTowerBST, after its towers).
        DCNV2 reads the first feature group (TorchEasyRec's rule): its cross network, then
        its ``deep`` DNN when set.
    """
    field = model_config.WhichOneof("model")
    if field == "dcn_v2":
        d = model_config.dcn_v2
        group = model_config.feature_groups[0].group_name if model_config.feature_groups else ""
        towers: list[TowerSpec] = [
            ("cross_v2", group, (d.cross, d.backbone if d.HasField("backbone") else None))]
        if d.HasField("deep"):
            towers.append(("dnn", group, d.deep))
        return "dcn_v2", d, towers
    if field == "dcn":
        d = model_config.dcn
        return "dcn", d, [("dnn", d.deep_tower.input, d.deep_tower.dnn),
                          ("cross", d.cross_tower.input, int(d.cross_tower.cross_num))]
    m = model_config.multi_tower
    towers: list[TowerSpec] = [("dnn", t.input, t.dnn) for t in m.towers]
    if model_config.model_class == _DIN:
        towers += [("din", t.input, t) for t in m.din_towers]
    if model_config.model_class == _BST:
        towers += [("bst", t.input, t) for t in m.bst_towers]
    return "multi_tower", m, towers


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> TowerModel:
    """MultiTower(DIN) / DCN(V2): the towers' groups, split into embedded and dense features.

    A DIN tower's group (a sequence attention group) holds its keys, then its sequences'
    positional keys position after position, and, as its dense feature, the first
    sequence's length column.
    """
    mc = config.model_config
    output_name = (list(config.data_config.label_fields) or ["label"])[0]
    sequences = sequence_blocks(config, feature_builder)
    field, _settings, towers = tower_settings(mc)
    groups = embedded_and_dense(mc, feature_builder, sequences)
    seq_lens = feature_builder.sequence_features
    dense_seqs = feature_builder.dense_sequence_features
    cols = feature_builder.dense_feature_columns
    din_dense: dict[str, tuple[int, int]] = {}
    for kind, group, _tower in towers:
        if kind not in ("din", "bst") or group in groups:
            continue
        keys, hists = sequence_attention_features(mc, group)
        if not hists or any(h not in seq_lens for h in hists):
            raise ConfigError("model_config.seq_att_groups",
                              f"group {group!r} needs SequenceFeatures in hist_seq")
        positions = seq_lens[hists[0]]
        # embedded keys and items first, then the dense ones (each position's after another)
        dense_keys = [c for k in keys if k in cols for c in cols[k]]
        items = [h for h in hists if h not in dense_seqs]
        dense_items = [h for h in hists if h in dense_seqs]
        groups[group] = ([k for k in keys if k not in cols]
                         + [sequence_key(h, p) for p in range(positions) for h in items],
                         dense_keys + [cols[h][p] for p in range(positions) for h in dense_items]
                         + [sequence_length_column(hists[0])])
        din_dense[group] = (len(dense_keys), len(dense_items))
    features = {fc.feature_name: fc for fc in feature_configs(config)}
    projected: dict[str, tuple[list[list[str]], int]] = {}
    for g in mc.feature_groups:  # EasyRec's projected raw features: vectors after the dense
        names = [n for n in g.feature_names if n in features and projected_raw(features[n])]
        if names and g.group_name in groups:
            proj_cols = [cols[n] for n in names]
            taken = {c for cols_of_one in proj_cols for c in cols_of_one}
            sparse, dense = groups[g.group_name]
            groups[g.group_name] = (sparse, [c for c in dense if c not in taken])
            projected[g.group_name] = (proj_cols, features[names[0]].embedding_dim)
    embedded: list[str] = []
    for _kind, group, _tower in towers:
        for f in groups.get(group, ([], []))[0]:
            if f not in embedded:
                embedded.append(f)
    try:
        layout = build_embedding_layout(feature_builder.table_specs, embedded, [], 1,
                                        mixed_dims=True)
        return TowerModel(layout, feature_builder.dense_feature_names, groups, mc,
                          output_name=output_name, sequences=sequences, din_dense=din_dense,
                          projected=projected)
    except ValueError as e:
        raise ConfigError(f"model_config.{field}", str(e)) from e


def _validate(check: ModelCheck) -> None:
    """Towers over existing groups, their settings, final_dnn."""
    config, features, groups = check.config, check.features, check.groups
    mc = config.model_config
    field, settings, towers = tower_settings(mc)
    where = f"model_config.{field}"
    if not mc.HasField(field):
        raise ConfigError(where, f"{mc.model_class} needs {field} {{ ... final_dnn {{ ... }} }}")
    if field == "multi_tower":
        if not towers:
            raise ConfigError(f"{where}.towers", "at least one tower is needed")
        paths = [f"{where}.towers[{i}]" for i in range(len(settings.towers))]
    elif field == "dcn_v2":
        if not settings.HasField("cross"):
            raise ConfigError(f"{where}.cross", "required (e.g. { cross_num: 3 low_rank: 32 })")
        cross = settings.cross
        if not 1 <= cross.cross_num <= limits.MAX_HIDDEN_LAYERS:
            raise ConfigError(f"{where}.cross.cross_num",
                              f"must be 1 to {limits.MAX_HIDDEN_LAYERS}, got {cross.cross_num}")
        if not 1 <= cross.low_rank <= limits.MAX_HIDDEN_UNITS:
            raise ConfigError(f"{where}.cross.low_rank",
                              f"must be 1 to {limits.MAX_HIDDEN_UNITS:,}, got {cross.low_rank}")
        if settings.HasField("backbone"):
            validate_dnn(settings.backbone, f"{where}.backbone", required=False)
        paths = [f"{where}.cross", f"{where}.deep"][: len(towers)]
    else:
        for name in ("deep_tower", "cross_tower"):
            if not settings.HasField(name):
                raise ConfigError(f"{where}.{name}", "required")
        paths = [f"{where}.deep_tower", f"{where}.cross_tower"]
    for name, owner in (("din_towers", _DIN), ("bst_towers", _BST)):
        if field != "multi_tower" or not getattr(settings, name):
            continue
        if mc.model_class != owner:
            logger.warning("%s.%s has no effect with model_class %r and is ignored (as "
                           "EasyRec's %s ignores it); model_class \"%s\" reads them",
                           where, name, mc.model_class, mc.model_class, owner)
            continue
        paths += [f"{where}.{name}[{i}]" for i in range(len(getattr(settings, name)))]
        validate_sequence_groups(config, features)
    for path, (kind, group, tower) in zip(paths, towers, strict=True):
        if kind in ("din", "bst"):
            names = [g.group_name for g in mc.seq_att_groups]
            if group not in names:
                raise ConfigError(f"{path}.input",
                                  f"no model_config.seq_att_groups group named {group!r} "
                                  f"(groups: {names})")
        if kind == "bst":
            _validate_bst(check, path, group, tower)
            continue
        if kind == "din":
            if tower.HasField("attn_mlp"):  # TorchEasyRec's encoder: any MLP, then a score
                validate_dnn(tower.attn_mlp, f"{path}.attn_mlp", required=True)
                continue
            validate_dnn(tower.dnn, f"{path}.dnn", required=True)
            if tower.dnn.hidden_units[-1] != 1:
                raise ConfigError(f"{path}.dnn.hidden_units",
                                  "a DIN tower's dnn ends in a layer of 1 unit (the score of "
                                  "a position), e.g. [128, 64, 32, 1]")
            continue
        if group not in groups:
            raise ConfigError(f"{path}.input", f"no feature group named {group!r}")
        gi = groups[group]
        check_dropout_group(mc, mc.feature_groups[gi], features)
        projected_group_dim(mc.feature_groups[gi], features,
                            f"model_config.feature_groups[{gi}].feature_names", "a tower's group")
        if kind == "dnn":
            validate_dnn(tower, path if field == "dcn_v2" else f"{path}.dnn", required=True)
        elif kind == "cross_v2":
            continue  # checked above
        elif not 1 <= tower <= limits.MAX_HIDDEN_LAYERS:
            raise ConfigError(f"{path}.cross_num",
                              f"must be 1 to {limits.MAX_HIDDEN_LAYERS}, got {tower}")
    # unset: no hidden layer, the towers' concatenation goes to the logit (EasyRec reads an
    # absent final_dnn as an empty DNN)
    validate_dnn(settings.final_dnn, f"{where}.final_dnn", required=False)
    if settings.l2_regularization < 0:
        raise ConfigError(f"{where}.l2_regularization", "must be >= 0")


def _validate_bst(check: ModelCheck, path: str, group: str,
                  tower: pipeline_pb2.BSTTower) -> None:
    """A BST tower: its settings; its group's keys and sequences embedded ids."""
    if tower.seq_len < 2:
        raise ConfigError(f"{path}.seq_len", "must be >= 2 (the sequence's positions and the "
                                             "target item)")
    if tower.seq_len > limits.MAX_SEQUENCE_LENGTH + 1:
        raise ConfigError(f"{path}.seq_len", f"at most {limits.MAX_SEQUENCE_LENGTH + 1}")
    if tower.multi_head_size < 1:
        raise ConfigError(f"{path}.multi_head_size", "must be >= 1")
    keys, hists = sequence_attention_features(check.config.model_config, group)
    raw = [n for n in keys + hists if n in check.features
           and not embedded_feature(check.features[n])]
    if raw:
        raise ConfigError(f"{path}.input", f"a BST tower reads embedded keys and sequences "
                                           f"only; {', '.join(raw)} of group {group!r} "
                                           f"{'is' if len(raw) == 1 else 'are'} raw values")


for _name in ("MultiTower", _DIN, "DCN", "DCNV2", _BST):
    register_model(ModelClass(_name, _build, _validate, group_attention="all",
                              variational_dropout=_name in ("MultiTower", _DIN, _BST),
                              projected_raw=True))
