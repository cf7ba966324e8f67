"""One delta topic, one model, one publisher.

A delta topic carries one model's versions (``publisher.delta_topic_owner``). A trainer of
another model_dir configured with the same topic by mistake stops at start with exit code 2
naming the owner, and the owner trains and publishes on. Told to take the topic over
(``--take_over_delta_topic``), or being the same model restarted, the newer trainer claims the
topic's transactional producer at start; the older one's next version is refused by the
broker, and it stops with exit code 3 (which the systemd unit does not restart), writing no
checkpoint. Serving and crash recovery apply only their base's model, and of its generations
the older ones only up to the newer one's first (``publisher.delta_stream``,
``publisher.generation_fence``, tested with hand-made versions here and in
``test_serving.py``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from odl.config.pipeline_config import load_pipeline_config
from odl.harness.delta_topic_audit import audit_delta_topic
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.train.trainer import Trainer, TrainerOptions
from publisher.delta_encoder import encode_version
from publisher.delta_format import DeltaFormatError, VersionHeader
from publisher.delta_recovery import read_published_state
from publisher.delta_stream import OTHER_MODEL_REASON, DeltaStreamReader
from publisher.delta_topic_owner import DeltaTopicOwnedError
from publisher.generation_fence import GenerationFence
from publisher.model_identity import model_id, model_of_generation, new_generation
from tests.harness import run_in_thread, write_config


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _start(tmp_path, name: str, bootstrap: str, topic: str, delta_topic: str,
           take_over: bool = False):
    incr = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 kafka {{ server: '
            f'"{bootstrap}" topic: "{delta_topic}" }} model_name: "ctr" }}')
    root = tmp_path / name
    root.mkdir(exist_ok=True)
    cfg = write_config(root, bootstrap, topic, batch_size=50, extra_train=incr)
    trainer = Trainer(load_pipeline_config(cfg),
                      TrainerOptions(online=True, device="cpu", status_port=-1,
                                     take_over_delta_topic=take_over))
    thread, outcome = run_in_thread(trainer)
    return trainer, thread, outcome


def _published_to(trainer: Trainer, ends: dict[int, int]) -> bool:
    pub = trainer.publisher.status() if trainer.publisher is not None else {}
    return (trainer.state == "training" and dict(trainer.positions) == ends
            and pub.get("last_version") == trainer.module.global_step)


@pytest.mark.slow
def test_a_trainer_told_to_take_over_fences_the_older_one(kafka_bootstrap, kafka_topic_factory,
                                                          tmp_path):
    in_a, in_b = kafka_topic_factory(partitions=1), kafka_topic_factory(partitions=1)
    delta_topic = kafka_topic_factory(prefix="delta", create=False)
    _, values = make_records(600, seed=21)
    produce(kafka_bootstrap, in_a, values[:200], 1)
    produce(kafka_bootstrap, in_b, values[200:400], 1)
    a, a_thread, a_out = _start(tmp_path, "a", kafka_bootstrap, in_a, delta_topic)
    b = b_thread = None
    try:
        ends_a = end_offsets(kafka_bootstrap, in_a)
        _wait(lambda: _published_to(a, ends_a), 90, "trainer A published its backlog")
        a_step, a_ckpt = a.module.global_step, a.checkpoints.last_saved_step
        b, b_thread, b_out = _start(tmp_path, "b", kafka_bootstrap, in_b, delta_topic,
                                    take_over=True)
        ends_b = end_offsets(kafka_bootstrap, in_b)
        _wait(lambda: _published_to(b, ends_b), 90, "trainer B published its backlog")
        assert b.publisher.status()["fencing"] == "transactional"
        # A trains on: its next version is refused, and it stops with exit code 3
        produce(kafka_bootstrap, in_a, values[400:], 1)
        a_thread.join(90)
        assert not a_thread.is_alive()
        assert a_out == {"rc": 3}, a_out
        assert "taken over by a newer producer" in a.failure
        assert a.publisher.fenced and a.status()["failure"] == a.failure
        assert a.checkpoints.last_saved_step == a_ckpt  # nothing written after the fence
        assert a.module.global_step > a_step  # it did train on, and published none of it
        assert b.state == "training" and b.publisher.status()["failures"] == 0
    finally:
        for trainer, thread in ((a, a_thread), (b, b_thread)):
            if trainer is not None:
                trainer.request_stop("test: done")
                thread.join(60)
    # the topic: A's versions, then B's; nothing of A after B's first chunk
    audit = audit_delta_topic(kafka_bootstrap, delta_topic)
    gens = [g for g, _ in audit.complete_versions]
    first_b = gens.index(b.generation)
    assert set(gens[:first_b]) == {a.generation} and set(gens[first_b:]) == {b.generation}
    assert audit.last_complete[a.generation] == a_step
    assert not audit.incomplete
    state = read_published_state(kafka_bootstrap, delta_topic, 0)
    assert state.generations == [a.generation, b.generation]
    assert state.version == b.module.global_step
    assert not state.rejected


def test_generation_fence_rule():
    fence = GenerationFence("g0")
    assert [fence.admit(g) for g in ["g0", "a", "a", "g0", "b", "a", "b", "c"]] == [
        True, True, True, False, True, False, True, True]
    assert fence.owner == "c" and fence.superseded == ["g0", "a", "b"]
    assert fence.takeovers == 3
    bounded = GenerationFence(max_superseded=2)
    for g in ["a", "b", "c", "d"]:
        assert bounded.admit(g)
    assert bounded.superseded == ["b", "c"]
    assert not bounded.admit("b") and bounded.admit("d")


@pytest.mark.slow
def test_another_model_on_the_topic_is_refused_and_a_restart_takes_over(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    in_a, in_b = kafka_topic_factory(partitions=1), kafka_topic_factory(partitions=1)
    delta_topic = kafka_topic_factory(prefix="delta", create=False)
    _, values = make_records(500, seed=22)
    produce(kafka_bootstrap, in_a, values[:200], 1)
    produce(kafka_bootstrap, in_b, values[200:300], 1)
    a, a_thread, _ = _start(tmp_path, "a", kafka_bootstrap, in_a, delta_topic)
    try:
        ends_a = end_offsets(kafka_bootstrap, in_a)
        _wait(lambda: _published_to(a, ends_a), 90, "trainer A published its backlog")
        # a second trainer with another model_dir and the same delta topic: refused at start
        b, b_thread, b_out = _start(tmp_path, "b", kafka_bootstrap, in_b, delta_topic)
        b_thread.join(60)
        err = b_out.get("error")
        assert isinstance(err, DeltaTopicOwnedError), b_out
        assert err.field == "train_config.incr_save_config.kafka.topic"
        assert model_id(a.model_dir) in str(err) and model_id(b.model_dir) in str(err)
        assert "--take_over_delta_topic" in str(err)
        assert b.publisher is None and b.module.global_step == 0
        # the owner was not disturbed: it trains and publishes on
        produce(kafka_bootstrap, in_a, values[300:400], 1)
        ends_a = end_offsets(kafka_bootstrap, in_a)
        _wait(lambda: _published_to(a, ends_a), 90, "trainer A published after the refusal")
        assert not a.publisher.fenced and a.publisher.status()["failures"] == 0
    finally:
        a.request_stop("test: restart")
        a_thread.join(60)
    # the same model restarted (same model_dir, new generation) takes over at once
    produce(kafka_bootstrap, in_a, values[400:], 1)
    a2, a2_thread, a2_out = _start(tmp_path, "a", kafka_bootstrap, in_a, delta_topic)
    try:
        ends_a = end_offsets(kafka_bootstrap, in_a)
        _wait(lambda: _published_to(a2, ends_a), 90, "the restarted trainer published")
        assert a2.generation != a.generation
        assert model_of_generation(a2.generation) == model_of_generation(a.generation)
    finally:
        a2.request_stop("test: done")
        a2_thread.join(60)
    assert a2_out == {"rc": 0}, a2_out
    audit = audit_delta_topic(kafka_bootstrap, delta_topic)
    assert {g for g, _ in audit.complete_versions} == {a.generation, a2.generation}


def _chunk(generation: str, version: int) -> bytes:
    header = VersionHeader(model_name="ctr", version=version, generation=generation)
    return encode_version(header, {0: np.zeros(2, np.float32)}, {})[0]


def test_a_read_applies_only_its_models_versions():
    """Serving's and crash recovery's reader: another model's versions are rejected as
    other_model and do not move the generation fence; the model's own restart does."""
    a1, a2 = new_generation("/models/a"), new_generation("/models/a")
    b1 = new_generation("/models/b")
    assert model_of_generation(a1) == model_of_generation(a2) == model_id("/models/a")
    assert model_of_generation(b1) == model_id("/models/b") != model_id("/models/a")
    assert model_of_generation("0123456789abcdef") == ""  # a generation naming no model
    assert model_id("oss://bucket/m/") == model_id("oss://bucket/m")

    reader = DeltaStreamReader(a1, None, 1 << 20)
    assert reader.model == model_id("/models/a")
    assert reader.read(_chunk(a1, 2), 0).header.version == 2
    with pytest.raises(DeltaFormatError) as e:
        reader.read(_chunk(b1, 9), 1)
    assert e.value.reason == OTHER_MODEL_REASON
    assert reader.fence.owner == a1  # the other model did not take the read over
    assert reader.read(_chunk(a2, 3), 2).header.version == 3  # the same model's restart
    assert reader.fence.owner == a2
    # a read that names no model (a base written before model ids) reads every model's
    assert DeltaStreamReader(None, None, 1 << 20).read(_chunk(b1, 9), 0) is not None
