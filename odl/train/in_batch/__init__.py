"""Learning within a batch: each record predicted after its batch's earlier records.

``in_batch_learning.py`` shifts each record's prediction by what the batch's earlier records
taught its rows (``in_batch_scan.py`` with ``in_batch_scan.c``: the sequential pass, C compiled
on first use; ``log_loss.py``: the records' loss slopes in closed form for cross entropy);
``per_record_adagrad.py`` counts a batch's records one by one in Adagrad's
accumulators; ``batch_row_pairs.py`` is the step's (table row, record) index both read. The
batch is the step's, every rank's records: ``step_exchange.py`` gives every rank every rank's
part of the step (the identity with one rank) and ``held_rows.py`` reads and writes the rows
this rank holds. ``row_pair_learning.py`` is what the training step calls.
"""
