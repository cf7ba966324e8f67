"""Outages: the broker stops for a while (trainer and serving wait, say so, resume by
themselves, nothing lost or trained twice), and the model dir cannot take a checkpoint.

The broker test uses its OWN embedded broker (never the session's): it is stopped with
SIGTERM (the noida broker saves its data) and started again on the same port and data dir.
``ODL_TEST_OUTAGE_SECS`` sets how long it stays down (default 20 s, as the issue asks).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from odl.broker.embedded_broker import EmbeddedBroker
from odl.checkpoint.checkpoint_manager import (
    list_checkpoints,
    read_checkpoint,
    verify_checkpoint,
)
from odl.config.pipeline_config import load_pipeline_config
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.http_client import http_request, post_json
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import create_topic, end_offsets
from odl.models.model_registry import check_pipeline_config
from odl.train.trainer import Trainer, TrainerOptions
from serving_plugin.serving_service import ServingService
from tests.harness import write_config

PARTS = 3
OUTAGE_SECS = float(os.environ.get("ODL_TEST_OUTAGE_SECS", "20"))


def _get(url: str) -> tuple[int, dict]:
    """GET: the status and the JSON answer (503 answers included)."""
    reply = http_request(url, timeout=10)
    return reply.status, reply.json()


def _wait(cond, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class _TrainerThread:
    """A Trainer running in a thread of this process, status API on a free port."""

    def __init__(self, cfg: str, ledger: str) -> None:
        config = load_pipeline_config(cfg)
        check_pipeline_config(config, online=True)
        self.trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=0,
                                                      sample_ledger=ledger))
        self.rc: list[int] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.url = _wait(self._url, 60, "the trainer's status API")

    def _run(self) -> None:
        try:
            self.rc.append(self.trainer.run())
        except BaseException as exc:
            self.error = exc
            raise

    def _url(self) -> str | None:
        try:
            with open(os.path.join(self.trainer.model_dir, "status.json")) as f:
                return json.load(f)["url"]
        except (OSError, ValueError, KeyError):
            return None

    def caught_up(self, ends: dict[int, int]) -> bool:
        """Trained up to ``ends``, every version acknowledged, no checkpoint being written."""
        t = self.trainer
        if not self.thread.is_alive():
            raise AssertionError(f"the trainer exited: {self.error!r}") from self.error
        pos = dict(t.positions)
        pub = t.publisher.status() if t.publisher is not None else None
        published = pub is None or (pub["last_version"] == t.module.global_step
                                    and not pub["republish_pending"])
        return (t.state == "training" and all(pos.get(p, 0) >= e for p, e in ends.items())
                and published and not t.checkpoint_writing)

    def abandon(self) -> None:
        """Stops a trainer a failed test leaves behind (no checks)."""
        self.trainer.request_stop("test: cleanup")
        self.thread.join(60)

    def stop(self) -> None:
        self.trainer.request_stop("test: done")
        self.thread.join(90)
        assert not self.thread.is_alive()
        assert self.rc == [0]


def _assert_serving_is_the_trainer(surl: str, trainer: Trainer, config, final: int) -> None:  # noqa: ANN001
    """Serving answers at the trainer's ``final`` version what the trainer predicts (1e-6)."""
    records = make_records(500, seed=99)[1]
    served = post_json(surl + "/predict", b"\n".join(records))
    assert served["version"] == final
    expected = trainer.module.predict(FeatureBuilder(config).build(records).batch)
    diff = float(np.abs(np.asarray(served["probabilities"]) - expected).max())
    assert diff <= 1e-6, diff


@pytest.mark.kafka  # starts a broker of its own
@pytest.mark.slow
def test_broker_outage_trainer_and_serving_wait_and_resume(tmp_path):
    broker = EmbeddedBroker(port=0, data_dir=tmp_path / "kafka").start()
    bootstrap = broker.bootstrap
    trainer = service = None
    try:
        create_topic(bootstrap, "samples", PARTS)
        ids, values = make_records(12000, seed=7)
        produce(bootstrap, "samples", values[:3000], PARTS)
        incr = (f'incr_save_config {{ sparse_save_steps: 3 dense_save_steps: 3 kafka {{ '
                f'server: "{bootstrap}" topic: "deltas" }} }}')
        cfg = write_config(tmp_path, bootstrap, "samples", batch_size=100, extra_train=incr,
                           save_checkpoints_steps=8)
        ledger = str(tmp_path / "ledger.tsv")
        trainer = _TrainerThread(cfg, ledger)
        t = trainer.trainer
        _wait(lambda: trainer.caught_up(end_offsets(bootstrap, "samples")), 90, "phase 1")

        # serving on an early checkpoint, replaying the delta topic
        config = load_pipeline_config(cfg)
        early = list_checkpoints(t.model_dir)[0]
        export_checkpoint(config, early, str(tmp_path / "export"))
        service = ServingService(str(tmp_path / "export"))
        surl = f"http://127.0.0.1:{service.start('127.0.0.1', 0)}"
        step = t.module.global_step
        _wait(lambda: _get(surl + "/status")[1]["version"] == step, 60, "serving to catch up")

        # more records, then the broker goes away while the trainer is still busy with them
        produce(bootstrap, "samples", values[3000:9000], PARTS)
        _wait(lambda: t.samples_trained >= 4000, 60, "training on phase 2")
        assert broker.stop() == 0
        down_at = time.monotonic()
        seen: dict[str, object] = {}

        def degraded() -> bool:
            code, st = _get(trainer.url + "/status")
            hcode, health = _get(trainer.url + "/healthz")
            scode, sst = _get(surl + "/status")
            shcode, shealth = _get(surl + "/healthz")
            seen.update(trainer_state=st["state"], trainer_health=hcode,
                        trainer_reason=health["reason"], serving_state=sst["state"],
                        serving_health=shcode, serving_reason=shealth["reason"],
                        publisher_error=st["publisher"]["broker_error"],
                        input_error=st["input"]["broker_error"])
            return (st["state"] == "waiting_for_broker" and hcode == 503
                    and "waiting_for_broker" in health["reason"]
                    and st["input"]["broker_error"] and sst["state"] == "waiting_for_broker"
                    and sst["broker_error"] and shcode == 503)

        _wait(degraded, max(5.0, OUTAGE_SECS - 5), "both to report waiting_for_broker")
        detected_after = time.monotonic() - down_at
        # serving keeps answering with the last applied version while the broker is away
        served = post_json(surl + "/predict", b"\n".join(values[:5]))
        assert len(served["probabilities"]) == 5
        time.sleep(max(0.0, OUTAGE_SECS - (time.monotonic() - down_at)))
        assert _get(trainer.url + "/healthz")[0] == 503
        assert _get(surl + "/healthz")[0] == 503

        broker.start()  # same port, same data dir: the noida broker reloads its data
        up_at = time.monotonic()
        last: dict[str, object] = {}

        def healthy() -> bool:
            last["trainer"] = _get(trainer.url + "/healthz")
            last["serving"] = _get(surl + "/healthz")
            return last["trainer"][0] == 200 and last["serving"][0] == 200

        try:
            _wait(healthy, 60, "both to be healthy again")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last}") from None
        healthy_after = time.monotonic() - up_at
        produce(bootstrap, "samples", values[9000:], PARTS)
        ends = end_offsets(bootstrap, "samples")
        assert sum(ends.values()) == len(values)  # nothing produced before the outage was lost
        _wait(lambda: trainer.caught_up(ends), 120, "the trainer to train everything")
        final = t.module.global_step
        _wait(lambda: _get(surl + "/status")[1]["version"] == final, 60,
              "serving to reach the final version")
        resumed_after = time.monotonic() - up_at
        pub = t.publisher.status()
        assert pub["failures"] >= 1 and pub["broker_error"] is None

        _assert_serving_is_the_trainer(surl, t, config, final)
        trainer.stop()
        trainer = None

        trained = ledger_sample_ids(ledger)
        assert len(trained) == len(ids) and sorted(trained) == sorted(ids)
        print(f"\noutage {OUTAGE_SECS:.0f}s: detected after {detected_after:.1f}s, healthy "
              f"{healthy_after:.1f}s after restart, serving at the final version "
              f"{resumed_after:.1f}s after restart; publisher failures {pub['failures']}, "
              f"producer restarts {pub['producer_restarts']}, merged {pub['versions_merged']}, "
              f"delta topic truncations {pub['delta_topic_truncations']}, serving offset "
              f"resets {service.replayer.offset_resets}; "
              f"seen {seen}")
    finally:
        if service is not None:
            service.stop()
        if trainer is not None:
            trainer.abandon()
        broker.stop()


def _empty_topic(bootstrap: str, topic: str) -> None:
    """Deletes ``topic`` and creates it again, empty: the broker lost every message of it."""
    from confluent_kafka.admin import AdminClient

    from odl.kafka.client_settings import admin_config
    from publisher.kafka_sink import DELTA_TOPIC_MAX_MESSAGE_BYTES

    admin = AdminClient(admin_config(bootstrap))
    admin.delete_topics([topic], operation_timeout=10)[topic].result(timeout=15)

    def created() -> bool:
        try:  # a real Kafka refuses the name while the deletion is in progress
            create_topic(bootstrap, topic, 1,
                         config={"max.message.bytes": str(DELTA_TOPIC_MAX_MESSAGE_BYTES)})
        except Exception:  # noqa: BLE001
            return False
        return end_offsets(bootstrap, topic) == {0: 0}

    _wait(created, 60, f"{topic} to be created again", interval=0.5)


@pytest.mark.kafka
@pytest.mark.slow
def test_serving_that_read_past_the_lost_versions_goes_back_to_the_full_republish(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """The delta topic loses its acknowledged versions while serving is not looking (here:
    its replay thread stopped; in production: parked or disconnected through a broker
    restart). The trainer notices at its next version and republishes every row, and by the
    time serving reads again the log has grown past serving's old position, so serving reads
    on from there and never sees the log end below it. The versions after the full republish
    name it: serving goes back to it and ends equal to the trainer. The topic is emptied by
    deleting and creating it again, the one loss a broker performs on request."""
    samples = kafka_topic_factory(partitions=PARTS)
    deltas = kafka_topic_factory(prefix="deltas", create=False)
    ids, values = make_records(4000, seed=21)
    produce(kafka_bootstrap, samples, values[:1000], PARTS)
    incr = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 kafka {{ '
            f'server: "{kafka_bootstrap}" topic: "{deltas}" }} }}')
    cfg = write_config(tmp_path, kafka_bootstrap, samples, batch_size=100, extra_train=incr,
                       save_checkpoints_steps=4)
    trainer = _TrainerThread(cfg, str(tmp_path / "ledger.tsv"))
    service = None
    try:
        t = trainer.trainer
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, samples)), 90, "phase 1")
        config = load_pipeline_config(cfg)
        export_checkpoint(config, list_checkpoints(t.model_dir)[0], str(tmp_path / "export"))
        service = ServingService(str(tmp_path / "export"))
        surl = f"http://127.0.0.1:{service.start('127.0.0.1', 0)}"
        step = t.module.global_step
        _wait(lambda: _get(surl + "/status")[1]["version"] == step, 60, "serving to catch up")
        replayer = service.replayer
        replayer.stop()
        position = replayer.next_offset
        assert position == end_offsets(kafka_bootstrap, deltas)[0]

        _empty_topic(kafka_bootstrap, deltas)
        produce(kafka_bootstrap, samples, values[1000:], PARTS)
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, samples)), 120, "phase 2")
        pub = t.publisher.status()
        assert pub["delta_topic_truncations"] == 1 and pub["last_full_version"] is not None
        assert end_offsets(kafka_bootstrap, deltas)[0] > position + 4  # refilled past it

        replayer.start()  # reads on from its old position: no out-of-range to notice
        final = t.module.global_step
        _wait(lambda: _get(surl + "/status")[1]["version"] == final, 60,
              "serving to reach the final version")
        status = _get(surl + "/status")[1]
        assert status["republish_rewinds"] == 1 and status["offset_resets"] == 0
        _assert_serving_is_the_trainer(surl, t, config, final)
        trainer.stop()
        trainer = None
    finally:
        if service is not None:
            service.stop()
        if trainer is not None:
            trainer.abandon()


# ---------------------------------------------------------------------- checkpoint failures


def _ckpt_steps(model_dir: str) -> list[int]:
    return [read_checkpoint(p).global_step for p in list_checkpoints(model_dir)]


def _due_checkpoints_written(trainer: _TrainerThread, every: int) -> bool:
    """The checkpoint of the last step due one (every ``every`` steps) is written: the save
    a step makes due may start just after the trainer reads as caught up."""
    t = trainer.trainer
    return (t.checkpoints.last_saved_step == t.module.global_step // every * every
            and not t.checkpoint_writing)


def _status(trainer: _TrainerThread) -> tuple[dict, int, dict]:
    st = _get(trainer.url + "/status")[1]
    code, health = _get(trainer.url + "/healthz")
    return st, code, health


def test_checkpoint_blocked_keeps_previous_and_retries(kafka_bootstrap, kafka_topic_factory,
                                                       tmp_path):
    """A regular file where the checkpoint's temporary dir must go: the save fails for real."""
    topic = kafka_topic_factory(partitions=PARTS)
    ids, values = make_records(3000, seed=8)
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=50, save_checkpoints_steps=5)
    model_dir = str(tmp_path / "model_dir")
    trainer = _TrainerThread(cfg, str(tmp_path / "ledger.tsv"))
    try:
        produce(kafka_bootstrap, topic, values[:500], PARTS)  # >= 10 steps: >= 2 checkpoints
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, topic)), 90, "phase 1")
        _wait(lambda: _due_checkpoints_written(trainer, 5), 30, "the due checkpoint")
        good = max(_ckpt_steps(model_dir))
        # every later checkpoint finds a file in the way of its temporary directory
        now = trainer.trainer.module.global_step
        blockers = [os.path.join(model_dir, f".model.ckpt-{s}.tmp-{os.getpid()}")
                    for s in range(now + 1, now + 400)]
        for path in blockers:
            open(path, "w").close()
        produce(kafka_bootstrap, topic, values[500:1500], PARTS)  # >= 20 steps
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, topic)), 90, "phase 2")
        st, code, health = _status(trainer)
        assert st["last_checkpoint"]["error"] and "step" in st["last_checkpoint"]["error"]
        assert st["last_checkpoint"]["step"] == good
        assert code == 503 and "checkpoint failing" in health["reason"]
        assert max(_ckpt_steps(model_dir)) == good
        assert verify_checkpoint(os.path.join(model_dir, f"model.ckpt-{good}")) is None
        assert trainer.trainer.metrics.checkpoint_failures._value.get() >= 3
        assert trainer.trainer.samples_trained == 1500  # training went on
        # the disk is fixed: the next due checkpoint succeeds
        for path in blockers:
            os.remove(path)
        produce(kafka_bootstrap, topic, values[1500:], PARTS)  # >= 30 steps
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, topic)), 90, "phase 3")
        _wait(lambda: _status(trainer)[1] == 200, 30, "healthz to recover")
        st = _status(trainer)[0]
        assert st["last_checkpoint"]["error"] is None and st["last_checkpoint"]["step"] > now
    finally:
        trainer.stop()
    assert sorted(ledger_sample_ids(str(tmp_path / "ledger.tsv"))) == sorted(ids)


def _can_mount_tmpfs(path: str) -> bool:
    os.makedirs(path, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", path],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_checkpoint_disk_full_keeps_previous_and_retries(kafka_bootstrap, kafka_topic_factory,
                                                         tmp_path):
    """model_dir on a 16 MiB tmpfs; a filler file takes the free space: ENOSPC for real."""
    mnt = str(tmp_path / "small_fs")
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    trainer = None
    try:
        topic = kafka_topic_factory(partitions=PARTS)
        ids, values = make_records(3000, seed=9)
        cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=50,
                           save_checkpoints_steps=5)
        text = open(cfg).read().replace(str(tmp_path / "model_dir"), os.path.join(mnt, "md"))
        text = text.replace("keep_checkpoint_max: 3", "keep_checkpoint_max: 1")
        open(cfg, "w").write(text)
        model_dir = os.path.join(mnt, "md")
        trainer = _TrainerThread(cfg, str(tmp_path / "ledger.tsv"))
        produce(kafka_bootstrap, topic, values[:500], PARTS)  # >= 10 steps: >= 2 checkpoints
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, topic)), 90, "phase 1")
        _wait(lambda: _due_checkpoints_written(trainer, 5), 30, "the due checkpoint")
        good = max(_ckpt_steps(model_dir))
        filler = os.path.join(mnt, "filler")
        # fill the disk until ENOSPC (so other small writes meanwhile cannot make the filler
        # fail), then leave ~64 KiB: far less than one checkpoint
        with open(filler, "wb", buffering=0) as f:
            chunk = b"\0" * (1 << 20)
            while True:
                try:
                    f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        os.truncate(filler, max(0, os.path.getsize(filler) - (64 << 10)))
        produce(kafka_bootstrap, topic, values[500:1500], PARTS)  # >= 20 steps
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, topic)), 90, "phase 2")
        st_doc, code, health = _status(trainer)
        err = st_doc["last_checkpoint"]["error"]
        assert err and "No space left on device" in err, err
        assert code == 503 and "checkpoint failing" in health["reason"]
        assert st_doc["last_checkpoint"]["step"] == good
        # the newest checkpoint is still the last good one, readable (through its chain when
        # it is an increment: retention keeps the links it needs, keep_checkpoint_max: 1)
        assert max(_ckpt_steps(model_dir)) == good
        assert all(verify_checkpoint(path) is None for path in list_checkpoints(model_dir))
        assert not [n for n in os.listdir(model_dir) if ".tmp-" in n]  # no half-written leftover
        assert trainer.trainer.samples_trained == 1500  # training went on
        os.remove(filler)
        produce(kafka_bootstrap, topic, values[1500:], PARTS)
        _wait(lambda: trainer.caught_up(end_offsets(kafka_bootstrap, topic)), 90, "phase 3")
        _wait(lambda: _status(trainer)[1] == 200, 30, "healthz to recover")
        assert max(_ckpt_steps(model_dir)) > good
        trainer.stop()
        trainer = None
        assert sorted(ledger_sample_ids(str(tmp_path / "ledger.tsv"))) == sorted(ids)
    finally:
        if trainer is not None:
            trainer.abandon()
        subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=10)
        shutil.rmtree(mnt, ignore_errors=True)


# ---------------------------------------------------------------------- slow delta sink


def test_slow_delta_sink_merges_versions_with_bounded_backlog(kafka_bootstrap, kafka_topic_factory,
                                                              tmp_path, monkeypatch):
    """The sink takes 0.25 s per version while a version is due every step: newest state wins."""
    import publisher.publisher_factory as ip
    from publisher.kafka_sink import KafkaSink

    class SlowKafkaSink(KafkaSink):
        def send(self, version, generation, chunks, timeout=30.0):  # noqa: ANN001, ANN201
            time.sleep(0.25)
            return super().send(version, generation, chunks, timeout)

    monkeypatch.setattr(ip, "KafkaSink", SlowKafkaSink)
    topic = kafka_topic_factory(partitions=PARTS)
    delta_topic = kafka_topic_factory(prefix="deltas", create=False)
    ids, values = make_records(6000, seed=10)
    incr = (f'incr_save_config {{ sparse_save_steps: 1 dense_save_steps: 1 kafka {{ '
            f'server: "{kafka_bootstrap}" topic: "{delta_topic}" }} }}')
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=100, extra_train=incr,
                       save_checkpoints_steps=20)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = _TrainerThread(cfg, ledger)
    t = trainer.trainer
    # the status API comes up before restore; the publisher is built right after it
    _wait(lambda: t.publisher is not None, 60, "the trainer to build its publisher")
    assert isinstance(t.publisher.sink, SlowKafkaSink)
    service = None
    try:
        produce(kafka_bootstrap, topic, values, PARTS)
        ends = end_offsets(kafka_bootstrap, topic)
        table_rows = sum(int(w.shape[0]) for w in t.module.embedding_tables().values())
        backlog_versions, backlog_rows = [], []

        def done() -> bool:
            st = t.publisher.status()
            backlog_versions.append(st["backlog_versions"])
            backlog_rows.append(st["backlog_rows"])
            return trainer.caught_up(ends)

        _wait(done, 120, "training and publishing to finish", interval=0.05)
        pub = t.publisher.status()
        steps = t.module.global_step
        assert max(backlog_versions) <= 1  # at most one snapshot waits, whatever the rate
        assert max(backlog_rows) <= table_rows  # a merged snapshot never exceeds the tables
        assert pub["versions_merged"] > 0
        assert pub["versions_published"] + pub["versions_merged"] >= steps
        assert pub["versions_published"] < steps
        assert pub["last_version"] == steps

        config = load_pipeline_config(cfg)
        export_checkpoint(config, list_checkpoints(t.model_dir)[0], str(tmp_path / "export"))
        service = ServingService(str(tmp_path / "export"))
        surl = f"http://127.0.0.1:{service.start('127.0.0.1', 0)}"
        _wait(lambda: _get(surl + "/status")[1]["version"] == steps, 60, "serving")
        records = make_records(500, seed=98)[1]
        served = post_json(surl + "/predict", b"\n".join(records))
        expected = t.module.predict(FeatureBuilder(config).build(records).batch)
        diff = float(np.abs(np.asarray(served["probabilities"]) - expected).max())
        assert diff <= 1e-6, diff
        print(f"\nslow sink: {steps} steps, {pub['versions_published']} versions published, "
              f"{pub['versions_merged']} merged, max backlog rows {max(backlog_rows)} of "
              f"{table_rows}, parity {diff:.2e}")
    finally:
        if service is not None:
            service.stop()
        trainer.stop()
    assert sorted(ledger_sample_ids(ledger)) == sorted(ids)


def test_checkpoint_save_reports_a_full_disk_as_its_oserror(tmp_path, monkeypatch):
    """torch.save reports a failed write only as "unexpected pos" of its archive writer (it
    drops the write's OSError); the checkpoint names the write's own error."""
    import errno
    import io

    import torch

    from odl.checkpoint import table_parts
    from odl.checkpoint.checkpoint_manager import CheckpointError, CheckpointManager

    mgr = CheckpointManager(str(tmp_path / "md"))
    first = mgr.save(1, {"w": torch.zeros(3)}, {0: 5}, {"source": "kafka"}, "cfg")

    class FullDisk(io.FileIO):
        written = 0

        def write(self, data):  # the disk fills after 100 bytes
            if FullDisk.written > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            FullDisk.written += memoryview(data).nbytes
            return super().write(data)

    monkeypatch.setattr(table_parts, "open", lambda p, mode: FullDisk(p, "w"), raising=False)
    with pytest.raises(CheckpointError, match="No space left on device"):
        mgr.save(2, {"w": torch.ones(10_000)}, {0: 9}, {"source": "kafka"}, "cfg")
    assert "OSError" in mgr.last_error
    assert list_checkpoints(str(tmp_path / "md")) == [first]
    assert verify_checkpoint(first) is None
    assert not [n for n in os.listdir(tmp_path / "md") if ".tmp-" in n]
