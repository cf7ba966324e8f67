"""The ids of features built from several values: ComboFeature crosses and LookupFeature.

Both work on whole columns of a batch at once, as the rest of the feature builder
(``odl.features.feature_builder``), and follow the rules of ``odl.features.feature_plan``:
:func:`combo_ids` hashes the joined values of a ComboFeature's inputs (every combination of
their values with ``combo_input_seps``), :func:`lookup_ids` hashes the values a
LookupFeature's map holds for the record's key.
"""

from __future__ import annotations

import numpy as np

from odl.features.column_ops import raw_ids, split_column
from odl.features.feature_plan import PlannedSparse
from odl.features.id_hashing import FNV64_PRIME, bucketize_hashes, hash_segments
from odl.features.record_parser import ParsedColumns

__all__ = ["combo_ids", "lookup_ids"]


def combo_ids(parsed: ParsedColumns, sp: PlannedSparse, sep_pos: dict
              ) -> tuple[np.ndarray, np.ndarray]:
    """A ComboFeature's ids and their count per row (the plan's docstring)."""
    if any(sp.combo_input_seps):
        return _combo_cross(parsed, sp, sep_pos)
    buf = parsed.buffer
    n = parsed.num_rows
    nonempty = np.ones(n, dtype=bool)
    h = None
    prime = np.uint64(FNV64_PRIME)
    for k, inp in enumerate(sp.inputs):
        s, e = parsed.starts[inp], parsed.ends[inp]
        nonempty &= e > s
        if k > 0:
            for byte in sp.combo_sep:
                h = (h ^ np.uint64(byte)) * prime
        h = hash_segments(buf, s, e, init=h)
    ids = raw_ids(h[nonempty]) if sp.raw_ids else bucketize_hashes(h[nonempty], sp.num_rows)
    return ids, nonempty.astype(np.int64)


def lookup_ids(parsed: ParsedColumns, sp: PlannedSparse, sep_pos: dict
               ) -> tuple[np.ndarray, np.ndarray]:
    """A LookupFeature's ids, as the plan's docstring says.

    The hashed values of its map's pieces keyed by the record's key, the first
    ``max_sel`` per record.
    """
    buf = parsed.buffer
    n = parsed.num_rows
    key, table = sp.inputs
    s, e, lengths = split_column(parsed, table, sp.separator, sep_pos[sp.separator])
    positions = sep_pos[sp.lookup_kv]
    if positions is None or positions.shape[0] == 0:
        k = e.copy()
    else:  # the first kv separator inside each piece
        j = np.searchsorted(positions, s)
        k = np.where(j < positions.shape[0], positions[np.minimum(j, positions.shape[0] - 1)],
                     e)
        k = np.where(k + len(sp.lookup_kv) <= e, k, e)
    row = np.repeat(np.arange(n), lengths)
    ks, ke = parsed.starts[key], parsed.ends[key]
    same = ((k < e) & (k - s == (ke - ks)[row])
            & (hash_segments(buf, s, k) == hash_segments(buf, ks, ke)[row]))
    picked = np.flatnonzero(same)
    rows = row[picked]
    count = np.bincount(rows, minlength=n)
    rank = np.arange(picked.shape[0]) - np.repeat(np.cumsum(count) - count, count)
    picked, rows = picked[rank < sp.max_sel], rows[rank < sp.max_sel]
    h = hash_segments(buf, k[picked] + len(sp.lookup_kv), e[picked])
    ids = raw_ids(h) if sp.raw_ids else bucketize_hashes(h, sp.num_rows)
    return ids, np.bincount(rows, minlength=n).astype(np.int64)


def _combo_cross(parsed: ParsedColumns, sp: PlannedSparse, sep_pos: dict
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A ComboFeature with ``combo_input_seps``: its ids, row by row.

    One per combination of its inputs' values, the first input's values varying slowest.
    """
    buf = parsed.buffer
    n = parsed.num_rows
    prime = np.uint64(FNV64_PRIME)
    rows = np.arange(n)
    h: np.ndarray | None = None
    for k, inp in enumerate(sp.inputs):
        sep = sp.combo_input_seps[k]
        if sep:
            s, e, count = split_column(parsed, inp, sep, sep_pos[sep])
        else:
            s, e = parsed.starts[inp], parsed.ends[inp]
            whole = e > s
            s, e, count = s[whole], e[whole], whole.astype(np.int64)
        first = np.cumsum(count) - count  # each row's first piece
        reps = count[rows]  # each combination so far, once per piece of its row
        total = int(reps.sum())
        piece = (np.repeat(first[rows], reps)
                 + np.arange(total) - np.repeat(np.cumsum(reps) - reps, reps))
        init = None
        if h is not None:
            init = np.repeat(h, reps)
            for byte in sp.combo_sep:
                init = (init ^ np.uint64(byte)) * prime
        h = hash_segments(buf, s[piece], e[piece], init=init)
        rows = np.repeat(rows, reps)
    assert h is not None
    ids = raw_ids(h) if sp.raw_ids else bucketize_hashes(h, sp.num_rows)
    return ids, np.bincount(rows, minlength=n).astype(np.int64)
