"""Vectorized column operations of the feature builder (``odl.features.feature_builder``).

Each works on whole columns of a batch at once: :func:`split_column` cuts a column's values
into pieces on a separator, :func:`sequence_positions` lays a sequence's ids out by position,
:func:`bag_weights` gives each id its weight in a weighted batch and :func:`raw_ids` turns
hashes or integers into a dynamic table's raw ids.
"""

from __future__ import annotations

import numpy as np

from odl.features.raw_id_index import RAW_ID_MASK
from odl.features.record_parser import ParsedColumns

__all__ = ["bag_weights", "raw_ids", "sequence_positions", "split_column", "split_ranges"]


def sequence_positions(ids: np.ndarray, lengths: np.ndarray, seq_len: int,
                       bag_sizes: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sequence's ids by position: the KJT values and lengths of its ``seq_len`` keys.

    Args:
        ids: the sequence's ids, sample after sample (position after position).
        lengths: positions per sample.
        seq_len: positions kept (the first ones).
        bag_sizes: ids per position, position after position (``seq_multi_sep``); None:
            one id each.

    Returns:
        ``(values, lengths, kept)``: position-major values (position 0's ids of every sample
        that has that position, then position 1's, ...), ``[seq_len * B]`` bag lengths in
        the same order, and the kept length per sample.
    """
    lengths = lengths.astype(np.int64)
    n = lengths.shape[0]
    starts = np.cumsum(lengths) - lengths
    num_positions = int(lengths.sum())
    pos = np.arange(num_positions) - np.repeat(starts, lengths)
    sample = np.repeat(np.arange(n), lengths)
    kept = np.minimum(lengths, seq_len)
    if bag_sizes is None:
        keep = pos < seq_len
        order = np.lexsort((sample[keep], pos[keep]))  # position-major, samples in order
        per_key = (kept[None, :] > np.arange(seq_len)[:, None]).astype(np.int64).reshape(-1)
        return ids[keep][order], per_key, kept
    bag_sizes = bag_sizes.astype(np.int64)
    per_key = np.zeros((seq_len, n), dtype=np.int64)
    keep_pos = pos < seq_len
    per_key[pos[keep_pos], sample[keep_pos]] = bag_sizes[keep_pos]
    id_pos = np.repeat(pos, bag_sizes)
    id_sample = np.repeat(sample, bag_sizes)
    keep = id_pos < seq_len
    # position-major, samples in order, a bag's ids in their order (lexsort is stable)
    order = np.lexsort((id_sample[keep], id_pos[keep]))
    return ids[keep][order], per_key.reshape(-1), kept


def bag_weights(weights: np.ndarray | None, lengths: np.ndarray, mean: bool) -> np.ndarray:
    """Per-value weights of one feature in a weighted batch (``odl.features.feature_plan``).

    Args:
        weights: the values' own weights (weighted tags), or None (1 each).
        lengths: values per bag.
        mean: the feature's combiner is ``mean``: each weight divided by its bag's sum.

    Returns:
        ``float64`` weights, one per value (0 in a bag whose weights sum to 0).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    w = (np.ones(int(lengths.sum()), dtype=np.float64) if weights is None
         else np.asarray(weights, dtype=np.float64))
    if not mean or w.shape[0] == 0:
        return w
    bag = np.repeat(np.arange(lengths.shape[0]), lengths)
    total = np.bincount(bag, weights=w, minlength=lengths.shape[0])
    denom = total[bag]
    return np.divide(w, denom, out=np.zeros_like(w), where=denom != 0)


def raw_ids(values: np.ndarray) -> np.ndarray:
    """The 63 low bits of hashes or integers as ``int64`` raw ids (a dynamic table's ids)."""
    return (np.asarray(values).astype(np.uint64) & np.uint64(RAW_ID_MASK)).astype(np.int64)


def split_column(
    parsed: ParsedColumns, inp: str, sep: bytes, positions: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits column ``inp`` of every row on ``sep``; empty pieces are dropped.

    Args:
        parsed: the parsed batch.
        inp: the column.
        sep: the separator.
        positions: the ascending offsets of ``sep`` in ``parsed.buffer`` (None: none).

    Returns:
        ``(starts, ends, lengths)``: each piece's byte range in ``parsed.buffer`` and the
        pieces per row (an empty value has none).
    """
    return split_ranges(parsed.starts[inp], parsed.ends[inp], sep, positions)


def split_ranges(s: np.ndarray, e: np.ndarray, sep: bytes, positions: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits byte ranges ``[s, e)`` of a buffer on ``sep``; empty pieces are dropped.

    Args:
        s: the ranges' starts.
        e: their ends.
        sep: the separator.
        positions: the ascending offsets of ``sep`` in the buffer (None: none).

    Returns:
        ``(starts, ends, counts)``: each piece's byte range and the pieces per range.
    """
    if positions is not None and positions.shape[0]:
        lo = np.searchsorted(positions, s)
        hi = np.searchsorted(positions, e - len(sep) + 1)
        cnt = np.maximum(hi - lo, 0)
    else:
        cnt = None
    if cnt is None or not cnt.any():
        nonempty = e > s
        return s[nonempty], e[nonempty], nonempty.astype(np.int64)
    npieces = cnt + 1
    total = int(npieces.sum())
    first = np.cumsum(npieces) - npieces
    k = np.arange(total) - np.repeat(first, npieces)
    pidx = np.repeat(lo, npieces) + k
    last = positions.shape[0] - 1
    ps = np.where(k == 0, np.repeat(s, npieces),
                  positions[np.clip(pidx - 1, 0, last)] + len(sep))
    pe = np.where(k == np.repeat(cnt, npieces), np.repeat(e, npieces),
                  positions[np.clip(pidx, 0, last)])
    keep = pe > ps
    row = np.repeat(np.arange(s.shape[0]), npieces)
    lengths = np.bincount(row[keep], minlength=s.shape[0]).astype(np.int64)
    return ps[keep], pe[keep], lengths
