"""The progressive metrics a config asks for beyond AUC and logloss: GAUC's group column.

TorchEasyRec names metrics in ``model_config.metrics`` and in each task tower's ``metrics``;
odl always reports progressive AUC and logloss (``odl.train.progressive_metrics``), and a
``grouped_auc { grouping_key }`` adds the progressive GAUC (the AUC within each group,
weighted by group size) of every output. The grouping key is an input column, or a feature
whose (first) input column is used; one grouping key per model.
"""

from __future__ import annotations

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.protos import pipeline_pb2

__all__ = ["grouped_auc_field"]


def _metric_entries(config: pipeline_pb2.EasyRecConfig
                    ) -> list[tuple[str, pipeline_pb2.MetricConfig]]:
    mc = config.model_config
    out = [(f"model_config.metrics[{i}]", m) for i, m in enumerate(mc.metrics)]
    for field in ("mmoe", "dbmtl"):
        for t, task in enumerate(getattr(mc, field).task_towers):
            out += [(f"model_config.{field}.task_towers[{t}].metrics[{i}]", m)
                    for i, m in enumerate(task.metrics)]
    return out


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
    for path, metric in _metric_entries(config):
        if not metric.HasField("grouped_auc"):
            continue
        key = metric.grouped_auc.grouping_key
        column = key if key in columns else inputs.get(key, "")
        if not column:
            raise ConfigError(f"{path}.grouped_auc.grouping_key",
                              f"{key!r} is neither an input field nor a feature")
        if chosen and column != chosen:
            raise ConfigError(f"{path}.grouped_auc.grouping_key",
                              f"one grouping key per model: {column!r} and {chosen!r}")
        chosen = column
    return chosen
