"""EasyRec's RankModel (``model_class: "RankModel"``): the network is ``model_config.backbone``.

The contract is ``odl.models.ctr_model``. The backbone (``odl.models.backbone``) is a DAG of
blocks over the feature groups, configured as in EasyRec: input layers, MLPs, FM, DLRM's dot
interaction, DCN's cross layers, MaskNet, FiBiNet, xDeepFM's CIN, PPNet, numeric embeddings,
DIN / BST / TextCNN over raw sequences, lambdas of a safe subset. Its output, through
``backbone.top_mlp``, ends in a Linear layer to ``num_class`` logits unless its last
dimension is ``num_class`` already. docs/config.md "RankModel" lists what each block may be.

The sparse part looks up each ``(feature, table)`` a block reads once, in one pooled group,
``"backbone"`` (``odl.models.backbone.backbone_inputs``).

``model_params.wide_to_logit`` (odl extension, default true): with one logit reached through
``top_mlp`` or the output layer, the WIDE groups' first-order weights (the wide lookups, every
column) are also summed into the logit, as DeepFM's ``wide_to_logit`` adds its wide part
beside a final DNN: per-id effects then learn online without waiting for the layers between
them and the logit. No effect when the backbone's output is the logit itself (an Add of the
wide sum, EasyRec's DeepFM form) or without a WIDE group read.

Loss: the configured prediction loss (``odl.models.ctr_losses``) + the backbone's auxiliary
losses in training (``AuxiliaryLoss`` blocks, contrastive learning over ``packages``) +
``model_params.l2_regularization`` * the squared kernels of every Linear layer of the
backbone (EasyRec regularizes its own layers' Dense kernels; odl regularizes the Keras
built-ins' too, and none of the kernels EasyRec keeps unregularized: CIN's, Highway's, the
numeric embeddings', the transformer's) + ``embedding_regularization`` * the mean squared
pooled lookup.

Parameter names: ``dense.graph.inputs.<i>.*`` (input layers: their normalizations, sequence
combiners, wide raw matrices), ``dense.graph.nodes.<j>.layer.steps.<k>.*`` (the blocks'
layers, in topological order; a package's input layers ``dense.graph.nodes.<j>.layer.layer.*``;
a package's layers under its first call's nodes), ``dense.top.*``, ``dense.out.*``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.backbone.backbone_graph import GraphBuilder
from odl.models.backbone.backbone_inputs import BackboneInputs
from odl.models.backbone.graph_modules import BackboneDense
from odl.models.ctr_model import CtrModel
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

class RankModel(CtrModel):
    """A backbone over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        config: the pipeline config.
        feature_builder: its feature builder.
        output_name: the name of the model's output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).

    Raises:
        ConfigError: by field, for a backbone odl cannot build.
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                 output_name: str = "label", ebc_device: torch.device | str = "meta") -> None:
        super().__init__()
        mc = config.model_config
        inputs = BackboneInputs(config, feature_builder)
        self.set_tables(inputs.layout, ebc_device)
        wide_start = inputs.first_wide_column if mc.model_params.wide_to_logit else -1
        self.dense: BackboneDense = GraphBuilder(
            mc.backbone, inputs.group_input, set(inputs.groups), int(mc.num_class),
            wide_start=wide_start).build()
        self.pooled_layout = (inputs.pooled,)
        self.kernel_l2 = float(mc.model_params.l2_regularization)
        self.set_configured_loss(mc, output_name)


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> RankModel:
    labels: Sequence[str] = list(config.data_config.label_fields) or ["label"]
    return RankModel(config, feature_builder, output_name=labels[0])


def _validate(check: ModelCheck) -> None:
    """A backbone and model_params; then the network is built (every block's own checks)."""
    mc = check.config.model_config
    if not mc.HasField("backbone"):
        raise ConfigError("model_config.backbone", "RankModel needs a backbone { blocks }")
    if mc.model_params.l2_regularization < 0:
        raise ConfigError("model_config.model_params.l2_regularization", "must be >= 0")
    if mc.model_params.outputs:
        logger.warning("model_config.model_params.outputs has no effect: a RankModel's "
                       "output is the backbone's logits")
    fb = FeatureBuilder(check.config)
    inputs = BackboneInputs(check.config, fb)
    GraphBuilder(mc.backbone, inputs.group_input, set(inputs.groups), int(mc.num_class)).build()


register_model(ModelClass("RankModel", _build, _validate, group_attention="all",
                          projected_raw=True))
