"""The in-batch package's C kernels, compiled on first use with the system C compiler.

``in_batch_scan.c`` (the sequential pass, ``odl.train.in_batch.in_batch_scan``) and
``row_pairs.c`` (a step's row reads and per-record row sums on the CPU,
``odl.train.in_batch.batch_row_pairs`` and ``odl.train.in_batch.per_record_adagrad``) are
built into one shared library, once per version of their sources, and loaded through
ctypes. Where no C compiler works, :func:`library` returns None (logged once) and the
callers compute the same in Python / torch, more slowly.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from odl.storage.file_store import cache_root

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("in_batch_scan.c", "row_pairs.c"))

_i64, _i32, _f64, _vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_double, ctypes.c_void_p
# each exported function: its result type and its arguments' types
SIGNATURES = {
    "odl_in_batch_scan": (None, [_i64, _i64, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp,
                                 _vp, _i32, _i32, _f64, _f64, _vp, _vp, _vp, _vp, _vp, _vp,
                                 _vp, _vp]),
    "odl_row_pair_reads": (_i64, [_i64, _i64] + [_vp] * 12),
    "odl_row_pair_sorted": (None, [_i64, _i64] + [_vp] * 14),
    "odl_row_gradient_sums": (_i64, [_i64, _i64, _i64, _i32, _f64] + [_vp] * 13),
    "odl_shared_reads": (_i64, [_i64] + [_vp] * 6),
    "odl_scan_reads": (None, [_i64, _i64, _i64, _i64] + [_vp] * 12),
    "odl_rows_read": (None, [_i64, _i64] + [_vp] * 6),
    "odl_rows_write": (None, [_i64, _i64] + [_vp] * 6 + [_i32]),
}

_library: ctypes.CDLL | None | bool = None  # None: not tried yet; False: no compiler


def _build_dirs() -> list[Path]:
    """Where the library may be kept, in order of preference.

    ``$ODL_CACHE_DIR/native`` (default ``~/.cache/odl/native``), else the temporary
    directory (a service without a writable home).
    """
    return [Path(cache_root()) / "native",
            Path(tempfile.gettempdir()) / f"odl-native-{os.getuid()}"]


def _build(target: Path, compiler: str) -> None:
    """Compiles the sources into ``target`` (atomic: concurrent builders agree on one file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, "-O3", "-fno-math-errno", "-shared", "-fPIC", "-o", tmp,
                        *(str(s) for s in SOURCES), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _compile() -> ctypes.CDLL | None:
    """The library, built once per version of the sources into the first usable directory.

    None without a working C compiler (logged).
    """
    digest = hashlib.sha256(sys.platform.encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    tag = digest.hexdigest()[:16]
    compiler = os.environ.get("CC", "cc")
    why = ""
    for directory in _build_dirs():
        target = directory / f"odl_in_batch-{tag}.so"
        try:
            if not target.exists():
                _build(target, compiler)
            lib = ctypes.CDLL(str(target))
            break
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[:300]
            why = f"{e.__class__.__name__}{': ' + detail if detail else ''}"
    else:
        logger.warning("in-batch learning: could not compile %s with %r (%s); using the "
                       "Python / torch code, which is much slower",
                       ", ".join(s.name for s in SOURCES), compiler, why)
        return None
    for name, (result, arguments) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = result
        fn.argtypes = arguments
    return lib


def address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's data, as the kernels take it.

    The caller holds ``a`` (by a name) until the kernel returns: an array made inside the
    call's argument list is freed before the kernel runs.
    """
    if not a.flags.c_contiguous:
        raise ValueError("the C kernels take C-contiguous arrays")
    return a.ctypes.data


def library() -> ctypes.CDLL | None:
    """The loaded library (compiled on the first call), or None where none could be built."""
    global _library
    if _library is None:
        _library = _compile() or False
    return _library if _library is not False else None
