"""The model classes odl implements and the config message that holds each one's settings.

``model_config.model_class`` names the class (EasyRec); TorchEasyRec names it by the message
alone (``deepfm { ... }``), which :func:`odl.config.easyrec_compat.infer_model_class` maps
back through :data:`MODEL_MESSAGES`. DeepFM and WideAndDeep share one structure (wide part,
deep tower, optional ``final_dnn``; DeepFM adds the FM term), so code that reads their tower
settings goes through :func:`wide_deep_settings`.
"""

from __future__ import annotations

from typing import Any

from odl.protos import pipeline_pb2

# model_class -> the EasyRecModel field with its settings
# (the first class of a message is the one a config naming only the message gets)
MODEL_MESSAGES: dict[str, str] = {"DeepFM": "deepfm", "WideAndDeep": "wide_and_deep",
                                  "MultiTower": "multi_tower", "MultiTowerDIN": "multi_tower",
                                  "DCN": "dcn", "DCNV2": "dcn_v2", "MMoE": "mmoe",
                                  "DBMTL": "dbmtl"}
IMPLEMENTED_MODEL_CLASSES = tuple(MODEL_MESSAGES)
# classes with an FM term over the deep group's embeddings
FM_MODEL_CLASSES = ("DeepFM",)
# the wide-and-deep family (wide part, deep tower, optional final_dnn)
WIDE_DEEP_MODEL_CLASSES = ("DeepFM", "WideAndDeep")
# the tower family (towers over named feature groups, concatenated into final_dnn)
TOWER_MODEL_CLASSES = ("MultiTower", "MultiTowerDIN", "DCN", "DCNV2")
# multi-task models (several task towers, one output per task)
MULTI_TASK_MODEL_CLASSES = ("MMoE", "DBMTL")


def wide_deep_settings(model_config: pipeline_pb2.EasyRecModel) -> tuple[str, Any]:
    """``(field name, message)`` of a wide-and-deep family model's settings.

    Args:
        model_config: the model config.

    Returns:
        e.g. ``("deepfm", model_config.deepfm)``; DeepFM's for any other class.
    """
    name = (MODEL_MESSAGES[model_config.model_class]
            if model_config.model_class in WIDE_DEEP_MODEL_CLASSES else "deepfm")
    return name, getattr(model_config, name)


def uses_fm(model_config: pipeline_pb2.EasyRecModel) -> bool:
    """Whether the model has DeepFM's FM term."""
    return model_config.model_class in FM_MODEL_CLASSES or not model_config.model_class


def is_multi_task_model(model_config: pipeline_pb2.EasyRecModel) -> bool:
    """Whether the model is MMoE or DBMTL."""
    return model_config.model_class in MULTI_TASK_MODEL_CLASSES


def multi_task_settings(model_config: pipeline_pb2.EasyRecModel) -> tuple[str, Any]:
    """``(field name, message)`` of a multi-task model (``("mmoe", model_config.mmoe)``, ...).

    Args:
        model_config: the model config (MMoE or DBMTL).

    Returns:
        The settings message with its ``task_towers``.
    """
    name = MODEL_MESSAGES[model_config.model_class]
    return name, getattr(model_config, name)


def task_label_names(model_config: pipeline_pb2.EasyRecModel,
                     label_fields: list[str]) -> list[str]:
    """The label each task of a multi-task model trains on, in task order.

    EasyRec's rule: a task's ``label_name``, else the ``label_fields`` entry at the task's
    position.

    Args:
        model_config: the model config (MMoE or DBMTL).
        label_fields: ``data_config.label_fields``.

    Returns:
        One label name per task (``""`` where neither gives one).
    """
    _field, settings = multi_task_settings(model_config)
    out = []
    for i, task in enumerate(settings.task_towers):
        out.append(task.label_name or (label_fields[i] if i < len(label_fields) else ""))
    return out


def is_tower_model(model_config: pipeline_pb2.EasyRecModel) -> bool:
    """Whether the model is MultiTower, MultiTowerDIN, DCN or DCNV2."""
    return model_config.model_class in TOWER_MODEL_CLASSES


# (kind, group name, settings): ("dnn", group, DNN), ("cross", group, cross_num),
# ("cross_v2", group, (CrossV2, backbone DNN or None)) or ("din", sequence attention group,
# DINTower)
TowerSpec = tuple[str, str, Any]


def tower_settings(model_config: pipeline_pb2.EasyRecModel) -> tuple[str, Any, list[TowerSpec]]:
    """``(field name, message, towers)`` of a tower-family model.

    Args:
        model_config: the model config (MultiTower, DCN or DCNV2).

    Returns:
        The settings message (its ``final_dnn`` joins the towers) and its towers in order,
        each ``(kind, group name, settings)``: ``("dnn", group, DNN)``, ``("cross", group,
        cross_num)``, ``("cross_v2", group, (CrossV2, backbone DNN or None))`` or
        ``("din", sequence attention group, DINTower)`` (MultiTowerDIN, after its towers).
        DCNV2 reads the first feature group (TorchEasyRec's rule): its cross network, then
        its ``deep`` DNN when set.
    """
    if model_config.model_class == "DCNV2":
        d = model_config.dcn_v2
        group = model_config.feature_groups[0].group_name if model_config.feature_groups else ""
        towers: list[TowerSpec] = [
            ("cross_v2", group, (d.cross, d.backbone if d.HasField("backbone") else None))]
        if d.HasField("deep"):
            towers.append(("dnn", group, d.deep))
        return "dcn_v2", d, towers
    if model_config.model_class == "DCN":
        d = model_config.dcn
        return "dcn", d, [("dnn", d.deep_tower.input, d.deep_tower.dnn),
                          ("cross", d.cross_tower.input, int(d.cross_tower.cross_num))]
    m = model_config.multi_tower
    towers: list[TowerSpec] = [("dnn", t.input, t.dnn) for t in m.towers]
    if model_config.model_class == "MultiTowerDIN":
        towers += [("din", t.input, t) for t in m.din_towers]
    return "multi_tower", m, towers


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

