"""A dynamic table's saved state at more rows: what growing a table does to its index.

A growing table (``DynamicTableSpec.grows_to``, ``odl.train.table_growth``) is rebuilt at
more rows and its saved state put into it. The state keeps every id in its row with its
counters; the rows added are free, taken after the rows free before, lowest first
(``odl.features.raw_id_index.grown_index_state``). The admission sketch is
sized for ``grows_to`` from the start and carries over as it is.

The state is one partition's (``DynamicTables.state_dict`` without ``partitions``): tables
split by id do not grow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from odl.config.dynamic_table_config import DynamicTableSpec
from odl.features.raw_id_index import grown_index_state
from odl.models.dynamic.dynamic_table import state_arrays, state_tensors

__all__ = ["grown_table_state", "grown_tables_state", "saved_capacities", "sized_specs"]

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


def saved_capacities(dynamic_state: Mapping[str, Any]) -> dict[str, int]:
    """Dynamic table -> its rows in a saved ``DynamicTables.state_dict`` of one partition."""
    if int(dynamic_state.get("partitions", 1)) != 1:
        return {}
    return {name: int(np.asarray(state_arrays(t["index"]["row_ids"])).shape[0])
            for name, t in (dynamic_state.get("tables") or {}).items()}


def grown_tables_state(dynamic_state: Mapping[str, Any],
                       capacities: Mapping[str, int]) -> dict[str, Any]:
    """A ``DynamicTables.state_dict`` of one partition with some tables grown.

    Args:
        dynamic_state: the saved state.
        capacities: table -> its rows now (tables left out keep theirs).

    Returns:
        The state with those tables at their new rows.
    """
    out = dict(dynamic_state)
    out["tables"] = {name: (grown_table_state(t, capacities[name]) if name in capacities
                            else t)
                     for name, t in (dynamic_state.get("tables") or {}).items()}
    return out


def sized_specs(specs: Mapping[str, DynamicTableSpec],
                capacities: Mapping[str, int]) -> dict[str, DynamicTableSpec]:
    """``specs`` with the growing tables at ``capacities`` rows (the others as they are)."""
    return {name: (replace(spec, capacity=int(capacities[name]))
                   if spec.grows_to and name in capacities else spec)
            for name, spec in specs.items()}
