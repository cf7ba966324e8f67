"""Checks of the settings of the loss terms F1_REWEIGHTED_LOSS and PAIRWISE_FOCAL_LOSS.

``f1_reweighted_loss`` and ``pairwise_focal_loss`` of the model's ``losses`` and of every
task tower's.

The formulas are :mod:`odl.models.ctr_losses`'s; the other loss terms' settings are checked by
:func:`odl.config.model_validation.validate_model`. EasyRec's ``JRC_LOSS`` stays refused
when the config is parsed: it needs a session id per sample and a two-logit output
(``num_class: 2``), and odl's batches carry one logit and no session column.
"""

from __future__ import annotations

from collections.abc import Iterator

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

__all__ = ["POINTWISE_LOSS_TYPES", "loss_entries", "validate_loss_settings"]

_L = pipeline_pb2
# loss types computed per sample, which per-sample weights (a task's sample space) apply to
POINTWISE_LOSS_TYPES = (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS, _L.L2_LOSS,
                        _L.SIGMOID_L2_LOSS, _L.BINARY_FOCAL_LOSS)


def loss_entries(config: pipeline_pb2.EasyRecConfig) -> Iterator[tuple[str, pipeline_pb2.Loss]]:
    """``(path, Loss)`` of the model's ``losses`` and of its task towers' ``losses``.

    Args:
        config: a config.

    Yields:
        Each loss term with its dotted path.
    """
    mc = config.model_config
    for i, loss in enumerate(mc.losses):
        yield f"model_config.losses[{i}]", loss
    for field in ("mmoe", "dbmtl"):
        if field not in mc.DESCRIPTOR.fields_by_name or not mc.HasField(field):
            continue
        for t, task in enumerate(getattr(mc, field).task_towers):
            for i, loss in enumerate(task.losses):
                yield f"model_config.{field}.task_towers[{t}].losses[{i}]", loss


def validate_loss_settings(config: pipeline_pb2.EasyRecConfig) -> None:
    """Checks ``f1_reweighted_loss`` and ``pairwise_focal_loss`` of every loss term.

    Args:
        config: a config.

    Raises:
        ConfigError: naming the first offending field.
    """
    for where, loss in loss_entries(config):
        f1 = loss.f1_reweighted_loss
        if not f1.f1_beta_square > 0:
            raise ConfigError(f"{where}.f1_reweighted_loss.f1_beta_square", "must be > 0")
        if not 0 <= f1.label_smoothing < 1:
            raise ConfigError(f"{where}.f1_reweighted_loss.label_smoothing", "must be in [0, 1)")
        pf = loss.pairwise_focal_loss
        sub = f"{where}.pairwise_focal_loss"
        if pf.gamma < 0:
            raise ConfigError(f"{sub}.gamma", "must be >= 0")
        if pf.HasField("alpha") and not 0 < pf.alpha < 1:
            raise ConfigError(f"{sub}.alpha", "must be in (0, 1)")
        if not 0 < pf.ohem_ratio <= 1:
            raise ConfigError(f"{sub}.ohem_ratio", "must be in (0, 1]")
        if not pf.temperature > 0:
            raise ConfigError(f"{sub}.temperature", "must be > 0")
        if pf.session_name:
            raise ConfigError(f"{sub}.session_name",
                              "pairs within a session are an EasyRec feature that odl does not "
                              "implement yet (pairs are formed over the batch)")
