"""Whether a config trains with in-batch learning and per-record Adagrad.

``train_config.in_batch_learning`` (odl extension, :mod:`odl.train.in_batch`):

* written ``true``: on at every step; the config must allow it (:func:`in_batch_refusal`,
  a ``ConfigError`` at validation otherwise);
* written ``false``: off;
* unwritten: the trainer decides from the stream (``IN_BATCH_AUTO``,
  :mod:`odl.train.in_batch.in_batch_choice`) where the config allows it, and leaves it off
  where it does not (the reason in ``/status``'s ``in_batch``).

``per_record_adagrad`` follows in-batch learning where the config does not write it
(:func:`per_record_adagrad_on`).
"""

from __future__ import annotations

from odl.config.feature_configs import feature_configs, feature_list_path
from odl.config.loss_settings import POINTWISE_LOSS_TYPES, num_classes, regression_outputs
from odl.config.optimizer_support import (
    IN_BATCH_TABLE_KINDS,
    PER_RECORD_TABLE_KINDS,
    optimizer_choices,
    table_gradient_bound,
    table_gradient_multiplier,
    table_kernel_kind,
)
from odl.protos import pipeline_pb2

__all__ = ["IN_BATCH_AUTO", "IN_BATCH_OFF", "IN_BATCH_ON", "in_batch_mode", "in_batch_refusal",
           "per_record_adagrad_on"]

IN_BATCH_ON = "on"
IN_BATCH_OFF = "off"
IN_BATCH_AUTO = "auto"


def in_batch_refusal(config: pipeline_pb2.EasyRecConfig,
                     world_size: int = 1) -> tuple[str, str] | None:
    """What keeps in-batch learning from ``config``: ``(field, reason)``, or None.

    In-batch learning needs a model with one output, SGD or (row-wise) Adagrad tables without
    gradient clipping or a gradient multiplier, nothing frozen (``freeze_gradient``), no
    distillation loss (``kd``), no sample weights, and with the sequential pass
    (``in_batch_sequential``, the default) losses of one record each; with several ranks,
    the sequential pass.

    Args:
        config: the pipeline config.
        world_size: the job's ranks.
    """
    tc = config.train_config
    field = "train_config.in_batch_learning"
    outputs = max(len(regression_outputs(config)), num_classes(config))
    if outputs != 1:
        mc = config.model_config
        return field, (f"needs a model with one output; this "
                       f"{mc.model_class or mc.WhichOneof('model')} has {outputs}")
    sparse, _ = optimizer_choices(tc)
    if table_kernel_kind(sparse.kind) not in IN_BATCH_TABLE_KINDS:
        return field, f"needs SGD or (row-wise) Adagrad tables; the tables train with {sparse.kind}"
    if config.data_config.sample_weight:
        return "data_config.sample_weight", f"{field} does not take sample weights"
    if table_gradient_multiplier(tc) != 1.0:
        return (f"{sparse.field.rsplit('.', 1)[0]}.embedding_learning_rate_multiplier",
                f"{field} does not take scaled table gradients (its shifted predictions "
                "follow unscaled steps)")
    if config.model_config.WhichOneof("model") == "rocket_launching":
        return ("model_config.rocket_launching",
                f"{field} does not take a booster beside the served network (its shifted "
                "predictions follow the served network's loss alone)")
    if config.model_config.kd:
        return ("model_config.kd",
                f"{field} does not take distillation losses (its shifted predictions follow "
                "the label's loss alone)")
    if tc.freeze_gradient:
        return ("train_config.freeze_gradient",
                f"{field} does not take frozen parameters (its shifted predictions follow "
                "steps of every table)")
    untrainable = [i for i, fc in enumerate(feature_configs(config)) if not fc.trainable]
    if untrainable:
        return (f"{feature_list_path(config)}[{untrainable[0]}].trainable",
                f"{field} does not take frozen tables (its shifted predictions follow steps "
                "of every table)")
    if table_gradient_bound(sparse) is not None:
        return (f"{sparse.field}.gradient_clipping",
                f"{field} does not take clipped table gradients (its shifted predictions "
                "follow unclipped steps)")
    if tc.in_batch_sequential:
        mc = config.model_config
        types = [t.loss_type for t in mc.losses] or [mc.loss_type]
        coupled = [pipeline_pb2.LossType.Name(t) for t in types
                   if t not in POINTWISE_LOSS_TYPES]
        if coupled:
            return "train_config.in_batch_sequential", (
                f"needs losses of one record each; {', '.join(coupled)} couples the batch's "
                "records (set it to false)")
    elif world_size > 1:
        return "train_config.in_batch_sequential", (
            f"in-batch learning with the batched shift (false) is not implemented for "
            f"{world_size} ranks (torchrun) yet; run one process")
    return None


def in_batch_mode(config: pipeline_pb2.EasyRecConfig, world_size: int = 1) -> str:
    """``IN_BATCH_ON``, ``IN_BATCH_OFF`` or ``IN_BATCH_AUTO`` (module docstring).

    A written ``true`` is on even where :func:`in_batch_refusal` objects: validation refuses
    such a config by field.
    """
    tc = config.train_config
    if tc.HasField("in_batch_learning"):
        return IN_BATCH_ON if tc.in_batch_learning else IN_BATCH_OFF
    return IN_BATCH_OFF if in_batch_refusal(config, world_size) else IN_BATCH_AUTO


def per_record_adagrad_on(config: pipeline_pb2.EasyRecConfig, world_size: int = 1) -> bool:
    """Whether per-record Adagrad runs (``odl.train.in_batch.per_record_adagrad``).

    ``train_config.per_record_adagrad`` as written; unwritten, with in-batch learning (on or
    decided by the trainer, which then runs both together) and (row-wise) Adagrad tables
    (``PER_RECORD_TABLE_KINDS``), else off.
    """
    tc = config.train_config
    if tc.HasField("per_record_adagrad"):
        return bool(tc.per_record_adagrad)
    if in_batch_mode(config, world_size) == IN_BATCH_OFF:
        return False
    sparse, _ = optimizer_choices(tc)
    return table_kernel_kind(sparse.kind) in PER_RECORD_TABLE_KINDS
