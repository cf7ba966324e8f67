"""EasyRec's DLRM (``model_class: "DLRM"``, settings ``dlrm {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. Two feature groups: "dense" (raw values, and any
embedded features, concatenated) through the bottom DNN, and "sparse" (embedded features,
one vector each). With ``C = max(num_class, 1)`` outputs::

    d     = bot_dnn(concat(the dense group's raw values, its pooled lookups))    [B, H]
    v_i   = the sparse group's pooled lookups                                     [B, D]
    "dot" (H == D):
      z     = the dot products <a, b> of the vectors [d, v_1, ..., v_n], pairs (a, b) of
              the upper triangle in row order (a before b; a == b too with
              arch_interaction_itself)                                           [B, P]
      x     = concat(z, v_1 .. v_n, d)   (v: unless arch_with_sparse is false; d: with
                                          arch_with_dense_feature)
    "cat":
      x     = concat(d, v_1 .. v_n)      (the v_i may differ in width)
    logit = Linear(top_dnn(x) -> C)       ([B] for C = 1)

Without a "dense" group (TorchEasyRec's form only: its one group is the sparse group) ``d``
is left out everywhere.

TorchEasyRec's ``dlrm { dense_mlp final arch_with_sparse }`` is the same model: dense_mlp is
bot_dnn, final is top_dnn, the interaction is "dot" without self pairs and ``d`` always joins
the top tower (its concatenation order differs, which only permutes top_dnn's first kernel);
its l2_regularization is 0 unless given (TorchEasyRec has none).

Loss: the configured prediction loss (``odl.models.ctr_losses``) + ``dlrm.l2_regularization``
* the squared dense Linear kernels + ``embedding_regularization`` * the mean squared pooled
lookup of each group.

Parameter names: ``dense.bottom.*`` (absent without a "dense" group), ``dense.top.*``,
``dense.out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads
``DLRMDense``'s class annotations as types.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import embedded_feature
from odl.config.model_validation import validate_dnn
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import build_mlp
from odl.models.ctr_model import CtrModel, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.group_inputs import embedded_and_dense
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

INTERACTION_OPS = ("dot", "cat")


@dataclass(frozen=True)
class DLRMArch:
    """The DLRM settings of either spelling (EasyRec's or TorchEasyRec's), resolved.

    Attributes:
        bottom: the bottom DNN (``bot_dnn`` / ``dense_mlp``).
        bottom_field: its field name, for messages.
        top: the top DNN (``top_dnn`` / ``final``).
        top_field: its field name.
        op: ``"dot"`` or ``"cat"``.
        itself: "dot" keeps each vector's product with itself.
        with_dense: "dot": the bottom output joins the top tower's input.
        with_sparse: "dot": the sparse vectors join the top tower's input.
        l2: weight of the squared dense Linear kernels.
        torcheasyrec: the settings are TorchEasyRec's spelling.
    """

    bottom: pipeline_pb2.DNN
    bottom_field: str
    top: pipeline_pb2.DNN
    top_field: str
    op: str
    itself: bool
    with_dense: bool
    with_sparse: bool
    l2: float
    torcheasyrec: bool

    @classmethod
    def of(cls, settings: pipeline_pb2.DLRM) -> "DLRMArch":
        """The resolved settings of a ``DLRM`` message (either spelling).

        Args:
            settings: ``model_config.dlrm``.

        Returns:
            The settings.

        Raises:
            ConfigError: both spellings of a tower given.
        """
        for easyrec, tz in (("bot_dnn", "dense_mlp"), ("top_dnn", "final")):
            if settings.HasField(easyrec) and settings.HasField(tz):
                raise ConfigError(f"model_config.dlrm.{tz}",
                                  f"give one of {tz} (TorchEasyRec) and {easyrec} (EasyRec)")
        tz = settings.HasField("dense_mlp") or settings.HasField("final")
        bottom = "dense_mlp" if settings.HasField("dense_mlp") else "bot_dnn"
        top = "final" if settings.HasField("final") else "top_dnn"
        l2 = float(settings.l2_regularization)
        if tz and not settings.HasField("l2_regularization"):
            l2 = 0.0
        return cls(getattr(settings, bottom), bottom, getattr(settings, top), top,
                   settings.arch_interaction_op, bool(settings.arch_interaction_itself),
                   bool(settings.arch_with_dense_feature) or tz,
                   bool(settings.arch_with_sparse), l2, tz)


class DLRMDense(nn.Module):
    """DLRM after the embedding lookup (the module docstring); scriptable.

    Args:
        arch: the settings.
        sparse_dims: width of each sparse lookup, in column order.
        dense_idx: ``Batch.dense`` columns of the "dense" group (raw values).
        dense_emb_width: columns of the "dense" group's pooled lookups.
        has_dense_group: a "dense" group exists (the bottom DNN is built).
        num_class: outputs (``[B]`` logits for 1, ``[B, C]`` for C > 1).

    Raises:
        ValueError: "dot" over vectors of different widths, an unsupported DNN setting.
    """

    __constants__ = ["num_sparse", "dim", "dot", "offset", "with_dense", "with_sparse",
                     "num_class", "dense_emb_width"]
    dense_idx: list[int]

    def __init__(self, arch: DLRMArch, sparse_dims: Sequence[int], dense_idx: Sequence[int],
                 dense_emb_width: int, has_dense_group: bool, num_class: int = 1) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.num_sparse = len(sparse_dims)
        self.dense_idx = [int(i) for i in dense_idx]
        self.dense_emb_width = int(dense_emb_width)
        self.dot = arch.op == "dot"
        self.offset = 0 if arch.itself else 1
        sparse_width = sum(int(d) for d in sparse_dims)
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        bottom_width = 0
        if has_dense_group:
            self.bottom, bottom_width = build_mlp(len(self.dense_idx) + self.dense_emb_width,
                                                  arch.bottom)
        else:
            self.bottom = None
        self.with_dense = bool(arch.with_dense) and self.bottom is not None
        self.with_sparse = bool(arch.with_sparse)
        if self.dot:
            widths = set(int(d) for d in sparse_dims) | ({bottom_width} if bottom_width else set())
            if len(widths) != 1:
                raise ValueError("the dot interaction needs the sparse embeddings and bot_dnn's "
                                 f"output of one width; got {sorted(widths)}")
            self.dim = widths.pop()
            n = self.num_sparse + (1 if self.bottom is not None else 0)
            pairs = n * (n - 1) // 2 + (n if arch.itself else 0)
            top_in = (pairs + (sparse_width if self.with_sparse else 0)
                      + (bottom_width if self.with_dense else 0))
        else:
            self.dim = 0
            self.with_sparse = True
            top_in = bottom_width + sparse_width
        self.top, top_width = build_mlp(top_in, arch.top)
        self.out = nn.Linear(top_width, self.num_class)

    def forward(self, sparse: torch.Tensor, dense_emb: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1).

        Args:
            sparse: ``[B, sum of sparse widths]`` the sparse group's pooled lookups.
            dense_emb: ``[B, dense_emb_width]`` the dense group's pooled lookups.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        b = dense.shape[0]
        d = torch.zeros(0)
        bottom = self.bottom
        if bottom is not None:
            x = dense[:, self.dense_idx]
            if self.dense_emb_width > 0:
                x = torch.cat([x, dense_emb], dim=1)
            d = bottom(x)
        parts: list[torch.Tensor] = []
        if self.dot:
            v = sparse.reshape(b, self.num_sparse, self.dim)
            if bottom is not None:
                v = torch.cat([d.unsqueeze(1), v], dim=1)
            n = v.shape[1]
            z = torch.bmm(v, v.transpose(1, 2))
            rows_cols = torch.triu_indices(n, n, self.offset, device=z.device)
            parts.append(z[:, rows_cols[0], rows_cols[1]])
            if self.with_sparse:
                parts.append(sparse)
            if self.with_dense:
                parts.append(d)
        else:
            if bottom is not None:
                parts.append(d)
            parts.append(sparse)
        out = self.out(self.top(torch.cat(parts, dim=1)))
        return out.squeeze(1) if self.num_class == 1 else out


class DLRM(CtrModel):
    """DLRM over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        sparse: the sparse group's embedded features.
        dense_emb: the dense group's embedded features.
        dense_raw: the dense group's ``Batch.dense`` columns.
        has_dense_group: a "dense" group exists.
        model_config: the ``EasyRecModel`` (``dlrm``, regularization, losses).
        output_name: the name of the model's output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).

    Raises:
        ValueError: a feature without a table, or widths "dot" cannot take.
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, feature_builder: FeatureBuilder, sparse: Sequence[str],
                 dense_emb: Sequence[str], dense_raw: Sequence[str], has_dense_group: bool,
                 model_config: pipeline_pb2.EasyRecModel, output_name: str = "label",
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        layout = build_embedding_layout(feature_builder.table_specs,
                                        list(sparse) + list(dense_emb), [], 1, mixed_dims=True)
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        self.arch = DLRMArch.of(model_config.dlrm)
        self.kernel_l2 = self.arch.l2
        self.dense = DLRMDense(self.arch, [dim_of[f] for f in sparse], [col[c] for c in dense_raw],
                               sum(dim_of[f] for f in dense_emb), has_dense_group,
                               int(model_config.num_class))
        self.pooled_layout = (
            PooledGroup.of("sparse", tuple((f, table_of[f]) for f in sparse),
                           [dim_of[f] for f in sparse]),
            PooledGroup.of("dense", tuple((f, table_of[f]) for f in dense_emb),
                           [dim_of[f] for f in dense_emb]),
        )
        self.set_configured_loss(model_config, output_name)


def sparse_group_name(model_config: pipeline_pb2.EasyRecModel) -> str:
    """The sparse group: "sparse", or the only group (TorchEasyRec's one-group form)."""
    groups = model_config.feature_groups
    if len(groups) == 1 and groups[0].group_name != "dense":
        return groups[0].group_name
    return "sparse"


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> DLRM:
    mc = config.model_config
    groups = embedded_and_dense(mc, feature_builder)
    sparse, _raw = groups[sparse_group_name(mc)]
    dense_emb, dense_raw = groups.get("dense", ([], []))
    try:
        return DLRM(feature_builder, sparse, dense_emb, dense_raw, "dense" in groups, mc,
                    output_name=(list(config.data_config.label_fields) or ["label"])[0])
    except ValueError as e:
        raise ConfigError("model_config.dlrm", str(e)) from e


def _validate(check: ModelCheck) -> None:
    """The groups, the towers, the interaction and its one embedding width (``dot``)."""
    mc, features, groups = check.config.model_config, check.features, check.groups
    if not mc.HasField("dlrm"):
        raise ConfigError(check.where(), "DLRM needs dlrm { bot_dnn { hidden_units } "
                                         "top_dnn { hidden_units } }")
    arch = DLRMArch.of(check.settings)
    sparse_name = sparse_group_name(mc)
    if sparse_name not in groups:
        raise ConfigError("model_config.feature_groups",
                          'DLRM needs a feature group named "sparse" (its embedded features)')
    if "dense" not in groups and not arch.torcheasyrec:
        raise ConfigError("model_config.feature_groups",
                          'DLRM needs a feature group named "dense" (the input of bot_dnn)')
    if arch.op not in INTERACTION_OPS:
        raise ConfigError(check.where("arch_interaction_op"),
                          f"must be one of {', '.join(INTERACTION_OPS)}, got {arch.op!r}")
    if check.settings.l2_regularization < 0:
        raise ConfigError(check.where("l2_regularization"), "must be >= 0")
    validate_dnn(arch.top, check.where(arch.top_field), required=True)
    if "dense" in groups:
        validate_dnn(arch.bottom, check.where(arch.bottom_field), required=True)
    sequence = pipeline_pb2.FeatureConfig.SequenceFeature
    dims: dict[str, int] = {}
    for i, g in enumerate(mc.feature_groups):
        if g.group_name not in (sparse_name, "dense"):
            continue
        for j, name in enumerate(g.feature_names):
            fc = features[name]
            where = f"model_config.feature_groups[{i}].feature_names[{j}]"
            if fc.feature_type == sequence:
                raise ConfigError(where, f"SequenceFeature {name!r}: DLRM reads no sequences")
            if g.group_name == sparse_name:
                if not embedded_feature(fc):
                    raise ConfigError(where, f"{name!r} is a raw value: the {sparse_name!r} "
                                             'group takes embedded features (raw values go in '
                                             'the "dense" group)')
                dims[name] = int(fc.embedding_dim)
    si = groups[sparse_name]
    if not dims:
        raise ConfigError(f"model_config.feature_groups[{si}].feature_names",
                          f"the {sparse_name!r} group needs at least one embedded feature")
    if arch.op != "dot":
        return
    if len(set(dims.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(dims.items())[:6])
        raise ConfigError(f"model_config.feature_groups[{si}].feature_names",
                          f'the dot interaction needs every feature of the {sparse_name!r} '
                          f"group to have the same embedding_dim; got {shown}"
                          f"{', ...' if len(dims) > 6 else ''}")
    dim = next(iter(dims.values()))
    if "dense" in groups and arch.bottom.hidden_units[-1] != dim:
        units = arch.bottom.hidden_units
        raise ConfigError(check.where(f"{arch.bottom_field}.hidden_units"),
                          f"the dot interaction needs the last hidden unit ({units[-1]}) to "
                          f"equal the {sparse_name!r} group's embedding_dim ({dim})")


register_model(ModelClass("DLRM", _build, _validate))
