"""The layers a backbone block names by ``keras_layer.class_name``.

A layer module of this package calls :func:`register_block` once per class name with a
builder. The graph (``odl.models.backbone.backbone_graph``) calls the builder with a
:class:`BlockArgs`: the class's settings (its ``KerasLayer`` params message, or
``st_params`` as a plain dict), the spec of the input (``odl.models.backbone.value_specs``)
and where in the config the layer is, for errors. The builder returns a :class:`BuiltLayer`:
a scriptable ``nn.Module`` with ``forward(xs: List[Tensor]) -> List[Tensor]`` (the input's
leaves in, the output's leaves out) and the output's spec. A builder raises ``ConfigError``
(at ``args.where``) for settings or an input it cannot take.

Layers use ``self.training`` for what differs between training and predictions (dropout,
batch normalization) and keep no state between calls. Kernel regularization is the model's:
``model_params.l2_regularization`` times the squared weight of every ``nn.Linear`` in the
network (nothing else), so a layer adds nothing for it; a layer keeps a kernel that EasyRec
leaves unregularized as a plain parameter or a convolution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message
from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.value_specs import Spec, describe


@dataclass(frozen=True)
class BlockArgs:
    """What a layer's builder gets.

    Attributes:
        class_name: the ``keras_layer.class_name``.
        params: the ``KerasLayer`` params message set (e.g. ``MLP``), or ``None``.
        st_params: ``st_params`` as a dict (numbers that are whole become ``int``, lists
            ``list``, structs ``dict``; EasyRec's reading), empty when not given.
        spec: the input's spec.
        where: the config path of the ``keras_layer``, for errors.
    """

    class_name: str
    params: Message | None
    spec: Spec
    where: str
    st_params: dict[str, Any] = field(default_factory=dict)

    def refuse(self, message: str) -> ConfigError:
        """A ``ConfigError`` at this layer naming the class and its input."""
        return ConfigError(self.where, f"{self.class_name} over {describe(self.spec)}: "
                                       f"{message}")


@dataclass(frozen=True)
class BuiltLayer:
    """A built layer: the module and its output's spec."""

    module: nn.Module
    spec: Spec


BlockBuilder = Callable[[BlockArgs], BuiltLayer]

_BUILDERS: dict[str, BlockBuilder] = {}


def register_block(class_name: str, builder: BlockBuilder) -> None:
    """Registers the builder of a class name (once per name).

    Raises:
        ValueError: the name is registered already.
    """
    if class_name in _BUILDERS:
        raise ValueError(f"backbone layer {class_name!r} is registered twice")
    _BUILDERS[class_name] = builder


def block_builder(class_name: str) -> BlockBuilder | None:
    """The builder of a class name, or ``None`` when odl has no such layer."""
    _load_layer_modules()
    return _BUILDERS.get(class_name)


def registered_blocks() -> list[str]:
    """The class names odl implements, sorted."""
    _load_layer_modules()
    return sorted(_BUILDERS)


_LAYER_MODULES = ("dense_layers", "interaction_layers", "feature_importance_layers",
                  "mask_layers", "numeric_embeddings", "sequence_encoders", "gated_layers",
                  "multi_task_layers", "contrastive_layers")
_LOADED = False


def _load_layer_modules() -> None:
    global _LOADED
    if _LOADED:
        return
    import importlib

    for name in _LAYER_MODULES:
        importlib.import_module(f"odl.models.backbone.{name}")
    _LOADED = True
