"""A behaviour sequence for DIN samples: ``hist_C3``, ids of C3 near each record's own.

``SyntheticCtrStream.history`` makes it (a deterministic function of the seed and the record
number; 0 to ``HISTORY_LENGTH`` ids, ``"|"``-joined 8-char hex like C3's). Its key is the
record's own C3: a DIN tower attends from the candidate (C3) over the items of the history.

Record layout: the 42 columns of ``odl.datagen.synthetic_ctr`` then ``hist_C3``: CSV appends
``,<ids>``; JSON adds the key ``"hist_C3"`` (a string).
"""

from __future__ import annotations

import json
import logging

from odl.datagen.synthetic_ctr import CtrBatch, SyntheticCtrStream

logger = logging.getLogger(__name__)

HISTORY_FIELD = "hist_C3"
HISTORY_LENGTH = 5


def encode_with_history(stream: SyntheticCtrStream, batch: CtrBatch,
                        fmt: str = "csv") -> list[bytes]:
    """The batch's records (``CtrBatch.encode``) with the ``hist_C3`` column added.

    Args:
        stream: the stream that made ``batch``.
        batch: its records.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        One encoded record per sample (layout in the module docstring).
    """
    history = stream.history(batch, field=2, length=HISTORY_LENGTH)
    records = batch.encode(fmt)
    if fmt == "json":
        return [r[:-1] + f',"{HISTORY_FIELD}":{json.dumps(h)}}}'.encode()
                for r, h in zip(records, history, strict=True)]
    return [r + b"," + h.encode() for r, h in zip(records, history, strict=True)]
