"""A dynamic table's saved state at more rows: what growing a table does to its index.

A growing table (``DynamicTableSpec.grows_to``, ``odl.train.table_growth``) is rebuilt at
more rows and its saved state put into it. The state keeps every id in its row with its
counters; the rows added are free, taken after the rows free before, lowest first
(``odl.features.raw_id_index.grown_index_state``). The admission sketch is
sized for ``grows_to`` from the start and carries over as it is.

Split by id (``dynamic_index_partitions`` P > 1) a growing table's rows are always a
multiple of P (:func:`partition_rows`), so every partition's block has the same rows; each
partition grows on its own to its new block (its state as above), and its rows move with
the block: partition p's rows ``[p·b, p·b + b)`` become ``[p·b', p·b' + b)``
(:func:`row_moves`), each in its place within the block, the rest of the new block added.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from odl.config.dynamic_table_config import DynamicTableSpec
from odl.features.raw_id_index import grown_index_state
from odl.models.dynamic.dynamic_table import state_arrays, state_tensors

__all__ = ["grown_table_state", "grown_tables_state", "partition_rows", "row_moves",
           "saved_capacities", "sized_specs"]

# per-row counters of a table's state, and what a new row holds in each
_ROW_COUNTERS = {"sightings": 0.0, "last_step": 0, "last_time": 0.0, "show": 0.0, "click": 0.0}


def _padded(values: np.ndarray, rows: int, fill: Any) -> np.ndarray:
    out = np.full((rows,) + values.shape[1:], fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


def grown_table_state(state: Mapping[str, Any], capacity: int) -> dict[str, Any]:
    """One table's ``DynamicTable.state_dict`` at ``capacity`` rows (module docstring).

    Args:
        state: the saved state (arrays or tensors).
        capacity: rows of the grown table (at least the saved ones).

    Returns:
        The state at ``capacity`` rows, arrays as tensors.

    Raises:
        ValueError: ``capacity`` is below the saved rows.
    """
    arrays = state_arrays(dict(state))
    old = int(np.asarray(arrays["index"]["row_ids"]).shape[0])
    out = dict(arrays)
    out["index"] = grown_index_state(arrays["index"], capacity)
    for name, fill in _ROW_COUNTERS.items():
        values = np.asarray(arrays[name])
        if values.shape[0] == old:  # show / click are empty when the table keeps no scores
            out[name] = _padded(values, capacity, fill)
    return state_tensors(out)


def partition_rows(rows: int, partitions: int) -> int:
    """``rows`` rounded up to a multiple of ``partitions`` (a growing table split by id)."""
    return -(-int(rows) // int(partitions)) * int(partitions)


def row_moves(old_rows: int, new_rows: int, partitions: int) -> list[tuple[int, int, int]]:
    """Where a growing table's rows go: ``[(old first row, new first row, rows)]``.

    One partition: the rows stay where they are. Split by id: each partition's block moves
    to its place in the grown table (module docstring).
    """
    if partitions <= 1:
        return [(0, 0, int(old_rows))]
    old, new = old_rows // partitions, new_rows // partitions
    return [(p * old, p * new, old) for p in range(partitions)]


def saved_capacities(dynamic_state: Mapping[str, Any]) -> dict[str, int]:
    """Dynamic table -> its rows in a saved ``DynamicTables.state_dict``.

    Split by id: the partitions' blocks times P (every saved partition's block has the
    same rows, as a growing table's rows are a multiple of P; a fixed table's capacity is
    not asked for).
    """
    partitions = int(dynamic_state.get("partitions", 1))
    if partitions == 1:
        tables = dynamic_state.get("tables") or {}
    else:
        parts = dynamic_state.get("parts") or {}
        tables = next(iter(parts.values()), {}).get("tables") or {}
    return {name: partitions * int(np.asarray(state_arrays(t["index"]["row_ids"])).shape[0])
            for name, t in tables.items()}


def grown_tables_state(dynamic_state: Mapping[str, Any],
                       capacities: Mapping[str, int]) -> dict[str, Any]:
    """A ``DynamicTables.state_dict`` with some tables grown (split by id: each partition's).

    Args:
        dynamic_state: the saved state.
        capacities: table -> its rows now, all partitions' (tables left out keep theirs).

    Returns:
        The state with those tables at their new rows.
    """
    partitions = int(dynamic_state.get("partitions", 1))

    def grown(tables: Mapping[str, Any]) -> dict[str, Any]:
        return {name: (grown_table_state(t, capacities[name] // partitions)
                       if name in capacities else t) for name, t in tables.items()}

    out = dict(dynamic_state)
    if partitions == 1:
        out["tables"] = grown(dynamic_state.get("tables") or {})
    else:
        out["parts"] = {p: {**part, "tables": grown(part.get("tables") or {})}
                        for p, part in (dynamic_state.get("parts") or {}).items()}
    return out


def sized_specs(specs: Mapping[str, DynamicTableSpec],
                capacities: Mapping[str, int]) -> dict[str, DynamicTableSpec]:
    """``specs`` with the growing tables at ``capacities`` rows (the others as they are)."""
    return {name: (replace(spec, capacity=int(capacities[name]))
                   if spec.grows_to and name in capacities else spec)
            for name, spec in specs.items()}
