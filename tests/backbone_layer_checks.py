"""What the backbone layers' test files share: a layer built by its class name, and random
inputs of its spec (``odl/models/backbone/block_registry.py``)."""

from __future__ import annotations

from typing import Any

import torch
from google.protobuf.message import Message

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, block_builder
from odl.models.backbone.value_specs import Spec, leaves

B = 5  # the batch of the layer tests
WHERE = "model_config.backbone.blocks[0].keras_layer"


def build(name: str, spec: Spec, params: Message | None = None,
          st: dict[str, Any] | None = None) -> BuiltLayer:
    """The layer ``name`` over ``spec``, from its params message or ``st_params``."""
    builder = block_builder(name)
    assert builder is not None, name
    return builder(BlockArgs(name, params, spec, WHERE, st or {}))


def inputs_for(spec: Spec, seed: int = 0) -> list[torch.Tensor]:
    """Random leaves of ``spec`` with a batch of :data:`B`, gradients on."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((B, *s.shape), generator=g, requires_grad=True)
            for s in leaves(spec)]
