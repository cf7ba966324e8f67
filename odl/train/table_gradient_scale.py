"""EasyRec's ``embedding_learning_rate_multiplier``: the tables' gradients scaled first.

EasyRec multiplies the gradient of every embedding variable by the factor before its
optimizer (TF's ``gradient_multipliers``, read from the first ``optimizer_config``). Here
every fbgemm TBE module of the sharded collection gets a forward hook that, on a training
forward, registers a gradient hook on its pooled output multiplying the gradient by the
factor; the fused kernel's backward (or the row-sparse tables' capture, whose hooks are
registered after these) then sees the scaled gradient, so every table kind, device and rank
takes it alike. TorchEasyRec's table ``gradient_clipping`` clamps the scaled gradient. The
columns of tables that ``freeze_gradient`` froze (:mod:`odl.train.frozen_parameters`) get
a zero gradient the same way, so their optimizer state stays as it is. A rebuilt module (a
table that grows) registers the hooks again.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from odl.train.row_sparse_tables import tbe_modules

logger = logging.getLogger(__name__)

__all__ = ["scale_table_gradients"]


def scale_table_gradients(dmp: nn.Module, factor: float,
                          frozen: Collection[str] = ()) -> list[Any]:
    """Multiplies the gradient reaching every table lookup of ``dmp`` by ``factor``.

    Args:
        dmp: the ``DistributedModelParallel`` model (tables under ``module.ebc``).
        factor: the multiplier (1.0 and nothing frozen: nothing is registered).
        frozen: tables ``freeze_gradient`` froze: their columns' gradient is zero.

    Returns:
        The forward hooks' handles (``remove()`` undoes them).
    """
    frozen = frozenset(frozen)
    handles = []
    for emb, configs in tbe_modules(dmp.module.ebc):
        held = [k for k, c in enumerate(configs) if c.name in frozen]
        if factor == 1.0 and not held:
            continue
        multiplier: float | torch.Tensor = factor
        if held:
            offsets = [int(d) for d in emb.D_offsets.tolist()]
            mask = torch.full((offsets[-1],), float(factor), device=emb.D_offsets.device)
            for f, t in enumerate(int(x) for x in emb.feature_table_map):
                if t in held:
                    mask[offsets[f]:offsets[f + 1]] = 0.0
            multiplier = 0.0 if not bool(mask.any()) else mask
        handles.append(emb.register_forward_hook(_hook(multiplier)))
    if factor != 1.0:
        logger.info("table gradients multiplied by %g (embedding_learning_rate_multiplier) in "
                    "%d lookup kernels", factor, len(handles))
    return handles


def _hook(multiplier: float | torch.Tensor) -> Any:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if module.training and torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(lambda grad: grad * multiplier)

    return hook
