"""Several CPU ranks for tests and benchmarks, joined into one gloo group.

Spawned processes join as ``torchrun`` would join them (``RANK`` / ``WORLD_SIZE`` /
``LOCAL_WORLD_SIZE`` / ``MASTER_*`` in the environment), one torch thread each.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from odl.models.subnormal_floats import flush_subnormal_floats
from odl.train.distributed import end_rank_process


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(target: Callable[..., Any], rank: int, world: int, port: int, results,
                args: tuple) -> None:
    """One rank: runs ``target``, hands its result (or error) over, ends as a rank ends.

    The process ends through ``end_rank_process`` (no interpreter teardown, which a gloo
    worker still releasing a collective's tensors can abort with SIGABRT), once the result
    has left through the queue's pipe.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    flush_subnormal_floats()  # as odl-train's ranks do
    code = 0
    try:
        results.put((rank, target(rank, *args), None))
        dist.barrier()  # leave together: a group torn down under a peer can abort
    except BaseException as e:  # reported to the caller, not lost in a child's stderr
        results.put((rank, None, repr(e)))
        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.close()
    results.join_thread()  # the result is in the pipe before the process ends
    end_rank_process(code)


def run_ranks(target: Callable[..., Any], world: int, *args: Any,
              timeout: float = 240.0) -> dict[int, Any]:
    """Runs ``target(rank, *args)`` on ``world`` spawned ranks; rank -> what it returned.

    ``target`` joins the group (e.g. by building a ``TrainModule``); it must be importable
    by name (spawned processes import it) and return something picklable without shared
    tensors (numpy arrays, numbers).

    Raises:
        RuntimeError: a rank raised (its exception's text) or exited with an error.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, port, results, args))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(world):
        rank, payload, error = results.get(timeout=timeout)
        if error is not None:
            raise RuntimeError(f"rank {rank} of {world}: {error}")
        got[rank] = payload
    for p in procs:
        p.join(120)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return got
