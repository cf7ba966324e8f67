"""Several training processes: the process group, the table placement, the ranks' turns.

``torchrun --nproc_per_node N ...`` starts N processes with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; ``join_process_group`` joins them
(gloo on CPU, NCCL on CUDA) and a process started alone gets a group of one. One model is
then trained by all ranks with TorchRec's ``DistributedModelParallel``: the embedding tables
are sharded over the ranks (below) and looked up with TorchRec's all-to-all; the dense part
is replicated: it starts from rank 0's values (``broadcast_parameters``) and every step
averages its gradients over the ranks before the optimizer step (``average_gradients``,
one all-reduce of all of them flattened), so it stays equal everywhere.

Table placement (``table_placement``), deterministic from the table sizes alone, so every
rank computes the same plan:

* a table of at least ``row_wise_min_rows`` rows is split by rows over all ranks (TorchRec's
  row-wise sharding: rank r holds a contiguous block of about rows / N rows), and so is
  every dynamic table whose index is split by id (``odl.models.dynamic.partitions``: rank
  r's rows are partition r's);
* every other table is placed whole on one rank (table-wise): largest first (bytes = rows x
  stored columns), each on the rank with the fewest bytes so far (ties: the lower rank).

Gradients: each rank's loss is the mean over its own records. TorchRec divides the
gradient that reaches a table row by N (its gradient division, on by default) and
``average_gradients`` averages the dense ones, so N ranks on a step's records split evenly
make the update one process makes on all of them.

Lock-step: every rank calls ``TrainModule.train_step`` at every step, with
``TrainModule.empty_batch()`` when it has no records; the ranks exchange their batch sizes,
pad to the largest (TorchRec's sharded lookup needs one size on all ranks; padding samples
read no rows and are left out of the loss) and weight each rank's loss by its share of the
step's records, so a step with uneven shares, or none on some rank, makes the update one
process makes on the step's records together. A step without records anywhere is skipped
by all.

Partitions: each rank reads its share of the Kafka topic's partitions or the DataHub topic's
shards (``odl.inputs.partition_assignment``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.types import ShardingEnv

from odl.config.config_error import ConfigError
from odl.config.limits import ROW_WISE_MIN_ROWS
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class NoDataParallel(DataParallelWrapper):
    """Leaves dense parameters unwrapped (no DDP).

    ``TrainModule.train_step`` averages their gradients itself (:func:`average_gradients`).
    """

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv,
             device: torch.device) -> None:
        """Wraps nothing."""
        return None


@dataclass(frozen=True)
class TablePlacement:
    """Where one table lives.

    Attributes:
        row_wise: split by rows over all ranks.
        rank: the rank holding the whole table (table-wise); -1 when row-wise.
    """

    row_wise: bool
    rank: int = -1


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the joined group, ``(0, 1)`` when there is none."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def join_process_group(device: torch.device) -> tuple[int, int]:
    """Joins the process group of ``torchrun``, or creates one of a single process.

    ``WORLD_SIZE`` > 1 in the environment joins (env://); nothing happens when a group
    exists already.

    Args:
        device: the training device (``cuda`` -> NCCL, else gloo).

    Returns:
        ``(rank, world size)``.
    """
    if dist.is_initialized():
        return world()
    backend = "nccl" if device.type == "cuda" else "gloo"
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        # env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT). torchrun's store outlives a restart of
        # the ranks: each attempt's keys under their own prefix, or a restarted rank could
        # read the address a dead rank of the previous attempt published
        store, rank, size = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"odl/attempt_{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size)
        logger.info("joined a %s process group: rank %d of %d", backend, dist.get_rank(),
                    dist.get_world_size())
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        logger.info("created a single-process %s process group", backend)
    return world()


def local_world_size(world_size: int) -> int:
    """Ranks on this host: ``LOCAL_WORLD_SIZE`` (set by torchrun), else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def leave_process_group() -> None:
    """Leaves the group together with the other ranks: a barrier, then its teardown.

    A group torn down while a peer still uses it can abort the process at exit.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_rank_process(exit_code: int) -> NoReturn:
    """Ends a rank's process with ``exit_code``, skipping the interpreter's teardown.

    A gloo worker thread releases a finished collective's tensors only after the caller has
    seen it complete, and that release takes the GIL. A worker still doing it while the
    interpreter finalizes cannot take the GIL and aborts the whole process (SIGABRT,
    "terminate called without an active exception"), which would turn a clean exit 0, or
    a failure's own code (3 for a fenced trainer, which systemd must not restart), into a
    crash. The trainer has closed everything it writes by the time ``run`` returns; the
    log handlers and stdio are flushed here, then the process ends at once.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(exit_code)


def table_placement(tables: Mapping[str, tuple[int, int]], world_size: int,
                    row_wise_min_rows: int = ROW_WISE_MIN_ROWS,
                    row_wise: Collection[str] = ()) -> dict[str, TablePlacement]:
    """The placement of every table (module docstring).

    Args:
        tables: table name -> ``(rows, stored columns)``.
        world_size: ranks.
        row_wise_min_rows: tables with at least this many rows are split by rows.
        row_wise: tables split by rows whatever their size (dynamic tables split by id).

    Returns:
        Table name -> placement.
    """
    out: dict[str, TablePlacement] = {}
    load = [0] * world_size
    whole = []
    for name, (rows, cols) in tables.items():
        if world_size > 1 and (rows >= row_wise_min_rows or name in row_wise):
            out[name] = TablePlacement(row_wise=True)
            for r in range(world_size):
                load[r] += rows * cols // world_size
        else:
            whole.append((rows * cols, name))
    for nbytes, name in sorted(whole, key=lambda x: (-x[0], x[1])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += nbytes
        out[name] = TablePlacement(row_wise=False, rank=rank)
    return out


@torch.no_grad()
def _in_one_collective(tensors: Sequence[torch.Tensor], collective) -> None:
    """Runs ``collective`` on all ``tensors`` flattened into one, then copies back."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    collective(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_parameters(params: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrites ``params`` on every rank with rank ``src``'s values (a collective)."""
    if params and world()[1] > 1:
        _in_one_collective([p.detach() for p in params], lambda flat: dist.broadcast(flat, src))


def average_gradients(params: Sequence[torch.Tensor]) -> None:
    """Replaces each parameter's gradient by its mean over the ranks (a collective).

    A parameter without a gradient on this rank counts as a zero gradient, so every rank
    takes part in the same all-reduce whatever its batch touched.
    """
    size = world()[1]
    if not params or size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat)
        flat.div_(size)

    _in_one_collective([p.grad for p in params], mean)


def _collective_device() -> torch.device:
    """Where a collective's small tensors live: NCCL takes CUDA tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankTurn(NamedTuple):
    """What one rank tells the others at each turn of ``odl.train.training_loop`` (small ints).

    Attributes:
        stop: it stops (a request, a stop condition or a failure).
        has_batch: it holds a batch.
        finished: its input has ended (and it holds no batch).
        checkpoint_due: a checkpoint is due by time (rank 0's clock counts for all).
        retry_checkpoint: no rank holds a batch and the last checkpoint failed long enough
            ago: retry it now (rank 0's counts for all).
        failed: it failed.
        publish_flags: which parts of a delta version are due (rank 0's publisher counts).
        split, file, record: a file stream's position of its batch (-1: none), so the
            ranks can check they train the same group of batches.
        size: the records of its batch (what it trains this step).
    """

    stop: int
    has_batch: int
    finished: int
    checkpoint_due: int
    retry_checkpoint: int
    failed: int
    publish_flags: int
    split: int
    file: int
    record: int
    size: int

    @property
    def file_position(self) -> tuple[int, int, int]:
        """``(split, file, record)`` of its batch."""
        return self.split, self.file, self.record


def exchange_turn(turn: RankTurn) -> list[RankTurn]:
    """Every rank's turn in rank order (a collective with several ranks; one: its own)."""
    if world()[1] == 1:
        return [turn]
    return [RankTurn(*t) for t in agree(turn)]


def agree(values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (small ints), in rank order (a collective)."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=_collective_device())
    everyone = [torch.zeros_like(mine) for _ in range(world()[1])]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def all_positions(positions: Mapping[int, int]) -> dict[int, int]:
    """The union of every rank's input positions (a collective; partitions are disjoint)."""
    out: dict[int, int] = {}
    for part in from_every_rank(dict(positions)):
        out.update(part)
    return out


def from_every_rank(value: object) -> list:
    """Every rank's ``value`` in rank order, on every rank (a collective)."""
    everyone: list = [None] * world()[1]
    dist.all_gather_object(everyone, value)
    return everyone


def arrays_from_every_rank(arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every rank's ``arrays`` in rank order, on every rank (a collective).

    Each rank gives the same names with the same dtypes and trailing shapes; the first
    dimension may differ. Sent as one byte tensor per rank (one all-gather of the largest
    rank's bytes), not pickled: several MB per step cost a few ms this way.
    """
    names = sorted(arrays)
    parts = [np.ascontiguousarray(arrays[k]) for k in names]
    sizes = agree([p.nbytes for p in parts])
    mine = np.concatenate([p.reshape(-1).view(np.uint8) for p in parts]) if parts else (
        np.empty(0, dtype=np.uint8))
    longest = max((sum(s) for s in sizes), default=0)
    device = _collective_device()
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[:len(mine)] = torch.from_numpy(mine).to(device)
    everyone = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(everyone, buf)
    out = []
    for got, rank_sizes in zip(everyone, sizes, strict=True):
        raw = got.cpu().numpy()
        at, arrays_r = 0, {}
        for name, part, n in zip(names, parts, rank_sizes, strict=True):
            arrays_r[name] = raw[at:at + n].copy().view(part.dtype).reshape(
                (-1, *part.shape[1:]))
            at += n
        out.append(arrays_r)
    return out


def int64_from_every_rank(mine: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """Every rank's ``int64`` array, in rank order, when every rank knows their lengths.

    One all-gather of the longest (``arrays_from_every_rank`` without its exchange of sizes).

    Args:
        mine: this rank's array (``counts[rank]`` values).
        counts: every rank's number of values, the same on every rank.
    """
    longest = max(counts, default=0)
    device = _collective_device()
    buf = torch.zeros(longest, dtype=torch.int64, device=device)
    buf[:len(mine)] = torch.from_numpy(np.ascontiguousarray(mine, dtype=np.int64)).to(device)
    everyone = [torch.empty_like(buf) for _ in counts]
    dist.all_gather(everyone, buf)
    return [got[:n].cpu().numpy() for got, n in zip(everyone, counts, strict=True)]


def gather_to_rank0(value: object) -> list | None:
    """Every rank's ``value`` in rank order on rank 0, None elsewhere (a collective)."""
    rank, size = world()
    everyone: list | None = [None] * size if rank == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone


def from_rank0(value: object) -> object:
    """Rank 0's ``value`` on every rank (a collective)."""
    return from_rank(value, 0)


def from_rank(value: object, src: int) -> object:
    """Rank ``src``'s ``value`` on every rank (a collective; the others' ``value`` unused)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def check_several_ranks(config: pipeline_pb2.EasyRecConfig, world_size: int) -> None:
    """Refuses what ``odl-train`` cannot do as several ranks yet, naming it.

    Raises:
        ConfigError: in-batch learning with the batched shift (``in_batch_sequential:
            false``).
    """
    why = f"is not implemented for {world_size} ranks (torchrun) yet; run one process"
    tc = config.train_config
    if tc.in_batch_learning and not tc.in_batch_sequential:
        raise ConfigError("train_config.in_batch_sequential",
                          f"in-batch learning with the batched shift (false) {why}")
