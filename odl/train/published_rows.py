"""What publishing reads from a ``TrainModule``'s tables: rows, their raw ids, deleted ids.

The delta publisher (``publisher.version_snapshot``) and the per-pass delta files read the
rows a version changed through these, wherever the rows live. With one process they read
the tables directly. With several ranks each is a collective: every rank sends the rows
its shards hold (and, with dynamic tables split by id, the raw ids of its partition's rows),
and rank 0 gets the whole answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from odl.train.distributed import from_every_rank, gather_to_rank0
from odl.train.table_shards import EBC_PREFIX

if TYPE_CHECKING:
    from odl.train.train_module import TrainModule

__all__ = ["PublishedRows"]


class PublishedRows:
    """Rows, raw ids and deleted ids of one ``TrainModule`` (module docstring).

    Args:
        module: the module whose tables hold the rows.
    """

    def __init__(self, module: TrainModule) -> None:
        self._m = module
        # rank 0, split by id: table -> (rows, raw ids) every rank named in the last read_rows
        self._read_names: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    @torch.no_grad()
    def read_rows(self, requested: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Current values of table rows, wherever their shard lives.

        One process: ``{table: (ids, rows)}`` for the ids as given. Several ranks: a
        collective every rank calls with the rows it wants (its own touched rows, say); each
        rank contributes the wanted rows its shards hold, and rank 0 gets every table's
        sorted union of the ranks' ids with their whole rows (the other ranks get ``{}``).

        Args:
            requested: table name -> row ids (int64, sorted and unique for one process).

        Returns:
            Table name -> ``(row ids, rows [n, stored columns])``; rows on the model's
            device for one process, on the CPU when gathered.
        """
        if self._m.world_size == 1:
            tables = self._m.embedding_tables()
            return {name: (ids, tables[name].index_select(0, ids.to(tables[name].device)))
                    for name, ids in requested.items()}
        union: dict[str, np.ndarray] = {}
        for part in from_every_rank({name: ids.cpu().numpy().astype(np.int64)
                                     for name, ids in requested.items()}):
            for name, ids in part.items():
                union[name] = np.union1d(union[name], ids) if name in union else np.unique(ids)
        held: dict[str, list] = {}  # table -> [(row ids, first column, values)]
        for key, t in self._m.dmp.state_dict().items():
            name = key[len(EBC_PREFIX):-len(".weight")] if key.startswith(EBC_PREFIX) else ""
            if name not in union or not hasattr(t, "local_shards"):
                continue
            ids = union[name]
            for sh in t.local_shards():
                (r0, c0), (nr, _) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                mine = ids[(ids >= r0) & (ids < r0 + nr)]
                if len(mine):
                    rows = sh.tensor.index_select(
                        0, torch.from_numpy(mine - r0).to(sh.tensor.device))
                    held.setdefault(name, []).append((mine, c0, rows.cpu()))
        names: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # split by id: own rows' raw ids
        if self._m.dynamic_split_over_ranks:
            for name, ids in union.items():
                dyn = self._m.dynamic_table(name)
                if dyn is not None:
                    raw = dyn.raw_ids(ids)
                    names[name] = (ids[raw >= 0], raw[raw >= 0])
        everyone = gather_to_rank0((held, names))
        if everyone is None:
            return {}
        self._read_names = {}
        for name in names:  # every rank's named rows of the table, sorted by row
            ids = np.concatenate([part[name][0] for _held, part in everyone if name in part])
            raw = np.concatenate([part[name][1] for _held, part in everyone if name in part])
            order = np.argsort(ids, kind="stable")
            self._read_names[name] = (ids[order], raw[order])
        shapes = self._m.table_shapes()
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, ids in union.items():
            values = torch.zeros((len(ids), shapes[name][1]), dtype=torch.float32)
            for part, _names in everyone:
                for mine, c0, rows in part.get(name, []):
                    at = torch.from_numpy(np.searchsorted(ids, mine))
                    values[at, c0:c0 + rows.shape[1]] = rows.to(values.dtype)
            out[name] = (torch.from_numpy(ids), values)
        return out

    def raw_ids(self, table: str, rows: np.ndarray) -> np.ndarray:
        """The raw ids rows of a dynamic table hold (-1: free).

        Split by id over several ranks a rank knows only its own partition's rows: rank 0
        names the rows of the last ``read_rows`` from what every rank sent along with them.

        Args:
            table: a TorchRec table backed by a dynamic table (``<t>`` or ``<t>_wide``).
            rows: its rows.
        """
        dyn = self._m.dynamic_table(table)
        if dyn is None:
            raise KeyError(f"{table} is not a dynamic table")
        rows = np.asarray(rows, dtype=np.int64)
        if not self._m.dynamic_split_over_ranks:
            return dyn.raw_ids(rows)
        ids, raw = self._read_names.get(table, (np.empty(0, np.int64), np.empty(0, np.int64)))
        out = np.full(rows.shape[0], -1, dtype=np.int64)
        if not len(ids):
            return out
        at = np.minimum(np.searchsorted(ids, rows), len(ids) - 1)
        found = ids[at] == rows
        out[found] = raw[at[found]]
        return out

    def take_deleted(self, consumer: str) -> dict[str, np.ndarray]:
        """Dynamic table -> raw ids evicted since ``consumer``'s last take (unique).

        Split by id over several ranks a collective: rank 0 gets every partition's ids, the
        other ranks ``{}``.
        """
        mine = self._m.dynamic.take_deleted(consumer)
        if not self._m.dynamic_split_over_ranks:
            return mine
        everyone = gather_to_rank0(mine)
        if everyone is None:
            return {}
        out: dict[str, np.ndarray] = {}
        for part in everyone:
            for name, ids in part.items():
                out[name] = np.union1d(out[name], ids) if name in out else np.unique(ids)
        return out
