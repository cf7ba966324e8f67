"""A dynamic table's state as the rows changed since a checkpoint, and that change applied.

An incremental checkpoint (``odl.checkpoint.checkpoint_chain``) writes the table rows changed
since its parent. A dynamic table's own state (``DynamicTable.state_dict``: the id of every
row, the free-row stack, per-row counters, the sketch) is written the same way, so an
increment's size follows what changed, not the table's capacity.

Contract. The caller (``odl.train.checkpoint_rows``) names the **changed rows**: every row
a training step looked up since the parent (its counters moved) and every row whose id
changed (admitted, evicted, expired). Those are the only rows whose per-row arrays
(``row_ids``, ``sightings``, ``last_step``, ``last_time``, ``show``, ``click``) can differ
from the parent's, except:

* ``show`` / ``click`` decay over all rows when a maintenance pass decays them: an
  increment then carries them whole (``scores_whole``);
* the free-row stack: rows are popped from its top and pushed back on it, so the parent's
  stack and this one share a bottom part; the increment holds the length of that part
  (``free_kept``) and the rest (``free_top``).

Everything else of the table (the admission sketch, lifetime counters, stream time, pending
deletes) is small or not per row, and is carried whole; a disk tier's rows as the slots
written or freed since the checkpoint (``odl.models.dynamic.disk_rows``).
:func:`apply_table_changes` turns the parent's full state and an increment's changes into
the increment's full state, so a reader of a chain hands one full state to
``DynamicTable.load_state_dict``, as from a full checkpoint. A changes document says
``"format": CHANGES_FORMAT``; a reader that does not know the format refuses it.

Tables split by id (``dynamic_index_partitions`` > 1) change per partition: each partition
is a table of its own rows (rows numbered from the partition's first), so its changes are
that table's (:func:`table_changes` with the partition's rows). The document mirrors
``DynamicTables.state_dict``: ``{"format", "partitions": P, "parts": {p: {"tables": ...}}}``
from one process holding every partition; with the partitions split over ranks each rank's
increment carries its partitions' parts, each ``{"format": CHANGES_FORMAT, "tables": ...}``
(:func:`apply_part_changes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from odl.models.dynamic.disk_rows import CHANGES_FORMAT as DISK_CHANGES_FORMAT
from odl.models.dynamic.disk_rows import apply_disk_changes
from odl.models.dynamic.dynamic_table import (
    STATE_FORMAT,
    DynamicTable,
    state_arrays,
    state_tensors,
)

__all__ = ["CHANGES_FORMAT", "apply_changes", "apply_part_changes", "apply_table_changes",
           "is_changes", "kept_free_rows", "table_changes"]

CHANGES_FORMAT = "odl.dynamic_tables.changes/1"
_ROW_ARRAYS = ("sightings", "last_step", "last_time")
_SCORE_ARRAYS = ("show", "click")


def kept_free_rows(before: np.ndarray, now: np.ndarray) -> int:
    """Length of the bottom part two free-row stacks share (bottom to top)."""
    n = min(before.shape[0], now.shape[0])
    if n == 0:
        return 0
    differ = np.flatnonzero(before[:n] != now[:n])
    return int(differ[0]) if differ.shape[0] else n


def table_changes(table: DynamicTable, rows: np.ndarray, free_kept: int,
                  scores_whole: bool, tier_slots: np.ndarray | None = None) -> dict[str, Any]:
    """``table``'s state as changes since a checkpoint (module docstring), arrays as tensors.

    Args:
        table: the table.
        rows: sorted unique rows changed since the checkpoint.
        free_kept: how much of the checkpoint's free-row stack (from the bottom) is
            unchanged (:func:`kept_free_rows`).
        scores_whole: ``show`` / ``click`` decayed since the checkpoint: carry them whole.
        tier_slots: with a disk tier, its slots changed since the checkpoint
            (``DiskRows.take_changed``); None: its rows whole.

    Returns:
        The changes document of one table.
    """
    rows = np.asarray(rows, dtype=np.int64)
    free = table.index.free_stack()
    out: dict[str, Any] = {
        "rows": rows,
        "row_ids": table.index.row_ids[rows].copy(),
        "free_kept": int(free_kept),
        "free_top": free[int(free_kept):].copy(),
        "scores_whole": bool(scores_whole),
    }
    for name in _ROW_ARRAYS:
        out[name] = getattr(table, name)[rows].copy()
    for name in _SCORE_ARRAYS:
        values = getattr(table, name)
        out[name] = (values.copy() if scores_whole or values.shape[0] == 0
                     else values[rows].copy())
    out.update(table.state_dict_without_rows(tier_slots))
    return state_tensors(out)


def apply_table_changes(full: Mapping[str, Any], changes: Mapping[str, Any]
                        ) -> dict[str, Any]:
    """The full state of one table after ``changes`` (its parent's state ``full``).

    Args:
        full: the parent's ``DynamicTable.state_dict`` (arrays or tensors).
        changes: :func:`table_changes`' document.

    Returns:
        A full state (tensors), ``full`` left as it was.

    Raises:
        ValueError: the changes do not fit the parent (rows outside it, a free stack
            shorter than the part they keep).
    """
    rows = _array(changes["rows"])
    index = full["index"]
    row_ids = _array(index["row_ids"]).copy()
    if rows.shape[0] and (int(rows.min()) < 0 or int(rows.max()) >= row_ids.shape[0]):
        raise ValueError(f"changed rows outside the table of {row_ids.shape[0]} rows")
    row_ids[rows] = _array(changes["row_ids"])
    kept = int(changes["free_kept"])
    parent_free = _array(index["free"])
    if kept > parent_free.shape[0]:
        raise ValueError(f"the changes keep {kept} free rows of the parent's "
                         f"{parent_free.shape[0]}")
    out: dict[str, Any] = {
        "index": {"row_ids": row_ids,
                  "free": np.concatenate([parent_free[:kept], _array(changes["free_top"])])},
    }
    for name in _ROW_ARRAYS:
        values = _array(full[name]).copy()
        values[rows] = _array(changes[name])
        out[name] = values
    for name in _SCORE_ARRAYS:
        values = _array(full[name])
        if bool(changes["scores_whole"]) or values.shape[0] == 0:
            out[name] = _array(changes[name]).copy()
        else:
            values = values.copy()
            values[rows] = _array(changes[name])
            out[name] = values
    for key, value in changes.items():
        if key not in out and key not in ("rows", "row_ids", "free_kept", "free_top",
                                          "scores_whole"):
            out[key] = value
    tier = changes.get("tier")
    if tier and tier["disk"].get("format") == DISK_CHANGES_FORMAT:  # the rows on disk
        out["tier"] = {**tier, "disk": apply_disk_changes(state_arrays(full["tier"]["disk"]),
                                                          state_arrays(tier["disk"]))}
    return state_tensors(out)


def is_changes(state: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint's ``dynamic_tables`` entry is a changes document."""
    return state is not None and state.get("format") == CHANGES_FORMAT


def apply_part_changes(full: Mapping[str, Any], changes: Mapping[str, Any]
                       ) -> dict[str, Any]:
    """One partition's (or one unsplit model's) tables after ``changes``.

    Args:
        full: the parent's ``{"tables": {name: DynamicTable.state_dict()}}`` (more keys kept).
        changes: ``{"tables": {name: table changes}}`` (its ``format`` not read).

    Returns:
        ``full`` with every table's state replaced by its changed state.

    Raises:
        ValueError: not the same tables, or a table's changes do not fit.
    """
    if set(full["tables"]) != set(changes["tables"]):
        raise ValueError(f"the increment has dynamic tables {sorted(changes['tables'])}, its "
                         f"parent {sorted(full['tables'])}")
    return {**full, "tables": {name: apply_table_changes(full["tables"][name], table)
                               for name, table in changes["tables"].items()}}


def apply_changes(full: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``DynamicTables.state_dict`` of the parent plus one increment's changes document.

    Args:
        full: the parent's full state (``{"format", "tables"}``, or split by id
            ``{"format", "partitions", "parts"}`` with every partition the changes name).
        changes: ``{"format": CHANGES_FORMAT, "tables": {name: table changes}}``, or split
            by id ``{"format", "partitions": P, "parts": {p: {"tables": ...}}}``.

    Returns:
        The increment's full state.

    Raises:
        ValueError: not the same tables or partitions, or a table's changes do not fit.
    """
    if full.get("format") != STATE_FORMAT:
        raise ValueError("the parent's dynamic tables are not a full state")
    partitions = int(changes.get("partitions", 1))
    if partitions != int(full.get("partitions", 1)):
        raise ValueError(f"the increment's dynamic tables are split into {partitions} "
                         f"partition(s), its parent's into {full.get('partitions', 1)}")
    if partitions == 1:
        if "tables" not in full:
            raise ValueError("the parent's dynamic tables hold no tables")
        return {"format": STATE_FORMAT, **apply_part_changes(full, changes)}
    parts = {int(p): v for p, v in (full.get("parts") or {}).items()}
    for p, part in (changes.get("parts") or {}).items():
        if int(p) not in parts:
            raise ValueError(f"the parent lacks partition {p} of the dynamic tables")
        parts[int(p)] = apply_part_changes(parts[int(p)], part)
    return {"format": STATE_FORMAT, "partitions": partitions, "parts": parts}


def _array(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
