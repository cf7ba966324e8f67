"""The checkpoint state of a ``TrainModule``: what a checkpoint holds, save, restore, warm start.

The state (:func:`checkpoint_state`), all plain CPU tensors::

    {
      "format": "odl.train_module/1",
      "global_step": int,
      "model": {name: Tensor},            # parameters and buffers, e.g.
                                          # "ebc.embedding_bags.C1.weight" [rows, dim],
                                          # "dense.dnn.0.weight", "dense.wide_bias"
      "dense_optimizer": torch.optim state_dict (tensors on CPU); with part optimizers
                          {"parts": [{"label", "params", "state"}]} (odl.train.dense_parts),
      "sparse_optimizer": {table_param_name: {state_name: Tensor}},
      "dense_ema": {dense name: Tensor, "__n_averaged__": Tensor} (only with ema;
                                          odl.train.dense_ema),
                                          # e.g. {"ebc.embedding_bags.C1.weight":
                                          #        {"C1.momentum1": Tensor[rows]}}
    }

Table weights are full tensors (with several ranks :func:`checkpoint_state` gathers them on
rank 0; a checkpoint of several ranks is written instead from :func:`state_without_tables`
and each rank's :func:`table_part`, ``odl.checkpoint.table_parts``, which reading the
checkpoint makes whole again). Wide tables keep their stored width (see
``odl.models.embedding_tables``). A model with dynamic tables (``odl.models.dynamic``) adds
``"dynamic_tables"``: ``DynamicTables.state_dict()`` (id index, free rows, counters, sketch,
pending deletes; tensors) plus ``"stream_time"``. A model with in-batch learning and wide
tables (``odl.train.in_batch.wide_rate``) adds ``"wide_rate"``: ``{"level": float,
"sensitivity": float | None, "steps": int, "since": int}``; one whose in-batch learning the
stream decides (``odl.train.in_batch.in_batch_choice``) adds ``"in_batch_choice"``:
``InBatchChoice.state_dict()`` (phase, open window, counts).

:func:`load_state` restores such a state exactly, into any number of ranks (each rank copies
the rows it holds; dynamic tables saved in another number of partitions are re-split, their
rows moving with their ids). A model's ``ADDED_PARAMETERS`` (``odl.models.ctr_model``), dense
parameters added after its checkpoints were first written, may be missing from the state:
they keep their initial values and the dense optimizer (and EMA) start fresh.
:func:`load_parameters` is a warm start: parameters only, with renames. ``TrainModule``'s
methods of the same purpose call these.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from odl.checkpoint import checkpoint_chain, table_parts
from odl.models.dynamic.resplit import resplit_state, saved_partitions
from odl.train.dense_parts import load_dense_optimizer_state
from odl.train.distributed import gather_to_rank0
from odl.train.table_shards import (
    EBC_PREFIX,
    copy_into,
    copy_shards,
    local_shards,
    local_view,
    shard_pieces,
    tensors_to_cpu,
    to_full_cpu,
)

if TYPE_CHECKING:
    from odl.train.train_module import TrainModule

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "odl.train_module/1"
# a re-split copies the rows moving with their ids this many at a time
_RESPLIT_CHUNK_ROWS = 1 << 16


@dataclass
class WarmStartReport:
    """What ``load_parameters`` did.

    Attributes:
        loaded: ``(name, source name)`` pairs copied.
        missing: own names with no source tensor (kept their initial values).
        unused: source names nothing was loaded from.
    """

    loaded: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def _named_state(m: TrainModule) -> dict[str, Any]:
    """Own parameter/buffer name -> live tensor (tables as writable full views)."""
    out: dict[str, Any] = {}
    for name, t in m.dmp.state_dict().items():
        out[name] = local_view(t) if name.startswith(EBC_PREFIX) else t
    out.update(m.dense_parameters())
    return out


def checkpoint_state(m: TrainModule) -> dict[str, Any]:
    """Full training state as plain CPU tensors (see the module docstring).

    With several ranks this is a collective: every rank must call it; rank 0 gets the
    whole state (every table whole, in the same layout as one process's, so it restores
    into any number of ranks) and the other ranks an empty dict.
    """
    if m.world_size > 1:
        parts = _gathered_parts(m)
        if parts is None:
            return {}
        out = state_without_tables(m)
        tables, out["sparse_optimizer"] = table_parts.assemble(parts)
        out["model"].update(tables)
        table_parts.merge_dynamic_parts(out, parts)
        return out
    out = state_without_tables(m, {k: to_full_cpu(v) for k, v in _named_state(m).items()})
    out["sparse_optimizer"] = {
        pname: {k: to_full_cpu(v) for k, v in states.items()}
        for pname, states in m.fused_optimizer.state_dict()["state"].items()}
    return out


def state_without_tables(m: TrainModule, model: dict[str, Any] | None = None,
                         dynamic_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint state but the tables, the same on every rank; not a collective.

    Step, dense part (or ``model``, when given), dense optimizer and the dynamic tables'
    state. A checkpoint of several ranks holds this in ``model.pt`` and each rank's
    ``table_part`` beside it (``odl.train.rank_checkpoint``); reading it puts the parts
    back together into ``state_dict_for_checkpoint``'s state. ``dynamic_state``, when
    given, stands for the dynamic tables' state (an increment's changes document,
    ``odl.models.dynamic.state_changes``).
    """
    out = {
        "format": CHECKPOINT_FORMAT,
        "global_step": int(m.global_step),
        "model": model if model is not None else {
            k: to_full_cpu(v) for k, v in m.dense_parameters().items()},
        "dense_optimizer": tensors_to_cpu(m.dense_optimizer.state_dict()),
        "sparse_optimizer": {},
    }
    if m.dense_ema is not None:
        out["dense_ema"] = m.dense_ema.state_dict()
    wide_rate = m.wide_rate
    if wide_rate is not None:
        out["wide_rate"] = wide_rate.state_dict()
    learning = m.row_pair_learning
    if learning is not None and learning.in_batch is not None and learning.choice.auto:
        out["in_batch_choice"] = learning.choice.state_dict()
    if m.dynamic:
        out["dynamic_tables"] = (dynamic_state if dynamic_state is not None
                                 else m.dynamic.state_dict())
        if m.dynamic_split_over_ranks:  # each rank's partition travels in its table part
            out["dynamic_tables"]["parts"] = {}
        out["stream_time"] = float(m.stream_time)
    return out


@torch.no_grad()
def load_state(m: TrainModule, state: Mapping[str, Any], strict: bool = True) -> None:
    """Restores parameters, buffers, optimizer states and the global step exactly.

    Args:
        m: the module.
        state: a dict from ``state_dict_for_checkpoint``.
        strict: raise when names differ (otherwise missing entries keep their values).

    Raises:
        KeyError: ``strict`` and a name is missing or unexpected.
        ValueError: a shape differs.
    """
    if m.world_size > 1:
        _load_sharded_state(m, state, strict)
        return
    own = _named_state(m)
    model = state["model"]
    added = _added_parameters_missing(m, set(own), model)
    if strict:
        _check_names(set(own) - added, set(model), "model")
    for name, t in own.items():
        if name in model:
            copy_into(t, model[name], name, name)
    own_sparse = m.fused_optimizer.state_dict()["state"]
    saved_sparse = state.get("sparse_optimizer", {})
    if strict:
        _check_names(
            {f"{p}/{k}" for p, s in own_sparse.items() for k in s},
            {f"{p}/{k}" for p, s in saved_sparse.items() for k in s},
            "sparse_optimizer")
    for pname, states in own_sparse.items():
        for k, v in states.items():
            if pname in saved_sparse and k in saved_sparse[pname]:
                copy_into(local_view(v), saved_sparse[pname][k], f"{pname}/{k}",
                           f"{pname}/{k}")
    _load_dense_optimizers(m, state, added)
    _load_dynamic_state(m, state, strict)
    _load_wide_rate(m, state)
    m.set_global_step(int(state.get("global_step", 0)))


def _local_pieces(m: TrainModule) -> dict[tuple[str, str, str], tuple[tuple[int, ...], list]]:
    """This rank's parts of the tables and their optimizer state.

    Returns:
        ``(kind, name, state key) -> (whole size, [(offsets, CPU tensor)])``.
    """
    pieces: dict[tuple[str, str, str], tuple[tuple[int, ...], list]] = {}
    for name, t in m.dmp.state_dict().items():
        if name.startswith(EBC_PREFIX):
            pieces[("model", name, "")] = shard_pieces(t)
    for pname, states in m.fused_optimizer.state_dict()["state"].items():
        for k, v in states.items():
            pieces[("sparse", pname, k)] = shard_pieces(v)
    return pieces


def _gathered_parts(m: TrainModule) -> list[dict[str, Any]] | None:
    """Every rank's table part gathered on rank 0 (a collective).

    Returns:
        The part documents in rank order on rank 0, None on the others.
    """
    return gather_to_rank0(table_part_copy(m))


def table_part_copy(m: TrainModule) -> dict[str, Any]:
    """``table_part`` with its tensors compact copies, to send or keep across a rebuild.

    A shard is a view of the fused buffer, which pickling would send whole.
    """
    part = table_part(m)
    for piece in part["pieces"]:
        piece[4] = [[off, t.clone()] for off, t in piece[4]]
    return part


def table_part(m: TrainModule) -> dict[str, Any]:
    """This rank's rows of every table and their optimizer state, as a part document.

    See ``odl.checkpoint.table_parts``; with one process, the whole tables. Dynamic
    tables split by id over the ranks add this rank's partition of their state.
    """
    return table_parts.part_document(
        _local_pieces(m), m.rank, m.world_size,
        m.dynamic.state_dict()["parts"] if m.dynamic_split_over_ranks else None)


@torch.no_grad()
def changed_rows_part(m: TrainModule, rows: Mapping[str, np.ndarray],
                      dynamic_parts: Mapping[int, Any] | None = None) -> dict[str, Any]:
    """This rank's changed rows of every table and their optimizer state (an increment).

    See ``odl.checkpoint.checkpoint_chain``: for each table and table-optimizer state, the
    rows of ``rows`` that this rank's shards hold, all columns, as CPU copies; a state that
    is not one value (or row) per table row is written whole. Dynamic tables split by id
    over the ranks add this rank's partitions of their state: their changes
    (``dynamic_parts``, ``odl.models.dynamic.state_changes``), else whole, as ``table_part``
    does.

    Args:
        m: the module.
        rows: TorchRec table name -> sorted unique whole-table row numbers changed.
        dynamic_parts: partition -> its changes since the parent, for the partitions this
            rank holds (split over the ranks only); None: whole.

    Raises:
        ValueError: a shard splits a table's columns (never with odl's placements).
    """
    tensors = {("model", n, ""): t for n, t in m.dmp.state_dict().items()
               if n.startswith(EBC_PREFIX)}
    for pname, states in m.fused_optimizer.state_dict()["state"].items():
        for k, v in states.items():
            if isinstance(v, torch.Tensor) or hasattr(v, "local_shards"):
                tensors[("sparse", pname, k)] = v
    shapes = m.table_shapes()
    empty = np.empty(0, dtype=np.int64)
    pieces: checkpoint_chain.RowPieces = {}
    for (kind, name, key), t in tensors.items():
        size = tuple(int(x) for x in t.size())
        table = name[len(EBC_PREFIX):-len(".weight")]
        if not size or table not in shapes or size[0] != shapes[table][0]:
            pieces[(kind, name, key)] = (size, None, to_full_cpu(t))
            continue
        wanted = torch.from_numpy(np.asarray(rows.get(table, empty), dtype=np.int64))
        got_ids, got = [], []
        for offsets, shard in local_shards(t):
            if len(size) > 1 and (offsets[1] != 0 or shard.shape[1] != size[1]):
                raise ValueError(f"{name} {key}: a shard of columns {offsets[1]}.. is not "
                                 "one of whole rows")
            r0 = int(offsets[0])
            mine = wanted[(wanted >= r0) & (wanted < r0 + shard.shape[0])]
            got_ids.append(mine)
            got.append(shard.index_select(0, (mine - r0).to(shard.device)).cpu())
        if got_ids:
            pieces[(kind, name, key)] = (size, torch.cat(got_ids), torch.cat(got))
    if not m.dynamic_split_over_ranks:
        dynamic_parts = None
    elif dynamic_parts is None:
        dynamic_parts = m.dynamic.state_dict()["parts"]
    return checkpoint_chain.rows_document(pieces, m.rank, m.world_size, dynamic_parts)


def _sharded_state(m: TrainModule) -> dict[str, Any]:
    """Own parameter / buffer name -> tables as ShardedTensors, the dense part plain."""
    own = {n: t for n, t in m.dmp.state_dict().items() if n.startswith(EBC_PREFIX)}
    own.update(m.dense_parameters())
    return own


@torch.no_grad()
def _load_sharded_state(m: TrainModule, state: Mapping[str, Any], strict: bool) -> None:
    """``load_checkpoint_state`` with several ranks: each copies its own rows.

    From whole tables, or straight from the table parts a state names
    (``read_checkpoint(whole_tables=False)``): then only the blocks overlapping this
    rank's shards are read.
    """
    model = state["model"]
    saved_sparse = state.get("sparse_optimizer", {})
    own = _sharded_state(m)
    fused = m.fused_optimizer.state_dict()["state"]
    if state.get("table_parts"):
        local = {("model", n, ""): local_shards(t) for n, t in own.items()
                 if n.startswith(EBC_PREFIX)}
        local.update({("sparse", p, k): local_shards(v) for p, st in fused.items()
                      for k, v in st.items()})
        held = table_parts.load_blocks(
            (table_parts.read_part(p, mmap=True) for p in state["table_parts"]), local)
        if state.get(checkpoint_chain.TABLE_ROWS_KEY):  # an increment's rows, in order
            checkpoint_chain.apply_rows_to_shards(checkpoint_chain.merged_rows(
                checkpoint_chain.read_rows(p)
                for p in state[checkpoint_chain.TABLE_ROWS_KEY]), local)
        if strict:  # every table; the optimizer state of the tables this rank holds
            _check_names({i for i in local if i[0] == "model"},
                         {i for i in held if i[0] == "model"}, "table parts")
            lacking = sorted(i for i in local if i[0] == "sparse" and i not in held)
            if lacking:
                raise KeyError(f"sparse_optimizer: the checkpoint lacks {lacking}")
        own = {n: t for n, t in own.items() if not n.startswith(EBC_PREFIX)}
        fused = {}
    added = _added_parameters_missing(m, set(own), model)
    if strict:  # with parts, the state's "model" holds the dense part only
        _check_names(set(own) - added, set(model), "model")
    for name, t in own.items():
        if name in model:
            copy_shards(t, model[name], name)
    for pname, states in fused.items():
        for k, v in states.items():
            if pname in saved_sparse and k in saved_sparse[pname]:
                copy_shards(v, saved_sparse[pname][k], f"{pname}/{k}")
            elif strict:
                raise KeyError(f"sparse_optimizer: the checkpoint lacks {pname}/{k}")
    _load_dense_optimizers(m, state, added)
    _load_dynamic_state(m, state, strict)
    _load_wide_rate(m, state)
    m.set_global_step(int(state.get("global_step", 0)))


def _added_parameters_missing(m: TrainModule, own: set[str], model: Mapping[str, Any]
                              ) -> set[str]:
    """The model's ``ADDED_PARAMETERS`` the checkpoint lacks (they keep their initial values)."""
    added = {n for n in getattr(m.model, "ADDED_PARAMETERS", ()) if n in own and n not in model}
    if added:
        logger.warning("the checkpoint predates the model's %s: %s starts at its initial value "
                       "and the dense optimizer starts fresh; every other parameter, the "
                       "tables and the positions are restored. A serving export made before "
                       "has no such variable and rejects the new versions (unknown_dense_id): "
                       "give serving a new export", ", ".join(sorted(added)),
                       "it" if len(added) == 1 else "each")
    return added


def _load_dense_optimizers(m: TrainModule, state: Mapping[str, Any], added: set[str]) -> None:
    """The dense optimizer's and the dense EMA's state, unless parameters were added since."""
    if "dense_optimizer" in state and not added:
        load_dense_optimizer_state(m.dense_optimizer, state["dense_optimizer"])
    if m.dense_ema is not None:  # (a checkpoint without one restarts it from the parameters)
        m.dense_ema.load_state_dict(None if added else state.get("dense_ema"))


def _load_wide_rate(m: TrainModule, state: Mapping[str, Any]) -> None:
    """Restores a checkpoint's wide rate and in-batch choice (their ``load_state_dict``)."""
    wide_rate = m.wide_rate
    if wide_rate is not None and "wide_rate" in state:
        wide_rate.load_state_dict(state["wide_rate"])
    learning = m.row_pair_learning
    if learning is not None and learning.in_batch is not None and "in_batch_choice" in state:
        learning.choice.load_state_dict(state["in_batch_choice"], learning.in_batch.gain)


def _load_dynamic_state(m: TrainModule, state: Mapping[str, Any], strict: bool) -> None:
    """The dynamic tables' index and counters of a checkpoint state (every rank).

    A state split into another number of partitions is re-split into this model's
    (``odl.models.dynamic.resplit``): each id's row of weights and optimizer state moves
    with it, the free rows get fresh values.
    """
    if m.dynamic:
        if "dynamic_tables" not in state:
            raise KeyError("the checkpoint has no dynamic-table state but the model has "
                           f"dynamic tables {sorted(m.dynamic.tables)}")
        saved = state["dynamic_tables"]
        if saved_partitions(saved) != m.dynamic.partitions:
            _load_resplit(m, saved, table_parts.TableBlocks(state), {},
                               int(state.get("global_step", 0)), list(m.dynamic.tables),
                               with_optimizer=True)
        else:
            m.dynamic.load_state_dict(saved)
        m.stream_time = float(state.get("stream_time", 0.0))
    elif strict and "dynamic_tables" in state:
        raise KeyError("the checkpoint has dynamic tables "
                       f"{sorted(state['dynamic_tables'].get('tables', {}))}, the model none")


@torch.no_grad()
def _load_resplit(m: TrainModule, saved: Mapping[str, Any], source: table_parts.TableBlocks,
                  var_map: Mapping[str, str], step: int, names: Sequence[str],
                  with_optimizer: bool) -> None:
    """Loads a dynamic-table state of another number of partitions, re-split into ours.

    Each kept id's row (weights, and with ``with_optimizer`` its optimizer state) is
    copied from ``source``'s old row to its new one; with ``with_optimizer`` (a restore)
    the other rows are reset as evicted rows are, otherwise (a warm start) they keep
    their initial values. With several ranks each rank writes the rows it holds.

    Args:
        m: the module.
        saved: the checkpoint's ``"dynamic_tables"`` (every partition).
        source: the checkpoint's tables, whole or in parts.
        var_map: own parameter name -> the source's (a warm start's renames).
        step: the checkpoint's global step.
        names: the dynamic tables to load (the others keep their state).
        with_optimizer: move the optimizer state too and reset the free rows.
    """
    specs = {n: m.dynamic.tables[n].spec for n in names}
    split = resplit_state(saved, specs, m.seed, m.dynamic.partitions, step,
                          m.dynamic.delete_consumers())
    m.dynamic.load_state_dict(split.state, tables=names)
    fused = m.fused_optimizer.state_dict()["state"] if with_optimizer else {}
    for base, src in split.sources.items():
        for t in m.dynamic_torch_tables[base]:
            pname = f"{EBC_PREFIX}{t}.weight"
            weight = m.table_shards(t)[0]
            targets = [("", weight)] + [
                (k, v) for k, v in fused.get(pname, {}).items()
                if (isinstance(v, torch.Tensor) or hasattr(v, "local_shards"))
                and len(v.size()) and int(v.size()[0]) == src.shape[0]]
            for key, tensor in targets:
                shards = (local_shards(tensor) if m.world_size > 1
                          else [((0,) * len(tensor.size()), local_view(tensor))])
                for offsets, shard in shards:
                    from_rows = src[offsets[0]:offsets[0] + shard.shape[0]]
                    kept = np.flatnonzero(from_rows >= 0)
                    for c in range(0, kept.shape[0], _RESPLIT_CHUNK_ROWS):
                        at = kept[c:c + _RESPLIT_CHUNK_ROWS]
                        rows = source.take(var_map.get(pname, pname),
                                           torch.from_numpy(from_rows[at]), key)
                        if shard.dim() > 1:
                            rows = rows[:, offsets[1]:offsets[1] + shard.shape[1]]
                        shard.index_copy_(0, torch.from_numpy(at).to(shard.device),
                                          rows.to(shard.device, shard.dtype))
    if with_optimizer:
        m.reset_dynamic_rows({b: np.flatnonzero(src < 0)
                                 for b, src in split.sources.items()}, step)
    logger.info("dynamic tables re-split from %d into %d partition(s) by id: %s",
                saved_partitions(saved), m.dynamic.partitions,
                ", ".join(f"{n} {m.dynamic.tables[n].live} rows kept on this rank, "
                          f"{split.dropped[n].shape[0]} dropped" for n in names))


@torch.no_grad()
def load_parameters(
    m: TrainModule,
    named_tensors: Mapping[str, torch.Tensor],
    var_map: Mapping[str, str] | None = None,
    dynamic_state: Mapping[str, Any] | None = None,
    source_step: int = 0,
) -> WarmStartReport:
    """Warm start: copies parameters (and buffers) only, no optimizer state.

    A dynamic table's rows mean nothing without its id index: its weights are copied only
    with the source's dynamic-table state (``dynamic_state``, another checkpoint's
    ``"dynamic_tables"``), which is then loaded too (ids, counters); otherwise the table
    starts empty.

    Args:
        m: the module.
        named_tensors: source name -> tensor (e.g. another checkpoint's ``"model"``).
        var_map: own (new) name -> source (old) name for renamed parameters.
        dynamic_state: the source checkpoint's ``"dynamic_tables"``, if any. Split into
            another number of partitions, it is re-split into this model's and each
            id's row moves with it (``odl.models.dynamic.resplit``).
        source_step: the source checkpoint's global step (the keep priority of ids a
            re-split has no room for).

    Returns:
        What was loaded, what is missing (kept initial values) and what was unused.

    Raises:
        ValueError: a source tensor's shape differs (message names both).
    """
    var_map = dict(var_map or {})
    report = WarmStartReport()
    used = set()
    saved_p = saved_partitions(dynamic_state or {})
    saved_tables = (dynamic_state or {}).get("tables", {}) if saved_p == 1 else next(
        iter((dynamic_state or {}).get("parts", {}).values()), {}).get("tables", {})
    present = [b for b in m.dynamic_torch_tables if b in saved_tables]
    skip, moved = set(), set()
    for base, torch_tables in m.dynamic_torch_tables.items():
        if base not in saved_tables:
            skip |= {f"{EBC_PREFIX}{t}.weight" for t in torch_tables}
            logger.warning("warm start: dynamic table %s starts empty (the source has no "
                           "id index for it)", base)
    if present and saved_p != m.dynamic.partitions:  # rows move with their ids
        _load_resplit(m, dynamic_state, table_parts.TableBlocks({"model": named_tensors}),
                           var_map, source_step, present, with_optimizer=False)
        for base in present:
            for t in m.dynamic_torch_tables[base]:
                name = f"{EBC_PREFIX}{t}.weight"
                moved.add(name)
                used.add(var_map.get(name, name))
                report.loaded.append((name, var_map.get(name, name)))
    elif present:
        m.dynamic.load_state_dict(dynamic_state, tables=present)
    own = _named_state(m) if m.world_size == 1 else _sharded_state(m)
    for name, t in own.items():
        if name in moved:
            continue
        if name in skip:
            report.missing.append(name)
            continue
        src = var_map.get(name, name)
        if src not in named_tensors:
            report.missing.append(name)
            continue
        copy_shards(t, named_tensors[src], name, src)  # each rank its own rows
        used.add(src)
        report.loaded.append((name, src))
    report.unused = sorted(set(named_tensors) - used)
    for name in report.missing:
        logger.warning("warm start: no value for %s, keeping its initial value", name)
    if report.unused:
        logger.info("warm start: %d source tensors unused: %s", len(report.unused),
                    ", ".join(report.unused[:20]))
    logger.info("warm start: loaded %d tensors", len(report.loaded))
    return report


def _check_names(own: set[str], saved: set[str], what: str) -> None:
    missing, unexpected = sorted(own - saved), sorted(saved - own)
    if missing or unexpected:
        raise KeyError(f"checkpoint {what} does not match the model: missing {missing}, "
                       f"unexpected {unexpected}")
