"""Serving's growing dynamic tables: more rows when a version's new ids need them.

An export gives a growing dynamic table (``odl.train.table_growth``) the rows it had in the
checkpoint and the most rows it may reach (``max_rows``, ``ExportContents.max_rows``), so
serving's memory follows the trainer's. When a version brings more new ids than such a table
has free rows, serving grows it before applying the version: it doubles until the ids fit
(at most ``max_rows``; a version that still does not fit is then refused as ``capacity``, as
for any dynamic table). The tables of one lookup group share one storage tensor
(``serving_plugin.export_reader``): the group moves to a new storage with the grown tables'
rows added at their ends (zeros, as freed rows are), every value kept; each grown table's
index keeps every id in its row (``odl.features.raw_id_index.grown_index_state``). A growth
changes no prediction.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from odl.features.raw_id_index import RawIdIndex, grown_index_state

__all__ = ["grown_index", "grown_tables", "rows_for"]


def rows_for(index: RawIdIndex, ids: np.ndarray, gone: np.ndarray, max_rows: int) -> int:
    """The rows a growing table needs to apply a version's rows and deletes.

    Args:
        index: the table's index.
        ids: the version's raw ids of the table.
        gone: the version's deleted raw ids of the table (applied first).
        max_rows: the most rows the table may have.

    Returns:
        Its rows now when the ids fit, else the rows doubled until they fit (at most
        ``max_rows``).
    """
    present = index.lookup(ids)
    new = int(((present < 0) | np.isin(ids, gone)).sum())
    room = index.free + int((index.lookup(gone) >= 0).sum())
    rows = index.capacity
    while new > room + rows - index.capacity and rows < max_rows:
        rows = min(2 * rows, max_rows)
    return rows


def grown_index(index: RawIdIndex, rows: int) -> RawIdIndex:
    """A new index of ``rows`` rows holding every id of ``index`` in its row."""
    out = RawIdIndex(rows)
    out.load_state_dict(grown_index_state(index.state_dict(), rows))
    return out


def grown_tables(tables: Mapping[str, torch.Tensor],
                 rows: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """The tables with ``rows`` rows each for those named, in new shared storages.

    Args:
        tables: table name -> its ``[rows, dim]`` view of its group's storage.
        rows: table -> its new rows (at least its rows now).

    Returns:
        Table name -> its view; tables whose storage holds no grown table are the same
        tensors.
    """
    groups: dict[int, list[str]] = {}
    for name, w in tables.items():
        base = w._base if w._base is not None else w  # noqa: SLF001 - a view's storage
        groups.setdefault(id(base), []).append(name)
    out = dict(tables)
    for names in groups.values():
        if not any(n in rows for n in names):
            continue
        names.sort(key=lambda n: tables[n].storage_offset())
        sizes = [max(int(rows.get(n, 0)), tables[n].shape[0]) for n in names]
        first = tables[names[0]]
        storage = torch.zeros((sum(sizes), first.shape[1]), dtype=first.dtype)
        at = 0
        for name, size in zip(names, sizes, strict=True):
            view = storage[at : at + size]
            view[: tables[name].shape[0]] = tables[name]
            out[name] = view
            at += size
    return out
