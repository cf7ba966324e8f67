"""EasyRec's vector labels (``label_dim``, ``label_sep``) and its distillation losses (``kd``).

EasyRec lists every label column in ``data_config.label_fields``; one with ``label_dim`` > 1
is split on its ``label_sep`` into that many numbers (an empty separator splits the text into
single characters, TF's ``string_split`` with an empty delimiter), and a ``model_config.kd``
entry reads one such column as its soft label. Only the first label trains the model's own
loss. Loading (:func:`normalize_vector_labels`) moves every label that is split (dim > 1) or
that a ``kd`` names as ``soft_label_name`` from ``label_fields`` into
``data_config.vector_labels`` (its name, dim and separator), so ``label_fields`` holds the
labels the model's outputs train on, as everywhere else in odl; ``label_dim`` and
``label_sep`` are then cleared. Checkpoints and exports hold the moved form.

The record parser reads a vector label as ``dim`` finite numbers per record (else
``bad_label``); ``Batch.label_vectors`` carries them; ``odl.models.distillation`` computes
the ``kd`` losses. Refused by field (:func:`validate_vector_labels`): a ``label_dim`` list
longer than ``label_fields``, a dim of 0 or above :data:`MAX_LABEL_DIM`, a split label without
a ``label_sep`` entry or that is not a STRING field, a vector label no ``kd`` reads, a
``kd`` naming another label, a ``kd`` loss type other than the four EasyRec computes in
closed form, a negative temperature.
"""

from __future__ import annotations

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

__all__ = ["KD_LOSS_TYPES", "MAX_LABEL_DIM", "normalize_vector_labels", "validate_vector_labels"]

_L = pipeline_pb2.LossType
KD_LOSS_TYPES = (_L.CROSS_ENTROPY_LOSS, _L.BINARY_CROSS_ENTROPY_LOSS, _L.KL_DIVERGENCE_LOSS,
                 _L.L2_LOSS)
MAX_LABEL_DIM = 4096


def normalize_vector_labels(config: pipeline_pb2.EasyRecConfig) -> None:
    """Moves EasyRec's split and soft labels into ``vector_labels``, in place (module docstring).

    Raises:
        ConfigError: ``label_dim`` / ``label_sep`` that do not fit ``label_fields``.
    """
    dc = config.data_config
    soft = {kd.soft_label_name for kd in config.model_config.kd}
    dims, seps = list(dc.label_dim), list(dc.label_sep)
    if not dims and not seps and not soft:
        return
    if len(dims) > len(dc.label_fields):
        raise ConfigError("data_config.label_dim",
                          f"{len(dims)} entries for {len(dc.label_fields)} label_fields")
    if len(seps) > len(dc.label_fields):
        raise ConfigError("data_config.label_sep",
                          f"{len(seps)} entries for {len(dc.label_fields)} label_fields")
    keep: list[str] = []
    for i, name in enumerate(dc.label_fields):
        dim = dims[i] if i < len(dims) else 1
        if dim < 1 or dim > MAX_LABEL_DIM:
            raise ConfigError(f"data_config.label_dim[{i}]",
                              f"must be in [1, {MAX_LABEL_DIM}], got {dim}")
        if dim == 1 and name not in soft:
            keep.append(name)
            continue
        if dim > 1 and i >= len(seps):
            raise ConfigError("data_config.label_sep",
                              f"label_fields[{i}] ({name!r}) has label_dim {dim} but no "
                              "label_sep entry")
        dc.vector_labels.add(input_name=name, dim=dim, separator=seps[i] if dim > 1 else "")
    del dc.label_fields[:]
    dc.label_fields.extend(keep)
    dc.ClearField("label_dim")
    dc.ClearField("label_sep")


def validate_vector_labels(config: pipeline_pb2.EasyRecConfig, fields: dict[str, int]) -> None:
    """Checks ``vector_labels`` and ``model_config.kd`` (module docstring).

    Args:
        config: the config (normalized).
        fields: input field name -> its ``input_type``.

    Raises:
        ConfigError: naming the first offending field.
    """
    dc = config.data_config
    for name in ("label_dim", "label_sep"):  # (loading moves them; a config from text)
        if getattr(dc, name):
            raise ConfigError(f"data_config.{name}",
                              "load the config with load_pipeline_config (it moves split and "
                              "soft labels to data_config.vector_labels)")
    names: list[str] = []
    for i, vl in enumerate(dc.vector_labels):
        where = f"data_config.vector_labels[{i}]"
        if vl.input_name not in fields:
            raise ConfigError(f"{where}.input_name", f"{vl.input_name!r} is not an input field")
        if vl.input_name in names or vl.input_name in dc.label_fields:
            raise ConfigError(f"{where}.input_name", f"label {vl.input_name!r} repeats")
        if not 1 <= vl.dim <= MAX_LABEL_DIM:
            raise ConfigError(f"{where}.dim", f"must be in [1, {MAX_LABEL_DIM}], got {vl.dim}")
        if vl.dim > 1 and fields[vl.input_name] != pipeline_pb2.DatasetConfig.STRING:
            raise ConfigError(f"{where}.input_name",
                              f"{vl.input_name!r} holds {vl.dim} numbers: a STRING field "
                              "(EasyRec splits text only)")
        names.append(vl.input_name)
    read = set()
    for i, kd in enumerate(config.model_config.kd):
        where = f"model_config.kd[{i}]"
        if kd.soft_label_name not in names:
            raise ConfigError(f"{where}.soft_label_name",
                              f"{kd.soft_label_name!r} is not one of data_config.label_fields")
        read.add(kd.soft_label_name)
        if kd.loss_type not in KD_LOSS_TYPES:
            raise ConfigError(f"{where}.loss_type", (
                f"{_L.Name(kd.loss_type)}: odl's distillation losses are "
                f"{', '.join(_L.Name(t) for t in KD_LOSS_TYPES)}"))
        if kd.temperature < 0:
            raise ConfigError(f"{where}.temperature", "must be >= 0")
        if not kd.pred_name:
            raise ConfigError(f"{where}.pred_name", "required (e.g. \"logits\")")
    for i, vl in enumerate(dc.vector_labels):
        if vl.input_name not in read:
            raise ConfigError(f"data_config.vector_labels[{i}]",
                              f"{vl.input_name!r} has several numbers per record; only a "
                              "model_config.kd reads such a label (soft_label_name)")
