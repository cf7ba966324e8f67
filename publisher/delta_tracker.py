"""Which embedding rows changed since the last publish.

``DeltaTracker.record(kjt)`` is registered as the train module's touched-rows hook
(``TrainModule.set_touched_rows_hook``) and runs once per training step with the step's
KeyedJaggedTensor of feature ids. A feature is looked up in one or more tables
(``TrainModule.feature_tables()``: its deep table and, for features in a wide group, also
``<table>_wide``); every id of the feature marks that row in each of its tables.

Per table the tracker keeps a boolean bitmap of ``num_rows`` entries (a numpy array for CPU
ids, a torch tensor on the ids' device otherwise): marking is one scatter per feature and
table per step (cost proportional to the batch's ids, duplicates free), memory is bounded by
the table sizes (1 byte per row), and ``take()`` turns each bitmap into sorted unique ids with
one ``flatnonzero`` / ``nonzero`` and clears it. Rows touched several times between two
publishes are therefore reported once. numpy is used on CPU because it is 2-3x faster than
torch for these small scatters and scans.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)


class DeltaTracker:
    """Records touched rows per table.

    Args:
        feature_tables: feature name -> tables it is looked up in.
        table_rows: table name -> number of rows.
    """

    def __init__(
        self,
        feature_tables: Mapping[str, Sequence[str]],
        table_rows: Mapping[str, int],
    ) -> None:
        self._feature_tables = {f: list(ts) for f, ts in feature_tables.items()}
        for f, ts in self._feature_tables.items():
            for t in ts:
                if t not in table_rows:
                    raise ValueError(f"feature {f!r} maps to unknown table {t!r}")
        self._rows = {t: int(n) for t, n in table_rows.items()}
        # Tables read by exactly the same features (a table and its ``_wide`` twin, usually)
        # share one bitmap: its touched rows are the same.
        readers: dict[str, list[str]] = {}
        for f, ts in sorted(self._feature_tables.items()):
            for t in ts:
                readers.setdefault(t, []).append(f)
        groups: dict[tuple, list[str]] = {}
        for t in sorted(readers):
            groups.setdefault((tuple(readers[t]), self._rows[t]), []).append(t)
        self._group_tables = {ts[0]: ts for ts in groups.values()}
        self._group_of = {t: ts[0] for ts in groups.values() for t in ts}
        self._bitmaps: dict[str, np.ndarray | torch.Tensor] = {}
        self._lock = threading.Lock()
        self._keys: list[str] | None = None
        self._plan: list[tuple[str, list[int]]] = []
        self.steps_recorded = 0

    def _build_plan(self, keys: list[str]) -> None:
        # bitmap group -> positions (in kjt key order) of the features that touch it.
        plan: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            tables = self._feature_tables.get(key, ())
            for group in dict.fromkeys(self._group_of[t] for t in tables):
                plan.setdefault(group, []).append(i)
        self._keys = keys
        self._plan = list(plan.items())

    def _bitmap(self, group: str, device: torch.device) -> np.ndarray | torch.Tensor:
        bm = self._bitmaps.get(group)
        if device.type == "cpu":
            if not isinstance(bm, np.ndarray):
                bm = np.zeros(self._rows[group], dtype=bool)
                self._bitmaps[group] = bm
        elif not isinstance(bm, torch.Tensor) or bm.device != device:
            bm = torch.zeros(self._rows[group], dtype=torch.bool, device=device)
            self._bitmaps[group] = bm
        return bm

    @torch.no_grad()
    def record(self, kjt: KeyedJaggedTensor) -> None:
        """Marks every id of the step's features as touched (the train module's hook).

        Args:
            kjt: the step's ids; keys are feature names.
        """
        keys = kjt.keys()
        if keys != self._keys:
            self._build_plan(list(keys))
        values = kjt.values()
        device = values.device
        ids = values.numpy() if device.type == "cpu" else values
        bounds = [0]
        for n in kjt.length_per_key():
            bounds.append(bounds[-1] + int(n))
        with self._lock:
            for group, positions in self._plan:
                bm = self._bitmap(group, device)
                for i in positions:
                    if bounds[i + 1] > bounds[i]:
                        bm[ids[bounds[i] : bounds[i + 1]]] = True
            self.steps_recorded += 1

    def take(self) -> dict[str, torch.Tensor]:
        """Returns and resets the touched rows.

        Returns:
            Table name -> sorted unique int64 row ids (on the ids' device; tables sharing a
            bitmap share the tensor: do not modify it); tables with no touched row are left out.
        """
        out: dict[str, torch.Tensor] = {}
        with self._lock:
            for group, bm in self._bitmaps.items():
                if isinstance(bm, np.ndarray):
                    idx = np.flatnonzero(bm)
                    if len(idx) > len(bm) // 16:
                        bm.fill(False)
                    else:
                        bm[idx] = False
                    ids = torch.from_numpy(idx.astype(np.int64, copy=False))
                else:
                    ids = torch.nonzero(bm, as_tuple=False).reshape(-1)
                    bm.zero_()
                if ids.numel():
                    for table in self._group_tables[group]:
                        out[table] = ids
        return out

    def put_back(self, touched: Mapping[str, torch.Tensor]) -> None:
        """Marks rows as touched again (e.g. rows of a snapshot that could not be taken).

        Args:
            touched: table name -> row ids.
        """
        with self._lock:
            for table, ids in touched.items():
                if ids.numel():
                    bm = self._bitmap(self._group_of[table], ids.device)
                    bm[ids.numpy() if isinstance(bm, np.ndarray) else ids] = True

    def grow(self, table_rows: Mapping[str, int],
             moves: Mapping[str, Sequence[tuple[int, int, int]]] | None = None) -> None:
        """Widens the bitmaps of tables that grew to ``table_rows`` rows; marks are kept.

        Args:
            table_rows: table name -> its rows now (tables left out or not larger keep theirs).
            moves: table name -> where its rows went (``[(old first row, new first row,
                rows)]``, a table split by id, ``odl.train.table_growth``); the marks move
                with them. None or a table left out: its rows stayed where they were.
        """
        with self._lock:
            for t, n in table_rows.items():
                if t in self._rows and int(n) > self._rows[t]:
                    self._rows[t] = int(n)
            for group, tables in self._group_tables.items():
                n = max(self._rows[t] for t in tables)
                self._rows[group] = n
                bm = self._bitmaps.get(group)
                if bm is None or bm.shape[0] >= n:
                    continue
                wider = (np.zeros(n, dtype=bool) if isinstance(bm, np.ndarray)
                         else torch.zeros(n, dtype=torch.bool, device=bm.device))
                table_moves = next((moves[t] for t in tables if moves and t in moves),
                                   [(0, 0, bm.shape[0])])
                for old, new, rows in table_moves:
                    wider[new : new + rows] = bm[old : old + rows]
                self._bitmaps[group] = wider

    def pending_rows(self) -> int:
        """Rows currently marked, over all tables (costs a count over every bitmap)."""
        with self._lock:
            return int(sum(int(bm.sum()) * len(self._group_tables[g])
                           for g, bm in self._bitmaps.items()))
