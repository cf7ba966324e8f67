"""Dynamic embedding tables: raw ids, admission, eviction, bounded memory.

One engine behind the three config forms of ``odl.config.dynamic_table_config`` (EasyRec
``ev_params``, TorchEasyRec ``zch``, PaddleRec ``ctr_accessor_param``). A dynamic table is a
TorchRec table of ``capacity`` rows (allocated once: memory is flat) plus a
:class:`~odl.features.raw_id_index.RawIdIndex` from raw ids to rows and per-row counters.

Per training step (:meth:`DynamicTables.remap` with ``admit=True``), per dynamic table, over
the ids of every feature reading it:

1. ids with a row are mapped to it;
2. the others are *candidates*: counted (when the spec has an admission threshold) in a
   count-min sketch of show and click counts (depth 4, ``width`` a power of two near the
   capacity, at most 2**20; every counter is halved once ``10 x width`` sightings have been
   added, so old sightings fade). A count-min sketch never under-counts: an id seen
   ``filter_freq`` times is always admitted, and one seen fewer times only when hash
   collisions inflate its estimate. A candidate is admitted when its estimated count reaches
   ``admit_freq``, its estimated score reaches ``admit_score`` and, with an
   ``admit_probability`` below 1, a draw seeded by (id, step) falls below it (a new chance at
   every step the id appears in); the rest are *rejected*
   for this step (counted, no row: they contribute nothing to the lookup, like an id serving
   does not know);
3. admitted ids take free rows; when too few are free, the lowest-priority rows not used by
   this batch are evicted first, in blocks of at least 1 % of the capacity (and 8 times the
   rows needed) so the ranking (O(capacity)) runs rarely. Priority (higher = kept): ``lru``
   last step seen; ``lfu`` sightings since admission; ``distance_lfu`` sightings / (steps
   since seen + 1) ** decay_exponent; ``score`` click_coeff * click + nonclk_coeff * (show -
   click);
4. the rows used get their counters updated: sightings, last step, last stream time, show
   (+1 per sample, or its ``show_field``) and click (+1 per sample with a positive label, or
   its ``click_field``; a multi-task model's first label).

Every ``maintenance_interval`` steps (:meth:`DynamicTables.maintain`) rows expire: unseen
for more than ``steps_to_live`` steps, show / click decayed by ``decay_rate_per_day`` per day
of stream time and evicted below ``delete_threshold``, unseen for more than
``delete_after_unseen_days`` days. Stream time is the newest event time trained on when the
config has ``data_config.event_time_field``, else the trainer's clock.

Evicted rows are returned to the caller (``TrainModule``), which resets their weights (the
table's initializer, seeded by table and step) and optimizer state before the rows are
reused; when the trainer publishes deltas their ids are kept for the next delta version as
deletes (:meth:`DynamicTables.take_deleted`), once per *delete consumer*: the delta
publisher (``"publisher"``, ``record_deletes``) and the per-pass delta files of a file
stream (``"pass_delta"``) each take their own copy. A table that has to make
room ranks its rows once per block (at least 1 % of the capacity and 8 times the rows the
step needs): exactly, by one ``argpartition`` up to 65,536 rows, beyond that from a
threshold taken on a strided sample of 32,768 rows, then exactly among the rows at or below
it. All decisions depend only on the ids, labels, steps and stream times trained on, so a
checkpoint (:meth:`DynamicTables.state_dict`: the index, the free-row stack, the counters,
the sketch) restores the tables exactly.

With ``partitions`` > 1 (``train_config.dynamic_index_partitions``) every table is split by
id into that many tables of a block of its rows each (``odl.models.dynamic.partitions``):
all of the above runs per partition, and a process may hold only some partitions (a rank
its own): :meth:`DynamicTables.map_lookups` then leaves the other partitions' ids
``UNHELD`` for the caller to fill in from the ranks holding them.

The engine's modules: :mod:`~odl.models.dynamic.admission_sketch` (the count-min sketch of
candidates), :mod:`~odl.models.dynamic.dynamic_table` (one table: index, counters, the
rules above), :mod:`~odl.models.dynamic.model_tables` (``DynamicTables``: every table of a
model, a batch's remap, the held partitions, the state), :mod:`~odl.models.dynamic.partitions`
(the split by id), :mod:`~odl.models.dynamic.resplit` (a saved state re-split into
another number of partitions), :mod:`~odl.models.dynamic.growth` (a saved state at more
rows: a table that grows, ``DynamicTableSpec.grows_to``) and
:mod:`~odl.models.dynamic.state_changes` (a table's state as the rows changed since a
checkpoint: an incremental checkpoint's).
"""
