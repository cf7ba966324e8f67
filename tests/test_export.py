"""odl-export: layout, atomicity, id maps, kafka.txt, shards, CLI behaviour."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest

from odl.checkpoint.file_digest import sha256_file
from odl.cli import export_cli
from odl.config.feature_configs import feature_configs
from odl.export.exporter import ExportError, export_checkpoint
from odl.models.embedding_tables import WIDE_SUFFIX
from publisher.id_maps import read_id_maps, write_id_maps
from tests.harness import train_checkpoint

EXPECTED_FILES = {
    "dense_model.pt", "serving_model.json", "DENSE_UPDATE_VARIABLES", "embed_name_to_ids.txt",
    "kafka.txt", "pipeline.config", "MANIFEST.json", "DONE", "embeddings/MANIFEST.json",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_checkpoint(str(tmp_path_factory.mktemp("export")), delta_offset=17,
                            extra_source={"delta_server": "127.0.0.1:1",
                                          "delta_topic": "deltas"})


def _files(root: str) -> set[str]:
    out = set()
    for d, _dirs, names in os.walk(root):
        for n in names:
            out.add(os.path.relpath(os.path.join(d, n), root))
    return out


def test_export_layout_complete_and_done_last(trained, tmp_path):
    asset = tmp_path / "fg.json"
    asset.write_text('{"features": []}')
    res = export_checkpoint(trained.config, trained.model_dir, str(tmp_path / "exp"),
                            asset_files=[str(asset)], now=1_700_000_000)
    assert res.path == str(tmp_path / "exp" / "1700000000")
    assert os.listdir(tmp_path / "exp") == ["1700000000"]  # no temporary left behind
    files = _files(res.path)
    assert EXPECTED_FILES <= files
    assert "assets/fg.json" in files
    tables = [c.name for c in trained.module.dmp.module.layout.configs]
    for t in tables:
        assert f"embeddings/{t}/part-00000.npy" in files
    # MANIFEST covers everything but DONE, with the right checksums; DONE is the newest file.
    manifest = json.loads((tmp_path / "exp" / "1700000000" / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == files - {"DONE", "MANIFEST.json"}
    for rel, info in manifest["files"].items():
        assert sha256_file(os.path.join(res.path, rel)) == info["sha256"]
    done_mtime = os.stat(os.path.join(res.path, "DONE")).st_mtime_ns
    assert all(os.stat(os.path.join(res.path, f)).st_mtime_ns <= done_mtime for f in files)


def test_export_contents(trained, tmp_path):
    res = export_checkpoint(trained.config, trained.path, str(tmp_path / "exp"))
    kafka = json.loads(open(os.path.join(res.path, "kafka.txt")).read())
    assert kafka == {"storage": "kafka", "server": "127.0.0.1:1", "topic": "deltas",
                     "consumer": {"offset": 17}}
    config_text = open(os.path.join(res.path, "pipeline.config")).read()
    assert "hunter2" not in config_text and "sasl.password" in config_text
    maps = read_id_maps(res.path)
    state = trained.module.state_dict_for_checkpoint()["model"]
    wdim = trained.config.model_config.deepfm.wide_output_dim
    emb = json.loads(open(os.path.join(res.path, "embeddings", "MANIFEST.json")).read())
    for name, info in maps.tables.items():
        full = state[f"ebc.embedding_bags.{name}.weight"].numpy()
        want = full[:, :wdim] if name.endswith(WIDE_SUFFIX) else full
        assert (info.num_rows, info.dim) == want.shape
        got = np.load(os.path.join(res.path, "embeddings", name, "part-00000.npy"))
        np.testing.assert_array_equal(got, want)
        t = emb["tables"][name]
        assert (t["id"], t["rows"], t["dim"], t["dtype"]) == (info.id, *want.shape, "float32")
    assert set(maps.dense) == {k for k, v in trained.module.dense_parameters().items()
                               if v.is_floating_point()}
    sig = json.loads(open(os.path.join(res.path, "serving_model.json")).read())
    assert sig["global_step"] == trained.module.global_step
    assert sig["generation"] == "gen0"
    # the features in fg.json form, named as in the config
    fg = json.loads(open(os.path.join(res.path, "assets", "fg.json")).read())
    fcs = feature_configs(trained.config)
    assert [f["feature_name"] for f in fg["features"]] == [fc.feature_name for fc in fcs]
    c1 = next(f for f in fg["features"] if f["feature_name"] == "C1")
    assert c1["feature_type"] == "id_feature" and c1["expression"] == "user:C1"
    assert c1["hash_bucket_size"] == 500 and c1["embedding_dim"] == 8
    assert fg["reserves"][0] == trained.config.data_config.label_fields[0]
    # an fg.json given as an asset is exported instead
    own = tmp_path / "fg.json"
    own.write_text('{"features": []}')
    res2 = export_checkpoint(trained.config, trained.path, str(tmp_path / "exp2"),
                             asset_files=[str(own)], now=time.time() + 5)
    assert open(os.path.join(res2.path, "assets", "fg.json")).read() == '{"features": []}'


def test_export_uses_publisher_id_maps_and_rejects_mismatch(trained, tmp_path):
    maps = read_id_maps(export_checkpoint(trained.config, trained.path,
                                          str(tmp_path / "a")).path)
    dense = {n: i.shape for n, i in maps.dense.items()}
    tables = {n: (t.num_rows, t.dim) for n, t in maps.tables.items()}
    model_dir = tmp_path / "md"
    model_dir.mkdir()
    write_id_maps(str(model_dir), dense, tables)
    # Same names -> same ids; a map with another shape is refused.
    trained.config.model_dir = str(model_dir)
    try:
        again = read_id_maps(export_checkpoint(trained.config, trained.path,
                                               str(tmp_path / "b")).path)
        assert again == maps
        first = sorted(tables)[0]
        tables[first] = (tables[first][0] + 1, tables[first][1])
        write_id_maps(str(model_dir), dense, tables)
        with pytest.raises(ExportError, match="embed_name_to_ids"):
            export_checkpoint(trained.config, trained.path, str(tmp_path / "c"))
    finally:
        trained.config.model_dir = trained.model_dir
    assert not os.path.exists(tmp_path / "c") or not os.listdir(tmp_path / "c")


def test_cli_oss_path_local_and_secrets(trained, tmp_path, capsys, caplog):
    cfg = tmp_path / "p.config"
    cfg.write_text(open(os.path.join(trained.path, "pipeline.config")).read())
    caplog.set_level(logging.DEBUG)
    rc = export_cli.main([
        "--pipeline_config_path", str(cfg), "--checkpoint_path", trained.path,
        "--export_dir", str(tmp_path / "exp"), "--oss_path", str(tmp_path / "oss"),
        "--oss_ak", "AKID", "--oss_sk", "TOPSECRET", "--oss_endpoint", "oss.example",
        "--delta_topic", "t2", "--delta_server", "h:9"])
    assert rc == 0
    path = capsys.readouterr().out.strip()
    name = os.path.basename(path)
    assert not os.path.exists(os.path.join(path, "embeddings"))
    assert os.path.isfile(tmp_path / "oss" / name / "embeddings" / "MANIFEST.json")
    sig = json.loads(open(os.path.join(path, "serving_model.json")).read())
    assert sig["embeddings_dir"] == str(tmp_path / "oss" / name / "embeddings")
    kafka = json.loads(open(os.path.join(path, "kafka.txt")).read())
    assert (kafka["server"], kafka["topic"], kafka["consumer"]["offset"]) == ("h:9", "t2", 17)
    assert "TOPSECRET" not in caplog.text
    for root in (path, str(tmp_path / "oss")):
        for rel in _files(root):
            with open(os.path.join(root, rel), "rb") as f:
                assert b"TOPSECRET" not in f.read()


def test_cli_errors(trained, tmp_path, capsys):
    cfg = tmp_path / "p.config"
    cfg.write_text(open(os.path.join(trained.path, "pipeline.config")).read())
    base = ["--pipeline_config_path", str(cfg), "--checkpoint_path", trained.path,
            "--export_dir", str(tmp_path / "exp")]
    assert export_cli.main(base + ["--oss_path", "oss://bucket/x"]) == 2
    assert "OSS_ACCESS_KEY_ID" in capsys.readouterr().err
    assert export_cli.main(base + ["--oss_path", "hdfs://nn/x"]) == 2
    assert "hdfs:// paths are not supported" in capsys.readouterr().err
    assert export_cli.main(base + ["--asset_files", str(tmp_path / "missing.json")]) == 2
    assert export_cli.main(["--pipeline_config_path", str(tmp_path / "nope"),
                            "--export_dir", str(tmp_path / "exp")]) == 2
    assert export_cli.main(base[:2] + ["--checkpoint_path", str(tmp_path),
                                       "--export_dir", str(tmp_path / "exp")]) == 1
    assert not os.path.exists(tmp_path / "exp") or not os.listdir(tmp_path / "exp")
