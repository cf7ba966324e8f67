"""Writes the synthetic CTR stream as a PaddleRec-style file stream (``odl-datagen --split-dir``).

Layout written (read by ``file_stream_input``, ``odl.inputs.file_stream_source``)::

    <root>/YYYYMMDD/HHMM/part-00000 ... part-<parts-1>   CSV or JSON lines, one record each
    <root>/YYYYMMDD/HHMM/<donefile>                     empty, written last

Splits start at ``start`` (``HHMM``) and follow every ``interval`` minutes, crossing into the
next days as needed. Each part is written to a hidden temporary name and renamed, and the
donefile is written only after every part of its split, so a reader never sees a partial
split as complete. A record's event time is its split's start plus its position in the split
(spread over the split's minutes).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from typing import Any

from odl.datagen.datagen_config import records_with_column
from odl.datagen.synthetic_ctr import SyntheticCtrStream

logger = logging.getLogger(__name__)


def write_splits(root: str, day: str, splits: int, per_split: int, interval: int = 5,
                 start: str = "0000", parts: int = 2, donefile: str = "to.hadoop.done",
                 seed: int = 0, fmt: str = "csv", column: str = "") -> dict[str, Any]:
    """Writes ``splits`` splits of ``per_split`` records each.

    Args:
        root: the stream's root (``train_data_dir``), a local directory.
        day: first day, ``YYYYMMDD``.
        splits: splits to write.
        per_split: records per split.
        interval: minutes between splits.
        start: first split's ``HHMM``.
        parts: files per split.
        donefile: completion marker's name ("" for none).
        seed: the stream's seed.
        fmt: ``"csv"`` or ``"json"``.
        column: a column written after the stream's 42 (``"buy"``, ``"hist_C3"``:
            ``odl.datagen.datagen_config.records_with_column``), or ``""``.

    Returns:
        A summary: records, the splits written (``YYYYMMDD/HHMM``), oracle AUC.
    """
    t0 = dt.datetime.strptime(day + start, "%Y%m%d%H%M").replace(tzinfo=dt.timezone.utc)
    stream = SyntheticCtrStream(seed=seed)
    written = []
    for k in range(splits):
        t = t0 + dt.timedelta(minutes=k * interval)
        d = os.path.join(root, t.strftime("%Y%m%d"), t.strftime("%H%M"))
        os.makedirs(d, exist_ok=True)
        base = t.timestamp()
        for p in range(parts):
            n = per_split // parts + (1 if p < per_split % parts else 0)
            batch = stream.next_batch(n, now=base + 60.0 * interval * (p + 1) / parts)
            tmp = os.path.join(d, f".part-{p:05d}.tmp")
            with open(tmp, "wb") as f:
                values = records_with_column(column, stream, batch, fmt)
                f.write(b"".join(v + b"\n" for v in values))
            os.replace(tmp, os.path.join(d, f"part-{p:05d}"))
        if donefile:
            open(os.path.join(d, donefile), "wb").close()
        written.append(f"{t:%Y%m%d}/{t:%H%M}")
        logger.info("wrote split %s (%d records in %d parts)", written[-1], per_split, parts)
    return {"root": root, "splits": written, "records": splits * per_split,
            "oracle_auc": round(stream.oracle_auc(), 6) if splits * per_split else None}
