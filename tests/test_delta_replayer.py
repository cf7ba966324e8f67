"""Serving's delta replay, message by message (no broker): ``DeltaReplayer.handle``.

A real export of a trained checkpoint is loaded as a ``ServingModel``; delta messages are
handed to the replayer as bytes with their offsets, the way its consumer thread does.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from odl.checkpoint.checkpoint_manager import read_checkpoint
from odl.export.exporter import export_checkpoint
from odl.train.train_module import TrainModule
from publisher.delta_encoder import encode_version
from publisher.delta_format import VersionHeader
from publisher.generation_fence import FENCED_REASON
from publisher.id_maps import read_id_maps
from serving_plugin.delta_replayer import DeltaReplayer
from serving_plugin.export_reader import KafkaReplaySource
from serving_plugin.serving_model import ServingModel
from tests.harness import TrainedCheckpoint, apply_to_module, train_checkpoint

START_OFFSET = 40  # the export's kafka.txt offset


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> TrainedCheckpoint:
    return train_checkpoint(str(tmp_path_factory.mktemp("replayer")), steps=4)


@pytest.fixture(scope="module")
def export(trained, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("replayer-export")
    return export_checkpoint(trained.config, trained.path, str(root)).path


@pytest.fixture
def replayer(export) -> DeltaReplayer:
    model = ServingModel.load(os.path.dirname(export))
    return DeltaReplayer(model, KafkaReplaySource("", "deltas", START_OFFSET))


@pytest.fixture(scope="module")
def batch(trained):
    return trained.feature_builder.build(trained.records(200, 5)).batch


def _version(maps, seed: int, version: int, generation: str, rows: int = 30):
    """Full values for one deep table, one wide table and every dense variable."""
    rng = np.random.default_rng(seed)
    names = sorted(maps.tables)
    picked = [n for n in names if not n.endswith("_wide")][:1] + \
             [n for n in names if n.endswith("_wide")][:1]
    sparse = {}
    for name in picked:
        info = maps.tables[name]
        ids = rng.choice(info.num_rows, size=min(rows, info.num_rows), replace=False)
        sparse[info.id] = (ids.astype(np.int64),
                           rng.normal(0, 0.3, size=(ids.size, info.dim)).astype(np.float32))
    dense = {info.id: rng.normal(0, 0.1, size=info.shape).astype(np.float32)
             for info in maps.dense.values()}
    return VersionHeader("m", version, generation), dense, sparse


def _feed(replayer: DeltaReplayer, chunks: list[bytes], first_offset: int) -> list:
    return [replayer.handle(c, first_offset + i) for i, c in enumerate(chunks)]


def test_a_version_applies_when_its_last_chunk_arrives(replayer, export, trained, batch):
    maps = read_id_maps(export)
    header, dense, sparse = _version(maps, 0, 100, "genA", rows=80)
    chunks = encode_version(header, dense, sparse, max_chunk_bytes=1024)
    assert len(chunks) > 3
    model = replayer.model
    base = model.predict_batch(batch)

    results = _feed(replayer, chunks[:-1], START_OFFSET)
    assert results == [None] * (len(chunks) - 1)
    assert model.state.version == trained.module.global_step  # nothing applied yet
    np.testing.assert_array_equal(model.predict_batch(batch), base)

    assert replayer.handle(chunks[-1], START_OFFSET + len(chunks) - 1) == 100
    st = model.state
    assert (st.version, st.generation, st.versions_applied) == (100, "genA", 1)
    assert st.rows_applied == sum(len(ids) for ids, _ in sparse.values())
    assert replayer.next_offset == START_OFFSET + len(chunks)
    assert replayer.messages == len(chunks) and replayer.rejected_total == 0

    reference = TrainModule(trained.config, trained.feature_builder, device="cpu")
    reference.load_checkpoint_state(read_checkpoint(trained.path).state)
    apply_to_module(reference, maps, dense, sparse)
    assert np.abs(model.predict_batch(batch) - reference.predict(batch)).max() <= 1e-6


def test_later_versions_win_and_a_new_generation_continues(replayer, export):
    maps = read_id_maps(export)
    assert _feed(replayer, encode_version(*_version(maps, 1, 30, "genA")), START_OFFSET) == [30]
    # a restarted trainer (new generation) recovered to an older step: it simply continues
    assert _feed(replayer, encode_version(*_version(maps, 2, 3, "genB")), START_OFFSET + 1) == [3]
    st = replayer.model.state
    assert (st.version, st.generation, st.versions_applied) == (3, "genB", 2)


def test_next_offset_follows_the_offsets_handled(replayer, export):
    maps = read_id_maps(export)
    assert replayer.next_offset == START_OFFSET
    replayer.handle(b"garbage")  # no offset: nothing to advance
    assert replayer.next_offset == START_OFFSET
    replayer.handle(b"garbage", START_OFFSET + 5)
    assert replayer.next_offset == START_OFFSET + 6
    replayer.handle(b"garbage", START_OFFSET + 2)  # never moves back
    assert replayer.next_offset == START_OFFSET + 6
    _feed(replayer, encode_version(*_version(maps, 3, 7, "genA")), START_OFFSET + 9)
    assert replayer.next_offset == START_OFFSET + 10


def test_corrupt_and_unfitting_messages_are_rejected_by_reason(replayer, export, batch):
    maps = read_id_maps(export)
    model = replayer.model
    assert _feed(replayer, encode_version(*_version(maps, 4, 50, "g")), START_OFFSET) == [50]
    serving_50 = model.predict_batch(batch)

    h, dense, sparse = _version(maps, 5, 51, "g")
    corrupt = bytearray(encode_version(h, dense, sparse)[0])
    corrupt[len(corrupt) // 2] ^= 0xFF  # inside the payload: checksum failure
    unknown_table = encode_version(h, dense, {999: next(iter(sparse.values()))})
    first_dense = maps.dense[sorted(maps.dense)[0]]
    bad_shape = encode_version(h, {first_dense.id: np.zeros(3, np.float32)}, sparse)
    table = maps.tables[sorted(maps.tables)[0]]
    out_of_range = encode_version(h, {}, {table.id: (
        np.array([table.num_rows], np.int64), np.zeros((1, table.dim), np.float32))})
    bad = [b"", b"garbage", bytes(corrupt), *unknown_table, *bad_shape, *out_of_range]
    assert _feed(replayer, bad, START_OFFSET + 1) == [None] * len(bad)

    assert replayer.rejected == {"empty": 1, "unparsable": 1, "crc_mismatch": 1,
                                 "unknown_table_id": 1, "shape": 1, "row_range": 1}
    assert replayer.rejected_total == 6
    assert f"offset {START_OFFSET + len(bad)}" in (replayer.last_error or "")
    assert model.state.version == 50 and model.state.versions_applied == 1
    np.testing.assert_array_equal(model.predict_batch(batch), serving_50)

    assert _feed(replayer, encode_version(h, dense, sparse), START_OFFSET + 20) == [51]


def test_a_superseded_generation_is_fenced(replayer, export, batch):
    maps = read_id_maps(export)
    model = replayer.model
    assert model.state.generation == "gen0"  # the base's generation owns the topic
    assert _feed(replayer, encode_version(*_version(maps, 6, 20, "genB")), START_OFFSET) == [20]
    served = model.predict_batch(batch)
    # the base's trainer is still publishing: it was superseded by genB, so it is ignored
    zombie = encode_version(*_version(maps, 7, 21, "gen0"), max_chunk_bytes=2048)
    assert _feed(replayer, zombie, START_OFFSET + 1) == [None] * len(zombie)
    assert replayer.rejected == {FENCED_REASON: len(zombie)}
    assert (model.state.version, model.state.generation) == (20, "genB")
    np.testing.assert_array_equal(model.predict_batch(batch), served)
    assert replayer.next_offset == START_OFFSET + 1 + len(zombie)


def _marked(maps, seed: int, version: int, generation: str, full: bool = False,
            names: tuple[int, int] = (0, -1)):
    """A version with a republish mark: ``full``, and the full version it ``names``."""
    header, dense, sparse = _version(maps, seed, version, generation)
    header.full_republish = full
    header.last_full_version, header.last_full_offset = names
    return encode_version(header, dense, sparse)


def test_a_version_naming_a_skipped_full_republish_rewinds_to_it(replayer, export, batch):
    """The topic lost versions; the replay read on past the full republish the publisher
    wrote into the refilled log: the first version naming it is not applied, replay goes
    back to the full version's offset, and from there everything applies in topic order."""
    maps = read_id_maps(export)
    model = replayer.model
    assert _feed(replayer, encode_version(*_version(maps, 1, 10, "genA")), START_OFFSET) == [10]
    full_at = START_OFFSET + 1  # where the publisher's full version 12 landed
    later = _marked(maps, 3, 14, "genA", names=(12, full_at))
    assert _feed(replayer, later, START_OFFSET + 5) == [None]
    assert replayer.rewind_to == full_at and replayer.republish_rewinds == 1
    assert (model.state.version, model.state.versions_applied) == (10, 1)
    assert replayer.rejected_total == 0

    # the replay thread assigns the consumer at rewind_to: the messages come again in order
    replayer.rewind_to = None
    replay = [*_marked(maps, 2, 12, "genA", full=True), *_marked(maps, 9, 13, "genA",
                                                                  names=(12, full_at)), *later]
    assert _feed(replayer, replay, full_at) == [12, 13, 14]
    assert replayer.rewind_to is None and replayer.republish_rewinds == 1

    # the model is what applying 10, 12, 13, 14 in order gives
    fresh = DeltaReplayer(ServingModel.load(os.path.dirname(export)),
                          KafkaReplaySource("", "deltas", START_OFFSET))
    _feed(fresh, [*encode_version(*_version(maps, 1, 10, "genA")), *replay], START_OFFSET)
    np.testing.assert_array_equal(model.predict_batch(batch), fresh.model.predict_batch(batch))
    assert fresh.republish_rewinds == 0  # read in order: it applied the full version itself


def test_a_full_republish_the_base_holds_or_already_sought_is_not_sought_again(replayer,
                                                                               export):
    maps = read_id_maps(export)
    base_generation, base_version = replayer.model.state.generation, replayer.model.state.version
    # the base export was taken after the full version: it holds it
    names_base = _marked(maps, 1, base_version + 5, base_generation,
                         names=(base_version, START_OFFSET - 10))
    assert _feed(replayer, names_base, START_OFFSET) == [base_version + 5]
    # a sink without offsets names no place to go back to
    no_offset = _marked(maps, 2, base_version + 6, base_generation, names=(base_version + 1, -1))
    assert _feed(replayer, no_offset, START_OFFSET + 1) == [base_version + 6]
    assert replayer.republish_rewinds == 0 and replayer.rewind_to is None

    # a full version lost in turn: sought once, then later versions apply without it
    gone = _marked(maps, 3, base_version + 9, base_generation,
                   names=(base_version + 7, START_OFFSET + 2))
    assert _feed(replayer, gone, START_OFFSET + 3) == [None]
    assert replayer.rewind_to == START_OFFSET + 2
    replayer.rewind_to = None
    assert _feed(replayer, gone, START_OFFSET + 3) == [base_version + 9]
    assert replayer.republish_rewinds == 1 and replayer.rewind_to is None
