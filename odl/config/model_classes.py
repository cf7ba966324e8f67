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
MODEL_MESSAGES: dict[str, str] = {"DeepFM": "deepfm", "WideAndDeep": "wide_and_deep"}
IMPLEMENTED_MODEL_CLASSES = tuple(MODEL_MESSAGES)
# classes with an FM term over the deep group's embeddings
FM_MODEL_CLASSES = ("DeepFM",)


def wide_deep_settings(model_config: pipeline_pb2.EasyRecModel) -> tuple[str, Any]:
    """``(field name, message)`` of a wide-and-deep family model's settings.

    Args:
        model_config: the model config.

    Returns:
        e.g. ``("deepfm", model_config.deepfm)``; DeepFM's for an unknown class.
    """
    name = MODEL_MESSAGES.get(model_config.model_class, "deepfm")
    return name, getattr(model_config, name)


def uses_fm(model_config: pipeline_pb2.EasyRecModel) -> bool:
    """Whether the model has DeepFM's FM term."""
    return model_config.model_class in FM_MODEL_CLASSES or not model_config.model_class
