"""The progressive metrics a config asks for beyond AUC and logloss: GAUC's group column.

odl always reports progressive AUC and logloss (``odl.train.progressive_metrics``). GAUC (the
AUC within each group, e.g. each user) is added for every output by either form:

* TorchEasyRec's ``metrics { grouped_auc { grouping_key } }`` in ``model_config`` or a task
  tower: the plain mean over the groups (TorchEasyRec's ``GroupedAUC``);
* EasyRec's ``metrics_set { gauc { uid_field reduction } }`` in ``eval_config`` or a task
  tower: ``reduction`` ``mean`` (default), ``mean_by_sample_num`` (weighted by group size) or
  ``mean_by_positive_num`` (weighted by positives).

The grouping key is an input column, or a feature whose (first) input column is used; one
grouping key and one reduction per model.
"""

from __future__ import annotations

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.config.model_classes import task_towers
from odl.protos import pipeline_pb2

__all__ = ["GAUC_REDUCTIONS", "grouped_auc_field", "grouped_auc_reduction"]

# How per-group AUCs are averaged (EasyRec's names; odl.auc.grouped_auc).
GAUC_REDUCTIONS = ("mean", "mean_by_sample_num", "mean_by_positive_num")


def _grouping_entries(config: pipeline_pb2.EasyRecConfig) -> list[tuple[str, str, str]]:
    """``(path of the key, key, reduction)`` of every GAUC metric of the config, in order."""
    mc = config.model_config
    torch_form = [(f"model_config.metrics[{i}]", m) for i, m in enumerate(mc.metrics)]
    easyrec_form = [(f"eval_config.metrics_set[{i}]", m)
                    for i, m in enumerate(config.eval_config.metrics_set)]
    for where, task in task_towers(mc):
        torch_form += [(f"{where}.metrics[{i}]", m) for i, m in enumerate(task.metrics)]
        easyrec_form += [(f"{where}.metrics_set[{i}]", m)
                         for i, m in enumerate(task.metrics_set)]
    out = [(f"{p}.grouped_auc.grouping_key", m.grouped_auc.grouping_key, "mean")
           for p, m in torch_form if m.HasField("grouped_auc")]
    for p, m in easyrec_form:
        if m.HasField("gauc"):
            if m.gauc.reduction not in GAUC_REDUCTIONS:
                raise ConfigError(f"{p}.gauc.reduction",
                                  f"expected one of {', '.join(GAUC_REDUCTIONS)}, got "
                                  f"{m.gauc.reduction!r}")
            out.append((f"{p}.gauc.uid_field", m.gauc.uid_field, m.gauc.reduction))
    return out


def grouped_auc_reduction(config: pipeline_pb2.EasyRecConfig) -> str:
    """How GAUC averages its groups' AUCs (:data:`GAUC_REDUCTIONS`; ``"mean"`` when unset).

    Raises:
        ConfigError: two GAUC metrics with different reductions, or an unknown one.
    """
    chosen = ""
    for path, _key, reduction in _grouping_entries(config):
        if chosen and reduction != chosen:
            raise ConfigError(path.rsplit(".", 1)[0] + ".reduction",
                              f"one GAUC reduction per model: {reduction!r} and {chosen!r}")
        chosen = reduction
    return chosen or "mean"


def grouped_auc_field(config: pipeline_pb2.EasyRecConfig) -> str:
    """The input column whose value groups samples for GAUC; ``""`` when none is asked for.

    Args:
        config: the config.

    Returns:
        The column name.

    Raises:
        ConfigError: a grouping key that names no input field or feature, or two different
            grouping keys.
    """
    columns = {f.input_name for f in config.data_config.input_fields}
    inputs = {fc.feature_name: fc.input_names[0] for fc in feature_configs(config)
              if fc.input_names}
    chosen = ""
    for path, key, _reduction in _grouping_entries(config):
        column = key if key in columns else inputs.get(key, "")
        if not column:
            raise ConfigError(path, f"{key!r} is neither an input field nor a feature")
        if chosen and column != chosen:
            raise ConfigError(path, f"one grouping key per model: {column!r} and {chosen!r}")
        chosen = column
    return chosen
