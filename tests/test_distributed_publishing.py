"""Delta versions of a model trained by two ranks (``odl.train.rank_publishing``).

Two CPU ranks (gloo, started as ``torchrun`` would) train on their shares of every batch and
publish through rank 0 on the schedule rank 0's turn flags carry; one process trains on the
whole batches with the same schedule. The versions must be the same: the same steps and
parts, the union of both ranks' touched rows (read from whichever rank's shard holds them)
with one process's values, every partition's positions and both ranks' time ranges; and
replaying them onto the initial model gives the model the ranks trained (serving parity).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from odl.datagen.bursty_stream import BurstyStream
from odl.datagen.datagen_config import bursty_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.train.distributed import agree
from odl.train.rank_publishing import RankPublishing
from odl.train.train_module import TrainModule
from publisher.delta_decoder import decode_chunk
from publisher.fs_sink import list_versions, read_chunks
from publisher.id_maps import read_id_maps
from publisher.publisher_factory import build_delta_sink, build_publisher
from publisher.version_assembler import VersionAssembler
from tests.harness import load_config_text

BATCH = 128
ROW_WISE_MIN_ROWS = 2048  # the 4096-row id tables split by rows, device / hour whole
# the ranks sum a step's gradients in another order than one process: float32 rounding drifts
TOL = 1e-4
INCR = 'incr_save_config { sparse_save_steps: 2 dense_save_steps: 3 fs { incr_save_dir: "v" } }'


def _config(model_dir: str):
    return load_config_text(bursty_config_text(model_dir, batch_size=BATCH, buckets=4096,
                                               extra_train=INCR))


def _event_range(step: int, rank: int) -> tuple[int, int]:
    """The event times rank ``rank`` notes for step ``step`` (ms)."""
    return 1000 * step + 10 * rank, 1000 * step + 10 * rank + 5


def _rank_main(rank: int, world: int, model_dir: str,
               steps: list[list[bytes]]) -> dict[str, np.ndarray]:
    """One rank's training and publishing; the gathered model on rank 0, {} elsewhere."""
    config = _config(model_dir)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    sink = build_delta_sink(config) if rank == 0 else None
    publishing = RankPublishing.build(config, tm, "gen0", rank, None, sink)
    positions: dict[int, int] = {}
    for k, records in enumerate(steps):
        step = tm.global_step
        flags = agree([publishing.turn_flags(step)])[0][0]  # rank 0's, as the loop does
        publishing.after_turn(step, flags, True, positions)
        share = records[rank::world]  # each rank its share of the step's records
        tm.train_step(fb.build(share).batch)
        positions = {rank: k + 1}  # this rank's partition
        publishing.note_times(_event_range(k, rank), None)
        if publishing.publisher is not None:  # each version sent alone, never merged
            assert publishing.publisher.wait_sent(30.0)
    publishing.flush(tm.global_step, positions, timeout=30.0)
    state = tm.state_dict_for_checkpoint()  # whole on rank 0
    return {k: v.numpy() for k, v in state.get("model", {}).items()}


def _versions(model_dir: str) -> list:
    out = []
    for path in list_versions(os.path.join(model_dir, "v")):
        asm = VersionAssembler()
        out += [v for v in (asm.add(decode_chunk(c)) for c in read_chunks(path)) if v]
    return out


def test_two_ranks_publish_the_versions_one_process_publishes(ranks, tmp_path):
    world = 2
    records = BurstyStream(seed=8).next_batch(7 * BATCH).encode("csv")
    steps = [records[k:k + BATCH] for k in range(0, len(records), BATCH)]
    two_dir, one_dir = str(tmp_path / "two"), str(tmp_path / "one")
    got = ranks.run(_rank_main, world, two_dir, steps)

    # one process on the whole batches, in each step the records in the ranks' order
    config = _config(one_dir)
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    initial = {k: v.clone() for k, v in one.state_dict_for_checkpoint()["model"].items()}
    pub = build_publisher(config, one, "gen0", sink=build_delta_sink(config))
    for k, recs in enumerate(steps):
        one.train_step(fb.build(recs[0::2] + recs[1::2]).batch)
        for r in range(world):
            pub.note_times(_event_range(k, r), None)
        pub.maybe_publish(one.global_step, {r: k + 1 for r in range(world)})
        assert pub.wait_sent(30.0)  # as on the ranks' side: no version merged into the next
    pub.flush(timeout=30.0, step=one.global_step, positions={0: 7, 1: 7})

    two, ref = _versions(two_dir), _versions(one_dir)
    assert [(v.header.version, v.header.kind) for v in two] == [
        (v.header.version, v.header.kind) for v in ref]
    assert [v.header.version for v in two] == [2, 3, 4, 6, 7]
    for a, b in zip(two, ref, strict=True):
        assert a.header.positions == b.header.positions
        assert (a.header.min_event_time_ms, a.header.max_event_time_ms) == (
            b.header.min_event_time_ms, b.header.max_event_time_ms)
        assert set(a.sparse) == set(b.sparse) and set(a.dense) == set(b.dense)
        for tid, (ids, values) in b.sparse.items():
            np.testing.assert_array_equal(a.sparse[tid][0], ids)
            np.testing.assert_allclose(a.sparse[tid][1], values, atol=TOL, rtol=0)
        for vid, arr in b.dense.items():
            np.testing.assert_allclose(a.dense[vid], arr, atol=TOL, rtol=0)
    assert two[-1].header.positions == [("odl_bursty", 0, 7), ("odl_bursty", 1, 7)]

    # replayed onto the initial model, as serving does, the versions give the ranks' model
    maps = read_id_maps(two_dir)
    tables, dense = maps.table_names(), maps.dense_names()
    replayed = {k: v.clone() for k, v in initial.items()}
    for v in two:
        for vid, arr in v.dense.items():
            replayed[dense[vid]] = torch.from_numpy(arr)
        for tid, (ids, values) in v.sparse.items():
            replayed[f"ebc.embedding_bags.{tables[tid]}.weight"][
                torch.from_numpy(ids), :values.shape[1]] = torch.from_numpy(values)
    assert got[1] == {}
    for name, t in got[0].items():
        if name in replayed:
            width = maps.tables[name.split(".")[2]].dim if name.startswith("ebc.") else None
            np.testing.assert_allclose(replayed[name].numpy()[..., :width], t[..., :width],
                                       atol=TOL, rtol=0, err_msg=name)
