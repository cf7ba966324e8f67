"""The model classes odl implements: each one module under ``odl/models/`` that registers it.

A model module ends with :func:`register_model` calls, one per ``model_class`` name it
implements, each a :class:`ModelClass`: how the class builds its ``CtrModel`` (contract:
``odl.models.ctr_model``) from a config, how it checks its own settings (a ``ConfigError``
naming the field), and what of the shared feature-group rules it accepts. The class's
settings message is the ``EasyRecModel`` field whose ``model_classes`` option names it in
``protos/pipeline.proto`` (``odl.config.model_classes``); nothing else in odl names a model
class. Adding a model = its module here + its message in the proto (+ tests and a sample).

Every module of this package is imported the first time a class is looked up, so a module
registers itself by existing; :func:`registered_model_classes` lists what registered, and
``tests/test_models.py`` checks that it is exactly what the proto declares.

:func:`validate_model` checks a config's model (the config layer's checks,
:func:`odl.config.config_validation.validate_pipeline_config`, come first);
:func:`check_pipeline_config` runs both; :func:`build_model` builds the model of a checked
config.
"""

from __future__ import annotations

import importlib
import logging
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from odl.config.config_error import ConfigError
from odl.config.config_validation import validate_pipeline_config
from odl.config.feature_configs import (
    FeatureConfig,
    embedded_feature,
    feature_configs,
    projected_raw,
)
from odl.config.feature_settings import with_vocabularies_as_buckets
from odl.config.model_classes import (
    IMPLEMENTED_MODEL_CLASSES,
    MODEL_MESSAGES,
    classes_of_message,
    model_settings,
)
from odl.config.model_validation import validate_sequence_groups
from odl.protos import pipeline_pb2

if TYPE_CHECKING:
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.ctr_model import CtrModel

logger = logging.getLogger(__name__)

__all__ = ["ModelCheck", "ModelClass", "build_model", "check_pipeline_config",
           "model_class_of", "register_model", "registered_model_classes", "validate_model"]


@dataclass(frozen=True)
class ModelCheck:
    """What a model's own validation reads.

    Attributes:
        config: the config (vocabularies counted as buckets).
        model_class: the class name (``model_config.model_class``, or the one its settings
            message implies).
        field: the ``EasyRecModel`` field of its settings, e.g. ``"deepfm"``.
        settings: that message.
        features: the features by name.
        groups: feature group name -> its index in ``model_config.feature_groups``.
    """

    config: pipeline_pb2.EasyRecConfig
    model_class: str
    field: str
    settings: object
    features: dict[str, FeatureConfig]
    groups: dict[str, int]

    def where(self, path: str = "") -> str:
        """The dotted path of a settings field, e.g. ``model_config.deepfm.dnn``."""
        return f"model_config.{self.field}" + (f".{path}" if path else "")


@dataclass(frozen=True)
class ModelClass:
    """One ``model_class`` name as its module registers it.

    Attributes:
        name: the ``model_class`` value (EasyRec's spelling).
        build: ``(config, feature builder) -> CtrModel`` (tables on the ``meta`` device).
        validate: checks the class's own settings; raises ``ConfigError`` by field.
        group_attention: which feature groups may hold ``sequence_features`` (a target
            attention appended to the group's input): ``"none"``, ``"deep"`` (``wide_deep:
            DEEP`` groups) or ``"all"``.
        attention_dense_parts: a group's target attention may read dense keys and sequences.
        projected_raw: a group may hold RawFeatures with ``embedding_dim`` and no
            ``boundaries`` (EasyRec's projected raw features).
        variational_dropout: the class applies ``model_config.variational_dropout`` to its
            input groups (``odl.models.feature_dropout``); the others refuse the field.
    """

    name: str
    build: Callable[[pipeline_pb2.EasyRecConfig, FeatureBuilder], CtrModel]
    validate: Callable[[ModelCheck], None]
    group_attention: str = "none"
    attention_dense_parts: bool = True
    projected_raw: bool = False
    variational_dropout: bool = False


_REGISTERED: dict[str, ModelClass] = {}
_LOADED = False


def register_model(entry: ModelClass) -> ModelClass:
    """Registers a model class (called by its module when imported).

    Args:
        entry: the class.

    Returns:
        ``entry``.

    Raises:
        ValueError: the proto declares no such class, or another module registered it.
    """
    if entry.name not in MODEL_MESSAGES:
        raise ValueError(f"model class {entry.name!r} is not named by any model_classes "
                         "option of EasyRecModel in protos/pipeline.proto")
    if entry.name in _REGISTERED and _REGISTERED[entry.name].build is not entry.build:
        raise ValueError(f"model class {entry.name!r} is registered twice")
    if entry.group_attention not in ("none", "deep", "all"):
        raise ValueError(f"group_attention must be none, deep or all, not "
                         f"{entry.group_attention!r}")
    _REGISTERED[entry.name] = entry
    return entry


def _load_model_modules() -> None:
    """Imports every module of ``odl.models`` once (each registers its classes)."""
    global _LOADED
    if _LOADED:
        return
    import odl.models

    for info in pkgutil.iter_modules(odl.models.__path__):
        if not info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"odl.models.{info.name}")
    _LOADED = True


def registered_model_classes() -> dict[str, ModelClass]:
    """Every registered class by name."""
    _load_model_modules()
    return dict(_REGISTERED)


def model_class_of(model_config: pipeline_pb2.EasyRecModel) -> ModelClass:
    """The class a model config names (by ``model_class``, else by its settings message).

    Args:
        model_config: the model config.

    Returns:
        The registered class.

    Raises:
        ConfigError: no class named, one odl does not implement, or settings in another
            class's message.
    """
    _load_model_modules()
    field = model_config.WhichOneof("model") or ""
    name = model_config.model_class
    if not name and field:
        name = next(c for c, f in MODEL_MESSAGES.items() if f == field)
    if not name:
        raise ConfigError("model_config.model_class",
                          f"required ({', '.join(IMPLEMENTED_MODEL_CLASSES)})")
    entry = _REGISTERED.get(name)
    if entry is None:
        raise ConfigError("model_config.model_class",
                          f"model class {name!r} is an EasyRec value that odl does not "
                          f"implement yet (implemented: {', '.join(sorted(_REGISTERED))})")
    expected = MODEL_MESSAGES[name]
    if field and field != expected and name not in classes_of_message(field):
        raise ConfigError(f"model_config.{field}",
                          f"{name} reads its settings from model_config.{expected}")
    return entry


def _check_variational_dropout(mc: pipeline_pb2.EasyRecModel, entry: ModelClass) -> None:
    """``model_config.variational_dropout``: a class that applies it, a usable lambda."""
    lam = mc.variational_dropout.regularization_lambda
    if not math.isfinite(lam) or lam < 0:
        raise ConfigError("model_config.variational_dropout.regularization_lambda",
                          f"must be a finite number >= 0, got {lam}")
    if not entry.variational_dropout:
        which = sorted(n for n, e in _REGISTERED.items() if e.variational_dropout)
        raise ConfigError("model_config.variational_dropout",
                          f"EasyRec's variational dropout is not implemented for {entry.name} "
                          f"(implemented for: {', '.join(which)})")


def validate_model(config: pipeline_pb2.EasyRecConfig) -> None:
    """Checks the model of a config that passed ``validate_pipeline_config``.

    The feature-group rules that depend on the class (target attention in a group,
    projected raw features), then the class's own ``validate``.

    Args:
        config: the config.

    Raises:
        ConfigError: naming the first offending field.
    """
    mc = config.model_config
    entry = model_class_of(mc)
    checked = with_vocabularies_as_buckets(config)
    features = {fc.feature_name: fc for fc in feature_configs(checked)}
    groups = {g.group_name: i for i, g in enumerate(mc.feature_groups)}
    if mc.HasField("variational_dropout"):
        _check_variational_dropout(mc, entry)
    for i, g in enumerate(mc.feature_groups):
        where = f"model_config.feature_groups[{i}]"
        if g.sequence_features:
            allowed = (entry.group_attention == "all"
                       or (entry.group_attention == "deep" and g.wide_deep == pipeline_pb2.DEEP))
            if not allowed:
                raise ConfigError(f"{where}.sequence_features",
                                  "a group's target attention (sequence_features) is not "
                                  f"implemented for {entry.name}"
                                  f"{'' if g.wide_deep == pipeline_pb2.DEEP else ' wide groups'}"
                                  f" (implemented for: {_classes_with_attention()})")
            validate_sequence_groups(checked, features, g.sequence_features,
                                     f"{where}.sequence_features",
                                     dense_parts=entry.attention_dense_parts)
        if entry.projected_raw:
            continue
        for j, name in enumerate(g.feature_names):
            if name in features and projected_raw(features[name]):
                raise ConfigError(f"{where}.feature_names[{j}]",
                                  f"RawFeature {name!r} has an embedding_dim and no "
                                  "boundaries (EasyRec's projected raw feature): implemented "
                                  f"for {', '.join(_classes_with_projection())}; for "
                                  f"{entry.name} add boundaries or remove embedding_dim")
    _check_some_table(mc, features)
    field, settings = model_settings(mc)
    entry.validate(ModelCheck(checked, entry.name, field, settings, features, groups))


def _check_some_table(mc: pipeline_pb2.EasyRecModel, features: dict[str, FeatureConfig]) -> None:
    """At least one feature the model reads has an embedding table.

    odl's models, their checkpoints, deltas and serving are built around the tables (a model
    of raw values alone has nothing to publish but its dense part, and TorchRec's table
    collection cannot be empty).

    Raises:
        ConfigError: naming ``model_config.feature_groups``.
    """
    names = [n for g in mc.feature_groups for n in g.feature_names]
    names += [n for g in mc.feature_groups for s in g.sequence_groups for n in s.feature_names]
    attention = [*mc.seq_att_groups, *(s for g in mc.feature_groups for s in g.sequence_features)]
    names += [n for g in attention for m in g.seq_att_map
              for n in [*m.key, *m.hist_seq, *m.aux_hist_seq]]
    if not any(n in features and embedded_feature(features[n]) for n in names):
        raise ConfigError("model_config.feature_groups",
                          "the groups read no feature with an embedding table (an id, tag, "
                          "combo or lookup feature, a bucketized raw feature, a sequence of "
                          "ids): odl trains models with at least one table")


def _classes_with_attention() -> str:
    return ", ".join(sorted(n for n, e in _REGISTERED.items() if e.group_attention != "none"))


def _classes_with_projection() -> list[str]:
    return sorted(n for n, e in _REGISTERED.items() if e.projected_raw)


def check_pipeline_config(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Every check of a config that needs no machine: the config layer's, then the model's.

    A config that passes it builds its feature plan (``odl.features.feature_plan``), which
    holds no static rule of its own: it refuses only a vocabulary it cannot read or whose
    entries share an FNV-1a 64 hash.

    Args:
        config: a loaded config.
        online: True for ``odl-train --online``.

    Raises:
        ConfigError: naming the first offending field.
    """
    validate_pipeline_config(config, online)
    validate_model(config)


def build_model(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> CtrModel:
    """Builds the configured model (tables on the ``meta`` device, dense parts on CPU).

    Args:
        config: the pipeline config.
        feature_builder: the feature builder of the same config.

    Returns:
        The model.

    Raises:
        ConfigError: an unknown model class, or settings its class refuses.
    """
    entry = model_class_of(config.model_config)
    model = entry.build(config, feature_builder)
    from odl.models.distillation import build_distillation  # (torch: only where built)

    model.distillation = build_distillation(config, model.output_names)
    return model
