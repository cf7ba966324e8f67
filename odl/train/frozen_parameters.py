"""EasyRec's ``train_config.freeze_gradient``: parameters that keep their values while training.

EasyRec leaves every TF variable whose name one of the ``freeze_gradient`` regular
expressions finds (``re.search``) out of its training op: the variable neither changes nor
moves its optimizer state. Here each pattern is searched in the names a parameter goes by:

* an embedding table ``<t>``: ``ebc.embedding_bags.<t>.weight`` (its name in checkpoints),
  and the names of the TF variables it stands for in EasyRec's graph,
  ``input_layer[_k]/<column>/embedding_weights``: ``_k`` counts EasyRec's input-layer calls
  (none for the first) in the order its model reads its feature groups, ``<column>`` is
  TF's feature-column scope (``<feature>_embedding`` for Id and Lookup features;
  ``<feature>_bucketized_embedding`` for a bucketized RawFeature, ``<feature>_raw_proj_id_
  weighted_by_<feature>_raw_proj_val_embedding`` for a projected one;
  ``<feature>_weighted_by_<feature>_w_embedding`` for a weighted TagFeature; TF's crossed
  column ``<feature>_X_<feature>_1_embedding`` for a ComboFeature; ``<embedding_name>`` /
  ``<embedding_name>_wide`` for an ``embedding_name`` that several features share). odl
  derives these for the models whose group order it knows from EasyRec's code (DeepFM:
  ``wide``, ``deep``, ``fm``; FM and WideAndDeep: ``wide``, ``deep``; MultiTower: its
  towers' inputs; any model with one feature group) whose groups have no sequence features
  and embed only those kinds; elsewhere every table goes by its odl name only (a pattern
  written for EasyRec's names then matches nothing and is refused, rather than freezing
  part of what EasyRec would);
* a dense parameter: ``dense.<path>`` (its name in checkpoints and exports). EasyRec's TF
  names of dense variables (``dnn/...``) are not derived.

A table is frozen too when a feature it serves has ``trainable: false`` (TorchEasyRec's
per-feature setting, the flat ``FeatureConfig.trainable``).

A frozen table trains in its own fused group at rate 0 and the gradient of its pooled output
is zero (``table_gradient_scale``), so neither its rows nor its optimizer state (an Adagrad
accumulator, Adam's moments) change; the row-sparse tables skip it. (fbgemm's fused Adam and
LAMB on CUDA decay the moments of a frozen row a batch reads, as a zero gradient's step does;
its weights stay.) A frozen dense parameter
has ``requires_grad`` off: it gets no gradient, and the dense optimizer and the ranks'
gradient average leave it alone. Both are still read, checkpointed and exported; a frozen
table that is not dynamic is left out of the touched rows the delta publisher and the
incremental checkpoints record (``changing_tables``: its rows never change, so no version
or increment carries them). In-batch learning refuses the field (its shifted predictions
assume every table steps).

Refused by field (``ConfigError`` on ``train_config.freeze_gradient``, at start-up and in
``--validate_only``): a pattern that is not a regular expression; one that matches no name
(the message lists some); one that matches some but not all of the EasyRec variables one odl
table stands for (EasyRec keeps one variable per input-layer call where odl shares one table,
e.g. a feature read by DeepFM's ``deep`` and ``fm`` groups).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.config.model_classes import model_settings
from odl.features.feature_builder import FeatureBuilder
from odl.models.embedding_tables import WIDE_SUFFIX
from odl.models.model_registry import build_model, registered_model_classes
from odl.protos import pipeline_pb2
from odl.train.table_shards import EBC_PREFIX

logger = logging.getLogger(__name__)

__all__ = ["FrozenParameters", "changing_tables", "check_freeze_gradient",
           "easyrec_table_variables", "freeze_dense", "frozen_parameters"]

FIELD = "train_config.freeze_gradient"

# EasyRec's input-layer calls, in order, per model settings message (module docstring)
_GROUP_ORDER = {
    "deepfm": ("wide", "deep", "fm"),
    "fm": ("wide", "deep"),
    "wide_and_deep": ("wide", "deep"),
}


@dataclass(frozen=True)
class FrozenParameters:
    """What ``freeze_gradient`` freezes.

    Attributes:
        tables: frozen table names (``<t>`` and ``<t>_wide`` as the collection names them).
        dense: frozen dense parameter names (``dense.<path>``).
    """

    tables: frozenset[str] = frozenset()
    dense: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.tables or self.dense)


def _group_order(config: pipeline_pb2.EasyRecConfig) -> list[str]:
    """The feature groups in EasyRec's input-layer call order; [] where odl does not know it."""
    mc = config.model_config
    groups = [g.group_name for g in mc.feature_groups]
    if any(g.sequence_features or g.sequence_groups or g.sequence_encoders
           for g in mc.feature_groups):
        return []
    field, settings = model_settings(mc)
    if field in _GROUP_ORDER:
        order = list(_GROUP_ORDER[field])
    elif field == "multi_tower" and settings is not None and settings.towers:
        order = [t.input for t in settings.towers]
    elif len(groups) == 1:
        order = groups
    else:
        return []
    return [g for g in order if g in groups]


def _column_scope(fc: pipeline_pb2.FeatureConfig, name: str) -> str | None:
    """TF's column name of an EasyRec feature (its embedding's scope less ``_embedding``)."""
    kind = pipeline_pb2.FeatureConfig.FeatureType.Name(fc.feature_type)
    if kind in ("IdFeature", "LookupFeature"):
        return name
    if kind == "TagFeature":
        weighted = len(fc.input_names) > 1 or fc.HasField("kv_separator")
        return f"{name}_weighted_by_{name}_w" if weighted else name
    if kind == "RawFeature":
        if fc.boundaries or (fc.num_buckets > 1 and fc.max_val > fc.min_val):
            return f"{name}_bucketized"
        return f"{name}_raw_proj_id_weighted_by_{name}_raw_proj_val"
    if kind == "ComboFeature":  # TF's crossed column of EasyRec's renamed inputs
        if fc.combo_join_sep:
            return name
        return "_X_".join(sorted([name] + [f"{name}_{i}" for i in range(1, len(fc.input_names))]))
    return None


def _column_scopes(config: pipeline_pb2.EasyRecConfig) -> dict[str, tuple[str, str] | None]:
    """Feature -> EasyRec's TF column scope ``(deep, wide)``; None for a kind odl cannot name."""
    fcs = feature_configs(config)
    shared = Counter(fc.embedding_name for fc in fcs if fc.embedding_name)
    out: dict[str, tuple[str, str] | None] = {}
    for fc in fcs:
        name = fc.feature_name or (fc.input_names[0] if fc.input_names else "")
        if fc.embedding_name and shared[fc.embedding_name] > 1:
            out[name] = (fc.embedding_name, fc.embedding_name + WIDE_SUFFIX)
        else:
            column = _column_scope(fc, name)
            out[name] = None if column is None else (f"{column}_embedding",) * 2
    return out


def easyrec_table_variables(config: pipeline_pb2.EasyRecConfig,
                            table_features: dict[str, list[str]]) -> dict[str, set[str]]:
    """Table -> the EasyRec TF variable names it stands for (module docstring).

    Args:
        config: the pipeline config.
        table_features: each table of the collection (``<t>``, ``<t>_wide``) and the
            features looked up in it.

    Returns:
        The names per table; a table without derivable names is absent.
    """
    order = _group_order(config)
    if not order:
        return {}
    scopes = _column_scopes(config)
    groups = {g.group_name: g for g in config.model_config.feature_groups}
    out: dict[str, set[str]] = {}
    for k, group_name in enumerate(order):
        group = groups[group_name]
        layer = "input_layer" if k == 0 else f"input_layer_{k}"
        wide = group.wide_deep == pipeline_pb2.WIDE
        if group.wide_deep not in (pipeline_pb2.WIDE, pipeline_pb2.DEEP):
            continue
        for f in group.feature_names:
            tables = [t for t, fs in table_features.items()
                      if f in fs and t.endswith(WIDE_SUFFIX) == wide]
            if len(tables) != 1:  # (not embedded)
                continue
            scope = scopes.get(f)
            if scope is None:  # a column odl cannot name: no EasyRec names at all (else a
                return {}      # pattern over a whole input layer would miss its table)
            out.setdefault(tables[0], set()).add(
                f"{layer}/{scope[1 if wide else 0]}/embedding_weights")
    return out


def frozen_parameters(config: pipeline_pb2.EasyRecConfig, model: nn.Module) -> FrozenParameters:
    """Resolves ``train_config.freeze_gradient`` against a built model (module docstring).

    Args:
        config: the pipeline config.
        model: the model (``ebc`` and ``dense``; the ``meta`` device will do).

    Returns:
        The frozen tables and dense parameters (empty without patterns).

    Raises:
        ConfigError: a pattern is not a regular expression, matches nothing, or matches only
            some of the EasyRec variables of one table.
    """
    patterns = list(config.train_config.freeze_gradient)
    untrainable = _untrainable_features(config)
    if not patterns and not untrainable:
        return FrozenParameters()
    table_features = {c.name: list(c.feature_names)
                      for c in model.ebc.embedding_bag_configs()}
    easyrec = easyrec_table_variables(config, table_features)
    dense_names = [f"dense.{n}" for n, _ in model.dense.named_parameters()]
    tables: set[str] = {t for t, fs in table_features.items()
                        if any(_base_feature(f) in untrainable for f in fs)}
    dense: set[str] = set()
    for i, pattern in enumerate(patterns):
        where = f"{FIELD}[{i}]" if len(patterns) > 1 else FIELD
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(where, f"{pattern!r} is not a regular expression: {exc}") from None
        found = False
        for table in table_features:
            tf_names = sorted(easyrec.get(table, ()))
            hits = [n for n in tf_names if regex.search(n)]
            if hits and len(hits) < len(tf_names):
                raise ConfigError(where, (
                    f"{pattern!r} matches {', '.join(hits)} but not "
                    f"{', '.join(n for n in tf_names if n not in hits)}: odl holds these "
                    f"EasyRec variables as one table, {table!r}; freeze all or none"))
            if hits or regex.search(f"{EBC_PREFIX}{table}.weight"):
                tables.add(table)
                found = True
        for name in dense_names:
            if regex.search(name):
                dense.add(name)
                found = True
        if not found:
            raise ConfigError(where, (
                f"{pattern!r} matches no parameter; names it is searched in: "
                f"{_examples(table_features, easyrec, dense_names)}"))
    frozen = FrozenParameters(frozenset(tables), frozenset(dense))
    logger.info("freeze_gradient: %d of %d tables (%s) and %d of %d dense parameters frozen",
                len(tables), len(table_features), ", ".join(sorted(tables)) or "none",
                len(dense), len(dense_names))
    return frozen


def _untrainable_features(config: pipeline_pb2.EasyRecConfig) -> set[str]:
    """The features written with ``trainable: false``."""
    return {fc.feature_name for fc in feature_configs(config) if not fc.trainable}


def _base_feature(name: str) -> str:
    """A table's feature without a sequence position (``feature_plan.sequence_key``)."""
    return name.split("#", 1)[0]


def _examples(table_features: Iterable[str], easyrec: dict[str, set[str]],
              dense_names: list[str], most: int = 8) -> str:
    names: list[str] = []
    for table in table_features:
        names.append(f"{EBC_PREFIX}{table}.weight")
        names.extend(sorted(easyrec.get(table, ())))
    names.extend(dense_names)
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def freeze_dense(model: nn.Module, frozen: FrozenParameters) -> FrozenParameters:
    """Turns ``requires_grad`` off for the frozen dense parameters of ``model.dense``.

    Returns:
        ``frozen``.
    """
    for name, p in model.dense.named_parameters():
        if f"dense.{name}" in frozen.dense:
            p.requires_grad_(False)
    return frozen


def check_freeze_gradient(config: pipeline_pb2.EasyRecConfig) -> None:
    """The start-up check: the patterns resolved against the model built on ``meta``.

    Raises:
        ConfigError: as :func:`frozen_parameters`.
    """
    if not config.train_config.freeze_gradient and not _untrainable_features(config):
        return
    feature_builder = FeatureBuilder(config)
    registered_model_classes()  # the model modules imported outside the meta context
    with torch.device("meta"):
        model = build_model(config, feature_builder)
    frozen_parameters(config, model)


def changing_tables(feature_tables: dict[str, list[str]], frozen: FrozenParameters,
                    dynamic: Collection[str]) -> dict[str, list[str]]:
    """``feature_tables`` less the frozen tables that are not dynamic (rows that never change).

    The delta and checkpoint trackers need not record those; a frozen dynamic table still
    admits and evicts ids, whose rows are new.
    """
    fixed = frozen.tables - set(dynamic)
    out = {f: [t for t in ts if t not in fixed] for f, ts in feature_tables.items()}
    return {f: ts for f, ts in out.items() if ts}
