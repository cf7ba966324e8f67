"""Suite-wide Kafka fixtures (one broker per test worker, a fresh topic per test), markers, order.

Set ``ODL_KAFKA_BOOTSTRAP=host:port`` to run against an external broker instead of the
embedded one. Topics made by ``kafka_topic_factory`` are unique per test and deleted after it
on either broker.

Every test that uses ``kafka_bootstrap`` or ``kafka_topic_factory`` is marked ``kafka``
here; tests that start a broker of their own carry the mark themselves. ``pytest -m "not
kafka"`` is the unit run: no broker is started.
"""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from odl.broker.embedded_broker import EmbeddedBroker
from odl.harness.topic_records import delete_topics
from odl.kafka.topic_admin import create_topic

EXTERNAL_BOOTSTRAP_ENV = "ODL_KAFKA_BOOTSTRAP"
KAFKA_FIXTURES = frozenset({"kafka_bootstrap", "kafka_topic_factory"})

# Seconds a file takes in ``make test`` on two cores (the sum of its tests' times in a
# ``--durations=0`` report, rounded), longest first; only the order in which the files start
# depends on them. A file not named here counts SLOW_TEST_SECONDS per ``slow`` test and
# TEST_SECONDS per other test.
FILE_SECONDS = {
    "test_config_compat.py": 173,
    "test_distributed_file_stream.py": 113,
    "test_file_stream.py": 105,
    "test_distributed_online.py": 81,
    "test_growing_tables.py": 77,
    "test_crash_recovery.py": 65,
    "test_oss_training.py": 60,
    "test_online_parity.py": 56,
    "test_outages.py": 49,
    "test_dynamic_partitions.py": 33,
    "test_job_status.py": 28,
    "test_online_training.py": 24,
    "test_serving.py": 21,
    "test_kafka_input_process.py": 21,
    "test_warm_start.py": 21,
    "test_secrets.py": 21,
    "test_dashboards.py": 20,
    "test_backlog.py": 20,
    "test_stream_evaluation.py": 18,
    "test_trainer_behaviour.py": 16,
    "test_distributed_training.py": 15,
    "test_multi_task_backbone.py": 14,
    "test_rank_model.py": 13,
    "test_esmm_ple_models.py": 12,
    "test_wukong_model.py": 12,
    "test_delta_topic_ownership.py": 12,
    "test_embedded_broker.py": 12,
    "test_disk_tier.py": 11,
    "test_retention_loss.py": 10,
    "test_dlrm_model.py": 10,
}
SLOW_TEST_SECONDS = 20.0
TEST_SECONDS = 0.35


def pytest_configure(config: pytest.Config) -> None:
    """In-process trainers and serving use odl's default thread rule (as the CLIs do); xdist
    hands out files in the order ``pytest_collection_modifyitems`` leaves them."""
    from odl.train.torch_runtime import configure_torch_threads

    configure_torch_threads(0)
    # xdist (>= 3.6) re-sorts ``--dist loadfile`` files by their number of tests unless told
    # not to: the long files with few tests (crash recovery, OSS) then started last and ran
    # alone at the end.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``kafka`` every test that uses a broker fixture; puts the longest files first.

    ``make test`` runs files on three workers (``-n 3 --dist loadfile``), each taken in this
    order (``pytest_configure`` keeps xdist from re-sorting them by test count): the longest
    files start at once and the short ones fill in around them, so no long file is left to
    run alone at the end. A file's length is its ``FILE_SECONDS`` entry, else an estimate
    from its ``slow`` and other tests.
    """
    for item in items:
        if KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)
    seconds: collections.Counter = collections.Counter()
    for item in items:
        seconds[item.path] += (SLOW_TEST_SECONDS if item.get_closest_marker("slow")
                               else TEST_SECONDS)
    for path in seconds:
        seconds[path] = FILE_SECONDS.get(path.name, seconds[path])
    items.sort(key=lambda item: -seconds[item.path])  # stable: the order within a file is kept


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of the session's broker (external if ODL_KAFKA_BOOTSTRAP is set)."""
    external = os.environ.get(EXTERNAL_BOOTSTRAP_ENV)
    if external:
        yield external
        return
    broker = EmbeddedBroker(port=0, data_dir=tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def kafka_topic_factory(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Makes unique topics: ``make(partitions=1, prefix="t", config=None, create=True)``."""
    created: list[str] = []

    def make(
        partitions: int = 1,
        prefix: str = "t",
        config: dict[str, str] | None = None,
        create: bool = True,
    ) -> str:
        name = f"odl-test-{prefix}-{uuid.uuid4().hex[:12]}"
        created.append(name)  # also names handed out uncreated: the test may create them
        if create:
            create_topic(kafka_bootstrap, name, partitions, config=config)
        return name

    yield make
    # deleted after the test on every broker (see delete_topics)
    delete_topics(kafka_bootstrap, created)


@pytest.fixture(scope="session")
def ranks() -> Iterator[object]:
    """Two spawned CPU ranks (``tests.harness.RankPool``) shared by a test process's tests:
    the processes and their imports start once, at the first ``ranks.run`` (each call's
    target joins and leaves a group of its own and leaves no state behind)."""
    from tests.harness import RankPool

    pool = RankPool(2)
    try:
        yield pool
    finally:
        pool.close()


OSS_TEST_SECRET = "oss-test-secret-never-logged"


@pytest.fixture
def oss(tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A loopback OSS test double; this process and its children are pointed at it.

    Sets ``OSS_ACCESS_KEY_ID`` / ``OSS_ACCESS_KEY_SECRET`` / ``OSS_ENDPOINT``, a fresh
    ``ODL_CACHE_DIR`` and a short ``ODL_OSS_RETRY_SECONDS`` (2 s) for the test.
    """
    from odl.harness.oss_double import OssDouble
    from odl.storage.oss_credentials import reset_oss_configuration
    from odl.storage.oss_store import reset_oss_store

    with OssDouble() as double:
        monkeypatch.setenv("OSS_ACCESS_KEY_ID", "test-key-id")
        monkeypatch.setenv("OSS_ACCESS_KEY_SECRET", OSS_TEST_SECRET)
        monkeypatch.setenv("OSS_ENDPOINT", double.endpoint)
        monkeypatch.setenv("ODL_CACHE_DIR", os.path.join(str(tmp_path), "odl-cache"))
        monkeypatch.setenv("ODL_OSS_RETRY_SECONDS", "2")
        reset_oss_configuration()
        reset_oss_store()
        try:
            yield double
        finally:
            reset_oss_store()
