"""samples/decode_deltas.py (the standalone example decoder) against an fs incr_save_dir
whose versions were written by the real encoder and sink."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from publisher.delta_encoder import encode_version
from publisher.delta_format import VersionHeader
from publisher.fs_sink import FsSink, version_file_name
from publisher.id_maps import write_id_maps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "samples", "decode_deltas.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def _versions(directory: str) -> None:
    rng = np.random.default_rng(0)
    sink = FsSink(directory)
    # v7: sparse rows of tables 0 and 2 plus a dense variable, split over several chunks; a
    # full republish (after the topic lost versions)
    h7 = VersionHeader("m", 7, "genA", "both", 1000, 2000, 1100, 2100,
                       [("events", 0, 50), ("events", 1, 61)], 3000, full_republish=True)
    sparse7 = {0: (np.arange(0, 200, 2, dtype=np.int64), rng.normal(size=(100, 8))),
               2: (np.array([3, 1], dtype=np.int64), rng.normal(size=(2, 1)))}
    chunks7 = encode_version(h7, {1: rng.normal(size=(40, 16))}, sparse7,
                             max_chunk_bytes=2048)
    assert len(chunks7) > 2
    sink.send(7, "genA", chunks7)
    # v9: fp16, sparse only, one chunk, with ids a dynamic table deleted; follows v7's full
    # republish (a Kafka offset in a real topic)
    h9 = VersionHeader("m", 9, "genA", "sparse", 0, 0, 0, 0, [("events", 0, 70)], 3100,
                       last_full_version=7, last_full_offset=12)
    sink.send(9, "genA", encode_version(h9, {}, {0: (np.array([5], np.int64),
                                                       rng.normal(size=(1, 8)))}, "fp16",
                                        deletes={0: np.array([(1 << 62) + 1, 42], np.int64)}))
    # v3 of a new generation (a restart from an older checkpoint): dense only.
    h3 = VersionHeader("m", 3, "genB", "dense", positions=[("events", 0, 40)])
    sink.send(3, "genB", encode_version(h3, {0: np.ones(4), 1: np.zeros((40, 16))}, {}))
    # v11 has no .done marker yet (still being written): must be ignored.
    h11 = VersionHeader("m", 11, "genA", "sparse")
    with open(os.path.join(directory, version_file_name(11, "genA")), "wb") as f:
        chunk = encode_version(h11, {}, {0: (np.array([1], np.int64), np.ones((1, 8)))})[0]
        f.write(len(chunk).to_bytes(4, "little") + chunk)


def test_decodes_fs_versions(tmp_path):
    d = str(tmp_path / "incr")
    _versions(d)
    res = _run("--dir", d, "--json")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(ln) for ln in res.stdout.splitlines()]
    # name order: version number first (zero padded), then generation
    assert [(v["version"], v["generation"]) for v in lines] == [
        (3, "genB"), (7, "genA"), (9, "genA")]
    v3, v7, v9 = lines
    assert v7["kind"] == "BOTH" and v7["value_type"] == "FP32" and v7["chunks"] > 2
    assert v7["rows"] == {"0": 100, "2": 2} and v7["dense_vars"] == 1
    assert v7["event_ms"] == [1000, 2000] and v7["produce_ms"] == [1100, 2100]
    assert v7["positions"] == [["events", 0, 50], ["events", 1, 61]]
    assert v7["file"].endswith(version_file_name(7, "genA"))
    assert v9["kind"] == "SPARSE" and v9["value_type"] == "FP16" and v9["rows"] == {"0": 1}
    assert v9["deleted"] == {"0": 2} and v7["deleted"] == {}
    assert v3["kind"] == "DENSE" and v3["rows"] == {} and v3["dense_vars"] == 2
    assert v7["full"] is True and "follows_full" not in v7
    assert v9["full"] is False and v9["follows_full"] == [7, 12]
    assert "full" not in v3 and "follows_full" not in v3
    assert "3 versions, 0 incomplete, 0 chunks rejected" in res.stderr


def test_text_output_with_table_names(tmp_path):
    d = str(tmp_path / "incr")
    _versions(d)
    write_id_maps(str(tmp_path), {"dense.a": (4,), "dense.b": (40, 16)},
                  {"C1": (200, 8), "C1_wide": (200, 1), "C2": (10, 1)})
    res = _run("--dir", d, "--id-maps", str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("version=7 generation=genA kind=BOTH value_type=FP32 chunks=")
    assert "rows={C1:100,C2:2} dense_vars=1 event_ms=1000..2000 produce_ms=1100..2100" in lines[1]
    assert "positions=events:0@50,events:1@61" in lines[1]
    assert lines[1].endswith(" full") and lines[2].endswith(" follows_full=7@12")
    assert "event_ms=- produce_ms=-" in lines[0]


def test_corrupt_chunk_rejected(tmp_path):
    d = str(tmp_path / "incr")
    _versions(d)
    path = os.path.join(d, version_file_name(9, "genA"))
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # inside the payload (serialized last): the crc32 no longer matches
    open(path, "wb").write(bytes(data))
    res = _run("--dir", d, "--json")
    assert res.returncode == 1
    assert [json.loads(ln)["version"] for ln in res.stdout.splitlines()] == [3, 7]
    assert "crc32 mismatch in version 9" in res.stderr


def test_help_and_bad_arguments(tmp_path):
    assert _run("--help").returncode == 0
    assert _run("--bootstrap", "127.0.0.1:1").returncode == 2  # needs --topic
    assert _run("--dir", str(tmp_path / "missing")).returncode == 2
