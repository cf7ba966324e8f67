r"""Example decoder of odl's delta stream, written for serving engineers to adapt.

It reads the versions a trainer published (``train_config.incr_save_config``) either from the
delta topic or from an fs ``incr_save_dir``, decodes every chunk with the generated protobuf
classes (``odl.protos.delta_pb2``) and numpy only -- deliberately NOT through
``publisher.delta_decoder``, so that it doubles as an independent description of the format
(``docs/publishing.md``, "Wire format") -- and prints one line per complete version::

    .venv/bin/python samples/decode_deltas.py --bootstrap 127.0.0.1:9092 --topic odl_deltas
    .venv/bin/python samples/decode_deltas.py --bootstrap 127.0.0.1:9092 --topic odl_deltas \
        --from-offset 1200 --max-messages 50 --id-maps exports/1767225600
    .venv/bin/python samples/decode_deltas.py --dir model_dir/incr_save --json

Format in brief: one Kafka message (or one ``[uint32 little-endian length][bytes]`` record of
a ``.delta`` file) is one serialized ``DeltaChunk``. Its ``payload`` is a serialized
``DeltaPayload`` whose ``zlib.crc32`` is ``payload_crc32``. Row ids are little-endian int64;
values are little-endian float32 (``value_type`` FP32) or float16 (FP16), row-major. A
version (``(generation, version)``) is complete when chunks ``0 .. chunk_count - 1`` have all
arrived; only then may it be applied (all-or-nothing). Values are full current values, so
applying a version twice is harmless. A version published after the delta topic lost
versions carries a ``RepublishMark`` in its payload: ``full`` (it holds every row its
generation ever published) and the newest full version it follows; a serving engine that
meets a version naming a full version it never applied read past it and must replay from
that full version's offset (``docs/publishing.md``).

Output, one line per complete version, in arrival order::

    version=120 generation=3f2a... kind=BOTH value_type=FP32 chunks=2 bytes=81234
      rows={0:512,3:40} dense_vars=9 event_ms=1767225600000..1767225601000
      produce_ms=... publish_ms=... positions=events:0@1500,events:1@1498 offsets=10..11

(on one line; ``offsets`` is the Kafka offset range of the chunks, ``file`` replaces it for a
directory; ``full`` and ``follows_full=VERSION@OFFSET`` are added after a republish).
Versions still incomplete at the end are listed as ``incomplete ...``; rejected chunks
(unparsable, unknown format_version, checksum mismatch, inconsistent lengths, a bad republish
mark) are reported on stderr. ``--json`` prints the same as JSON lines.

Exit codes: 0 all chunks decoded; 1 some chunk was rejected or a version stayed incomplete;
2 bad command line or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from odl.protos import delta_pb2

FORMAT_VERSION = 1
KIND_NAMES = {delta_pb2.DENSE: "DENSE", delta_pb2.SPARSE: "SPARSE", delta_pb2.BOTH: "BOTH"}
# value_type -> numpy dtype of the value bytes (always little-endian on the wire).
VALUE_DTYPES = {delta_pb2.FP32: np.dtype("<f4"), delta_pb2.FP16: np.dtype("<f2")}
VALUE_TYPE_NAMES = {delta_pb2.FP32: "FP32", delta_pb2.FP16: "FP16"}
ID_DTYPE = np.dtype("<i8")
FILE_RECORD_LEN = struct.Struct("<I")  # fs sink: each chunk is prefixed by its length
DELTA_SUFFIX = ".delta"
DONE_SUFFIX = ".delta.done"


class BadChunk(ValueError):
    """A chunk that must not be applied (the reason is the message)."""


@dataclass
class Chunk:
    """What one decoded chunk contributes to its version.

    Attributes:
        msg: the parsed ``DeltaChunk`` (header fields; its ``payload`` is left as bytes).
        sparse: table id -> ``(ids int64 [n], values float32 [n, dim])``.
        dense: ``(variable id, full shape, flat offset, float32 values)`` per variable or slice.
        nbytes: serialized size of the chunk.
        where: Kafka offset (int) or file path (str) it came from.
        deleted: table id -> raw ids a dynamic table evicted (apply before ``sparse``).
        republish: the payload's ``RepublishMark``, or None.
    """

    msg: delta_pb2.DeltaChunk
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]
    dense: list[tuple[int, tuple[int, ...], int, np.ndarray]]
    nbytes: int
    where: int | str
    deleted: dict[int, np.ndarray] = field(default_factory=dict)
    republish: delta_pb2.RepublishMark | None = None


@dataclass
class Pending:
    """Chunks of one ``(generation, version)`` collected so far."""

    chunk_count: int
    chunks: dict[int, Chunk] = field(default_factory=dict)


def decode_chunk(data: bytes, where: int | str) -> Chunk:
    """Parses and checks one serialized ``DeltaChunk``.

    Args:
        data: the message value / file record.
        where: its Kafka offset or file path (for messages).

    Returns:
        The chunk with its arrays decoded to int64 ids and float32 values.

    Raises:
        BadChunk: the chunk is malformed; it must be skipped, never applied.
    """
    if not data:
        raise BadChunk("empty message")
    msg = delta_pb2.DeltaChunk()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise BadChunk(f"unparsable DeltaChunk: {exc}") from None
    if msg.format_version != FORMAT_VERSION:
        raise BadChunk(f"unknown format_version {msg.format_version}")
    if msg.chunk_count == 0 or msg.chunk_index >= msg.chunk_count:
        raise BadChunk(f"chunk_index {msg.chunk_index} of chunk_count {msg.chunk_count}")
    if msg.kind not in KIND_NAMES or msg.value_type not in VALUE_DTYPES:
        raise BadChunk(f"unknown kind {msg.kind} or value_type {msg.value_type}")
    # The checksum covers the exact payload bytes, so verify it before parsing them.
    if zlib.crc32(msg.payload) != msg.payload_crc32:
        raise BadChunk(f"crc32 mismatch in version {msg.version} chunk {msg.chunk_index}")
    payload = delta_pb2.DeltaPayload()
    try:
        payload.ParseFromString(msg.payload)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise BadChunk(f"unparsable DeltaPayload: {exc}") from None
    vdtype = VALUE_DTYPES[msg.value_type]

    sparse: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for rows in payload.sparse:
        if rows.dim == 0 or len(rows.ids) % ID_DTYPE.itemsize:
            raise BadChunk(f"table {rows.table_id}: dim {rows.dim}, {len(rows.ids)} id bytes")
        n = len(rows.ids) // ID_DTYPE.itemsize
        if len(rows.values) != n * rows.dim * vdtype.itemsize:
            raise BadChunk(f"table {rows.table_id}: {len(rows.values)} value bytes for {n} rows "
                           f"x dim {rows.dim}")
        ids = np.frombuffer(rows.ids, dtype=ID_DTYPE).astype(np.int64)
        values = np.frombuffer(rows.values, dtype=vdtype).astype(np.float32).reshape(n, rows.dim)
        if rows.table_id in sparse:  # a table may appear more than once: concatenate
            old_ids, old_values = sparse[rows.table_id]
            ids, values = np.concatenate([old_ids, ids]), np.concatenate([old_values, values])
        sparse[rows.table_id] = (ids, values)

    dense: list[tuple[int, tuple[int, ...], int, np.ndarray]] = []
    for var in payload.dense:
        shape = tuple(int(d) for d in var.shape)
        if len(var.values) % vdtype.itemsize:
            raise BadChunk(f"dense {var.id}: {len(var.values)} value bytes")
        values = np.frombuffer(var.values, dtype=vdtype).astype(np.float32)
        if var.offset + values.size > math.prod(shape):
            raise BadChunk(f"dense {var.id}: {values.size} values at offset {var.offset} "
                           f"exceed shape {shape}")
        dense.append((int(var.id), shape, int(var.offset), values))
    deleted: dict[int, np.ndarray] = {}
    for gone in payload.deleted:  # dynamic tables: raw ids to forget
        if len(gone.ids) % ID_DTYPE.itemsize:
            raise BadChunk(f"deleted ids of table {gone.table_id}: {len(gone.ids)} bytes")
        ids = np.frombuffer(gone.ids, dtype=ID_DTYPE).astype(np.int64)
        deleted[gone.table_id] = np.concatenate([deleted.get(gone.table_id, ids[:0]), ids])
    mark = payload.republish if payload.HasField("republish") else None
    if mark is not None and (mark.last_full_version > msg.version or mark.last_full_offset < -1):
        raise BadChunk(f"version {msg.version}: republish mark names version "
                       f"{mark.last_full_version} at offset {mark.last_full_offset}")
    return Chunk(msg, sparse, dense, len(data), where, deleted, mark)


def merge_version(chunks: list[Chunk]) -> dict:
    """Summarizes a complete version (chunks in index order) as one printable record.

    A serving engine would, at this point, forget the ``deleted`` ids of dynamic tables, then
    apply ``sparse`` (``table[ids] = values``; a dynamic table's ids are raw ids) and the
    dense variables (slices joined by ``offset``, reshaped to ``shape``) under one lock.

    Raises:
        BadChunk: the dense slices do not tile their variables exactly.
    """
    head = chunks[0].msg
    rows: dict[int, int] = {}
    deleted: dict[int, int] = {}
    covered: dict[int, tuple[int, int]] = {}  # variable id -> (elements seen, total)
    for c in chunks:
        for tid, ids in c.deleted.items():
            deleted[tid] = deleted.get(tid, 0) + len(ids)
        for tid, (ids, _values) in c.sparse.items():
            rows[tid] = rows.get(tid, 0) + len(ids)
        for vid, shape, _offset, values in c.dense:
            seen, total = covered.get(vid, (0, math.prod(shape)))
            covered[vid] = (seen + values.size, total)
    short = [vid for vid, (seen, total) in covered.items() if seen != total]
    if short:
        raise BadChunk(f"version {head.version}: dense slices do not cover variables {short}")
    if sum(rows.values()) != head.version_rows or len(covered) != head.version_variables:
        raise BadChunk(f"version {head.version}: {sum(rows.values())} rows / {len(covered)} "
                       f"variables, header says {head.version_rows} / {head.version_variables}")
    wheres = [c.where for c in chunks]
    out = {
        "version": head.version,
        "generation": head.generation,
        "model_name": head.model_name,
        "kind": KIND_NAMES[head.kind],
        "value_type": VALUE_TYPE_NAMES[head.value_type],
        "chunks": len(chunks),
        "bytes": sum(c.nbytes for c in chunks),
        "rows": {str(t): n for t, n in sorted(rows.items())},
        "deleted": {str(t): n for t, n in sorted(deleted.items())},
        "dense_vars": len(covered),
        "event_ms": [head.min_event_time_ms, head.max_event_time_ms],
        "produce_ms": [head.min_produce_time_ms, head.max_produce_time_ms],
        "publish_ms": head.publish_time_ms,
        "positions": [[p.topic, p.partition, p.next_offset] for p in head.positions],
    }
    mark = chunks[0].republish
    if mark is not None:
        out["full"] = bool(mark.full)
        if mark.last_full_version:
            out["follows_full"] = [mark.last_full_version, mark.last_full_offset]
    if isinstance(wheres[0], int):
        out["offsets"] = [min(wheres), max(wheres)]
    else:
        out["file"] = wheres[0]
    return out


class Assembler:
    """Groups chunks by ``(generation, version)``; a version is complete with all its chunks."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, int], Pending] = {}

    def add(self, chunk: Chunk) -> list[Chunk] | None:
        """Adds a chunk; returns the version's chunks in order once the last one arrived."""
        key = (chunk.msg.generation, chunk.msg.version)
        p = self.pending.get(key)
        if p is None or p.chunk_count != chunk.msg.chunk_count:
            p = self.pending[key] = Pending(chunk.msg.chunk_count)
        p.chunks.setdefault(chunk.msg.chunk_index, chunk)  # a duplicate chunk is ignored
        if len(p.chunks) < p.chunk_count:
            return None
        del self.pending[key]
        return [p.chunks[i] for i in range(p.chunk_count)]


# ----------------------------------------------------------------------------- sources


def read_topic(bootstrap: str, topic: str, from_offset: int, max_messages: int,
               follow: bool, extra: dict) -> Iterator[tuple[bytes, int]]:
    """Yields ``(value, offset)`` from partition 0 of the delta topic.

    Stops at the end of the topic (unless ``follow``) or after ``max_messages`` (0 = no limit).
    """
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    conf = {
        "bootstrap.servers": bootstrap,
        "group.id": f"odl-decode-deltas-{uuid.uuid4().hex[:8]}",  # never committed
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        # Chunks are up to 16 MiB and some brokers ignore fetch limits: accept any response.
        "receive.message.max.bytes": 2147483647,
    }
    conf.update(extra)
    consumer = Consumer(conf)
    # The delta topic has exactly one partition; assign it directly at the start offset.
    consumer.assign([TopicPartition(topic, 0, from_offset)])
    seen = 0
    try:
        while max_messages <= 0 or seen < max_messages:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if follow:
                        continue
                    return
                raise RuntimeError(f"kafka: {err.str()}")
            seen += 1
            yield msg.value() or b"", msg.offset()
    finally:
        consumer.close()


def read_dir(directory: str) -> Iterator[tuple[bytes, str]]:
    """Yields ``(chunk, path)`` for every complete version file of an fs ``incr_save_dir``.

    A version file ``<version:020d>-<generation>.delta`` counts only when its
    ``.delta.done`` marker exists; files are taken in name order (version order within a
    generation).
    """
    names = set(os.listdir(directory))
    for name in sorted(names):
        if not name.endswith(DELTA_SUFFIX) or name.startswith("."):
            continue
        if name[: -len(DELTA_SUFFIX)] + DONE_SUFFIX not in names:
            continue  # still being written (or the writer died before the marker)
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            if pos + FILE_RECORD_LEN.size > len(data):
                raise ValueError(f"{path}: truncated length prefix")
            (n,) = FILE_RECORD_LEN.unpack_from(data, pos)
            pos += FILE_RECORD_LEN.size
            if pos + n > len(data):
                raise ValueError(f"{path}: truncated chunk")
            yield data[pos : pos + n], path
            pos += n


# ----------------------------------------------------------------------------- output


def read_id_map_names(path: str) -> tuple[dict[int, str], dict[int, str]]:
    """``(table id -> name, dense variable id -> name)`` from a model_dir or export dir."""
    tables = {}
    with open(os.path.join(path, "embed_name_to_ids.txt"), encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 4:  # name, id, num_rows, dim
                tables[int(parts[1])] = parts[0]
    with open(os.path.join(path, "DENSE_UPDATE_VARIABLES"), encoding="utf-8") as f:
        dense = {int(info["id"]): name for name, info in json.load(f).items()}
    return tables, dense


def _range(pair: list[int]) -> str:
    return "-" if not any(pair) else f"{pair[0]}..{pair[1]}"


def format_line(v: dict, table_names: dict[int, str]) -> str:
    """The one-line text form of a version summary."""
    rows = ",".join(f"{table_names.get(int(t), t)}:{n}" for t, n in v["rows"].items())
    if v.get("deleted"):
        rows += " deleted " + ",".join(f"{table_names.get(int(t), t)}:{n}"
                                        for t, n in v["deleted"].items())
    positions = ",".join(f"{t}:{p}@{o}" for t, p, o in v["positions"]) or "-"
    where = (f"offsets={v['offsets'][0]}..{v['offsets'][1]}" if "offsets" in v
             else f"file={os.path.basename(v['file'])}")
    if v.get("full"):
        where += " full"
    if "follows_full" in v:
        where += f" follows_full={v['follows_full'][0]}@{v['follows_full'][1]}"
    return (f"version={v['version']} generation={v['generation']} kind={v['kind']} "
            f"value_type={v['value_type']} chunks={v['chunks']} bytes={v['bytes']} "
            f"rows={{{rows}}} dense_vars={v['dense_vars']} event_ms={_range(v['event_ms'])} "
            f"produce_ms={_range(v['produce_ms'])} publish_ms={v['publish_ms']} "
            f"positions={positions} {where}")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        description="Decode odl delta versions from a Kafka topic or an fs incr_save_dir and "
                    "print one line per complete version.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bootstrap", help="Kafka bootstrap servers (with --topic)")
    src.add_argument("--dir", help="an fs incr_save_dir (train_config.incr_save_config.fs)")
    p.add_argument("--topic", help="the delta topic (incr_save_config.kafka.topic)")
    p.add_argument("--from-offset", type=int, default=0,
                   help="first offset to read, e.g. an export's kafka.txt consumer.offset "
                        "(default 0)")
    p.add_argument("--max-messages", type=int, default=0,
                   help="stop after this many messages (default 0: read to the topic's end)")
    p.add_argument("--follow", action="store_true",
                   help="keep reading new messages after the end of the topic (Ctrl-C stops)")
    p.add_argument("--kafka-config", default="",
                   help='extra librdkafka settings as JSON, e.g. {"security.protocol": "SSL"}')
    p.add_argument("--id-maps", default="",
                   help="a model_dir or export dir: print table names instead of table ids")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bootstrap and not args.topic:
        parser.error("--bootstrap needs --topic")
    try:
        extra = json.loads(args.kafka_config) if args.kafka_config else {}
        table_names, _dense_names = (read_id_map_names(args.id_maps) if args.id_maps
                                     else ({}, {}))
    except (OSError, ValueError) as exc:
        print(f"decode_deltas: {exc}", file=sys.stderr)
        return 2
    if args.dir:
        if not os.path.isdir(args.dir):
            print(f"decode_deltas: {args.dir} is not a directory", file=sys.stderr)
            return 2
        source: Iterator[tuple[bytes, int | str]] = read_dir(args.dir)
    else:
        source = read_topic(args.bootstrap, args.topic, args.from_offset, args.max_messages,
                            args.follow, extra)

    assembler = Assembler()
    rejected = versions = 0
    t0 = time.monotonic()
    try:
        for data, where in source:
            try:
                complete = assembler.add(decode_chunk(data, where))
                if complete is None:
                    continue
                summary = merge_version(complete)
            except BadChunk as exc:
                rejected += 1
                print(f"rejected {where}: {exc}", file=sys.stderr)
                continue
            versions += 1
            print(json.dumps(summary) if args.json else format_line(summary, table_names),
                  flush=True)
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"decode_deltas: {exc}", file=sys.stderr)
        return 2
    for (generation, version), p in sorted(assembler.pending.items(), key=lambda kv: kv[0][1]):
        line = {"incomplete": version, "generation": generation,
                "chunks_seen": sorted(p.chunks), "chunk_count": p.chunk_count}
        print(json.dumps(line) if args.json else
              f"incomplete version={version} generation={generation} "
              f"chunks_seen={len(p.chunks)}/{p.chunk_count}")
    print(f"{versions} versions, {len(assembler.pending)} incomplete, {rejected} chunks "
          f"rejected in {time.monotonic() - t0:.2f}s", file=sys.stderr)
    return 1 if rejected or assembler.pending else 0


if __name__ == "__main__":
    sys.exit(main())
