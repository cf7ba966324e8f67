"""A loopback test double of Alibaba Cloud DataHub for the real ``pydatahub`` SDK.

``DatahubDouble`` serves DataHub's REST API, JSON protocol and, for reading records, the
protobuf protocol (``enable_pb=True``: ``DHUB`` frames with crc32c), request and response
bodies LZ4-compressed when the client asks (``pydatahub``'s default), from memory on
127.0.0.1:

* ``GET /projects/P/topics/T`` (record type, TUPLE schema), ``GET .../shards`` (state,
  parents, hash ranges);
* ``POST .../shards/S`` ``{"Action": "cursor"}``: OLDEST, LATEST, SEQUENCE, SYSTEM_TIME; a
  sequence below the shard's oldest (expired) or past its end is ``SeekOutOfRange``;
* ``POST .../shards/S`` ``{"Action": "sub"}``: up to ``Limit`` records from the cursor with
  ``NextCursor``, ``Sequence``, ``SystemTime``; at the end of an ACTIVE shard an empty read;
  at the end of a CLOSED shard ``InvalidShardOperation`` (the SDK's
  ``ShardSealedException``); a cursor of expired records is ``InvalidCursor``;
* ``POST .../shards`` ``{"Action": "pub"}`` (put records, hashed to ACTIVE shards round-robin).

Errors are DataHub's JSON error documents (``ErrorCode``, ``ErrorMessage``) with
``x-datahub-request-id``. Tests set the data up directly: ``create_topic`` (BLOB, or TUPLE
with fields), ``append(project, topic, shard, records)``, ``split_shard`` (the parent is
CLOSED, two ACTIVE children), ``merge_shards`` and ``expire(project, topic, shard,
below_sequence)`` (retention).

Faults (thread-safe): ``fail_next`` (a status and error code, e.g. 500 InternalServerError),
``throttle_next`` (429 LimitExceeded), ``delay_next``, ``drop_next`` (close the connection with
no answer) and ``set_down`` (503 for everything until lifted).

Clients must pass ``user_agent=`` to ``datahub.DataHub``: without it the SDK opens a UDP
socket towards 8.8.8.8 to find its own address for the default user agent.

What the double does not prove: writing in the protobuf protocol and the batch protocol
(odl only reads; tests load data directly or through JSON); request signatures and
credentials (any are accepted); real limits (request sizes, QPS), latency, retention
timing, shard split/merge timing and hash ranges; subscriptions and connectors (odl uses neither).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Optional

from datahub.models.compress import get_compressor
from datahub.proto.datahub_record_proto_pb import (
    FieldData,
    GetRecordsRequest,
    GetRecordsResponse,
    RecordData,
    RecordEntry,
)
from datahub.utils.codec import pb_message_wrap, unwrap_pb_frame

from odl.harness.loopback_server import LoopbackServer

logger = logging.getLogger(__name__)


@dataclass
class _Shard:
    shard_id: str
    state: str = "ACTIVE"
    parents: list[str] = field(default_factory=list)
    # (sequence, system_time_ms, data, JSON of the record as GetRecords returns it)
    records: list[tuple[int, int, Any, str]] = field(default_factory=list)
    next_seq: int = 0
    oldest: int = 0
    closed_time: int = 0


@dataclass
class _Topic:
    record_type: str  # "BLOB" | "TUPLE"
    fields: list[tuple[str, str]]
    shards: dict[str, _Shard]
    created: int
    rr: int = 0


def _cursor(seq: int) -> str:
    return f"{seq:032x}"


def _record(seq: int, ts: int, data: Any, blob: bool) -> tuple[int, int, Any, str]:
    """A stored record with its GetRecords JSON, encoded once at append time."""
    enc = (base64.b64encode(data).decode() if blob
           else [None if v is None else str(v) for v in data])
    return seq, ts, data, json.dumps({"Data": enc, "Sequence": seq, "SystemTime": ts})


class DatahubDouble(LoopbackServer):
    """In-memory DataHub on loopback (see the module docstring).

    Args:
        port: port to bind (0: a free one).
    """

    def __init__(self, port: int = 0) -> None:
        super().__init__(_Handler, port)
        self._lock = threading.Lock()
        self._topics: dict[tuple[str, str], _Topic] = {}
        self._faults: list[dict[str, Any]] = []
        self._down = False
        self.request_count = 0
        self.requests_log: list[tuple[str, str, int]] = []

    # ---------------------------------------------------------------- data set-up
    def create_topic(self, project: str, topic: str, shards: int = 1,
                     fields: Optional[list[tuple[str, str]]] = None) -> None:
        """A BLOB topic, or a TUPLE topic when ``fields`` (name, type) are given."""
        with self._lock:
            self._topics[(project, topic)] = _Topic(
                "TUPLE" if fields else "BLOB", list(fields or []),
                {str(i): _Shard(str(i)) for i in range(shards)}, int(time.time() * 1000))

    def append(self, project: str, topic: str, shard: str, records: list[Any],
               system_time_ms: Optional[int] = None) -> list[int]:
        """Appends records (bytes for BLOB, lists of values for TUPLE); returns sequences."""
        with self._lock:
            s = self._topics[(project, topic)].shards[str(shard)]
            if s.state != "ACTIVE":
                raise ValueError(f"shard {shard} is {s.state}")
            now = int(time.time() * 1000) if system_time_ms is None else system_time_ms
            seqs = []
            blob = self._topics[(project, topic)].record_type == "BLOB"
            for r in records:
                s.records.append(_record(s.next_seq, now, r, blob))
                seqs.append(s.next_seq)
                s.next_seq += 1
            return seqs

    def split_shard(self, project: str, topic: str, shard: str) -> tuple[str, str]:
        """Closes ``shard``; two new ACTIVE shards have it as parent. Returns their ids."""
        with self._lock:
            t = self._topics[(project, topic)]
            parent = t.shards[str(shard)]
            parent.state, parent.closed_time = "CLOSED", int(time.time())
            base = max(int(k) for k in t.shards) + 1
            kids = (str(base), str(base + 1))
            for k in kids:
                t.shards[k] = _Shard(k, parents=[parent.shard_id])
            return kids

    def merge_shards(self, project: str, topic: str, a: str, b: str) -> str:
        """Closes ``a`` and ``b``; one new ACTIVE shard has both as parents. Returns its id."""
        with self._lock:
            t = self._topics[(project, topic)]
            for k in (a, b):
                t.shards[str(k)].state = "CLOSED"
                t.shards[str(k)].closed_time = int(time.time())
            kid = str(max(int(k) for k in t.shards) + 1)
            t.shards[kid] = _Shard(kid, parents=[str(a), str(b)])
            return kid

    def expire(self, project: str, topic: str, shard: str, below_sequence: int) -> None:
        """Drops a shard's records below a sequence (retention)."""
        with self._lock:
            s = self._topics[(project, topic)].shards[str(shard)]
            s.records = [r for r in s.records if r[0] >= below_sequence]
            s.oldest = max(s.oldest, below_sequence)

    # ---------------------------------------------------------------- faults
    def _add(self, kind: str, n: int, **kw: Any) -> None:
        with self._lock:
            self._faults = [f for f in self._faults if f["kind"] != kind or n > 0]
            if n > 0:
                self._faults.append({"kind": kind, "left": n, **kw})

    def fail_next(self, n: int, status: int = 500, code: str = "InternalServerError") -> None:
        """The next ``n`` requests get this error (``n=0`` clears)."""
        self._add("fail", n, status=status, code=code)

    def throttle_next(self, n: int) -> None:
        """The next ``n`` requests get 429 LimitExceeded."""
        self._add("fail", n, status=429, code="LimitExceeded")

    def delay_next(self, n: int, seconds: float) -> None:
        """The next ``n`` requests are answered ``seconds`` late (``n=0`` clears)."""
        self._add("delay", n, seconds=seconds)

    def drop_next(self, n: int) -> None:
        """The next ``n`` requests are read and the connection closed without an answer."""
        self._add("drop", n)

    def set_down(self, down: bool) -> None:
        """While down every request gets 503 ServiceUnavailable."""
        with self._lock:
            self._down = down

    def _take_faults(self) -> list[dict[str, Any]]:
        with self._lock:
            if self._down:
                return [{"kind": "fail", "status": 503, "code": "ServiceUnavailable"}]
            hit = []
            for f in list(self._faults):
                if f["kind"] not in {h["kind"] for h in hit}:
                    f["left"] -= 1
                    if f["left"] <= 0:
                        self._faults.remove(f)
                    hit.append(f)
            return hit


_PROTOBUF = "application/x-protobuf"


class _Raw(str):
    """A response body already encoded as JSON."""


class _ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Handler(BaseHTTPRequestHandler):
    owner: DatahubDouble
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug("datahub double: " + fmt, *args)

    def _reply(self, status: int, doc: Any) -> None:
        content_type = "application/json"
        if isinstance(doc, bytes):
            body, content_type = doc, _PROTOBUF
        else:
            body = (doc if isinstance(doc, _Raw) else json.dumps(doc)).encode()
        headers = {"Content-Type": content_type,
                   "x-datahub-request-id": uuid.uuid4().hex[:20]}
        wanted = self.headers.get("Accept-Encoding", "")
        comp = get_compressor(wanted) if wanted in ("lz4", "deflate", "zlib") else None
        if comp is not None and len(body) > 64:
            packed = comp.compress(body)
            if len(packed) < len(body):
                headers["Content-Encoding"] = wanted
                headers["x-datahub-content-raw-size"] = str(len(body))
                body = packed
        self._status = status
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _read_json(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        enc = self.headers.get("Content-Encoding", "")
        if enc:
            raw = get_compressor(enc).decompress(
                raw, int(self.headers.get("x-datahub-content-raw-size", "-1")))
        if self.headers.get("Content-Type", "").startswith(_PROTOBUF):
            # the protobuf protocol: a "DHUB" frame (crc32c, length) around the message
            action = self.headers.get("x-datahub-request-action", "")
            if action != "sub":
                raise _ApiError(400, "InvalidParameter", f"protobuf {action!r} is not "
                                                         "implemented by the double")
            crc, computed, pb = unwrap_pb_frame(raw)
            if crc != computed:
                raise _ApiError(400, "InvalidParameter", "protobuf frame crc mismatch")
            req = GetRecordsRequest()
            req.ParseFromString(pb)
            return {"Action": "sub", "Cursor": req.cursor, "Limit": req.limit, "_pb": True}
        return json.loads(raw) if raw else {}

    def _handle(self) -> None:
        o = self.owner
        self._status = 0
        with o._lock:
            o.request_count += 1
        try:
            body = self._read_json() if self.command in ("POST", "PUT") else {}
            faults = o._take_faults()
            for f in faults:
                if f["kind"] == "delay":
                    time.sleep(f["seconds"])
            if any(f["kind"] == "drop" for f in faults):
                self.close_connection = True
                self.connection.close()
                self._status = -1
                return
            fail = next((f for f in faults if f["kind"] == "fail"), None)
            if fail is not None:
                raise _ApiError(fail["status"], fail["code"], "injected by the test double")
            self._reply(200, self._route(body))
        except _ApiError as e:
            self._reply(e.status, {"ErrorCode": e.code, "ErrorMessage": e.message})
        finally:
            with o._lock:
                o.requests_log.append((self.command, self.path, self._status))

    do_GET = do_POST = do_PUT = do_DELETE = _handle  # noqa: N815

    # ---------------------------------------------------------------- API
    def _topic(self, project: str, topic: str) -> _Topic:
        t = self.owner._topics.get((project, topic))
        if t is None:
            raise _ApiError(404, "NoSuchTopic", f"The specified topic {topic} does not exist.")
        return t

    def _route(self, body: dict) -> Any:
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        if len(parts) < 4 or parts[0] != "projects" or parts[2] != "topics":
            raise _ApiError(400, "InvalidUriSpec", f"unsupported path {self.path}")
        project, topic = parts[1], parts[3]
        with self.owner._lock:
            t = self._topic(project, topic)
            if len(parts) == 4 and self.command == "GET":
                doc = {"ShardCount": len(t.shards), "Lifecycle": 7, "RecordType": t.record_type,
                       "Comment": "", "CreateTime": t.created // 1000,
                       "LastModifyTime": t.created // 1000}
                if t.fields:
                    doc["RecordSchema"] = json.dumps({"fields": [
                        {"name": n, "type": ty} for n, ty in t.fields]})
                return doc
            if len(parts) == 5 and self.command == "GET":
                return {"Protocol": "http1.1", "Interval": 500, "Shards": [
                    {"ShardId": s.shard_id, "State": s.state, "BeginHashKey": "0" * 32,
                     "EndHashKey": "f" * 32, "ClosedTime": s.closed_time,
                     "ParentShardIds": s.parents, "LeftShardId": "", "RightShardId": ""}
                    for s in t.shards.values()]}
            if len(parts) == 5 and body.get("Action") == "pub":
                return self._put(t, body)
            if len(parts) == 6 and self.command == "POST":
                shard = t.shards.get(parts[5])
                if shard is None:
                    raise _ApiError(404, "NoSuchShard", f"shard {parts[5]} does not exist")
                if body.get("Action") == "cursor":
                    return self._cursor(shard, body)
                if body.get("Action") == "sub":
                    if body.get("_pb"):
                        return self._get_pb(t, shard, body)
                    return self._get(t, shard, body)
        raise _ApiError(400, "InvalidParameter", f"unsupported request {self.command} "
                                                 f"{self.path} {body.get('Action')}")

    @staticmethod
    def _cursor(s: _Shard, body: dict) -> dict:
        kind = body.get("Type")
        if kind == "OLDEST":
            seq = s.oldest
        elif kind == "LATEST":
            seq = max(s.oldest, s.next_seq - 1)
        elif kind == "SEQUENCE":
            seq = int(body["Sequence"])
            if seq < s.oldest or seq > s.next_seq:
                raise _ApiError(400, "SeekOutOfRange", f"sequence {seq} is out of range "
                                f"[{s.oldest}, {s.next_seq}]")
        elif kind == "SYSTEM_TIME":
            t = int(body["SystemTime"])
            seq = next((r[0] for r in s.records if r[1] >= t), s.next_seq)
        else:
            raise _ApiError(400, "InvalidParameter", f"cursor type {kind}")
        i = seq - s.oldest
        rec = s.records[i] if 0 <= i < len(s.records) else None
        return {"Cursor": _cursor(seq), "RecordTime": rec[1] if rec else -1, "Sequence": seq}

    def _get(self, t: _Topic, s: _Shard, body: dict) -> Any:
        seq, out = self._check_read(s, body)
        nxt = out[-1][0] + 1 if out else seq
        head = json.dumps({"NextCursor": _cursor(nxt), "RecordCount": len(out), "StartSeq": seq})
        return _Raw(head[:-1] + ', "Records": [' + ",".join(r[3] for r in out) + "]}")

    @staticmethod
    def _check_read(s: _Shard, body: dict) -> tuple[int, list]:
        seq = int(body["Cursor"], 16)
        limit = max(1, min(int(body.get("Limit", 10)), 1000))
        if seq < s.oldest:
            raise _ApiError(400, "InvalidCursor", "The cursor is expired")
        if seq >= s.next_seq and s.state == "CLOSED":
            raise _ApiError(400, "InvalidShardOperation", "The specified shard is sealed")
        start = seq - s.oldest
        return seq, s.records[start:start + limit]

    def _get_pb(self, t: _Topic, s: _Shard, body: dict) -> bytes:
        seq, out = self._check_read(s, body)
        resp = GetRecordsResponse()
        resp.next_cursor = _cursor(out[-1][0] + 1 if out else seq)
        resp.record_count = len(out)
        resp.start_sequence = seq
        for rseq, ts, data, _json in out:
            entry = RecordEntry()
            entry.sequence, entry.system_time = rseq, ts
            entry.data = RecordData()
            values = [data] if t.record_type == "BLOB" else [
                None if v is None else str(v).encode() for v in data]
            for v in values:
                fd = FieldData()
                if v is not None:
                    fd.value = v
                entry.data.data.append(fd)
            resp.records.append(entry)
        return pb_message_wrap(resp.SerializeToString())

    @staticmethod
    def _put(t: _Topic, body: dict) -> dict:
        active = [s for s in t.shards.values() if s.state == "ACTIVE"]
        now = int(time.time() * 1000)
        for rec in body.get("Records", []):
            s = next((x for x in active if x.shard_id == rec.get("ShardId")), None)
            if s is None:
                s = active[t.rr % len(active)]
                t.rr += 1
            data = rec["Data"]
            blob = t.record_type == "BLOB"
            value = base64.b64decode(data) if blob else list(data)
            s.records.append(_record(s.next_seq, now, value, blob))
            s.next_seq += 1
        return {"FailedRecordCount": 0, "FailedRecords": []}
