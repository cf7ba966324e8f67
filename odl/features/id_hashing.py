"""The id hash shared by the trainer and serving: FNV-1a 64-bit over UTF-8 bytes.

The hash is fixed and documented so that any process (trainer, serving plugin, an offline
job in another language) maps a categorical value to the same embedding row:

    h = 0xcbf29ce484222325                            # FNV-1a 64 offset basis
    for byte in value.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001b3) mod 2**64    # FNV-1a 64 prime
    row = h % num_rows                                 # bucketize_hashes

Python's built-in ``hash`` is salted per process and must never be used for ids.

Vectorization: ``hash_segments`` hashes many byte ranges of one buffer at once. Ranges are
sorted by length (longest first) so that at byte position ``j`` the ranges still being hashed
form a prefix; one FNV round then runs over that prefix with numpy (gather, xor, multiply).
The cost is about ``max_len`` vectorized passes; when only a few long ranges remain they are
finished with the scalar loop. ``hash_strings`` packs a column of strings into one buffer
and calls ``hash_segments``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

FNV64_OFFSET_BASIS = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1

# When at most this many ranges are still being hashed, finish them one by one in Python
# rather than running one vectorized pass per remaining byte.
_SCALAR_TAIL = 4


def fnv1a64(s: str | bytes, h: int = FNV64_OFFSET_BASIS) -> int:
    """FNV-1a 64-bit hash of ``s`` (UTF-8 encoded when a ``str``), the scalar reference.

    Args:
        s: the value; ``str`` is encoded as UTF-8, ``bytes`` are hashed as they are.
        h: starting state (the offset basis; pass a previous result to continue a hash).

    Returns:
        The hash as a Python int in ``[0, 2**64)``.
    """
    data = s.encode("utf-8") if isinstance(s, str) else s
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _MASK64
    return h


def hash_segments(
    buf: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    init: np.ndarray | None = None,
) -> np.ndarray:
    """FNV-1a 64 of the byte ranges ``buf[starts[i]:ends[i]]``, vectorized.

    Args:
        buf: ``uint8`` buffer.
        starts: ``int64`` range starts.
        ends: ``int64`` range ends (exclusive), ``ends >= starts``.
        init: optional ``uint64`` starting states (to continue hashes, e.g. for joined
            values); the offset basis when ``None``.

    Returns:
        ``uint64`` hashes, one per range.
    """
    n = int(starts.shape[0])
    if init is None:
        h = np.full(n, FNV64_OFFSET_BASIS, dtype=np.uint64)
    else:
        h = np.array(init, dtype=np.uint64, copy=True)
    if n == 0:
        return h
    lengths = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
    max_len = int(lengths.max())
    if max_len <= 0:
        return h
    # A stable sort of 16-bit keys is a radix sort in numpy: cheap for short ids.
    key = (-lengths).astype(np.int16) if max_len < 32767 else -lengths
    order = np.argsort(key, kind="stable")
    sorted_len = lengths[order]
    s = np.asarray(starts, dtype=np.int64)[order]
    hs = h[order]
    # active[j]: number of ranges longer than j (a prefix in this order).
    active = np.searchsorted(-sorted_len, -np.arange(max_len), side="left")
    prime = np.uint64(FNV64_PRIME)
    for j in range(max_len):
        k = int(active[j])
        if k == 0:
            break
        if k <= _SCALAR_TAIL and max_len - j > 2:
            raw = buf.tobytes()
            for i in range(k):
                a = int(s[i]) + j
                b = int(s[i]) + int(sorted_len[i])
                hs[i] = np.uint64(fnv1a64(raw[a:b], int(hs[i])))
            break
        seg = hs[:k]
        byte = buf[s[:k] + j]
        np.bitwise_xor(seg, byte, out=seg, casting="unsafe")
        np.multiply(seg, prime, out=seg)
    out = np.empty(n, dtype=np.uint64)
    out[order] = hs
    return out


def pack_strings(
    values: Sequence[str] | Sequence[bytes] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packs values into one UTF-8 buffer.

    Args:
        values: ``str`` (encoded as UTF-8) or ``bytes`` values.

    Returns:
        ``(buf uint8, starts int64, ends int64)`` with value ``i`` at ``buf[starts[i]:ends[i]]``.
    """
    vals = values.tolist() if isinstance(values, np.ndarray) else list(values)
    n = len(vals)
    if n and all(isinstance(v, str) for v in vals):
        joined = "".join(vals)
        if joined.isascii():
            data = joined.encode("ascii")
            lengths = np.fromiter(map(len, vals), dtype=np.int64, count=n)
        else:
            enc = [v.encode("utf-8") for v in vals]
            data = b"".join(enc)
            lengths = np.fromiter(map(len, enc), dtype=np.int64, count=n)
    elif all(isinstance(v, bytes) for v in vals):
        data = b"".join(vals)
        lengths = np.fromiter(map(len, vals), dtype=np.int64, count=n)
    else:
        enc = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in vals]
        data = b"".join(enc)
        lengths = np.fromiter(map(len, enc), dtype=np.int64, count=n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return np.frombuffer(data, dtype=np.uint8), starts, ends


def hash_strings(values: Sequence[str] | Sequence[bytes] | np.ndarray) -> np.ndarray:
    """FNV-1a 64 of every value in a column, vectorized.

    Args:
        values: ``str`` values (hashed as UTF-8) or ``bytes`` values (hashed as they are),
            as a sequence or a numpy array of such objects.

    Returns:
        ``uint64`` array of the same length; element ``i`` equals ``fnv1a64(values[i])``.
    """
    buf, starts, ends = pack_strings(values)
    return hash_segments(buf, starts, ends)


def bucketize_hashes(h: np.ndarray, n: int) -> np.ndarray:
    """Maps hashes to rows: ``h % n`` as ``int64``.

    Args:
        h: ``uint64`` hashes from ``hash_strings``.
        n: number of rows (``hash_bucket_size``), ``>= 1``.

    Returns:
        ``int64`` row indices in ``[0, n)``.
    """
    if n < 1:
        raise ValueError(f"number of buckets must be >= 1, got {n}")
    return (np.asarray(h, dtype=np.uint64) % np.uint64(n)).astype(np.int64)
