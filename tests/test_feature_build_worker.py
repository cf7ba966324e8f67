"""Feature building in worker processes: same results, same order, clear failures, no leaks."""

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.inputs.feature_build_worker import FeatureBuildError, FeatureBuildWorkers
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import odl_helper_processes

BAD = [b"", b"\xff\xfe garbage", b"1,2,3", b"not,enough"]


def _config(tmp_path, **kw):
    return parse_pipeline_config_text(deepfm_config_text(str(tmp_path / "m"), **kw))


def _batches(seed: int = 3) -> list[list[bytes]]:
    stream = SyntheticCtrStream(seed=seed)
    out = []
    for i, size in enumerate([50, 1, 300, 7, 128, 64, 200]):
        values = list(stream.next_batch(size).encode("csv"))
        if i % 2 == 0:  # some batches carry malformed records at known places
            values[len(values) // 2 : len(values) // 2] = BAD
        out.append(values)
    out.append(list(BAD))  # every record rejected
    return out


def test_workers_return_what_the_builder_builds_in_submission_order(tmp_path):
    config = _config(tmp_path)
    local = FeatureBuilder(config)
    batches = _batches()
    workers = FeatureBuildWorkers(config, num_workers=3).start()
    try:
        sender = threading.Thread(target=lambda: [workers.submit(v) for v in batches])
        sender.start()
        results = [workers.collect() for _ in batches]
        sender.join()
    finally:
        workers.close()
    for values, got in zip(batches, results, strict=True):
        want = local.build_arrays(values)
        assert got.rejected == want.rejected
        assert np.array_equal(got.accepted, want.accepted)
        if want.arrays is None:
            assert got.arrays is None
            continue
        for name in ("values", "lengths", "dense", "labels", "event_times"):
            a, b = getattr(got.arrays, name), getattr(want.arrays, name)
            assert (a is None and b is None) or np.array_equal(a, b), name
        assert got.arrays.sample_ids == want.arrays.sample_ids
        # and the arrays become the same model batch (writable arrays: no copy, no warning)
        batch, ref = local.to_batch(got.arrays), local.build(values).batch
        assert torch.equal(batch.sparse.values(), ref.sparse.values())
        assert torch.equal(batch.sparse.lengths(), ref.sparse.lengths())
        assert batch.sparse.keys() == ref.sparse.keys()
    assert any(r.rejected for r in results)
    assert not odl_helper_processes()


def test_a_worker_that_dies_is_reported_not_waited_for(tmp_path):
    config = _config(tmp_path)
    workers = FeatureBuildWorkers(config, num_workers=1).start()
    try:
        workers.submit(_batches()[0])
        assert workers.collect() is not None
        os.kill(workers.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(FeatureBuildError, match="exited"):
            workers.submit(_batches()[1])
            workers.collect()
        assert time.monotonic() - t0 < 5
    finally:
        workers.close()


def test_workers_ignore_sigterm_and_exit_when_closed(tmp_path):
    """systemd and Ctrl-C signal the whole group; the trainer, not the signal, ends workers."""
    workers = FeatureBuildWorkers(_config(tmp_path), num_workers=2).start()
    try:
        workers.submit(_batches()[0])
        workers.collect()
        for pid in workers.pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        for values in _batches()[1:3]:  # one batch to each worker: both still answer
            workers.submit(values)
        assert workers.collect() is not None
        assert workers.collect() is not None
    finally:
        workers.close()
    assert not odl_helper_processes()


def test_close_wakes_a_thread_blocked_sending_to_a_worker(tmp_path):
    workers = FeatureBuildWorkers(_config(tmp_path), num_workers=1).start()
    big = list(SyntheticCtrStream(seed=1).next_batch(5000).encode("csv"))
    outcome = {}

    def flood() -> None:  # never collects: the sockets fill up and send blocks
        try:
            for _ in range(50):
                workers.submit(big)
            outcome["result"] = "all sent"
        except FeatureBuildError as exc:
            outcome["result"] = str(exc)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    time.sleep(1.0)
    assert sender.is_alive()  # blocked on a full socket
    workers.close(timeout=2)
    sender.join(5)
    assert not sender.is_alive()
    assert "exited" in outcome["result"]
    assert not odl_helper_processes()


def _offline_run(tmp_path, name: str, num_workers: int, csv_path) -> Trainer:
    config = parse_pipeline_config_text(
        deepfm_config_text(str(tmp_path / name), batch_size=64, save_checkpoints_steps=0))
    config.train_input_path = str(csv_path)
    config.data_config.num_workers = num_workers
    trainer = Trainer(config, TrainerOptions(online=False, device="cpu", status_port=-1))
    assert trainer.run() == 0
    return trainer


def test_training_is_the_same_with_and_without_workers(tmp_path):
    values = list(SyntheticCtrStream(seed=8).next_batch(700).encode("csv"))
    values[100:100] = [b"1,2,3"]  # one malformed record
    csv_path = tmp_path / "train.csv"
    csv_path.write_bytes(b"\n".join(values) + b"\n")
    runs = {n: _offline_run(tmp_path, f"w{n}", n, csv_path) for n in (0, 1, 2)}
    states = {}
    for n, trainer in runs.items():
        assert trainer.stop_reason == "end of input"
        assert trainer.samples_trained == 700
        assert trainer.records_rejected == {"field_count": 1}
        states[n] = read_checkpoint(list_checkpoints(trainer.model_dir)[-1]).state["model"]
    for n in (1, 2):
        assert states[n].keys() == states[0].keys()
        for key, value in states[0].items():
            assert torch.equal(states[n][key], value), (n, key)
    assert not odl_helper_processes()


def test_num_workers_default_depends_on_device_and_cpus(monkeypatch):
    from odl.protos import pipeline_pb2
    from odl.train import torch_runtime as trainer_module

    dc = pipeline_pb2.DatasetConfig()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert trainer_module.effective_num_workers(dc, "cpu") == 0
    assert trainer_module.effective_num_workers(dc, "cuda") == 4
    dc.num_workers = 0  # set explicitly: honoured on CUDA too
    assert trainer_module.effective_num_workers(dc, "cuda") == 0
    dc.num_workers = 2
    assert trainer_module.effective_num_workers(dc, "cpu") == 2
    dc.ClearField("num_workers")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert trainer_module.effective_num_workers(dc, "cuda") == 0  # too few CPUs to spare
