"""Subnormal floats flushed to zero on the CPU, in every thread that runs a model.

A dense weight that receives no gradient from the data (the incoming weights of a ReLU unit
that no longer fires, the outgoing weights of such a unit) still receives the L2 term's
gradient, so Adam shrinks it a little at every step, geometrically, for as long as the
daemon runs. After a few thousand steps such weights, and their optimizer moments, pass
below ``torch.finfo(torch.float32).tiny`` (1.2e-38) into the subnormal range. x86 CPUs
compute with subnormal operands through a microcode assist that is about a hundred times
slower than a normal multiply-add: one forward of DeepFM's first 461 x 256 layer on a batch
of 1,024 takes 302 ms with ~2,700 such weights instead of 1.6 ms, and without flushing a
trainer holding 10k samples/s falls to 3k after two minutes, as does serving's ``/predict``.

Flush-to-zero (FTZ: a subnormal result is written as 0) and denormals-are-zero (DAZ: a
subnormal operand is read as 0) remove the slow path. They change results only below
1.2e-38, far under anything a CTR model's prediction resolves, and the trainer and serving
both set them, so serving parity (same inputs, same outputs) holds.

The setting is a bit of the CPU's MXCSR register, **per thread**: a thread inherits it from
the thread that creates it, and torch's OpenMP workers are created by the first parallel
operation of the thread that runs it and keep their setting. The daemons' command lines call
:func:`flush_subnormal_floats` first thing, before any worker exists; the objects that run a
model (``TrainModule``, serving's model) call it again for their own thread. Where workers
already exist (a library caller that computed with torch first), it runs one OpenMP parallel
region through the OpenMP runtime torch loaded (``GOMP_parallel``, libgomp's entry point,
which Intel's runtime also provides) that sets the bit in each of them. It then checks that
a parallel addition of subnormals really gives zero, and logs a warning once when not.

CUDA devices handle subnormals in hardware and are left alone. On a CPU without DAZ
(``torch.set_flush_denormal`` returns False, e.g. some non-x86 machines) nothing changes and
a debug line says so. TensorFlow sets the same flags in its own threads, which is why an
EasyRec job of the same model never met this.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["flush_subnormal_floats", "subnormals_flushed"]

# Large enough that torch splits the addition over every intra-op thread (its grain is
# 32,768 elements), so the check sees every worker.
_CHECK_ELEMENTS = 1 << 18

_warned = threading.Event()


def subnormals_flushed() -> bool:
    """Whether a parallel float32 operation in this thread reads and writes subnormals as 0.

    Returns:
        True when this thread and every intra-op worker it uses flush subnormals.
    """
    # The smallest subnormal, made from its bit pattern (converting a subnormal constant
    # would itself be flushed where flushing is on); the sums are counted as bits (a float
    # comparison would read a subnormal as zero where flushing is on).
    probe = torch.ones(_CHECK_ELEMENTS, dtype=torch.int32).view(torch.float32)
    return not bool(torch.count_nonzero((probe + probe).view(torch.int32)).item())


_OPENMP_LIBRARY = re.compile(r"\S*lib(?:gomp|iomp5)[^/\s]*\.so[^/\s]*")
# ctypes keeps a callback alive only while referenced
_WORKER_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_worker_callback: Optional[object] = None


def _openmp_runtime() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime loaded into this process (Linux), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            found = _OPENMP_LIBRARY.search(maps.read())
    except OSError:
        return None
    if found is None:
        return None
    try:
        runtime = ctypes.CDLL(found.group(0))
        runtime.GOMP_parallel  # noqa: B018 - raises AttributeError when absent
    except (OSError, AttributeError):
        return None
    return runtime


def _flush_in_openmp_workers() -> None:
    """Sets flush-to-zero in each thread of this thread's OpenMP team (its existing workers)."""
    global _worker_callback
    runtime = _openmp_runtime()
    if runtime is None:
        return
    if _worker_callback is None:
        _worker_callback = _WORKER_CALLBACK_TYPE(lambda _data: torch.set_flush_denormal(True))
    runtime.GOMP_parallel.argtypes = [_WORKER_CALLBACK_TYPE, ctypes.c_void_p, ctypes.c_uint,
                                      ctypes.c_uint]
    runtime.GOMP_parallel.restype = None
    # ctypes releases the GIL for the call, so the workers can run the Python callback
    runtime.GOMP_parallel(_worker_callback, None, torch.get_num_threads(), 0)


def flush_subnormal_floats() -> bool:
    """Makes this thread (and the threads it creates later) flush subnormal floats to zero.

    Call it before the thread's first torch computation; calling it again is cheap.

    Returns:
        True when subnormals are flushed in this thread and its intra-op workers; False
        when the CPU cannot (logged at DEBUG) or when workers created before the call could
        not be reached (logged as a WARNING once per process: computations on subnormal
        weights then run up to a hundred times slower).
    """
    if not torch.set_flush_denormal(True):
        logger.debug("this CPU cannot flush subnormal floats to zero (no DAZ)")
        return False
    if subnormals_flushed():
        return True
    _flush_in_openmp_workers()
    if subnormals_flushed():
        return True
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "torch's intra-op threads were started before subnormal floats were set to "
            "flush to zero: a model whose weights decay into the subnormal range will run "
            "up to 100x slower on them (call odl.models.subnormal_floats."
            "flush_subnormal_floats() before the process's first torch computation)")
    return False
