"""``odl-train --online`` as two ranks under ``torchrun``: each reads its partitions, they
step in lock-step, checkpoint together, and every record is trained exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.features.feature_builder import FeatureBuilder
from odl.harness.exactly_once_audit import ledger_sample_ids, reflected_exactly_once
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from tests.harness import write_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stream(bootstrap: str, topic_factory, tmp_path, partitions: int, records: int,
            seed: int, batch_size: int, checkpoint_steps: int):
    """A topic of ``records`` test records over ``partitions`` and a config reading it:
    ``(sample ids, end offsets, config path)``."""
    topic = topic_factory(partitions=partitions)
    ids, values = make_records(records, seed=seed)
    produce(bootstrap, topic, values, partitions)
    cfg = write_config(tmp_path, bootstrap, topic, batch_size=batch_size,
                       save_checkpoints_steps=checkpoint_steps)
    return ids, end_offsets(bootstrap, topic), cfg


def _torchrun(cfg: str, ledger: str, log, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", *extra,
           "-m", "odl.cli.train_cli", "--pipeline_config_path", cfg, "--online",
           "--device", "cpu", "--status_port", "-1", "--sample_ledger", ledger,
           "--log_level", "WARNING"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait_until(cond, proc: subprocess.Popen, log_path, secs: float = 240) -> None:
    deadline = time.monotonic() + secs
    while not cond():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.3)


def _kill_tree(proc: subprocess.Popen) -> None:
    """torchrun and every process under it (ranks, their input processes), if still up."""
    if proc.poll() is not None:
        return
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait(30)


def _stop_ranks(proc: subprocess.Popen, log_path) -> None:
    """SIGTERM to the ranks themselves (torchrun's agent reports its own SIGTERM as a
    failure): the first to see it tells the other, both checkpoint and exit 0, and so does
    torchrun."""
    for rank in psutil.Process(proc.pid).children():
        rank.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, log_path.read_text()[-3000:]


def _entries(ledger: str) -> list[tuple[str, int, str]]:
    return read_ledger(ledger + ".rank0") + read_ledger(ledger + ".rank1")


def _trained(ledger: str, generation: str | None = None) -> set[str]:
    """Sample ids in the ranks' ledgers (of one generation, or all)."""
    return {sid for gen, _, sid in _entries(ledger) if generation in (None, gen)}


def test_two_ranks_under_torchrun_train_every_record_once(kafka_bootstrap, kafka_topic_factory,
                                                         tmp_path):
    ids, ends, cfg = _stream(kafka_bootstrap, kafka_topic_factory, tmp_path, partitions=3,
                             records=1500, seed=21, batch_size=64, checkpoint_steps=4)
    ledger = str(tmp_path / "ledger.tsv")
    model_dir = str(tmp_path / "model_dir")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = _torchrun(cfg, ledger, log)
        try:
            _wait_until(lambda: _trained(ledger) >= set(ids), proc, log_path)
            _stop_ranks(proc, log_path)  # the final checkpoint covers every record
        finally:
            _kill_tree(proc)
    trained = ledger_sample_ids(ledger + ".rank0") + ledger_sample_ids(ledger + ".rank1")
    assert sorted(trained) == sorted(ids)  # every record once, over both ranks
    assert ledger_sample_ids(ledger + ".rank0") and ledger_sample_ids(ledger + ".rank1")
    ckpt = read_checkpoint(list_checkpoints(model_dir)[-1])
    assert ckpt.positions == ends
    # the checkpoint, written by rank 0 from both ranks' rows, restores into one process
    config = load_pipeline_config(cfg)
    one = TrainModule(config, FeatureBuilder(config), device="cpu")
    one.load_checkpoint_state(ckpt.state)
    assert one.global_step == ckpt.global_step > 0


def test_kill_9_of_one_rank_restarts_both_from_the_checkpoint(kafka_bootstrap,
                                                              kafka_topic_factory, tmp_path):
    """SIGKILL of rank 1 mid-stream: torchrun restarts both ranks, they restore the last
    checkpoint (rank 0 wrote it with both ranks' positions and rows) and read on from its
    positions. Over the two generations every record is reflected in a checkpoint exactly
    once: what the killed generation trained after its last checkpoint is trained again."""
    ids, ends, cfg = _stream(kafka_bootstrap, kafka_topic_factory, tmp_path, partitions=2,
                             records=3000, seed=22, batch_size=32, checkpoint_steps=5)
    text = open(cfg).read().replace("keep_checkpoint_max: 3", "keep_checkpoint_max: 0")
    open(cfg, "w").write(text)
    ledger = str(tmp_path / "ledger.tsv")
    model_dir = str(tmp_path / "model_dir")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = _torchrun(cfg, ledger, log, "--max-restarts", "1")
        try:
            def mid_stream() -> bool:
                ckpts = list_checkpoints(model_dir)
                return bool(ckpts) and read_checkpoint(ckpts[-1]).global_step >= 10
            _wait_until(mid_stream, proc, log_path)
            ranks = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
            ranks[-1].kill()  # SIGKILL, no goodbye
            killed = read_checkpoint(list_checkpoints(model_dir)[-1]).manifest["generation"]

            def caught_up() -> bool:  # the new generation trained what the checkpoint lacks
                entries = _entries(ledger)
                last = max(read_checkpoint(c).global_step for c in list_checkpoints(model_dir)
                           if read_checkpoint(c).manifest["generation"] == killed)
                kept = {sid for gen, step, sid in entries if gen == killed and step <= last}
                new = {sid for gen, _, sid in entries if gen != killed}
                return bool(new) and kept | new >= set(ids)
            _wait_until(caught_up, proc, log_path)
            _stop_ranks(proc, log_path)
        finally:
            _kill_tree(proc)
    last_complete: dict[str, int] = {}
    for path in list_checkpoints(model_dir):
        c = read_checkpoint(path)
        gen = c.manifest["generation"]
        last_complete[gen] = max(last_complete.get(gen, -1), c.global_step)
    assert len(last_complete) == 2  # the killed job's and the restarted one's
    lost, twice = reflected_exactly_once(ids, _entries(ledger), last_complete)
    assert lost == [] and twice == []
    assert read_checkpoint(list_checkpoints(model_dir)[-1]).positions == ends
