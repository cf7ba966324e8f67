import json
import os

import pytest
import torch

from odl.checkpoint.checkpoint_manager import (
    CheckpointError,
    CheckpointManager,
    list_checkpoints,
    read_checkpoint,
    resolve_checkpoint_path,
    verify_checkpoint,
)


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((3, 4), v)}, "optimizer": {}, "global_step": int(v)}


def test_save_and_read_round_trip(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_max=3)
    path = mgr.save(7, _state(7), {0: 10, 1: 3}, {"source": "kafka", "topic": "t"}, "cfg", "gen1")
    assert os.path.basename(path) == "model.ckpt-7"
    assert verify_checkpoint(path) is None
    ck = read_checkpoint(path)
    assert ck.global_step == 7
    assert ck.positions == {0: 10, 1: 3}
    assert ck.source["topic"] == "t"
    assert torch.equal(ck.state["model"]["w"], torch.full((3, 4), 7.0))
    assert ck.manifest["generation"] == "gen1"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_keep_checkpoint_max_prunes_oldest(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_max=2)
    for s in (1, 2, 3, 4):
        mgr.save(s, _state(s), {}, {}, "")
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == [
        "model.ckpt-3",
        "model.ckpt-4",
    ]


def test_damaged_newest_is_skipped_for_the_previous(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_max=5)
    mgr.save(1, _state(1), {0: 1}, {}, "")
    newest = mgr.save(2, _state(2), {0: 2}, {}, "")
    with open(os.path.join(newest, "model.pt"), "r+b") as f:
        f.seek(100)
        f.write(b"garbage!")
    assert "checksum" in verify_checkpoint(newest)
    assert os.path.basename(mgr.latest()) == "model.ckpt-1"
    assert os.path.basename(resolve_checkpoint_path(str(tmp_path))) == "model.ckpt-1"
    with pytest.raises(CheckpointError):
        resolve_checkpoint_path(newest)


def test_incomplete_and_temporary_dirs_are_ignored_and_cleaned(tmp_path):
    os.makedirs(tmp_path / "model.ckpt-9")  # no DONE marker
    os.makedirs(tmp_path / ".model.ckpt-10.tmp-123")
    mgr = CheckpointManager(str(tmp_path))
    assert mgr.latest() is None
    assert not (tmp_path / ".model.ckpt-10.tmp-123").exists()
    mgr.save(9, _state(9), {}, {}, "")  # replaces the incomplete leftover
    assert os.path.basename(mgr.latest()) == "model.ckpt-9"


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _state(1), {0: 5}, {}, "")
    # A plain file where the temporary directory must go makes the write fail for real
    # (permissions do not stop root, which CI runs as).
    (tmp_path / f".model.ckpt-2.tmp-{os.getpid()}").write_bytes(b"in the way")
    with pytest.raises(CheckpointError):
        mgr.save(2, _state(2), {0: 6}, {}, "")
    assert mgr.last_error
    assert os.path.basename(mgr.latest()) == "model.ckpt-1"
    assert read_checkpoint(mgr.latest()).positions == {0: 5}


def test_manifest_lists_checksums(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(3, _state(3), {}, {}, "x")
    manifest = json.load(open(os.path.join(path, "MANIFEST.json")))
    assert set(manifest["files"]) == {"model.pt", "positions.json", "pipeline.config"}

