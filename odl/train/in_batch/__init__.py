"""Learning within a batch: each record predicted after its batch's earlier records.

``in_batch_learning.py`` shifts each record's prediction by what the batch's earlier records
taught its rows (``in_batch_scan.py`` with ``in_batch_scan.c``: the sequential pass, C compiled
on first use); ``per_record_adagrad.py`` counts a batch's records one by one in Adagrad's
accumulators; ``batch_row_pairs.py`` is the step's (table row, record) index both read. With
several ranks ``rank_in_batch.py`` runs the pass over every rank's records of a step and
``rank_per_record.py`` corrects the accumulators by the rank holding each row.
"""
