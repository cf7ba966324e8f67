"""A second label for multi-task models: conversions (``buy``) of the synthetic stream's clicks.

A record converts only if it was clicked: ``buy = label * Bernoulli(sigmoid(cvr_logit))``
with ``cvr_logit = CVR_BIAS + CVR_GAIN * effect(C3 rank) + 0.5 * (I1 - 1.5)``, where
``effect`` is a deterministic standard normal of ``(seed, rank)``; the draw is a pure
function of ``(seed, record number)``, like every other column of the stream. So the CVR
task shares the click model's signal (clicks) and has its own (C3, I1), which is what a
multi-task model is for.

Record layout: the 42 columns of ``odl.datagen.synthetic_ctr`` then ``buy`` (0 or 1): CSV
appends ``,<buy>``; JSON adds the key ``"buy"`` (an int).
"""

from __future__ import annotations

import logging

import numpy as np

from odl.datagen.synthetic_ctr import CtrBatch, _mix, _mix_int, _normal, _uniform

logger = logging.getLogger(__name__)

CONVERSION_FIELD = "buy"
CVR_BIAS = -0.5
CVR_GAIN = 1.2
_S_CVR = 101


def conversion_labels(batch: CtrBatch, seed: int) -> np.ndarray:
    """The ``buy`` label of every record of ``batch`` (module docstring).

    Args:
        batch: records of a ``SyntheticCtrStream``.
        seed: the stream's seed.

    Returns:
        int8 0/1, shape ``(b,)``; 0 wherever ``label`` is 0.
    """
    k1, k2, k3 = (_mix_int(seed, _S_CVR, i) for i in range(3))
    effect = _normal(batch.ranks[:, 2].astype(np.uint64), k1, k2)
    logit = CVR_BIAS + CVR_GAIN * effect + 0.5 * (batch.dense[:, 0] - 1.5)
    p = 1.0 / (1.0 + np.exp(-logit))
    draw = _uniform(_mix(batch.indices.astype(np.uint64), k3)) < p
    return (draw & (batch.labels > 0)).astype(np.int8)


def encode_with_conversions(batch: CtrBatch, seed: int, fmt: str = "csv") -> list[bytes]:
    """The batch's records (``CtrBatch.encode``) with the ``buy`` column added.

    Args:
        batch: records of a ``SyntheticCtrStream``.
        seed: the stream's seed.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        One encoded record per sample (layout in the module docstring).
    """
    buys = conversion_labels(batch, seed).tolist()
    records = batch.encode(fmt)
    if fmt == "json":
        return [r[:-1] + b',"buy":%d}' % b for r, b in zip(records, buys, strict=True)]
    return [r + b",%d" % b for r, b in zip(records, buys, strict=True)]
