"""A serving started on an old export catches up without looking like a broker outage.

The first fetch of a replayer far behind the topic end carries a large backlog: on the
embedded broker, which ignores fetch size limits, the whole backlog in one response; on any
broker, up to ``max.partition.fetch.bytes`` over whatever link there is. While that response
is in transit, every other request on the same connection waits behind it. Here the backlog
reaches serving through a proxy that delivers the broker's responses at a few MB/s, so the
first fetch takes seconds, as a backlog of hundreds of MB does on the embedded broker.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint
from odl.config.config_redaction import config_to_text
from odl.export.exporter import export_checkpoint
from odl.harness.topic_records import produce
from publisher.delta_encoder import encode_version
from publisher.delta_format import VersionHeader
from publisher.id_maps import read_id_maps
from serving_plugin.serving_service import ServingService
from tests.harness import train_checkpoint

VERSIONS = 200
ROWS_PER_TABLE = 200
PROXY_BYTES_PER_SEC = 3_000_000


class SlowLinkProxy:
    """A TCP proxy in front of one Kafka broker that delivers its responses slowly.

    Each client connection gets its own connection to the broker. Responses (size-prefixed
    Kafka frames) are forwarded at ``bytes_per_sec`` per connection, with the broker's own
    address in them (metadata, coordinator lookups) replaced by the proxy's, so the client
    keeps talking through the proxy. Requests pass unchanged.

    Args:
        broker_port: the broker's port on 127.0.0.1.
        bytes_per_sec: delivery rate of responses, per connection.
    """

    def __init__(self, broker_port: int, bytes_per_sec: int) -> None:
        self.broker_port = broker_port
        self.rate = bytes_per_sec
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._old = b"127.0.0.1" + struct.pack(">i", broker_port)
        self._new = b"127.0.0.1" + struct.pack(">i", self.port)
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def bootstrap(self) -> str:
        """The ``host:port`` clients connect to."""
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.broker_port))
            self._socks += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _requests(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def _responses(self, src: socket.socket, dst: socket.socket) -> None:
        def read(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                part = src.recv(min(n - len(buf), 1 << 20))
                if not part:
                    raise OSError("closed")
                buf += part
            return bytes(buf)

        try:
            while True:
                frame = read(4)
                frame += read(struct.unpack(">i", frame)[0]).replace(self._old, self._new)
                for i in range(0, len(frame), 1 << 16):
                    piece = frame[i : i + (1 << 16)]
                    dst.sendall(piece)
                    if len(frame) > 1 << 16:  # small responses pass at once
                        time.sleep(len(piece) / self.rate)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def close(self) -> None:
        """Stops accepting and closes every connection."""
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def slow_link(kafka_bootstrap: str):
    host, _, port = kafka_bootstrap.rpartition(":")
    if host != "127.0.0.1" or "," in kafka_bootstrap:
        pytest.skip("the proxy stands in front of one broker advertised as 127.0.0.1")
    proxy = SlowLinkProxy(int(port), PROXY_BYTES_PER_SEC)
    yield proxy
    proxy.close()


def _versions(export: str, n: int) -> tuple[list[bytes], int]:
    """``n`` versions touching ``ROWS_PER_TABLE`` rows of every table, plus the dense part."""
    maps = read_id_maps(export)
    rng = np.random.default_rng(3)
    chunks: list[bytes] = []
    rows = 0
    for v in range(n):
        sparse = {}
        for info in maps.tables.values():
            ids = rng.choice(info.num_rows, size=min(ROWS_PER_TABLE, info.num_rows),
                             replace=False).astype(np.int64)
            sparse[info.id] = (ids, rng.normal(0, 0.1, (ids.size, info.dim)).astype(np.float32))
            rows += ids.size
        dense = {d.id: rng.normal(0, 0.1, d.shape).astype(np.float32)
                 for d in maps.dense.values()}
        header = VersionHeader(model_name="m", version=100 + v, generation="gen0", kind="both")
        chunks += encode_version(header, dense, sparse)
    return chunks, rows


@pytest.mark.slow
def test_serving_far_behind_catches_up_without_reporting_a_broker_outage(
        tmp_path, kafka_bootstrap, kafka_topic_factory, slow_link):
    """A backlog whose first fetch takes seconds: replay starts applying once it arrives,
    `/status` shows the lag meanwhile and never `waiting_for_broker`."""
    topic = kafka_topic_factory()
    tc = train_checkpoint(str(tmp_path))
    st = read_checkpoint(tc.path)
    ckpt = CheckpointManager(os.path.join(str(tmp_path), "md0")).save(
        st.global_step, st.state, st.positions,
        {"source": "kafka", "topic": "samples", "delta_topic_offset": 0},
        config_to_text(tc.config), generation="gen0")
    export = export_checkpoint(tc.config, ckpt, os.path.join(str(tmp_path), "exports"),
                               delta_server=slow_link.bootstrap, delta_topic=topic).path
    chunks, rows = _versions(export, VERSIONS)
    backlog = sum(len(c) for c in chunks)
    assert 6e6 < backlog < 20e6, backlog  # a few seconds through the proxy
    end = produce(kafka_bootstrap, topic, chunks)[-1].offset + 1

    svc = ServingService(os.path.dirname(export))
    t0 = time.monotonic()
    svc.start()
    states: set[str] = set()
    errors: set[str] = set()
    lag_seen_before_first_version = False
    first_version = None
    try:
        while svc.model.state.versions_applied < VERSIONS:
            status = svc.status()
            states.add(status["state"])
            if status["broker_error"]:
                errors.add(status["broker_error"])
            if status["versions_applied"] == 0 and status["end_offset"] == end:
                lag_seen_before_first_version = True
            if first_version is None and status["versions_applied"] > 0:
                first_version = time.monotonic() - t0
            assert time.monotonic() - t0 < 60, f"catch-up stalled: {status}"
            time.sleep(0.02)
        status = svc.status()
    finally:
        svc.stop()
    took = time.monotonic() - t0
    assert svc.model.state.rows_applied == rows
    assert status["lag_messages"] == 0 and status["rejected_messages"] == 0
    # the first fetch alone takes backlog / rate through the proxy
    assert first_version is not None and first_version >= 0.8 * backlog / PROXY_BYTES_PER_SEC
    assert first_version < 30, f"first version after {first_version:.1f}s ({took:.1f}s in all)"
    assert states == {"serving"}, (states, errors)
    assert not errors
    assert lag_seen_before_first_version  # /status knew how far behind it was
