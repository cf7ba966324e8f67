"""Serving's pooled lookups: the embedding inputs of the dense part from a batch's ids.

A pooled input of the export (``serving_model.json``'s ``pooled_inputs``) is answered by one
:class:`LookupGroup` per lookup width: one ``torch.nn.functional.embedding_bag`` over the
rows of all its lookups in their group's shared storage (``serving_plugin.export_reader``),
sum or mean pooled as each table's combiner, in the trainer's pooled layout. A dynamic
table's raw ids are mapped to rows first (a ``RowLookup``: its ``RawIdIndex``, or its
``serving_plugin.serving_tier.TieredTable``); an id without a row leaves its bag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from odl.features.raw_id_index import drop_unmapped
from serving_plugin.export_reader import ExportLoadError
from serving_plugin.serving_tier import RowLookup

__all__ = ["LookupGroup", "PooledInput"]


@dataclass
class PooledInput:
    """One pooled input of the dense part: a ``LookupGroup`` per lookup width.

    A pooled input whose lookups share one width is one group; one of mixed widths (tables
    of different dims, concatenated) is one group per width, their columns put back in the
    input's lookup order by ``order``.
    """

    parts: list[LookupGroup]
    order: Optional[torch.Tensor]  # columns of cat(parts) in lookup order (None: as they are)

    @classmethod
    def build(cls, lookups: list[tuple[int, str, str]], dims: Sequence[int],
              tables: dict[str, torch.Tensor],
              dynamic: Optional[dict[str, RowLookup]] = None) -> PooledInput:
        """One group per lookup width (``lookups``: ``(key, table, pooling)``, ``dims``)."""
        widths = sorted(set(dims))
        if len(widths) <= 1:
            return cls([LookupGroup.build(lookups, tables, widths[0] if widths else 0,
                                           dynamic)], None)
        parts, starts = [], {}
        col = 0
        for w in widths:
            idx = [i for i, d in enumerate(dims) if d == w]
            parts.append(LookupGroup.build([lookups[i] for i in idx], tables, w, dynamic))
            for i in idx:
                starts[i] = col
                col += w
        order = [c for i, d in enumerate(dims) for c in range(starts[i], starts[i] + d)]
        return cls(parts, torch.tensor(order, dtype=torch.int64))

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
               starts: torch.Tensor, b: int,
               value_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, input width]`` pooled vectors of this input, in lookup order."""
        outs = [p.pooled(values, lengths, counts, starts, b, value_weights)
                for p in self.parts]
        if self.order is None:
            return outs[0]
        return torch.cat(outs, dim=1).index_select(1, self.order)


@dataclass
class LookupGroup:
    """Lookups (deep or wide) answered by one ``embedding_bag`` over their shared storage.

    Bags are ordered lookup-major (lookup j's B bags, then lookup j+1's); the result is
    reshaped to ``[B, n_lookups * dim]`` in lookup order, the trainer's pooled layout.
    Mean-pooled lookups use per-value weights ``1 / bag length`` (sum-pooled: no weights,
    so the arithmetic is exactly a per-feature sum); a weighted batch's own per-value weights
    (weighted tags; its tables are all sum-pooled) multiply them.
    """

    keys: torch.Tensor          # [n] KJT key index per lookup
    row_offsets: torch.Tensor   # [n] first storage row of each lookup's table
    is_mean: torch.Tensor       # [n] bool
    any_mean: bool
    storage: Optional[torch.Tensor]
    dim: int
    indexes: tuple[Optional[RowLookup], ...] = ()  # per lookup: its dynamic table's rows

    @classmethod
    def build(cls, lookups: list[tuple[int, str, str]], tables: dict[str, torch.Tensor],
              dim: int, dynamic: Optional[dict[str, RowLookup]] = None) -> LookupGroup:
        """The group of ``lookups`` (``(key, table, pooling)``) of width ``dim``.

        Raises:
            ExportLoadError: its tables do not share one storage.
        """
        storage = None
        offs = []
        for _k, t, _m in lookups:
            w = tables[t]
            base = w._base if w._base is not None else w  # noqa: SLF001 - view's storage
            if storage is None:
                storage = base
            elif base is not storage:
                raise ExportLoadError("tables of one lookup group must share a storage")
            offs.append(w.storage_offset() // max(1, w.shape[1]))
        return cls(
            keys=torch.tensor([k for k, _t, _m in lookups], dtype=torch.int64),
            row_offsets=torch.tensor(offs, dtype=torch.int64),
            is_mean=torch.tensor([m == "mean" for _k, _t, m in lookups], dtype=torch.bool),
            any_mean=any(m == "mean" for _k, _t, m in lookups),
            storage=storage,
            dim=dim,
            indexes=tuple((dynamic or {}).get(t) for _k, t, _m in lookups),
        )

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
               starts: torch.Tensor, b: int,
               value_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, n_lookups * dim]`` pooled vectors of this group.

        ``value_weights`` (a weighted batch's per-value weights, aligned with ``values``)
        multiply each value's row.
        """
        n = int(self.keys.shape[0])
        if n == 0 or self.storage is None:
            return torch.zeros((b, 0), dtype=torch.float32)
        bag_len = lengths.index_select(0, self.keys)              # [n, B]
        cnt = counts.index_select(0, self.keys)                   # [n]
        total = int(cnt.sum())
        which = torch.repeat_interleave(torch.arange(n), cnt)     # lookup of each value
        out_start = torch.cumsum(cnt, 0) - cnt
        src = (torch.arange(total) - out_start.index_select(0, which)
               + starts.index_select(0, self.keys).index_select(0, which))
        vals = values.index_select(0, src)
        flat_len = bag_len.reshape(-1)
        own = value_weights.index_select(0, src) if value_weights is not None else None
        if any(ix is not None for ix in self.indexes):
            if own is not None:
                raise ExportLoadError("weighted tags with dynamic tables are not supported")
            vals, which, flat_len = self._map_raw_ids(vals, which, flat_len)
            total = int(vals.shape[0])
        ids = vals + self.row_offsets.index_select(0, which)
        offsets = torch.cumsum(flat_len, 0) - flat_len
        weights = None
        if self.any_mean:
            bag_of_value = torch.repeat_interleave(torch.arange(n * b), flat_len)
            inv = 1.0 / flat_len.clamp(min=1).to(torch.float32)
            weights = torch.where(self.is_mean.index_select(0, which),
                                  inv.index_select(0, bag_of_value), torch.ones(total))
        if own is not None:
            weights = own.to(torch.float32) if weights is None else weights * own
        out = F.embedding_bag(ids, self.storage, offsets, mode="sum",
                              per_sample_weights=weights)
        return out.view(n, b, self.dim).transpose(0, 1).reshape(b, n * self.dim)

    def _map_raw_ids(self, vals: torch.Tensor, which: torch.Tensor,
                     flat_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw ids of dynamic lookups -> rows; ids without a row leave their bags."""
        v = vals.numpy().copy()
        w = which.numpy()
        keep = np.ones(v.shape[0], dtype=bool)
        for j, index in enumerate(self.indexes):
            if index is None:
                continue
            sel = np.flatnonzero(w == j)
            rows = index.lookup(v[sel])
            v[sel] = rows
            keep[sel] = rows >= 0
        kept, lengths = drop_unmapped(v, flat_len.numpy(), keep)
        return (torch.from_numpy(kept), torch.from_numpy(w[keep]),
                torch.from_numpy(np.ascontiguousarray(lengths)))
