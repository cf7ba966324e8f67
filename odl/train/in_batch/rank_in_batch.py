"""Sequential in-batch learning with several ranks: one pass over the whole step's records.

With several ranks a step trains the records of every rank together (``TrainModule``'s
ranked step: the update one process makes on the ranks' records in rank order). In-batch
learning keeps that equivalence: each record is shifted by the batch's earlier records *of
every rank* (rank 0's records first, then rank 1's, ...), exactly as one process with the
concatenated batch would shift it (``odl.train.in_batch.in_batch_scan``'s contract). Per step, a
collective every rank calls:

1. each rank lists its records' row reads (``RowPairIndex.pairs`` of its own batch), their
   ``dlogit/de`` and its records' logits and loss slopes;
2. every rank receives every rank's lists (``arrays_from_every_rank``) and puts them in the one
   process's order: records numbered rank after rank, reads sorted by (table, row, record);
3. the rows two or more records read need their accumulators, which live in the shard that
   holds each row: every rank contributes those its shards hold (the same request on every
   rank, so one exchange);
4. every rank runs the same pass over all records and keeps its own records' shifts.

A record's loss slope is the one of the ranked step's update: its weighted loss's slope
divided by the number of ranks (TorchRec averages the tables' gradients over the ranks).
The error model is fitted once at the unshifted logits (exact for cross entropy and L2
losses; a first-order fit for other per-record losses, which one process refines with more
passes). ``per_record_adagrad`` is not implemented with ranks (its correction writes rows of
other ranks' shards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from odl.train.distributed import arrays_from_every_rank
from odl.train.in_batch.batch_row_pairs import ROW_SPAN, RowPairIndex, RowPairs, argsort
from odl.train.in_batch.in_batch_scan import InBatchScan, fit_errors, scan_pairs, scan_pass

# (tables, rows) -> (accumulators [U, acc_width], held [U] bool) of the rows this rank holds
HeldAccumulators = Callable[[Sequence[str], np.ndarray], tuple[np.ndarray, np.ndarray]]


def rank_logit_shift(rank: int, index: RowPairIndex, scan: InBatchScan,
                     lookup_tables: Sequence[str], pairs: RowPairs | None,
                     jac: Sequence[torch.Tensor | None], logits: torch.Tensor,
                     slope: np.ndarray, curve: np.ndarray, lr: float,
                     held: HeldAccumulators | None) -> torch.Tensor:
    """This rank's ``[n]`` shifts of the module docstring (a collective).

    Args:
        rank: this rank.
        index: the model's ``RowPairIndex`` (no storage needed).
        scan: the pass's settings.
        lookup_tables: per lookup of ``index``, the TorchRec table it reads.
        pairs: this rank's row reads (None: none).
        jac: per pooled group, ``[n, width]`` ``dlogit/d pooled`` of this rank's records.
        logits: ``[n]`` this rank's records' logits at the step's start.
        slope: ``[n]`` each record's loss slope (as the table update sees it).
        curve: ``[n]`` its derivative in the record's own logit.
        lr: the table rate of the step.
        held: ``(tables, rows) -> (values [U, acc_width], held [U] bool)``: the accumulators
            of the rows this rank's shards hold; None for SGD tables.

    Returns:
        Tensor ``[n]`` like ``logits``.
    """
    n = int(logits.shape[0])
    width = index.width
    mine: dict[str, np.ndarray] = {
        "base": logits.detach().cpu().to(torch.float32).numpy(),
        "slope": slope.astype(np.float32), "curve": curve.astype(np.float32),
        "lookup": np.empty(0, dtype=np.int64), "rows": np.empty(0, dtype=np.int64),
        "sample": np.empty(0, dtype=np.int64), "weight": np.empty(0, dtype=np.float32),
        "jrow": np.empty((0, width), dtype=np.float32)}
    if pairs is not None and n:
        mine.update(
            lookup=pairs.lookup.cpu().numpy().astype(np.int64),
            rows=pairs.rows.cpu().numpy().astype(np.int64),
            sample=pairs.sample.cpu().numpy().astype(np.int64),
            weight=pairs.weight.cpu().to(torch.float32).numpy(),
            jrow=index.per_pair(jac, pairs, torch.float32).cpu().numpy())
    everyone = arrays_from_every_rank(mine)
    sizes = [len(part["base"]) for part in everyone]
    offset = int(sum(sizes[:rank]))
    base = np.concatenate([part["base"] for part in everyone])
    slope_all = np.concatenate([part["slope"] for part in everyone])
    curve_all = np.concatenate([part["curve"] for part in everyone])
    with_pairs = [(part, int(sum(sizes[:r]))) for r, part in enumerate(everyone)
                  if len(part["lookup"])]
    shift = np.zeros(len(base), dtype=np.float32)
    if with_pairs:
        lookup_all = np.concatenate([p["lookup"] for p, _ in with_pairs])
        rows_all = np.concatenate([p["rows"] for p, _ in with_pairs]).astype(np.int64)
        sample_all = np.concatenate([p["sample"] + off for p, off in with_pairs])
        weight_all = np.concatenate([p["weight"] for p, _ in with_pairs])
        jrow_all = np.concatenate([p["jrow"] for p, _ in with_pairs])
        table_ids = {t: i for i, t in enumerate(sorted(set(lookup_tables)))}
        table_of_lookup = np.array([table_ids[t] for t in lookup_tables], dtype=np.int64)
        key = table_of_lookup[lookup_all] * ROW_SPAN + rows_all
        order = argsort(torch.from_numpy(key * (len(base) + 1) + sample_all)).numpy()
        key, sample_sorted = key[order], sample_all[order]
        new_row = np.ones(len(key), dtype=bool)
        new_row[1:] = key[1:] != key[:-1]
        new_pair = new_row.copy()
        new_pair[1:] |= sample_sorted[1:] != sample_sorted[:-1]
        slot = np.cumsum(new_row) - 1
        readers = np.bincount(slot, weights=new_pair.astype(np.float64))
        keep = np.flatnonzero(readers[slot] > 1)  # reads of rows two or more records read
        if len(keep):
            first = new_row[keep]
            slot_k = np.cumsum(first) - 1
            heads = order[keep[first]]  # each shared row's first read, as gathered
            h_lookup, h_rows = lookup_all[heads], rows_all[heads]
            acc = None
            if held is not None:
                values, mask = held([lookup_tables[i] for i in h_lookup], h_rows)
                acc = np.zeros_like(values)
                for part in arrays_from_every_rank({"values": values,
                                                    "held": mask.astype(np.uint8)}):
                    got = part["held"].astype(bool)
                    acc[got] = part["values"][got]
            # the kept reads in the pass's (record, row) order, each array indexed once
            by_record = argsort(torch.from_numpy(
                sample_sorted[keep] * (int(slot_k[-1]) + 1) + slot_k)).numpy()
            pick = order[keep[by_record]]
            h_lookup_t = torch.from_numpy(h_lookup)
            prepared = scan_pairs(
                torch.from_numpy(sample_all[pick]), torch.from_numpy(slot_k[by_record]),
                torch.from_numpy(jrow_all[pick]), torch.from_numpy(weight_all[pick]),
                lr * index.multiplier.cpu().index_select(0, h_lookup_t),
                torch.from_numpy(acc) if acc is not None else None,
                index.stored.cpu().index_select(0, h_lookup_t),
                index.col_mask.cpu().sum(1).index_select(0, h_lookup_t),
                in_record_order=True)
            errors = fit_errors(slope_all, curve_all, base, scan.logistic)
            shift = scan_pass(prepared, scan.kind, scan.per_record, scan.gain, scan.eps, base,
                              errors)
    own = shift[offset:offset + n]
    return torch.from_numpy(np.ascontiguousarray(own)).to(logits.device, logits.dtype)
