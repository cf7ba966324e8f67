"""odl-serve: parity with the trainer, /predict, and delta replay from a real topic."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint
from odl.config.config_redaction import config_to_text
from odl.export.exporter import export_checkpoint
from odl.harness.http_client import http_request
from odl.harness.topic_records import produce
from odl.train.train_module import TrainModule
from publisher.delta_encoder import encode_version
from publisher.delta_format import VersionHeader
from publisher.delta_recovery import read_published_state
from publisher.id_maps import read_id_maps
from serving_plugin.serving_model import ServingModel
from serving_plugin.serving_service import ServingService
from tests.harness import apply_to_module, train_checkpoint

N_PARITY = 1000
TOL = 1e-6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_checkpoint(str(tmp_path_factory.mktemp("serve")))


@pytest.fixture(scope="module")
def exotic(tmp_path_factory):
    return train_checkpoint(str(tmp_path_factory.mktemp("exotic")), kind="exotic")


def _reference(tc) -> TrainModule:
    """A fresh TrainModule holding the checkpoint (safe to modify)."""
    tm = TrainModule(tc.config, tc.feature_builder, device="cpu")
    tm.load_checkpoint_state(read_checkpoint(tc.path).state)
    return tm


def _export(tc, root, topic="", server="", offset=None) -> str:
    ckpt = tc.path
    if offset is not None:  # a copy of the checkpoint that records a delta-topic offset
        st = read_checkpoint(tc.path)
        ckpt = CheckpointManager(os.path.join(str(root), f"md-{offset}")).save(
            st.global_step, st.state, st.positions,
            {"source": "kafka", "topic": "samples", "delta_topic_offset": offset},
            config_to_text(tc.config), generation="gen0")
    return export_checkpoint(tc.config, ckpt, os.path.join(str(root), "exports"),
                             delta_server=server, delta_topic=topic).path


def _predict(port: int, body: bytes, ctype: str = "text/plain") -> tuple[int, dict]:
    """POST /predict: the status and the JSON answer (error answers included)."""
    reply = http_request(f"http://127.0.0.1:{port}/predict", body, {"Content-Type": ctype})
    return reply.status, reply.json()


def _random_version(maps, rng, version: int, generation: str,
                    rows: int = 40, event_ms: int = 0):
    """Full-value updates for two tables (a deep and a wide one) and every dense variable."""
    names = sorted(maps.tables)
    picked = [n for n in names if not n.endswith("_wide")][:1] + \
             [n for n in names if n.endswith("_wide")][:1]
    sparse = {}
    for name in picked:
        info = maps.tables[name]
        ids = rng.choice(info.num_rows, size=min(rows, info.num_rows), replace=False)
        vals = rng.normal(0, 0.3, size=(ids.size, info.dim)).astype(np.float32)
        sparse[info.id] = (ids.astype(np.int64), vals)
    dense = {info.id: rng.normal(0, 0.1, size=info.shape).astype(np.float32)
             for info in maps.dense.values()}
    header = VersionHeader(model_name="m", version=version, generation=generation, kind="both",
                           min_event_time_ms=event_ms, max_event_time_ms=event_ms)
    return header, dense, sparse


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("kind", ["trained", "exotic"])
def test_serving_matches_trainer_predict(kind, request, tmp_path):
    tc = request.getfixturevalue(kind)
    model = ServingModel.load(os.path.dirname(_export(tc, tmp_path)))
    values = tc.records(N_PARITY, 7)
    batch = tc.feature_builder.build(values).batch
    assert batch.size == N_PARITY
    want = tc.module.predict(batch)
    got, rejected = model.predict_values(values)
    assert rejected == []
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL


# ----------------------------------------------------------------------------- HTTP


def test_http_predict_and_errors(trained, tmp_path, kafka_topic_factory, kafka_bootstrap):
    topic = kafka_topic_factory()
    svc = ServingService(os.path.dirname(_export(trained, tmp_path, topic, kafka_bootstrap)))
    port = svc.start()
    try:
        values = trained.records(N_PARITY, 11)
        want = trained.module.predict(trained.feature_builder.build(values).batch)
        code, out = _predict(port, b"\n".join(values))
        assert code == 200, out
        assert np.abs(np.asarray(out["probabilities"]) - want).max() <= TOL
        assert out["version"] == trained.module.global_step
        assert out["generation"] == "gen0"

        js = [json.loads(v) for v in trained.records(3, 11, "json")]
        code, out = _predict(port, json.dumps(js).encode(), "application/json")
        assert code == 200 and np.abs(np.asarray(out["probabilities"]) - want[:3]).max() <= TOL
        code, out = _predict(port, json.dumps({"records": js}).encode(), "application/json")
        assert code == 200 and len(out["probabilities"]) == 3
        no_label = dict(js[0])
        del no_label["label"]
        code, out = _predict(port, json.dumps(no_label).encode(), "application/json")
        assert code == 200 and abs(out["probabilities"][0] - want[0]) <= TOL
        csv_no_label = values[0].decode().split(",")
        del csv_no_label[2]  # the label column
        code, out = _predict(port, ",".join(csv_no_label).encode())
        assert code == 200 and abs(out["probabilities"][0] - want[0]) <= TOL

        for body in (b"", b"   \n", b"[1, 2]", b"[", b"{not json", b"a,b,c", b"\xff\xfe,1",
                     values[0] + b"\n" + b"x,y", json.dumps({"event_time": {}}).encode()):
            code, out = _predict(port, body)
            assert 400 <= code < 500, (body, code, out)
            assert out["detail"]["error"]
        code, out = _predict(port, values[0] + b"\nx,y")
        assert out["detail"]["rejected"] == [{"index": 1, "reason": "field_count"}]

        health = http_request(f"http://127.0.0.1:{port}/healthz")
        assert health.status == 200 and health.json()["ok"] is True
        status = http_request(f"http://127.0.0.1:{port}/status")
        st = status.json()
        assert status.status == 200
        assert st["version"] == trained.module.global_step and st["versions_applied"] == 0
        assert st["base_export"] == svc.model.path and st["delta_topic"] == topic
        assert st["rejected_messages"] == 0
        metrics = http_request(f"http://127.0.0.1:{port}/metrics")
        assert metrics.status == 200 and b"odl_serving_predict_requests" in metrics.body
    finally:
        svc.stop()


# ----------------------------------------------------------------------------- replay


def test_replay_all_or_nothing(trained, tmp_path, kafka_topic_factory, kafka_bootstrap):
    topic = kafka_topic_factory()
    export = _export(trained, tmp_path, topic, kafka_bootstrap)
    maps = read_id_maps(export)
    ref = _reference(trained)
    rng = np.random.default_rng(0)
    values = trained.records(N_PARITY, 12)
    batch = trained.feature_builder.build(values).batch
    svc = ServingService(os.path.dirname(export))
    svc.start()
    try:
        base = svc.model.predict_batch(batch)
        header, dense, sparse = _random_version(maps, rng, 100, "genA", rows=60,
                                                event_ms=1_700_000_000_000)
        chunks = encode_version(header, dense, sparse, max_chunk_bytes=1024)
        assert len(chunks) > 5
        offs = produce(kafka_bootstrap, topic, chunks[:-1])
        assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
        assert svc.model.state.version == trained.module.global_step  # nothing applied
        np.testing.assert_array_equal(svc.model.predict_batch(batch), base)
        offs = produce(kafka_bootstrap, topic, chunks[-1:])
        assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
        st = svc.model.state
        assert (st.version, st.generation, st.versions_applied) == (100, "genA", 1)
        assert st.rows_applied == sum(len(i) for i, _ in sparse.values())
        apply_to_module(ref, maps, dense, sparse)
        assert np.abs(svc.model.predict_batch(batch) - ref.predict(batch)).max() <= TOL
        status = svc.status()
        assert status["lag_messages"] in (0, None) and status["freshness_seconds"] > 0
    finally:
        svc.stop()


def test_corrupt_and_unknown_versions_rejected(trained, tmp_path, kafka_topic_factory,
                                               kafka_bootstrap):
    topic = kafka_topic_factory()
    export = _export(trained, tmp_path, topic, kafka_bootstrap)
    maps = read_id_maps(export)
    rng = np.random.default_rng(1)
    values = trained.records(200, 13)
    batch = trained.feature_builder.build(values).batch
    svc = ServingService(os.path.dirname(export))
    svc.start()
    try:
        good = encode_version(*_random_version(maps, rng, 50, "g"))
        offs = produce(kafka_bootstrap, topic, good)
        assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
        assert svc.model.state.version == 50
        serving_50 = svc.model.predict_batch(batch)

        h, dense, sparse = _random_version(maps, rng, 51, "g")
        corrupt = bytearray(encode_version(h, dense, sparse)[0])
        corrupt[len(corrupt) // 2] ^= 0xFF  # inside the payload: checksum failure
        unknown_table = encode_version(h, dense, {999: next(iter(sparse.values()))})
        name0 = sorted(maps.dense)[0]
        bad_shape = encode_version(h, {maps.dense[name0].id: np.zeros(3, np.float32)}, sparse)
        rng_big = maps.tables[sorted(maps.tables)[0]]
        out_of_range = encode_version(h, {}, {rng_big.id: (
            np.array([rng_big.num_rows], np.int64), np.zeros((1, rng_big.dim), np.float32))})
        bad = [b"", b"garbage", bytes(corrupt), *unknown_table, *bad_shape, *out_of_range]
        offs = produce(kafka_bootstrap, topic, bad)
        assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
        assert svc.model.state.version == 50
        assert svc.replayer.rejected == {"empty": 1, "unparsable": 1, "crc_mismatch": 1,
                                         "unknown_table_id": 1, "shape": 1, "row_range": 1}
        np.testing.assert_array_equal(svc.model.predict_batch(batch), serving_50)
        assert svc.status()["rejected_messages"] == 6

        offs = produce(kafka_bootstrap, topic, encode_version(h, dense, sparse))
        assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
        assert svc.model.state.version == 51
    finally:
        svc.stop()


def test_generation_change_offset_and_restart(trained, tmp_path, kafka_topic_factory,
                                              kafka_bootstrap):
    topic = kafka_topic_factory()
    rng = np.random.default_rng(2)
    probe = _export(trained, tmp_path / "probe", topic, kafka_bootstrap)
    maps = read_id_maps(probe)
    ref = _reference(trained)
    early = _random_version(maps, rng, 5, "old")  # before the base: must be skipped
    produce(kafka_bootstrap, topic, encode_version(*early))
    export = _export(trained, tmp_path, topic, kafka_bootstrap, offset=1)
    v_a = _random_version(maps, rng, 30, "genA")
    v_b = _random_version(maps, rng, 3, "genB", rows=25)  # trainer restart
    offs = produce(kafka_bootstrap, topic, encode_version(*v_a) +
                   encode_version(*v_b, max_chunk_bytes=2048))
    for _, dense, sparse in (v_a, v_b):
        apply_to_module(ref, maps, dense, sparse)
    values = trained.records(N_PARITY, 14)
    batch = trained.feature_builder.build(values).batch
    want = ref.predict(batch)
    results = []
    for _ in range(2):  # the second run is a restart: base again, replay again
        svc = ServingService(os.path.dirname(export))
        svc.start()
        try:
            assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
            st = svc.model.state
            assert (st.version, st.generation, st.versions_applied) == (3, "genB", 2)
            results.append(svc.model.predict_batch(batch))
        finally:
            svc.stop()
    np.testing.assert_array_equal(results[0], results[1])
    assert np.abs(results[0] - want).max() <= TOL


def test_grouped_lookup_matches_per_feature_embedding_bag():
    """One embedding_bag per group == per-feature sum / mean pooling (empty bags included)."""
    from serving_plugin.pooled_lookups import LookupGroup

    gen = torch.Generator().manual_seed(0)
    storage = torch.randn(70, 4, generator=gen)
    tables = {"a": storage[0:30], "b": storage[30:70]}
    lookups = [(2, "b", "mean"), (0, "a", "sum"), (1, "b", "sum")]  # keys out of KJT order
    b = 5
    lengths = torch.tensor([[1, 0, 3, 2, 1], [2, 2, 0, 1, 4], [0, 3, 1, 1, 2]])
    counts = lengths.sum(dim=1)
    starts = torch.cumsum(counts, 0) - counts
    hi = [30, 40, 40]
    values = torch.cat([torch.randint(0, hi[k], (int(counts[k]),), generator=gen)
                        for k in range(3)])
    group = LookupGroup.build(lookups, tables, 4)
    got = group.pooled(values, lengths, counts, starts, b)
    want = []
    for k, t, mode in lookups:
        seg = values[int(starts[k]) : int(starts[k] + counts[k])]
        offs = torch.cumsum(lengths[k], 0) - lengths[k]
        want.append(torch.nn.functional.embedding_bag(seg, tables[t], offs, mode=mode))
    torch.testing.assert_close(got, torch.cat(want, dim=1), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_serve_cli(trained, tmp_path, capsys):
    """odl-serve: exit 2 without an export or with a bad disk tier option; serves (with a
    disk tier directory), answers, and stops cleanly on SIGTERM."""
    import signal
    import subprocess
    import sys

    from odl.cli import serve_cli

    assert serve_cli.main(["--export_dir", str(tmp_path / "none"), "--port", "0"]) == 2
    export_root = os.path.dirname(_export(trained, tmp_path))
    tier = str(tmp_path / "tier")
    assert serve_cli.main(["--export_dir", export_root, "--disk_tier_dir", tier,
                           "--ram_rows", "0"]) == 2
    assert "--ram_rows must be > 0" in capsys.readouterr().err
    proc = subprocess.Popen(
        [sys.executable, "-m", "odl.cli.serve_cli", "--export_dir", export_root, "--port", "0",
         "--disk_tier_dir", tier, "--ram_rows", "4"],
        stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            if "ready on http://127.0.0.1:" in line:
                port = int(line.split("127.0.0.1:")[1].split()[0])
                break
        assert port, "odl-serve did not start"
        code, out = _predict(port, trained.records(1, 3)[0])
        assert code == 200 and len(out["probabilities"]) == 1
        assert os.path.isfile(os.path.join(tier, "ODL_SERVING_DISK_TIER"))  # owned while served
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_idle_replayer_applies_new_versions_promptly(trained, tmp_path, kafka_topic_factory,
                                                     kafka_bootstrap):
    """Caught up, the replayer parks (partition paused, watching the log end); versions
    published after idle spells still apply, in order, well within a second or two."""
    topic = kafka_topic_factory()
    rng = np.random.default_rng(5)
    export = _export(trained, tmp_path, topic, kafka_bootstrap, offset=0)
    maps = read_id_maps(export)
    svc = ServingService(os.path.dirname(export))
    svc.start()
    try:
        for i, idle in enumerate((0.5, 1.5, 0.05)):
            time.sleep(idle)  # caught up: parked
            version = _random_version(maps, rng, 10 + i, "gen")
            offs = produce(kafka_bootstrap, topic, encode_version(*version))
            t0 = time.monotonic()  # acknowledged by the broker (a new producer may take 1 s)
            assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 10)
            waited = time.monotonic() - t0
            assert svc.model.state.version == 10 + i
            # two 10 ms intervals plus produce and apply; a replayer left asleep by the
            # pause (librdkafka's idle broker thread) would take a second or more
            assert waited < 0.9, f"version {10 + i} applied {waited:.2f}s after its ack"
    finally:
        svc.stop()


def test_superseded_generation_is_fenced_in_serving_and_recovery(
        trained, tmp_path, kafka_topic_factory, kafka_bootstrap):
    """Two trainers on one topic: from the newer one's first chunk on, the older is ignored."""
    topic = kafka_topic_factory()
    rng = np.random.default_rng(5)
    export = _export(trained, tmp_path, topic, kafka_bootstrap, offset=0)
    maps = read_id_maps(export)
    a1 = _random_version(maps, rng, 10, "genA")
    b1 = _random_version(maps, rng, 8, "genB")  # a second trainer starts publishing
    a2 = _random_version(maps, rng, 11, "genA", rows=25)  # the first goes on: superseded
    b2 = _random_version(maps, rng, 9, "genB", rows=25)
    a2_chunks = encode_version(*a2, max_chunk_bytes=2048)
    offs = produce(kafka_bootstrap, topic, encode_version(*a1) + encode_version(*b1)
                   + a2_chunks + encode_version(*b2))
    ref = _reference(trained)
    for _, dense, sparse in (a1, b1, b2):
        apply_to_module(ref, maps, dense, sparse)
    batch = trained.feature_builder.build(trained.records(N_PARITY, 15)).batch
    want = ref.predict(batch)
    svc = ServingService(os.path.dirname(export))
    svc.start()
    try:
        assert svc.replayer.wait_for_offset(offs[-1].offset + 1, 30)
        st = svc.model.state
        assert (st.version, st.generation, st.versions_applied) == (9, "genB", 3)
        assert dict(svc.replayer.rejected) == {"fenced_generation": len(a2_chunks)}
        status = svc.status()
        assert status["owner_generation"] == "genB"
        assert status["superseded_generations"] == ["gen0", "genA"]
        assert status["rejected_by_reason"] == {"fenced_generation": len(a2_chunks)}
        got = svc.model.predict_batch(batch)
    finally:
        svc.stop()
    assert np.abs(got - want).max() <= TOL
    # crash recovery (the trainer replaying its own topic) follows the same rule
    state = read_published_state(kafka_bootstrap, topic, 0, owner="gen0")
    assert state.rejected["fenced_generation"] == len(a2_chunks)
    assert state.generations == ["genA", "genB"] and state.version == 9
    for tid, (ids, vals) in state.sparse.items():
        name = maps.table_names()[tid]
        table = ref.embedding_tables()[name]
        np.testing.assert_array_equal(vals, table[torch.from_numpy(ids), : vals.shape[1]].numpy())
