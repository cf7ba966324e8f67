"""The model classes a config may name, read from ``protos/pipeline.proto``, and their settings.

``EasyRecModel``'s ``oneof model`` holds one settings message per model; each of its fields
names, in its ``model_classes`` option, the ``model_config.model_class`` values whose settings
it holds (EasyRec names a model by ``model_class``; TorchEasyRec by the message alone, which
:func:`odl.config.easyrec_compat.infer_model_class` maps back to the first name). This is
everything the config layer knows about a model class; what a class is (its module, how it
builds, validates and counts its outputs) is ``odl.models.model_registry``'s.

A model whose settings message has tasks is multi-task: one output per task, each trained on
its own label (:func:`is_multi_task_model`, :func:`task_label_names`); for a field whose
``multi_task_classes`` option names classes, only those classes are (``model_params``:
MultiTaskModel, not RankModel). Its tasks are its
``task_towers``, or, for a message without that field, its ``TaskTower`` fields in declaration
order (EasyRec's ESMM: ``cvr_tower``, ``ctr_tower``; :func:`task_towers`). A message whose
``product_output`` option names an output has that output after its tasks' (:func:`product_output`).
"""

from __future__ import annotations

from typing import Any

from odl.protos import pipeline_pb2

_ONEOF = pipeline_pb2.EasyRecModel.DESCRIPTOR.oneofs_by_name["model"]


def _messages() -> dict[str, str]:
    out: dict[str, str] = {}
    for fd in _ONEOF.fields:
        for name in fd.GetOptions().Extensions[pipeline_pb2.model_classes]:
            out.setdefault(name, fd.name)
    return out


# model_class -> the EasyRecModel field with its settings (a field's first class is the one a
# config naming only the message gets; a class named by two fields reads the first)
MODEL_MESSAGES: dict[str, str] = _messages()
IMPLEMENTED_MODEL_CLASSES = tuple(MODEL_MESSAGES)


def classes_of_message(field: str) -> tuple[str, ...]:
    """The ``model_class`` names whose settings the ``EasyRecModel`` field ``field`` holds."""
    fd = next((f for f in _ONEOF.fields if f.name == field), None)
    return tuple(fd.GetOptions().Extensions[pipeline_pb2.model_classes]) if fd else ()


def model_settings(model_config: pipeline_pb2.EasyRecModel) -> tuple[str, Any]:
    """``(field name, message)`` of the model's settings.

    The message set in ``oneof model``; when none is set, the (empty) message of
    ``model_class``; ``("", None)`` when neither says.

    Args:
        model_config: the model config.

    Returns:
        e.g. ``("deepfm", model_config.deepfm)``.
    """
    field = model_config.WhichOneof("model") or MODEL_MESSAGES.get(model_config.model_class, "")
    return (field, getattr(model_config, field)) if field else ("", None)


def _task_fields(descriptor: Any) -> list[Any]:
    """The singular ``TaskTower`` fields of a settings message without ``task_towers``."""
    if "task_towers" in descriptor.fields_by_name:
        return []
    return [fd for fd in descriptor.fields
            if fd.message_type is pipeline_pb2.TaskTower.DESCRIPTOR
            and not fd.is_repeated]


def _has_tasks(descriptor: Any) -> bool:
    return "task_towers" in descriptor.fields_by_name or bool(_task_fields(descriptor))


def task_towers(model_config: pipeline_pb2.EasyRecModel) -> list[tuple[str, Any]]:
    """``(dotted path, TaskTower)`` per task of a multi-task model, in task order.

    Args:
        model_config: the model config.

    Returns:
        ``model_config.<field>.task_towers[i]`` each, or the message's ``TaskTower`` fields in
        declaration order; empty for a model that is not multi-task.
    """
    field, settings = model_settings(model_config)
    if settings is None:
        return []
    where = f"model_config.{field}"
    if "task_towers" in settings.DESCRIPTOR.fields_by_name:
        return [(f"{where}.task_towers[{i}]", t) for i, t in enumerate(settings.task_towers)]
    return [(f"{where}.{fd.name}", getattr(settings, fd.name))
            for fd in _task_fields(settings.DESCRIPTOR)]


def _multi_task_classes(field: str) -> tuple[str, ...] | None:
    """The field's ``multi_task_classes`` option, or None when it has none."""
    fd = next((f for f in _ONEOF.fields if f.name == field), None)
    names = tuple(fd.GetOptions().Extensions[pipeline_pb2.multi_task_classes]) if fd else ()
    return names or None


def _task_towers(model_config: pipeline_pb2.EasyRecModel) -> Any:
    field, settings = model_settings(model_config)
    if settings is None or not _has_tasks(settings.DESCRIPTOR):
        return None
    only = _multi_task_classes(field)
    if only is not None and (model_config.model_class or classes_of_message(field)[0]) \
            not in only:
        return None  # e.g. model_params of a RankModel: its task_towers are not read
    return [t for _path, t in task_towers(model_config)]


def product_output(model_config: pipeline_pb2.EasyRecModel) -> str:
    """The name of the model's output after its tasks' (the product of their predictions).

    ``""`` when its settings message declares none (``product_output`` option).
    """
    _field, settings = model_settings(model_config)
    if settings is None:
        return ""
    return settings.DESCRIPTOR.GetOptions().Extensions[pipeline_pb2.product_output]


def domain_label(model_config: pipeline_pb2.EasyRecModel) -> str:
    """The label field holding each record's domain (PEPNet's ``domain_input_name``); "".

    Such a label is not trained on: a feature may read its column too, and it holds an
    integer in ``[0, task_domain_num)``.
    """
    if model_config.HasField("pepnet"):
        return model_config.pepnet.domain_input_name
    return ""


def is_multi_task_model(model_config: pipeline_pb2.EasyRecModel) -> bool:
    """Whether the model trains one output per task (its settings message has tasks)."""
    return _task_towers(model_config) is not None


def multi_task_model_classes() -> tuple[str, ...]:
    """The classes whose settings message has tasks (for messages to users)."""
    return tuple(name for name, field in MODEL_MESSAGES.items()
                 if _has_tasks(pipeline_pb2.EasyRecModel.DESCRIPTOR.fields_by_name[
                     field].message_type)
                 and name in (_multi_task_classes(field) or (name,)))


def task_label_names(model_config: pipeline_pb2.EasyRecModel,
                     label_fields: list[str]) -> list[str]:
    """The label each task of a multi-task model trains on, in task order.

    EasyRec's rule: a task's ``label_name``, else the ``label_fields`` entry at the task's
    position.

    Args:
        model_config: the model config (a multi-task model).
        label_fields: ``data_config.label_fields``.

    Returns:
        One label name per task (``""`` where neither gives one).
    """
    out = []
    for i, task in enumerate(_task_towers(model_config) or ()):
        out.append(task.label_name or (label_fields[i] if i < len(label_fields) else ""))
    return out


def sequence_attention_features(model_config: pipeline_pb2.EasyRecModel,
                                group: str) -> tuple[list[str], list[str]]:
    """``(keys, sequences)`` of a sequence attention group, in order (empty if none).

    Args:
        model_config: the model config.
        group: ``seq_att_groups[].group_name``.

    Returns:
        The key features and the SequenceFeatures of every ``seq_att_map`` of the group.
    """
    keys: list[str] = []
    hists: list[str] = []
    for g in model_config.seq_att_groups:
        if g.group_name == group:
            for m in g.seq_att_map:
                keys += list(m.key)
                hists += list(m.hist_seq)
    return keys, hists
