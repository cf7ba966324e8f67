"""The storage layer on OSS: real ``oss2`` against the loopback double (``oss`` fixture).

What a user relies on: files and directories behave as on a local disk; a checkpoint or an
export on OSS is trusted only once its DONE object is there; a failure mid-upload leaves
nothing a reader trusts and is cleaned up later; transient errors are retried and counted,
permanent ones fail at once; secrets never show.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from odl.checkpoint.checkpoint_manager import (
    DONE_FILE,
    MANIFEST_FILE,
    CheckpointError,
    CheckpointManager,
    list_checkpoints,
    read_checkpoint,
    resolve_checkpoint_path,
)
from odl.config.pipeline_config import load_pipeline_config
from odl.storage import file_store
from odl.storage.oss_store import OssStore, StorageError, oss_health, oss_store
from odl.storage.storage_path import dirname, join, parse_oss
from tests.conftest import OSS_TEST_SECRET

BUCKET = "bkt"
ROOT = f"oss://{BUCKET}/odl"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 8, generator=g)}, "optimizer": {},
            "global_step": step}


def _save(mgr: CheckpointManager, step: int) -> str:
    return mgr.save(step, _state(step), {0: step * 10, 1: step}, {"source": "kafka",
                                                                  "topic": "t"}, "cfg")


def test_paths() -> None:
    assert parse_oss("oss://b/a/b/").key == "a/b"
    assert parse_oss("oss://b").key == ""
    assert join("oss://b/x/", "y", "z") == "oss://b/x/y/z"
    assert dirname("oss://b/x/y") == "oss://b/x" and dirname("oss://b/x") == "oss://b"


def test_files_and_directories_behave_as_on_disk(oss, tmp_path) -> None:
    file_store.write_bytes(f"{ROOT}/a/one.txt", b"1")
    file_store.write_bytes(f"{ROOT}/a/sub/two.csv", b"2")
    file_store.write_bytes(f"{ROOT}/a/sub/three.csv", b"3")
    assert file_store.read_bytes(f"{ROOT}/a/one.txt") == b"1"
    assert file_store.is_file(f"{ROOT}/a/one.txt") and not file_store.is_file(f"{ROOT}/a")
    assert file_store.exists(f"{ROOT}/a") and not file_store.exists(f"{ROOT}/nothing")
    assert file_store.list_dir(f"{ROOT}/a") == (["sub"], ["one.txt"])
    assert file_store.glob_files(f"{ROOT}/a/sub/*.csv") == [
        f"{ROOT}/a/sub/three.csv", f"{ROOT}/a/sub/two.csv"]
    with pytest.raises(FileNotFoundError):
        file_store.read_bytes(f"{ROOT}/a/missing")
    local = file_store.local_copy(f"{ROOT}/a")
    assert open(os.path.join(local, "sub", "two.csv"), "rb").read() == b"2"
    file_store.remove_tree(f"{ROOT}/a")
    assert oss.objects(BUCKET, "odl/a") == {}


def test_upload_tree_writes_the_commit_markers_last(oss, tmp_path) -> None:
    src = tmp_path / "d"
    (src / "x").mkdir(parents=True)
    for name in ("DONE", "MANIFEST.json", "b.bin", "x/a.bin"):
        (src / name).write_bytes(name.encode())
    file_store.upload_tree(str(src), f"{ROOT}/tree", last=("MANIFEST.json", "DONE"))
    puts = [path for method, path, *_ in oss.requests_log if method == "PUT"]
    assert [p.rsplit("/", 1)[-1] for p in puts[-2:]] == ["MANIFEST.json", "DONE"]
    assert set(oss.objects(BUCKET, "odl/tree/")) == {
        "odl/tree/DONE", "odl/tree/MANIFEST.json", "odl/tree/b.bin", "odl/tree/x/a.bin"}


def test_large_files_go_multipart_and_read_back_equal(oss, tmp_path) -> None:
    store = OssStore(multipart_threshold=1 << 20, part_size=256 << 10)
    data = os.urandom((1 << 20) + 12345)
    (tmp_path / "big").write_bytes(data)
    store.put_file(parse_oss(f"{ROOT}/big"), str(tmp_path / "big"))
    assert any("uploadId" in str(q) for _m, _p, q, *_ in oss.requests_log)
    assert store.get(parse_oss(f"{ROOT}/big")) == data
    assert oss.incomplete_uploads(BUCKET) == []


def test_transient_errors_are_retried_and_counted(oss) -> None:
    oss.fail_next(2, status=503, code="ServiceUnavailable")
    file_store.write_bytes(f"{ROOT}/r", b"x")
    assert file_store.read_bytes(f"{ROOT}/r") == b"x"
    oss.fail_next(1, status=503, code="SlowDown")
    assert file_store.read_bytes(f"{ROOT}/r") == b"x"
    health = oss_health()
    assert health["retries"] == 3 and health["failures"] == 0 and health["healthy"]


def test_an_outage_fails_after_the_budget_then_once_until_back(oss) -> None:
    oss.set_down(True)
    with pytest.raises(StorageError) as err:
        file_store.write_bytes(f"{ROOT}/o", b"x")
    assert err.value.transient and "oss://bkt/odl/o" in str(err.value)
    assert not oss_health()["healthy"]
    before = oss.request_count
    with pytest.raises(StorageError):  # known down: one attempt, no new retry budget
        file_store.write_bytes(f"{ROOT}/o", b"x")
    assert oss.request_count - before == 1
    oss.set_down(False)
    file_store.write_bytes(f"{ROOT}/o", b"y")
    assert oss_health()["healthy"] and file_store.read_bytes(f"{ROOT}/o") == b"y"


def test_permanent_errors_fail_at_once(oss) -> None:
    oss.fail_next(1, status=403, code="AccessDenied")
    with pytest.raises(StorageError) as err:
        file_store.write_bytes(f"{ROOT}/p", b"x")
    assert not err.value.transient and "AccessDenied" in str(err.value)
    assert oss_health()["retries"] == 0


def test_checkpoints_round_trip_and_prune(oss) -> None:
    model_dir = f"{ROOT}/model"
    mgr = CheckpointManager(model_dir, keep_max=2)
    paths = [_save(mgr, s) for s in (5, 10, 15)]
    assert paths[-1] == f"{model_dir}/model.ckpt-15"
    assert list_checkpoints(model_dir) == paths[1:]
    ckpt = read_checkpoint(resolve_checkpoint_path(model_dir))
    assert ckpt.global_step == 15 and ckpt.positions == {0: 150, 1: 15}
    assert torch.equal(ckpt.state["model"]["w"], _state(15)["model"]["w"])
    assert ckpt.path == paths[-1]
    # the local mirror keeps only the newest (the upload source)
    mirror = file_store.cache_dir_for(model_dir)
    assert sorted(n for n in os.listdir(mirror) if n.startswith("model")) == ["model.ckpt-15"]


def test_an_upload_that_dies_leaves_nothing_trusted_and_is_cleaned_up(oss) -> None:
    model_dir = f"{ROOT}/model"
    mgr = CheckpointManager(model_dir, keep_max=0)
    _save(mgr, 1)
    # OSS goes down after the model file: MANIFEST and DONE never arrive
    oss.fail_next(1000, status=503, key_prefix="odl/model/model.ckpt-2/MANIFEST")
    with pytest.raises(CheckpointError):
        _save(mgr, 2)
    assert mgr.last_error and "model.ckpt-2" in mgr.last_error
    assert "odl/model/model.ckpt-2/model.pt" in oss.objects(BUCKET, "odl/model/")
    assert list_checkpoints(model_dir) == [f"{model_dir}/model.ckpt-1"]
    assert read_checkpoint(mgr.latest()).global_step == 1
    oss.fail_next(0)
    oss.set_down(False)
    # the next start removes the orphan; the next checkpoint commits
    mgr = CheckpointManager(model_dir, keep_max=0)
    assert not any("model.ckpt-2" in k for k in oss.objects(BUCKET, "odl/model/"))
    _save(mgr, 3)
    assert [p.rsplit("-", 1)[-1] for p in list_checkpoints(model_dir)] == ["1", "3"]


def test_a_checkpoint_without_done_or_with_a_bad_file_is_never_loaded(oss) -> None:
    model_dir = f"{ROOT}/model"
    mgr = CheckpointManager(model_dir, keep_max=0)
    _save(mgr, 1)
    newest = _save(mgr, 2)
    oss.put(BUCKET, "odl/model/model.ckpt-2/model.pt", b"not a checkpoint")
    file_store.remove_tree(file_store.cache_dir_for(model_dir))
    assert resolve_checkpoint_path(model_dir).endswith("model.ckpt-1")
    file_store.remove(join(newest, DONE_FILE))
    assert list_checkpoints(model_dir) == [f"{model_dir}/model.ckpt-1"]
    assert file_store.is_file(join(newest, MANIFEST_FILE))


def test_table_parts_from_two_hosts_commit_together_and_read_whole(oss, tmp_path,
                                                                   monkeypatch) -> None:
    """A checkpoint of two ranks on two hosts (two local mirrors): rank 1 uploads its table
    part itself, rank 0 commits with DONE last; a reader on either host, or a third, gets the
    whole tables. Nothing of a checkpoint whose part never came is trusted."""
    import dataclasses

    from odl.checkpoint import table_parts

    model_dir = f"{ROOT}/model"
    g = torch.Generator().manual_seed(3)
    weight, acc, bias = torch.randn(6, 4, generator=g), torch.rand(6, generator=g), torch.ones(2)
    docs = [table_parts.part_document(
        {("model", "ebc.t.weight", ""): ((6, 4), [((3 * r, 0), weight[3 * r:3 * r + 3])]),
         ("sparse", "ebc.t.weight", "t.momentum1"): ((6,), [((3 * r,), acc[3 * r:3 * r + 3])]),
         ("model", "ebc.small.weight", ""): ((2,), [(None, bias)])}, r, 2) for r in (0, 1)]
    host0 = str(tmp_path / "host0")
    monkeypatch.setenv("ODL_CACHE_DIR", host0)
    rank0 = CheckpointManager(model_dir, keep_max=0)
    pending = rank0.begin_save(7)
    entries = [rank0.write_table_part(pending, docs[0], 0, 2)]
    monkeypatch.setenv("ODL_CACHE_DIR", str(tmp_path / "host1"))
    rank1 = CheckpointManager(model_dir, keep_max=0)
    elsewhere = dataclasses.replace(pending, tmp=str(tmp_path / "not-on-this-host"))
    entries.append(rank1.write_table_part(elsewhere, docs[1], 1, 2))
    assert "odl/model/model.ckpt-7/tables.rank-1-of-2.pt" in oss.objects(BUCKET, "odl/model/")
    assert list_checkpoints(model_dir) == []  # not committed before rank 0's DONE
    monkeypatch.setenv("ODL_CACHE_DIR", host0)
    state = {"model": {"dense.w": torch.zeros(3)}, "sparse_optimizer": {}, "global_step": 7}
    assert rank0.commit_save(pending, state, {0: 70, 1: 71}, {"source": "kafka"}, "cfg",
                             parts=entries) == f"{model_dir}/model.ckpt-7"
    for host in ("host0", "host1", "host2"):  # host0's mirror lacks rank 1's part
        monkeypatch.setenv("ODL_CACHE_DIR", str(tmp_path / host))
        ckpt = read_checkpoint(resolve_checkpoint_path(model_dir))
        assert torch.equal(ckpt.state["model"]["ebc.t.weight"], weight), host
        assert torch.equal(ckpt.state["model"]["ebc.small.weight"], bias)
        assert torch.equal(ckpt.state["sparse_optimizer"]["ebc.t.weight"]["t.momentum1"], acc)
        assert "table_parts" not in ckpt.state and ckpt.positions == {0: 70, 1: 71}
    # a second checkpoint whose rank-1 part never arrives is dropped, never listed
    monkeypatch.setenv("ODL_CACHE_DIR", host0)
    pending = rank0.begin_save(8)
    rank0.write_table_part(pending, docs[0], 0, 2)
    rank0.abort_save(pending)
    assert [p.rsplit("-", 1)[-1] for p in list_checkpoints(model_dir)] == ["7"]
    assert not os.path.exists(pending.tmp)


def test_listing_failure_is_an_error_not_an_empty_model_dir(oss) -> None:
    model_dir = f"{ROOT}/model"
    _save(CheckpointManager(model_dir), 1)
    reset = oss_store()
    oss.set_down(True)
    with pytest.raises(StorageError):
        CheckpointManager(model_dir).latest()
    assert reset is oss_store()


def test_pipeline_config_loads_from_oss(oss) -> None:
    text = open(os.path.join(os.path.dirname(__file__), "..", "samples",
                             "deepfm_online.config")).read()
    file_store.write_bytes(f"{ROOT}/p.config", text.encode())
    config = load_pipeline_config(f"{ROOT}/p.config")
    assert config.model_config.model_class == "DeepFM"


def test_secrets_never_show(oss, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    oss.set_down(True)
    with pytest.raises(StorageError) as err:
        file_store.write_bytes(f"{ROOT}/s", b"x")
    oss.set_down(False)
    file_store.write_bytes(f"{ROOT}/s", b"x")
    texts = [caplog.text, str(err.value), repr(oss_store()), repr(oss_store().credentials),
             str(oss_health())]
    assert not any(OSS_TEST_SECRET in t for t in texts)
    assert all(key_id == "test-key-id" for *_rest, key_id in oss.requests_log)


def test_file_deltas_and_offline_input_on_oss(oss, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from odl.inputs.file_source import FileSource
    from publisher.fs_sink import FsSink, list_versions, read_chunks

    sink = FsSink(f"{ROOT}/deltas")
    sink.send(3, "gen", [b"one", b"two"])
    sink.send(4, "gen", [b"three"])
    oss.put(BUCKET, "odl/deltas/00000000000000000005-gen.delta", b"half")  # no .done marker
    versions = list(list_versions(f"{ROOT}/deltas"))
    assert [v.rsplit("/", 1)[-1][:20] for v in versions] == [f"{3:020d}", f"{4:020d}"]
    assert read_chunks(versions[0]) == [b"one", b"two"]

    file_store.write_bytes(f"{ROOT}/data/part-0.csv", b"a,1\nb,2\n")
    table = pa.table({"c": ["x", "y"], "n": [1, 2]})
    pq.write_table(table, tmp_path / "p.parquet")
    file_store.upload_file(str(tmp_path / "p.parquet"), f"{ROOT}/data/part-1.parquet")
    src = FileSource(f"{ROOT}/data/part-*", batch_size=10)
    values = [v for b in src.batches() for v in b.values]
    assert values[:2] == [b"a,1", b"b,2"]
    assert [json.loads(v) for v in values[2:]] == [{"c": "x", "n": 1}, {"c": "y", "n": 2}]
    mirror = file_store.cache_dir_for(f"{ROOT}/data")
    assert not os.path.exists(mirror) or not os.listdir(mirror)  # downloads removed after use
