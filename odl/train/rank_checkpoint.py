"""The checkpoint save of several ranks: every rank writes its own rows, rank 0 commits.

Contract (``save_across_ranks``, a collective that every rank calls at the same step):

1. rank 0 starts the checkpoint (``CheckpointManager.begin_save``: its temporary directory,
   or the finding that this step's checkpoint exists already) and hands that to every rank;
2. every rank writes its table part (``TrainModule.table_part``: the rows it holds and their
   optimizer state, ``odl.checkpoint.table_parts``) into that directory, or on OSS from
   another host to the checkpoint's prefix, and reports its size and digest, or its error,
   to rank 0;
3. rank 0 commits only when every part is in: ``model.pt`` (dense part, dense optimizer,
   step, the parts' names), every rank's input positions, the manifest listing every file,
   DONE last (then the OSS upload, DONE last); otherwise it drops the directory;
4. every rank learns the outcome, so all count the checkpoint as written, or all raise
   ``CheckpointError`` and go on training to the next one.

An increment (``odl.checkpoint.checkpoint_chain``): rank 0 decides at 1 whether the
checkpoint may be one (``CheckpointManager.increment_allowed``, its parent in the pending
save); every rank then writes, instead of its table part, the rows of its shards that any
rank changed since the parent (the union of every rank's ``CheckpointRows.take``, one
all-gather of row numbers); the dynamic tables' state goes in as those rows' changes
(``odl.models.dynamic.state_changes``): written by rank 0 when every rank holds the whole
index, by each rank for its own partitions beside its rows when they are split by id.

No rank holds more than its own rows at a save. Reading the checkpoint puts the tables back
together (``read_checkpoint``), so it restores as one process's; an export writes it block
by block (``odl.checkpoint.table_parts.TableBlocks``); a restore of several ranks
reads from the parts only the blocks of its own rows (``read_checkpoint(whole_tables=False)``
and ``TrainModule.load_checkpoint_state``), into any number of ranks, and crash recovery
writes the recovered delta rows through to the shards that hold them
(``TrainModule.table_rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from odl.checkpoint.checkpoint_manager import CheckpointError, CheckpointManager
from odl.train.distributed import all_positions, from_every_rank, from_rank0, gather_to_rank0
from odl.train.module_state import changed_rows_part
from odl.train.train_module import TrainModule


def save_across_ranks(manager: CheckpointManager, module: TrainModule,
                      positions: Mapping[int, int], source: dict, config_text: str,
                      generation: str, overwrite: bool = False,
                      extra_state: Mapping[str, object] | None = None,
                      changed: Mapping[str, np.ndarray] | None = None,
                      dynamic_changes: Callable[[Mapping[str, np.ndarray]], dict | None]
                      | None = None) -> str:
    """Writes one checkpoint of several ranks (module docstring; a collective).

    Args:
        manager: this rank's checkpoint manager of the shared model_dir.
        module: this rank's train module.
        positions: this rank's input positions (the ranks' partitions are disjoint).
        source: the input's description (rank 0's is written).
        config_text: the effective pipeline config, redacted.
        generation: the job's generation id.
        overwrite: replace a complete checkpoint of the same step.
        extra_state: more entries of the checkpoint state (rank 0's are written).
        changed: this rank's rows changed since the last checkpoint (TorchRec table ->
            row numbers), when it counts them; None on every rank: a full checkpoint.
        dynamic_changes: gives an increment's dynamic-table state from every rank's
            changed rows (``CheckpointRows.dynamic_changes_of``: rank 0's is called, or every
            rank's when the tables are split by id over the ranks), or None: the state goes
            in whole.

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: on every rank, when any rank's part or rank 0's commit failed.
    """
    rank, world = module.rank, module.world_size
    step = module.global_step
    everyone = all_positions(positions)
    state = module.state_without_tables() if rank == 0 else {}
    if rank == 0 and extra_state:
        state.update(extra_state)
    pending, error = None, None
    if rank == 0:
        try:
            pending = manager.begin_save(
                step, overwrite,
                increment=changed is not None and manager.increment_allowed(overwrite))
        except CheckpointError as exc:
            error = str(exc)
    pending, error = from_rank0((pending, error))
    if error is not None:
        raise CheckpointError(error)
    if pending.exists:
        manager.last_saved_step, manager.last_saved_path = step, pending.target
        return pending.target
    if pending.parent is not None:
        rows: dict[str, np.ndarray] = {}
        for theirs in from_every_rank(dict(changed or {})):
            for table, ids in theirs.items():
                rows[table] = np.union1d(rows[table], ids) if table in rows else ids
        # split by id: this rank's partitions' changes, beside its rows; else the whole
        # index's rows changed on any rank, in rank 0's state
        split = module.dynamic_split_over_ranks
        changes = (dynamic_changes(rows) if dynamic_changes is not None
                   and (split or rank == 0) else None)
        part = changed_rows_part(module, rows,
                                 changes["parts"] if split and changes is not None else None)
        if changes is not None and not split:
            state["dynamic_tables"] = changes
    else:
        part = module.table_part()
    entry, my_error = None, None
    try:
        entry = manager.write_table_part(pending, part, rank, world)
    except CheckpointError as exc:
        my_error = str(exc)
    del part
    reports = gather_to_rank0((entry, my_error))
    if rank == 0:
        assert reports is not None
        errors = [e for _entry, e in reports if e is not None]
        if errors:
            manager.abort_save(pending)
            error = "; ".join(errors)
        else:
            try:
                manager.commit_save(pending, state, everyone, source, config_text, generation,
                                    [e for e, _err in reports])
            except CheckpointError as exc:
                error = str(exc)
    error = from_rank0(error)
    if error is not None:
        raise CheckpointError(error)
    manager.last_saved_step, manager.last_saved_path = step, pending.target
    return pending.target
