"""``dense_model.pt``: the training model's own dense part, compiled with TorchScript.

``script_dense(model)`` compiles a copy of ``model.dense`` (contract:
``odl.models.ctr_model``) with ``torch.jit.script`` and holds it as the child ``dense`` of a
small root module, ``ExportedDense``, whose ``forward`` has the dense part's signature and
only calls it. The file therefore contains the training code itself (its TorchScript class is
the model's dense class, e.g. ``__torch__.odl.models.deepfm.DeepFMDense``), and its
parameters and buffers keep the trainer's names (``dense.dnn.0.weight``, ``dense.wide_bias``,
...), the keys of ``DENSE_UPDATE_VARIABLES``, so serving copies replayed dense variables in by
name.
"""

from __future__ import annotations

import copy
import logging

import torch

from odl.models.ctr_model import CtrModel

logger = logging.getLogger(__name__)

DENSE_CHILD = "dense"


def _forward_source(dense: torch.jit.ScriptModule) -> str:
    """TorchScript source of a ``forward`` with ``dense.forward``'s signature calling it."""
    schema = dense.forward.schema
    args = schema.arguments[1:]  # without self
    params = ", ".join(f"{a.name}: {a.type.annotation_str}" for a in args)
    names = ", ".join(a.name for a in args)
    if len(schema.returns) != 1:
        raise ValueError(f"the dense part must return one value, its schema is {schema}")
    returns = schema.returns[0].type.annotation_str
    return (f"def forward(self, {params}) -> {returns}:\n"
            f"    return self.{DENSE_CHILD}({names})\n")


class ExportedDense(torch.jit.ScriptModule):
    """Root of ``dense_model.pt``: the scripted dense part under the name ``dense``.

    Args:
        dense: the scripted dense part.
    """

    def __init__(self, dense: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.dense = dense
        self.define(_forward_source(dense))


def script_dense(model: CtrModel) -> torch.jit.ScriptModule:
    """Compiles a copy of ``model.dense`` (eval mode, on CPU) for ``dense_model.pt``.

    Args:
        model: the model; its dense part holds the values to export.

    Returns:
        The root module (save it with ``torch.jit.save``); ``forward`` takes what
        ``model.dense`` takes and returns its logits.
    """
    dense = copy.deepcopy(model.dense).cpu().eval()
    root = ExportedDense(torch.jit.script(dense))
    root.eval()
    return root
