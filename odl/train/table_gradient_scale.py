"""EasyRec's ``embedding_learning_rate_multiplier``: the tables' gradients scaled first.

EasyRec multiplies the gradient of every embedding variable by the factor before its
optimizer (TF's ``gradient_multipliers``, read from the first ``optimizer_config``). Here
every fbgemm TBE module of the sharded collection gets a forward hook that, on a training
forward, registers a gradient hook on its pooled output multiplying the gradient by the
factor; the fused kernel's backward (or the row-sparse tables' capture, whose hooks are
registered after these) then sees the scaled gradient, so every table kind, device and rank
takes it alike. TorchEasyRec's table ``gradient_clipping`` clamps the scaled gradient. A
rebuilt module (a table that grows) registers the hooks again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from odl.train.row_sparse_tables import tbe_modules

logger = logging.getLogger(__name__)

__all__ = ["scale_table_gradients"]


def scale_table_gradients(dmp: nn.Module, factor: float) -> list[Any]:
    """Multiplies the gradient reaching every table lookup of ``dmp`` by ``factor``.

    Args:
        dmp: the ``DistributedModelParallel`` model (tables under ``module.ebc``).
        factor: the multiplier (1.0: nothing is registered).

    Returns:
        The forward hooks' handles (``remove()`` undoes them).
    """
    if factor == 1.0:
        return []

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if module.training and torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(lambda grad: grad * factor)

    handles = [emb.register_forward_hook(hook) for emb, _ in tbe_modules(dmp.module.ebc)]
    logger.info("table gradients multiplied by %g (embedding_learning_rate_multiplier) in %d "
                "lookup kernels", factor, len(handles))
    return handles
