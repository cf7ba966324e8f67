"""Crash recovery's merge of published versions, fed message by message (no broker), and
its read of a topic that lost versions (the session's broker).

What a restarted trainer recovers from its delta topic: the newest value of every row and
variable over the complete versions, nothing of a half-sent version, nothing at or below the
checkpoint's version, nothing of a superseded generation, and the last complete version's
step and input positions; after the topic lost versions past the checkpoint, what the full
republish and the versions after it add up to.
"""

from __future__ import annotations

import numpy as np
import pytest

from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_format import VersionHeader
from publisher.delta_recovery import RecoveredState, RecoveryMerger, read_published_state
from publisher.full_republish import FullRepublishes
from publisher.generation_fence import FENCED_REASON

TABLE = 3
VAR = 7


def _header(version: int, generation: str = "gen-a", offset: int = 0) -> VersionHeader:
    return VersionHeader("m", version, generation, positions=[("samples", 0, offset),
                                                              ("other", 0, 5)])


def _rows(ids: list[int], value: float, dim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, np.int64), np.full((len(ids), dim), value, np.float32)


def _version(version: int, rows: tuple[np.ndarray, np.ndarray], dense_value: float | None,
             generation: str = "gen-a", chunk_bytes: int = 900_000) -> list[bytes]:
    dense = {} if dense_value is None else {VAR: np.full((2, 3), dense_value, np.float32)}
    return encode_version(_header(version, generation, offset=version * 10), dense,
                          {TABLE: rows}, max_chunk_bytes=chunk_bytes)


def _recover(messages: list[bytes], **kw) -> RecoveredState:
    merger = RecoveryMerger(RecoveredState(topic="deltas", start_offset=0, end_offset=0), **kw)
    for offset, data in enumerate(messages):
        merger.add(data, offset)
    return merger.finish()


def _row_values(state: RecoveredState) -> dict[int, float]:
    ids, values = state.sparse[TABLE]
    return {int(i): float(v[0]) for i, v in zip(ids, values, strict=True)}


def test_newest_value_wins_per_row_and_variable():
    state = _recover(_version(10, _rows([1, 2, 3], 1.0), 1.0)
                     + _version(11, _rows([2, 4], 2.0), None)
                     + _version(12, _rows([3], 3.0), 3.0))
    assert _row_values(state) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 2.0}
    np.testing.assert_array_equal(state.dense[VAR], np.full((2, 3), 3.0, np.float32))
    assert state.versions == 3 and state.rows == 4
    assert state.version == 12
    assert state.positions_for("samples") == {0: 120}
    assert state.positions_for("other") == {0: 5}
    assert state.positions_for("unknown") == {}
    assert state.dropped_versions == 0 and not state.rejected


def test_incomplete_versions_are_dropped():
    half = _version(13, _rows(list(range(300)), 9.0), 9.0, chunk_bytes=2048)
    assert len(half) > 2
    state = _recover(_version(12, _rows([1], 1.0), 1.0) + half[: len(half) // 2])
    assert state.version == 12 and state.versions == 1
    assert state.dropped_versions == 1
    assert _row_values(state) == {1: 1.0}
    assert float(state.dense[VAR][0, 0]) == 1.0


def test_a_version_split_into_chunks_counts_once_complete():
    chunks = _version(20, _rows(list(range(300)), 5.0), 5.0, chunk_bytes=2048)
    assert len(chunks) > 2
    state = _recover(chunks)
    assert state.version == 20 and state.versions == 1 and state.rows == 300


def test_versions_not_newer_than_min_version_are_skipped():
    state = _recover(_version(10, _rows([1], 1.0), 1.0) + _version(11, _rows([1, 2], 2.0), None)
                     + _version(12, _rows([2], 3.0), None), min_version=11)
    assert state.skipped_versions == 2 and state.versions == 1
    assert _row_values(state) == {2: 3.0}
    assert VAR not in state.dense


def test_nothing_newer_recovers_nothing():
    state = _recover(_version(10, _rows([1], 1.0), 1.0), min_version=10)
    assert state.version is None and state.last_header is None
    assert state.dense == {} and state.sparse == {} and state.rows == 0
    assert state.positions_for("samples") == {}


def test_a_superseded_generation_is_fenced():
    # gen-a owns the topic (the checkpoint's); gen-b takes over; gen-a's later chunks count not
    state = _recover(_version(10, _rows([1], 1.0), 1.0, "gen-a")
                     + _version(8, _rows([1, 2], 2.0), 2.0, "gen-b")
                     + _version(11, _rows([1, 2, 3], 7.0), 7.0, "gen-a"), owner="gen-a")
    assert state.rejected == {FENCED_REASON: 1}
    assert state.version == 8 and state.generations == ["gen-a", "gen-b"]
    assert _row_values(state) == {1: 2.0, 2: 2.0}


def test_a_generation_that_comes_back_after_a_takeover_is_fenced():
    state = _recover(_version(9, _rows([1], 1.0), 1.0, "gen-b")
                     + _version(12, _rows([1], 5.0), 5.0, "gen-a")  # a newer start takes over
                     + _version(10, _rows([1], 6.0), 6.0, "gen-b"), owner="gen-b")
    assert state.rejected == {FENCED_REASON: 1}
    assert state.version == 12 and state.generations == ["gen-b", "gen-a"]
    assert _row_values(state) == {1: 5.0}


@pytest.mark.parametrize("bad,reason", [(b"", "empty"), (b"garbage", "unparsable")])
def test_corrupt_messages_are_counted_and_skipped(bad, reason):
    state = _recover([bad] + _version(10, _rows([1], 1.0), 1.0) + [bad])
    assert state.rejected == {reason: 2}
    assert state.version == 10 and _row_values(state) == {1: 1.0}


def test_a_chunk_with_a_bad_checksum_is_rejected():
    chunk = bytearray(_version(10, _rows(list(range(50)), 1.0), 1.0)[0])
    chunk[len(chunk) // 2] ^= 0xFF
    state = _recover([bytes(chunk)])
    assert state.rejected == {"crc_mismatch": 1}
    assert state.version is None


def _marked(version: int, rows: tuple[np.ndarray, np.ndarray], full: bool = False,
            names: tuple[int, int] = (0, -1), generation: str = "gen-a") -> list[bytes]:
    header = _header(version, generation, offset=version * 10)
    header.full_republish = full
    header.last_full_version, header.last_full_offset = names
    return encode_version(header, {VAR: np.full((2, 3), float(version), np.float32)},
                          {TABLE: rows})


def _refilled_log() -> list[bytes]:
    """The topic after it lost versions back to offset 0 and the trainer published on: the
    version that noticed (11), the full republish (12, offset 1), two naming it."""
    return (_marked(11, _rows([1, 2], 1.0)) + _marked(12, _rows([1, 2, 3, 4], 2.0), full=True)
            + _marked(13, _rows([3], 3.0), names=(12, 1))
            + _marked(14, _rows([5], 4.0), names=(12, 1)))


def _merger(republishes: FullRepublishes) -> RecoveryMerger:
    return RecoveryMerger(RecoveredState(topic="deltas", start_offset=3, end_offset=3),
                          min_version=10, owner="gen-a", republishes=republishes)


def test_a_full_republish_before_the_start_offset_is_gone_back_to_once():
    log = _refilled_log()
    republishes = FullRepublishes("gen-a", 10, read_from=3)
    merger = _merger(republishes)
    merger.add(log[3], 3)
    assert merger.rewind_to == 1 and merger.state.versions == 0
    # the read again from offset 1, with the same record of full versions: merges 12, 13, 14
    republishes.read_from = 1
    again = _merger(republishes)
    for offset in (1, 2, 3):
        again.add(log[offset], offset)
    state = again.finish()
    assert again.rewind_to is None and state.version == 14 and state.versions == 3
    assert _row_values(state) == {1: 2.0, 2: 2.0, 3: 3.0, 4: 2.0, 5: 4.0}
    # the checkpoint holds the full republish (same generation, at or after its step): read on
    held = RecoveryMerger(RecoveredState(topic="deltas", start_offset=2, end_offset=2),
                          min_version=12, owner="gen-a",
                          republishes=FullRepublishes("gen-a", 12, read_from=2))
    for offset in (2, 3):
        held.add(log[offset], offset)
    assert held.rewind_to is None and held.finish().version == 14
    # sought already (it was lost in turn): read on
    lost = FullRepublishes("gen-a", 10, read_from=3)
    assert lost.skipped(decode_chunk(log[3]).header) == 1
    lost_merger = _merger(lost)
    lost_merger.add(log[3], 3)
    assert lost_merger.rewind_to is None and _row_values(lost_merger.finish()) == {5: 4.0}


@pytest.mark.kafka
def test_recovery_from_a_checkpoint_past_a_refilled_log_reads_from_the_full_republish(
        kafka_bootstrap, kafka_topic_factory):
    """The checkpoint's delta offset (3) was written before the topic lost its versions; the
    trainer refilled the log past it before it was killed."""
    from odl.harness.topic_records import produce

    topic = kafka_topic_factory(prefix="deltas")
    produce(kafka_bootstrap, topic, _refilled_log(), 1)
    state = read_published_state(kafka_bootstrap, topic, 3, min_version=10, owner="gen-a",
                                 timeout=30)
    assert state.rewound_to == 1 and state.start_offset == 3 and state.end_offset == 4
    assert state.version == 14 and state.versions == 3
    assert _row_values(state) == {1: 2.0, 2: 2.0, 3: 3.0, 4: 2.0, 5: 4.0}
    np.testing.assert_array_equal(state.dense[VAR], np.full((2, 3), 14.0, np.float32))
