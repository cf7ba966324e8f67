"""Two ranks on files: offline files and PaddleRec-style file streams under ``torchrun`` /
``odl-train --nproc 2``: the ranks step together through batches, splits and passes, write
day and pass saves that replay to serving, survive a SIGKILL of one rank, and train what one
process with twice the batch trains. (The Kafka and DataHub streams under ``torchrun`` are in
``test_distributed_online.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.features.feature_builder import FeatureBuilder
from odl.harness.exactly_once_audit import ledger_sample_ids, reflected_exactly_once
from odl.harness.topic_records import make_records
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from tests.harness import REPO, write_config
from tests.test_distributed_online import _entries, _kill_tree, _torchrun


@pytest.mark.slow
def test_two_ranks_train_offline_files_as_one_process_with_twice_the_batch(tmp_path):
    """Offline files (``train_input_path``, no ``--online``) under torchrun: rank r takes
    every other batch of the files' records, the ranks step together until both are done
    and exit 0; each record is trained once, and the final checkpoint equals that of one
    process with a batch twice as large (the same records at each step)."""
    ids, values = make_records(1000, seed=41)
    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):  # two files: the batches run across the file boundary
        (data / f"part-{k}.csv").write_bytes(b"\n".join(values[k * 500:(k + 1) * 500]) + b"\n")
    runs = {}
    for name, batch, launch in (("one", 128, ()), ("two", 64, ("-m", "torch.distributed.run",
                                                                "--standalone",
                                                                "--nproc_per_node", "2"))):
        # (the plain step: in-batch learning's ranks are test_distributed_training's)
        cfg = write_config(tmp_path, "127.0.0.1:9", "unused", name=f"{name}.config",
                           batch_size=batch, save_checkpoints_steps=4,
                           extra_train="in_batch_learning: false")
        text = open(cfg).read().replace(str(tmp_path / "model_dir"), str(tmp_path / name))
        with open(cfg, "w") as f:
            f.write(text)
        ledger = str(tmp_path / f"{name}.ledger")
        if not launch:  # one process: odl-train's Trainer in this process
            from odl.train.trainer import Trainer, TrainerOptions

            config = load_pipeline_config(cfg)
            config.train_input_path = str(data / "*.csv")  # odl-train's --train_input_path
            assert Trainer(config, TrainerOptions(online=False, device="cpu", status_port=-1,
                                                  sample_ledger=ledger)).run() == 0
        else:
            cmd = [sys.executable, *launch, "-m", "odl.cli.train_cli", "--pipeline_config_path",
                   cfg, "--train_input_path", str(data / "*.csv"), "--device", "cpu",
                   "--status_port", "-1", "--sample_ledger", ledger, "--log_level", "WARNING"]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=300)
            assert done.returncode == 0, done.stderr.decode()[-3000:]
        runs[name] = (read_checkpoint(list_checkpoints(str(tmp_path / name))[-1]), ledger)
    one, one_ledger = runs["one"]
    two, two_ledger = runs["two"]
    assert sorted(ledger_sample_ids(one_ledger)) == sorted(ids)
    rank0, rank1 = (ledger_sample_ids(two_ledger + f".rank{r}") for r in (0, 1))
    assert sorted(rank0 + rank1) == sorted(ids) and len(rank0) == 512  # 8 of the 16 batches
    assert one.global_step == two.global_step == 8
    assert set(one.state["model"]) == set(two.state["model"])
    for name, t in one.state["model"].items():
        np.testing.assert_allclose(two.state["model"][name].numpy(), t.numpy(), atol=3e-5,
                                   rtol=0, err_msg=name)


@pytest.mark.slow
def test_two_ranks_train_a_file_stream_as_one_process_and_resume_in_one(tmp_path):
    """A PaddleRec-style file stream (``file_stream_input``) under ``odl-train --nproc 2``:
    the ranks read the same groups of two batches, each training its own, and step through
    the splits and passes together (short last batches of a split included). The first day
    on two ranks, then the second day on one process resuming from the ranks' checkpoint:
    every record trained once, and the final checkpoint that of one process with twice the
    batch over both days (the same records at each step)."""
    from tests.test_file_stream import _config as stream_config
    from tests.test_file_stream import _write_two_days

    data = tmp_path / "data"
    ids, _values = _write_two_days(data)

    def run(name: str, model_dir: str, batch: int, end_day: str, *launch: str) -> None:
        text = stream_config(tmp_path, str(data), end_day).replace(
            str(tmp_path / "model_dir"), model_dir).replace("batch_size: 50",
                                                            f"batch_size: {batch}")
        if not launch:  # one process: odl-train's Trainer in this process
            from odl.config.pipeline_config import parse_pipeline_config_text
            from odl.train.trainer import Trainer, TrainerOptions

            trainer = Trainer(parse_pipeline_config_text(text), TrainerOptions(
                online=True, device="cpu", status_port=-1,
                sample_ledger=str(tmp_path / f"{name}.ledger")))
            assert trainer.run() == 0
            return
        cfg = tmp_path / f"{name}.config"
        cfg.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", str(cfg),
             "--online", "--device", "cpu", "--status_port", "-1", "--sample_ledger",
             str(tmp_path / f"{name}.ledger"), "--log_level", "WARNING", *launch],
            cwd=REPO, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()[-3000:]

    one_dir, mixed_dir = str(tmp_path / "one"), str(tmp_path / "mixed")
    run("one", one_dir, 100, "20261125")
    run("ranks", mixed_dir, 50, "20261124", "--nproc", "2")
    day1 = read_checkpoint(list_checkpoints(mixed_dir)[-1])
    rank0, rank1 = (ledger_sample_ids(str(tmp_path / f"ranks.ledger.rank{r}")) for r in (0, 1))
    assert rank0 and rank1 and not set(rank0) & set(rank1)
    assert len(rank0 + rank1) == 400  # the first day's two splits
    run("resumed", mixed_dir, 100, "20261125")
    resumed = ledger_sample_ids(str(tmp_path / "resumed.ledger"))
    assert sorted(rank0 + rank1 + resumed) == sorted(ids)  # every record once
    assert sorted(ledger_sample_ids(str(tmp_path / "one.ledger"))) == sorted(ids)
    one = read_checkpoint(list_checkpoints(one_dir)[-1])
    mixed = read_checkpoint(list_checkpoints(mixed_dir)[-1])
    assert one.global_step == mixed.global_step > day1.global_step > 0
    assert one.positions == mixed.positions
    for name, t in one.state["model"].items():  # to the ranks' summation order
        np.testing.assert_allclose(mixed.state["model"][name].numpy(), t.numpy(), atol=2e-4,
                                   rtol=0, err_msg=name)


def _slow_reader_rank(rank: int, world: int, text: str, slow_rank: int,
                      loses: int = 0, offline_files: str = "") -> dict:
    """One rank of a file-stream job (``offline_files``: an offline job on those files)
    whose rank ``slow_rank`` hands out each batch only at the second ask (a slow reader)
    and, with ``loses``, never hands out its ``loses``-th batch (its reading went another
    way); returns what it trained and, on rank 0, the model."""
    import odl.train.trainer as trainer_module

    leave = trainer_module.leave_process_group
    trainer_module.leave_process_group = lambda: None  # the harness leaves the group itself
    try:
        return _slow_reader_run(rank, text, slow_rank, loses, offline_files)
    finally:  # (a RankPool rank runs other tasks after this one)
        trainer_module.leave_process_group = leave


def _slow_reader_run(rank: int, text: str, slow_rank: int, loses: int,
                     offline_files: str = "") -> dict:
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.train.trainer import Trainer, TrainerOptions

    class SlowReader(Trainer):
        def _open_input(self, restored_positions):
            super()._open_input(restored_positions)
            pipeline = self.input_pipeline
            if rank != slow_rank:
                return
            real_get, asks = pipeline.get, [0]

            def get(timeout: float):
                asks[0] += 1
                if asks[0] % 2:
                    return None
                item = real_get(timeout)
                if item is not None and asks[0] == 2 * loses:
                    item = real_get(60.0)  # this batch is lost: the next one instead
                return item

            pipeline.get = get

    config = parse_pipeline_config_text(text)
    if offline_files:
        config.train_input_path = offline_files  # odl-train's --train_input_path
    trainer = SlowReader(config, TrainerOptions(online=not offline_files, device="cpu",
                                                status_port=-1))
    code = trainer.run()
    if loses:
        return {"code": code, "failure": trainer.failure, "samples": trainer.samples_trained,
                "step": trainer.module.global_step}
    assert code == 0
    shown = trainer.status()["passes"]
    passes = [(p["day"], p["pass"], p["samples"]) for p in shown["passes"]] if shown else []
    state = trainer.module.state_dict_for_checkpoint()
    return {"samples": trainer.samples_trained, "passes": passes,
            "positions": dict(trainer.positions), "step": trainer.module.global_step,
            "model": {k: v.numpy() for k, v in state.get("model", {}).items()}}


@pytest.mark.slow
def test_file_stream_ranks_wait_for_a_slow_reader_and_end_passes_together(ranks, tmp_path):
    """Two ranks on a file stream, one of them a slow reader: the fast rank holds its batch
    of each group until the slow one has its own, so both train every group at the same
    step and close every pass together; the model is that of one process with twice the
    batch, and each pass's samples add up to that process's."""
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.train.trainer import Trainer, TrainerOptions
    from tests.test_file_stream import _config as stream_config
    from tests.test_file_stream import _write_two_days

    data = tmp_path / "data"
    ids, _values = _write_two_days(data)
    text = stream_config(tmp_path, str(data), "20261125")
    one_text = text.replace("batch_size: 50", "batch_size: 100").replace(
        str(tmp_path / "model_dir"), str(tmp_path / "one_dir"))
    one = Trainer(parse_pipeline_config_text(one_text),
                  TrainerOptions(online=True, device="cpu", status_port=-1))
    assert one.run() == 0
    got = ranks.run(_slow_reader_rank, 2, text, 1)
    assert got[0]["samples"] + got[1]["samples"] == one.samples_trained == len(ids)
    assert got[0]["step"] == got[1]["step"] == one.module.global_step
    assert got[0]["positions"] == got[1]["positions"] == one.positions
    want = [(p["day"], p["pass"], p["samples"]) for p in one.status()["passes"]["passes"]]
    assert [(d, p) for d, p, _n in got[0]["passes"]] == [(d, p) for d, p, _n in want]
    assert [a[2] + b[2] for a, b in zip(got[0]["passes"], got[1]["passes"], strict=True)] == [
        n for _d, _p, n in want]
    for name, t in one.module.state_dict_for_checkpoint()["model"].items():
        np.testing.assert_allclose(got[0]["model"][name], t.numpy(), atol=2e-4, rtol=0,
                                   err_msg=name)


def test_offline_ranks_wait_for_a_slow_reader_and_train_as_one_process(ranks, tmp_path):
    """Offline files on two ranks, rank 1 a slow reader, 15 batches: the fast rank holds each
    batch until the slow one has its own, so every step trains the records one process with
    twice the batch trains at that step, and the last step is rank 0's alone (rank 1 has no
    batch left) instead of a wait without end."""
    from odl.train.trainer import Trainer, TrainerOptions

    _ids, values = make_records(900, seed=43)
    data = tmp_path / "data.csv"
    data.write_bytes(b"\n".join(values) + b"\n")
    cfg = write_config(tmp_path, "127.0.0.1:9", "unused", name="two.config", batch_size=64,
                       save_checkpoints_steps=0, extra_train="in_batch_learning: false")
    text = open(cfg).read()
    config = load_pipeline_config(cfg)
    config.data_config.batch_size = 128
    config.model_dir = str(tmp_path / "one_dir")
    config.train_input_path = str(data)
    one = Trainer(config, TrainerOptions(online=False, device="cpu", status_port=-1))
    assert one.run() == 0
    got = ranks.run(_slow_reader_rank, 2, text, 1, 0, str(data))
    assert one.module.global_step == got[0]["step"] == got[1]["step"] == 8
    assert (got[0]["samples"], got[1]["samples"]) == (8 * 64 - 60, 7 * 64)
    assert got[0]["samples"] + got[1]["samples"] == one.samples_trained == 900
    for name, t in one.module.state_dict_for_checkpoint()["model"].items():
        np.testing.assert_allclose(got[0]["model"][name], t.numpy(), atol=2e-4, rtol=0,
                                   err_msg=name)


def test_file_stream_ranks_that_read_different_records_stop_untrained(ranks, tmp_path):
    """A rank whose reading went another way (here: one of its batches lost) holds another
    group than the others: the ranks stop with exit code 1 naming it, without training the
    mismatched step, so a restart resumes from the last checkpoint."""
    from tests.test_file_stream import _config as stream_config
    from tests.test_file_stream import _write_two_days

    data = tmp_path / "data"
    _write_two_days(data)
    got = ranks.run(_slow_reader_rank, 2, stream_config(tmp_path, str(data), "20261125"), 1,
                    3)
    for r in (0, 1):
        assert got[r]["code"] == 1 and "different records" in got[r]["failure"], got[r]
        assert got[r]["step"] == 2  # the two groups before the lost batch
    assert got[0]["samples"] + got[1]["samples"] == 200


@pytest.mark.slow
def test_two_ranks_write_day_and_pass_saves_that_replay_to_serving_parity(tmp_path):
    """A file stream's day and pass saves (``model_save_path``) written by two ranks under
    ``odl-train --nproc 2``, with a table shrunk at each day's end and a dynamic one, the
    job stopped and started again twice: at step 2, after the first pass's last record (the
    restarted ranks still close that pass), and at step 3, inside the next pass (the
    checkpoint keeps every rank's rows pending for the pass delta). Every record trained
    once, the layout one process writes, and serving on the starting base replaying every
    pass delta (each with every rank's rows and evictions) predicts what the final
    checkpoint predicts."""
    from tests.test_file_stream import _serve_from, _shrinking_saves_config, _write_two_days

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data)
    cfg = tmp_path / "ranks.config"
    text = _shrinking_saves_config(tmp_path, str(data), str(saves))
    ledger = str(tmp_path / "ranks.ledger")
    for num_steps in (2, 3, 0):  # stops at step 2, then 3, then the end
        cfg.write_text(text.replace("train_config {", f"train_config {{\n  num_steps: "
                                    f"{num_steps}", 1) if num_steps else text)
        done = subprocess.run(
            [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", str(cfg),
             "--online", "--device", "cpu", "--status_port", "-1", "--sample_ledger", ledger,
             "--log_level", "WARNING", "--nproc", "2"], cwd=REPO, capture_output=True,
            timeout=300)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    rank0, rank1 = (ledger_sample_ids(f"{ledger}.rank{r}") for r in (0, 1))
    assert rank0 and rank1 and sorted(rank0 + rank1) == sorted(ids)
    assert sorted(os.listdir(saves)) == ["20261123", "20261124", "20261125"]
    assert sorted(os.listdir(saves / "20261124")) == ["23", "24", "base", "delta_23",
                                                      "delta_24"]
    assert sorted(os.listdir(saves / "20261125")) == ["1", "2", "24", "base", "delta_1",
                                                      "delta_2", "delta_24"]
    final = read_checkpoint(list_checkpoints(str(tmp_path / "model_dir"))[-1])
    assert read_checkpoint(str(saves / "20261125" / "24")).global_step == final.global_step
    config = load_pipeline_config(str(cfg))
    fb = FeatureBuilder(config)
    model = TrainModule(config, fb, device="cpu")
    model.load_checkpoint_state(final.state)
    assert model.dynamic.tables["C1"].counters.expired > 0  # the days' shrinks
    probe = fb.build(values).batch
    service = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert service.follower.deltas_applied == 5
    assert service.model.state.version == final.global_step
    assert float(abs(service.model.predict_batch(probe) - model.predict(probe)).max()) <= 1e-6


@pytest.mark.slow
def test_kill_9_of_one_file_stream_rank_restarts_both_at_the_last_checkpoint(tmp_path):
    """SIGKILL of rank 1 inside a pass of a file stream with day and pass saves, under
    ``torchrun --max-restarts 1``: both ranks restart from the last checkpoint's positions
    (every rank's are the same) and run to ``end_day``, exit 0. Every record is in the final
    model exactly once, and the starting base with every pass delta (the interrupted pass's
    rewritten) serves the last day's base."""
    from tests.test_file_stream import (
        _checkpoint_steps_by_generation,
        _saves_config,
        _serve_from,
        _write_two_days,
    )

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data)
    text = _saves_config(tmp_path, str(data), str(saves)).replace(
        "save_checkpoints_steps: 50", "save_checkpoints_steps: 4").replace(
        "keep_checkpoint_max: 3", "keep_checkpoint_max: 100").replace(
        "batch_size: 50", "batch_size: 10")
    cfg = tmp_path / "pipeline.config"
    cfg.write_text(text)
    ledger = str(tmp_path / "ledger.tsv")
    model_dir = str(tmp_path / "model_dir")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = _torchrun(str(cfg), ledger, log, "--max-restarts", "1")
        try:
            deadline = time.monotonic() + 240
            while True:  # inside the first day's second pass (records 200..399 of 1,200)
                trained = sum(len(read_ledger(f"{ledger}.rank{r}"))
                              for r in (0, 1) if os.path.exists(f"{ledger}.rank{r}"))
                if trained >= 250:
                    break
                assert proc.poll() is None and time.monotonic() < deadline, \
                    log_path.read_text()[-3000:]
                time.sleep(0.005)
            ranks = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
            ranks[-1].kill()  # SIGKILL, no goodbye
            assert proc.wait(240) == 0, log_path.read_text()[-3000:]
        finally:
            _kill_tree(proc)
    generations = _checkpoint_steps_by_generation(model_dir)
    assert len(generations) == 2  # the killed job's and the restarted one's
    assert sorted(os.listdir(saves / "20261124")) == ["23", "24", "base", "delta_23",
                                                      "delta_24"]
    lost, twice = reflected_exactly_once(ids, _entries(ledger), generations)
    assert not lost and not twice, (len(lost), len(twice))
    chain = _serve_from(str(saves / "20261123" / "base"), str(saves))
    last = _serve_from(str(saves / "20261125" / "base"), str(saves))
    assert chain.model.state.version == last.model.state.version
    fb = FeatureBuilder(load_pipeline_config(str(cfg)))
    got = chain.model.predict_batch(fb.build(values).batch)
    want = last.model.predict_batch(fb.build(values).batch)
    assert float(abs(got - want).max()) <= 1e-6
