"""Loss-term settings: their checks, and which outputs are regressions.

Checks ``f1_reweighted_loss`` and ``pairwise_focal_loss`` of the model's ``losses`` and of
every task tower's; :func:`regression_outputs` says which outputs predict a value (all their
terms ``L2_LOSS``) rather than a probability, and :func:`real_valued_labels` which label
columns may then hold any number.

The formulas are :mod:`odl.models.ctr_losses`'s; the other loss terms' settings are checked by
:func:`odl.config.model_validation.validate_model`. ``JRC_LOSS`` needs a ``num_class: 2``
model (or task tower, :func:`task_classes`) and a session column
(:func:`jrc_session_field`), whose hash the batches carry (``Batch.session_keys``).
EasyRec's ``data_config.sample_weight`` names a numeric input column whose value weights
each sample's loss (:func:`sample_weight_field`; ``Batch.sample_weights``).
``ZILN_LOSS`` (:func:`ziln_settings`) is a single-task ``num_class: 3`` model's only term:
its two outputs are the probability of a positive value and the expected value
(``odl.models.ziln``), its label any number.
"""

from __future__ import annotations

from collections.abc import Iterator

from odl.config.config_error import ConfigError
from odl.config.model_classes import (
    domain_label,
    is_multi_task_model,
    product_output,
    task_label_names,
    task_towers,
)
from odl.protos import pipeline_pb2

__all__ = ["JRC_STRATEGIES", "POINTWISE_LOSS_TYPES", "SOFTMAX_LOSS_TYPES", "jrc_session_field",
           "label_class_counts", "loss_entries", "num_classes", "real_valued_labels",
           "task_classes", "regression_outputs", "sample_weight_field", "validate_loss_settings",
           "ziln_settings"]

_L = pipeline_pb2
# loss types computed per sample, which per-sample weights (a task's sample space) apply to
POINTWISE_LOSS_TYPES = (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS, _L.L2_LOSS,
                        _L.SIGMOID_L2_LOSS, _L.BINARY_FOCAL_LOSS)
# the loss types of an output of several classes (a softmax over its logits)
SOFTMAX_LOSS_TYPES = (_L.CLASSIFICATION, _L.CROSS_ENTROPY_LOSS, _L.JRC_LOSS)


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
    for path, task in task_towers(mc):
        for i, loss in enumerate(task.losses):
            yield f"{path}.losses[{i}]", loss


def _output_terms(config: pipeline_pb2.EasyRecConfig) -> list[list[int]]:
    """Per model output (the model's one, or each task tower's), its loss types.

    A product output (``product_output``) follows the tasks' with the first task's types.
    """
    mc = config.model_config
    if is_multi_task_model(mc):
        terms = [[t.loss_type for t in task.losses
                  if t.loss_type != _L.ORDER_CALIBRATE_LOSS] or [task.loss_type]
                 for _path, task in task_towers(mc)]
        return terms + (terms[:1] if product_output(mc) else [])
    return [[t.loss_type for t in mc.losses] or [mc.loss_type]]


def ziln_settings(config: pipeline_pb2.EasyRecConfig) -> pipeline_pb2.ZILNLoss | None:
    """The ``ZILN_LOSS`` term's settings of a single-task model; None without one.

    Its ``num_class: 3`` logits make two outputs: the probability of a positive value and
    the expected value (``odl.models.ziln``).
    """
    mc = config.model_config
    if is_multi_task_model(mc):
        return None
    if mc.losses:
        for term in mc.losses:
            if term.loss_type == _L.ZILN_LOSS:
                return term.ziln_loss
        return None
    return pipeline_pb2.ZILNLoss() if mc.loss_type == _L.ZILN_LOSS else None


def num_classes(config: pipeline_pb2.EasyRecConfig) -> int:
    """The classes of a single-task model's label: 1 (binary), or ``num_class`` C > 1.

    A C-class model has C outputs, ``<label>_<k>`` the probability of class k (a softmax
    over its C logits, trained by softmax cross entropy); its label column holds the class
    index and its batches carry the labels one-hot (``[B, C]``). A ``ZILN_LOSS`` model's
    three logits are not classes: 1.
    """
    mc = config.model_config
    if is_multi_task_model(mc) or ziln_settings(config) is not None:
        return 1
    return max(int(mc.num_class), 1)


def label_class_counts(config: pipeline_pb2.EasyRecConfig) -> dict[str, int]:
    """Label fields holding a class index, each with its number of classes C.

    The label is an integer in ``[0, C)``; a record holding another value is rejected as
    ``bad_label``. A ``num_class`` C > 1 model's label (:func:`num_classes`) and a domain
    label (PEPNet's ``domain_input_name``, its ``task_domain_num`` domains).
    """
    labels = list(config.data_config.label_fields) or ["label"]
    out = {}
    if num_classes(config) > 1:
        out[labels[0]] = num_classes(config)
    domain = domain_label(config.model_config)
    if domain:
        out[domain] = max(int(config.model_config.pepnet.task_domain_num), 1)
    return out


def task_classes(config: pipeline_pb2.EasyRecConfig) -> tuple[int, ...]:
    """Per task of a multi-task model, its logits: 1, or 2 for a two-class task.

    A task tower with ``num_class: 2`` (EasyRec's, TorchEasyRec's; e.g. for ``JRC_LOSS``)
    has two logits, trained by softmax cross entropy or JRC over the task's 0/1 label
    one-hot; its output is the probability of class 1, ``softmax(logits)[1]``. Empty for a
    model that is not multi-task.
    """
    mc = config.model_config
    if not is_multi_task_model(mc):
        return ()
    return tuple(max(int(task.num_class), 1) for _path, task in task_towers(mc))


def regression_outputs(config: pipeline_pb2.EasyRecConfig) -> list[bool]:
    """Per model output, whether it is a regression: every loss term of it is ``L2_LOSS``.

    A regression output predicts its logit itself (EasyRec's ``y`` for ``L2_LOSS``) and
    trains on real-valued labels; every other output predicts ``sigmoid(logit)``, a
    probability, of 0/1 labels. A ``ZILN_LOSS`` model's two outputs are the probability of a
    positive value and the expected value (a regression). A PEPNet with domains has each
    task's flag once per domain (its outputs).

    Args:
        config: a config.

    Returns:
        One flag per output, in output order.
    """
    classes = num_classes(config)
    if classes > 1:
        return [False] * classes
    if ziln_settings(config) is not None:  # the probability, then the value
        return [False, True]
    flags = _task_regression(config)
    domain = domain_label(config.model_config)
    if domain:  # PEPNet: each task's output per domain
        flags = [f for f in flags for _ in range(max(int(config.model_config.pepnet
                                                         .task_domain_num), 1))]
    return flags


def _task_regression(config: pipeline_pb2.EasyRecConfig) -> list[bool]:
    """Per task (or the model's one output), whether every loss term of it is ``L2_LOSS``."""
    return [all(t == _L.L2_LOSS for t in terms) for terms in _output_terms(config)]


def real_valued_labels(config: pipeline_pb2.EasyRecConfig) -> set[str]:
    """The label columns that only regression outputs read (any finite number is a label).

    Args:
        config: a config.

    Returns:
        Label field names; the others must hold 0 or 1.
    """
    labels = list(config.data_config.label_fields)
    if not labels:
        return set()
    if ziln_settings(config) is not None:
        return {labels[0]}
    mc = config.model_config
    names = (task_label_names(mc, labels) if is_multi_task_model(mc) else labels[:1])
    flags = _task_regression(config)
    real = {n for n, f in zip(names, flags, strict=False) if f}
    return real - {n for n, f in zip(names, flags, strict=False) if not f}


# JRC_LOSS's ways of weighing its two parts (EasyRec's names).
JRC_STRATEGIES = ("fixed", "random_uniform", "random_normal", "random_bernoulli")


def jrc_session_field(config: pipeline_pb2.EasyRecConfig) -> str:
    """The input column of the JRC_LOSS terms' ``session_name``; ``""`` without one.

    A ``session_name`` is an input field, or a feature (its first input column).

    Raises:
        ConfigError: a JRC term without a session, one that names nothing, or two terms
            naming different columns.
    """
    columns = {f.input_name for f in config.data_config.input_fields}
    inputs = {}
    for fc in list(config.feature_configs) + list(config.feature_config.features):
        if fc.input_names:
            inputs[fc.feature_name or fc.input_names[0]] = fc.input_names[0]
    chosen = ""
    for where, loss in loss_entries(config):
        if loss.loss_type != _L.JRC_LOSS:
            continue
        name = loss.jrc_loss.session_name
        column = name if name in columns else inputs.get(name, "")
        if not column:
            raise ConfigError(f"{where}.jrc_loss.session_name",
                              f"{name!r} is neither an input field nor a feature (JRC_LOSS "
                              "needs the session of each sample)" if name else
                              "required: the column whose value is the session")
        if chosen and column != chosen:
            raise ConfigError(f"{where}.jrc_loss.session_name",
                              f"one session column per model: {column!r} and {chosen!r}")
        chosen = column
    return chosen


_NUMERIC_INPUTS = (pipeline_pb2.DatasetConfig.INT32, pipeline_pb2.DatasetConfig.INT64,
                   pipeline_pb2.DatasetConfig.FLOAT, pipeline_pb2.DatasetConfig.DOUBLE)


def sample_weight_field(config: pipeline_pb2.EasyRecConfig) -> str:
    """The input column of EasyRec's ``data_config.sample_weight``; ``""`` without one.

    Each sample's loss is multiplied by the column's value and a term is ``sum(w * loss) /
    count(w != 0)`` over the batch (TF's ``SUM_BY_NONZERO_WEIGHTS``, as EasyRec's
    ``tf.losses`` calls); a record whose weight is not a finite number is rejected
    (``bad_number`` / ``non_finite``). Serving does not read it.

    Raises:
        ConfigError: the field names no numeric input field, names a label, or the model
            has a loss term that is not computed per sample, or in-batch learning is on.
    """
    dc = config.data_config
    name = dc.sample_weight
    if not name:
        return ""
    where = "data_config.sample_weight"
    fields = {f.input_name: f for f in dc.input_fields}
    if name not in fields:
        raise ConfigError(where, f"{name!r} is not an input field")
    if fields[name].input_type not in _NUMERIC_INPUTS:
        raise ConfigError(where, f"{name!r} must be a numeric input field (INT32, INT64, "
                                 "FLOAT or DOUBLE)")
    if name in dc.label_fields:
        raise ConfigError(where, f"{name!r} is a label field")
    for types in _output_terms(config):
        for kind in types:
            if kind not in POINTWISE_LOSS_TYPES:
                raise ConfigError(where, "sample weights apply to losses computed per "
                                         f"sample; {pipeline_pb2.LossType.Name(kind)} is not")
    tc = config.train_config
    for flag in ("in_batch_learning", "per_record_adagrad"):
        if getattr(tc, flag):
            raise ConfigError(where, f"train_config.{flag} does not take sample weights")
    return name


def validate_loss_settings(config: pipeline_pb2.EasyRecConfig) -> None:
    """Checks ``f1_reweighted_loss`` and ``pairwise_focal_loss`` of every loss term.

    Args:
        config: a config.

    Raises:
        ConfigError: naming the first offending field.
    """
    jrc_session_field(config)
    sample_weight_field(config)
    _validate_ziln(config)
    # the classes of the output each loss term trains
    mc = config.model_config
    classes_of = {"model_config": int(mc.num_class)}
    classes_of.update({path: int(task.num_class) for path, task in task_towers(mc)})
    kd_only = (_L.BINARY_CROSS_ENTROPY_LOSS, _L.KL_DIVERGENCE_LOSS)
    owners = [("model_config", mc), *task_towers(mc)]
    for where, kind in ([(f"{path}.loss_type", getattr(m, "loss_type", 0)) for path, m in owners]
                        + [(f"{w}.loss_type", loss.loss_type) for w, loss in loss_entries(config)]):
        if kind in kd_only:
            raise ConfigError(where, f"{pipeline_pb2.LossType.Name(kind)} is a distillation "
                                     "loss: odl computes it "
                                     "for model_config.kd entries only")
    for where, loss in loss_entries(config):
        if loss.loss_type == _L.JRC_LOSS:
            jrc = loss.jrc_loss
            if not 0 <= jrc.alpha <= 1:
                raise ConfigError(f"{where}.jrc_loss.alpha", "must be in [0, 1]")
            if jrc.loss_weight_strategy not in JRC_STRATEGIES:
                raise ConfigError(f"{where}.jrc_loss.loss_weight_strategy",
                                  f"expected one of {', '.join(JRC_STRATEGIES)}, got "
                                  f"{jrc.loss_weight_strategy!r}")
            owner = where.rsplit(".losses[", 1)[0]  # the model, or its task tower
            if classes_of.get(owner, 0) != 2:
                raise ConfigError(f"{where}.loss_type",
                                  f"JRC_LOSS needs {owner}.num_class: 2 (two logits)")
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


def _validate_ziln(config: pipeline_pb2.EasyRecConfig) -> None:
    """``ZILN_LOSS``: a single-task ``num_class: 3`` model's only term, with sane settings."""
    mc = config.model_config
    for where, loss in loss_entries(config):
        if loss.loss_type != _L.ZILN_LOSS:
            continue
        if not where.startswith("model_config.losses"):
            raise ConfigError(f"{where}.loss_type",
                              "ZILN_LOSS is a single-task model's loss (EasyRec's rank models); "
                              "a task tower's is not implemented")
        if len(mc.losses) > 1:
            raise ConfigError(f"{where}.loss_type",
                              "ZILN_LOSS is the model's only loss term (its three logits are "
                              "not a probability another term could read)")
        z = loss.ziln_loss
        checks = (("max_sigma", z.max_sigma > 0, "must be > 0"),
                  ("mu_regularization", z.mu_regularization >= 0, "must be >= 0"),
                  ("sigma_regularization", z.sigma_regularization >= 0, "must be >= 0"),
                  ("classification_weight", z.classification_weight >= 0, "must be >= 0"),
                  ("regression_weight", z.regression_weight >= 0, "must be >= 0"),
                  ("max_log_clip_value", -100 < z.max_log_clip_value < 1e30, "must be > -100"))
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"{where}.ziln_loss.{name}", why)
    if ziln_settings(config) is not None and mc.num_class != 3:
        raise ConfigError("model_config.num_class",
                          f"ZILN_LOSS needs num_class: 3 (a positive logit, the log's mean and "
                          f"scale), got {mc.num_class}")
