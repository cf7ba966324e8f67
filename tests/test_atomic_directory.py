"""odl.storage.atomic_directory: all-or-nothing directories and files."""

from __future__ import annotations

import os

import pytest

from odl.storage.atomic_directory import atomic_directory, write_atomic, write_durable


def test_directory_committed_on_success(tmp_path):
    final, tmp = str(tmp_path / "d"), str(tmp_path / ".d.tmp")
    with atomic_directory(final, tmp) as work:
        assert work == tmp and os.listdir(work) == []
        write_durable(os.path.join(work, "a"), b"1")
        assert not os.path.exists(final)
    assert os.listdir(tmp_path) == ["d"]
    assert open(os.path.join(final, "a"), "rb").read() == b"1"


def test_directory_dropped_on_error_and_final_untouched(tmp_path):
    final, tmp = str(tmp_path / "d"), str(tmp_path / ".d.tmp")
    os.makedirs(tmp)
    open(os.path.join(tmp, "stale"), "w").close()  # a leftover is cleared first
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(final, tmp) as work:
            assert os.listdir(work) == []
            write_durable(os.path.join(work, "a"), b"1")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_existing_final_needs_replace(tmp_path):
    final, tmp = str(tmp_path / "d"), str(tmp_path / ".d.tmp")
    os.makedirs(final)
    open(os.path.join(final, "old"), "w").close()
    with pytest.raises(FileExistsError):
        with atomic_directory(final, tmp):
            pass
    assert os.listdir(final) == ["old"] and not os.path.exists(tmp)
    with atomic_directory(final, tmp, replace=True) as work:
        write_durable(os.path.join(work, "new"), b"")
    assert os.listdir(final) == ["new"]


def test_write_atomic_replaces_whole_file(tmp_path):
    path = str(tmp_path / "f")
    write_atomic(path, b"first")
    write_atomic(path, b"second")
    assert open(path, "rb").read() == b"second"
    assert os.listdir(tmp_path) == ["f"]
    with pytest.raises(OSError):
        write_atomic(str(tmp_path / "missing" / "f"), b"x")
    assert os.listdir(tmp_path) == ["f"]
