"""The features of a pipeline config, in either of EasyRec's two forms.

EasyRec gives features as top-level ``feature_configs`` or nested as
``feature_config { features {...} }``; :func:`feature_configs` reads whichever a config uses
(never both) and fills in each ``feature_name`` (default: ``input_names[0]``), the name the
feature groups, the embedding tables and the published deltas use. :func:`embedded_feature`
says which features have an embedding table.
"""

from __future__ import annotations

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

__all__ = [
    "EMBEDDED_FEATURE_TYPES",
    "NUMERIC_FIELD_TYPES",
    "FeatureConfig",
    "embedded_feature",
    "feature_configs",
    "feature_list_path",
    "projected_group_dim",
    "projected_raw",
]

FeatureConfig = pipeline_pb2.FeatureConfig
_FT = pipeline_pb2.FeatureConfig.FeatureType
_FIELD_TYPE = pipeline_pb2.DatasetConfig.FieldType

# Feature types that always have an embedding table (a RawFeature has one with boundaries).
EMBEDDED_FEATURE_TYPES = (_FT.IdFeature, _FT.ComboFeature, _FT.SequenceFeature,
                          _FT.LookupFeature)
# Input field types that hold a number (labels, event times and RawFeature inputs need one).
NUMERIC_FIELD_TYPES = (
    _FIELD_TYPE.INT32, _FIELD_TYPE.INT64, _FIELD_TYPE.FLOAT, _FIELD_TYPE.DOUBLE, _FIELD_TYPE.BOOL,
)


def feature_configs(config: pipeline_pb2.EasyRecConfig) -> list[FeatureConfig]:
    """Return the features of a config from whichever form it uses, with names filled in.

    Args:
        config: the config.

    Returns:
        Copies of the feature configs; ``feature_name`` defaults to ``input_names[0]``.

    Raises:
        ConfigError: both ``feature_configs`` and ``feature_config.features`` are used.

    """
    if config.feature_configs and config.feature_config.features:
        raise ConfigError("feature_config",
                          "give features either as top-level feature_configs or as "
                          "feature_config { features {...} }, not both")
    out = []
    for fc in list(config.feature_configs) or list(config.feature_config.features):
        copy = FeatureConfig()
        copy.CopyFrom(fc)
        if not copy.feature_name and copy.input_names:
            copy.feature_name = copy.input_names[0]
        out.append(copy)
    return out


def feature_list_path(config: pipeline_pb2.EasyRecConfig) -> str:
    """The dotted path of a config's feature list, for errors about one feature.

    Args:
        config: the config.

    Returns:
        ``"feature_configs"`` or ``"feature_config.features"``, the form the config uses.
    """
    return "feature_configs" if config.feature_configs else "feature_config.features"


def projected_raw(fc: FeatureConfig) -> bool:
    """Whether a feature is EasyRec's projected raw feature (``value * p``, ``p`` learned).

    That is a RawFeature with an ``embedding_dim`` and no ``boundaries``.
    """
    return (fc.feature_type == _FT.RawFeature and not fc.boundaries
            and fc.embedding_dim > 0)


def projected_group_dim(group: pipeline_pb2.FeatureGroupConfig,
                        features: dict[str, FeatureConfig], where: str, owner: str) -> int:
    """The one ``embedding_dim`` of a feature group's projected raw features (0: none).

    A group's projected raw features are one ``RawProjection`` of one width, and they do not
    share a group with sequences (whose combined vectors replace the group's input).

    Args:
        group: the feature group.
        features: feature name -> its config.
        where: the group's ``feature_names`` path, for errors.
        owner: what reads the group (``"a multi-task group"``, ``"a tower's group"``).

    Raises:
        ConfigError: two widths, or sequences beside them.
    """
    dims = {n: features[n].embedding_dim for n in group.feature_names
            if n in features and projected_raw(features[n])}
    if len(set(dims.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(dims.items())[:6])
        raise ConfigError(where, f"the projected raw features of {owner} need one "
                                 f"embedding_dim; got {shown}")
    if dims and (group.sequence_features or group.sequence_groups or any(
            n in features and features[n].feature_type == _FT.SequenceFeature
            for n in group.feature_names)):
        raise ConfigError(where, f"projected raw features beside sequences in {owner} are "
                                 "not implemented")
    return next(iter(dims.values()), 0)


def embedded_feature(fc: FeatureConfig) -> bool:
    """Whether a feature is looked up in an embedding table (vs. a dense raw value).

    Args:
        fc: a feature config.

    Returns:
        True for IdFeature, ComboFeature, LookupFeature, RawFeature with boundaries and
        SequenceFeature (except one of numbers without boundaries: :func:`dense_sequence`).

    """
    if dense_sequence(fc):
        return False
    return fc.feature_type in EMBEDDED_FEATURE_TYPES or (
        fc.feature_type == _FT.RawFeature and len(fc.boundaries) > 0)


def dense_sequence(fc: FeatureConfig) -> bool:
    """Whether a feature is a SequenceFeature of numbers kept as dense positions.

    That is a SequenceFeature with ``sub_feature_type: RawFeature`` and no ``boundaries``.
    """
    return (fc.feature_type == _FT.SequenceFeature and fc.sub_feature_type == _FT.RawFeature
            and not fc.boundaries)

