"""One delta topic, one publisher: a newer trainer fences the older one at the broker.

Two trainers configured with the same delta topic (a copy started by mistake, or a zombie
left behind a network partition) must not both reach serving. The newer trainer claims the
topic's transactional producer at start; the older one's next version is refused by the
broker, and it stops with exit code 3 (which the systemd unit does not restart), writing no
checkpoint. Serving and crash recovery see the older generation's versions only up to the
newer one's first (``publisher.generation_fence``, tested with hand-made versions in
``test_serving.py``).
"""

from __future__ import annotations

import time

import pytest

from odl.config.pipeline_config import load_pipeline_config
from odl.harness.delta_topic_audit import audit_delta_topic
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.train.trainer import Trainer, TrainerOptions
from publisher.delta_recovery import read_published_state
from publisher.generation_fence import GenerationFence
from tests.harness import run_in_thread, write_config


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _start(tmp_path, name: str, bootstrap: str, topic: str, delta_topic: str):
    incr = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 kafka {{ server: '
            f'"{bootstrap}" topic: "{delta_topic}" }} model_name: "ctr" }}')
    root = tmp_path / name
    root.mkdir()
    cfg = write_config(root, bootstrap, topic, batch_size=50, extra_train=incr)
    trainer = Trainer(load_pipeline_config(cfg),
                      TrainerOptions(online=True, device="cpu", status_port=-1))
    thread, outcome = run_in_thread(trainer)
    return trainer, thread, outcome


def _published_to(trainer: Trainer, ends: dict[int, int]) -> bool:
    pub = trainer.publisher.status() if trainer.publisher is not None else {}
    return (trainer.state == "training" and dict(trainer.positions) == ends
            and pub.get("last_version") == trainer.module.global_step)


@pytest.mark.slow
def test_a_newer_trainer_fences_the_older_one(kafka_bootstrap, kafka_topic_factory, tmp_path):
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
        b, b_thread, b_out = _start(tmp_path, "b", kafka_bootstrap, in_b, delta_topic)
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
