"""The offline source: CSV and Parquet files, read in name order, ``num_epochs`` times."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from odl.inputs.file_source import FileSource


def _write_csv(path, lines: list[str], newline: str = "\n") -> str:
    path.write_bytes("".join(line + newline for line in lines).encode())
    return str(path)


def _values(source: FileSource) -> list[list[bytes]]:
    return [batch.values for batch in source.batches()]


def test_files_are_read_in_name_order_in_batches_across_files(tmp_path):
    _write_csv(tmp_path / "part-2.csv", ["c1", "c2"])
    _write_csv(tmp_path / "part-0.csv", ["a1", "a2", "a3"])
    _write_csv(tmp_path / "part-1.txt", ["b1"])
    source = FileSource(str(tmp_path / "part-*"), batch_size=2)
    assert source.files == [str(tmp_path / f) for f in ("part-0.csv", "part-1.txt",
                                                          "part-2.csv")]
    assert _values(source) == [[b"a1", b"a2"], [b"a3", b"b1"], [b"c1", b"c2"]]
    assert source.records_consumed == 6


def test_comma_separated_globs_keep_their_order(tmp_path):
    _write_csv(tmp_path / "b.csv", ["b"])
    _write_csv(tmp_path / "a.csv", ["a"])
    source = FileSource(f"{tmp_path / 'b.csv'}, {tmp_path / 'a.csv'}", batch_size=10)
    assert _values(source) == [[b"b", b"a"]]  # the last batch may be short


def test_epochs_repeat_the_files(tmp_path):
    _write_csv(tmp_path / "x.csv", ["1", "2", "3"])
    source = FileSource(str(tmp_path / "x.csv"), batch_size=2, num_epochs=3)
    assert _values(source) == [[b"1", b"2"], [b"3", b"1"], [b"2", b"3"], [b"1", b"2"],
                               [b"3"]]
    assert source.records_consumed == 9
    assert FileSource(str(tmp_path / "x.csv"), batch_size=5, num_epochs=0).num_epochs == 1


def test_batches_carry_no_positions(tmp_path):
    _write_csv(tmp_path / "x.csv", ["1", "2", "3"])
    batches = list(FileSource(str(tmp_path / "x.csv"), batch_size=2).batches())
    assert [b.positions for b in batches] == [{}, {}]  # offline training never resumes mid-file
    assert [len(b) for b in batches] == [2, 1]
    assert all(len(b.partitions) == len(b.offsets) == len(b.timestamps_ms) == len(b)
               for b in batches)


def test_blank_lines_are_skipped_and_line_ends_stripped(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"1,a\r\n\r\n2,b\n\n3,c")
    assert _values(FileSource(str(path), batch_size=10)) == [[b"1,a", b"2,b", b"3,c"]]


def test_parquet_rows_become_json_objects(tmp_path):
    table = pa.table({"label": [0, 1], "C1": ["x", None], "I1": [1.5, 2.0],
                      "raw": [b"\xff", b"ok"]})
    pq.write_table(table, tmp_path / "x.parquet")
    (batch,) = _values(FileSource(str(tmp_path / "x.parquet"), batch_size=10))
    assert [json.loads(v) for v in batch] == [
        {"label": 0, "C1": "x", "I1": 1.5, "raw": "\ufffd"},
        {"label": 1, "C1": None, "I1": 2.0, "raw": "ok"},
    ]


def test_csv_and_parquet_mix_in_name_order(tmp_path):
    _write_csv(tmp_path / "a.csv", ["1,x"])
    pq.write_table(pa.table({"label": [1]}), tmp_path / "b.parquet")
    (batch,) = _values(FileSource(str(tmp_path / "*"), batch_size=10))
    assert batch == [b"1,x", b'{"label": 1}']


def test_a_pattern_matching_nothing_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no files"):
        FileSource(str(tmp_path / "*.csv"), batch_size=2)
